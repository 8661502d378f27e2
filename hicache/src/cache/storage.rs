//! Attaching and detaching the L3 tier ([`HiCache::attach_storage`] and friends).

use std::sync::Arc;

use hicache_core::TenantId;
use hicache_storage::{BackendContext, Storage, StorageConfig};

use super::HiCache;
use crate::error::{HiCacheError, Result};
use crate::l3::{L3, new_runtime};

impl HiCache {
    fn backend_context(&self) -> BackendContext {
        let tree = &self.tiers.tree;
        BackendContext {
            page_bytes: self.shape.page_bytes(),
            layout: self.cfg.mem_layout,
            namespace: tree
                .tenant_root(TenantId(0))
                .ok()
                .and_then(|_| tree.chain_start(TenantId(0)).ok())
                .flatten()
                .map(|c| c.namespace_id),
            tp_rank: self.namespace.tp_rank,
            tp_size: self.namespace.tp_size,
            pp_rank: self.namespace.pp_rank,
            pp_size: self.namespace.pp_size,
            memory: Some(self.tiers.host_pool.region()),
        }
    }

    /// Attaches an L3 backend opened from `config` through the registry (idle only:
    /// no live requests, nothing in flight). Attaching the same backend again only updates
    /// the policy fields; a different one while attached is an error (detach first).
    pub fn attach_storage(&mut self, config: StorageConfig) -> Result<()> {
        self.check_open()?;
        if let Some(l3) = &mut self.l3 {
            if l3.config_name() == config.backend {
                l3.update(&self.cfg, config);
                return Ok(());
            }
            return Err(HiCacheError::NotIdle(format!(
                "backend {} is attached; detach it before attaching {}",
                l3.config_name(),
                config.backend
            )));
        }
        if !self.registry.contains(&config.backend)
            && let Some(feature) = crate::backends::feature_for(&config.backend)
        {
            return Err(HiCacheError::BackendNotCompiled {
                backend: config.backend.clone(),
                feature,
            });
        }
        let runtime = new_runtime()?;
        let ctx = self.backend_context();
        let storage = runtime.block_on(self.registry.open(&config, &ctx))?;
        self.attach_with_runtime(config, storage, runtime)
    }

    /// Attaches a backend instance (idle only), with `config`'s common fields.
    pub fn attach_storage_instance(
        &mut self,
        config: StorageConfig,
        storage: Arc<dyn Storage>,
    ) -> Result<()> {
        self.check_open()?;
        if let Some(l3) = &self.l3 {
            return Err(HiCacheError::NotIdle(format!(
                "backend {} is attached; detach it first",
                l3.config_name()
            )));
        }
        let runtime = new_runtime()?;
        self.attach_with_runtime(config, storage, runtime)
    }

    fn attach_with_runtime(
        &mut self,
        config: StorageConfig,
        storage: Arc<dyn Storage>,
        runtime: tokio::runtime::Runtime,
    ) -> Result<()> {
        self.require_idle("attach a storage backend")?;
        let l3 = L3::open(
            &self.cfg,
            self.shape,
            self.rank.rank(),
            config,
            storage,
            runtime,
            &self.tiers,
        )?;
        self.l3 = Some(l3);
        Ok(())
    }

    fn require_idle(&self, what: &str) -> Result<()> {
        let busy = [
            (self.requests.len(), "live requests"),
            (self.copies.writes_in_flight(), "D2H batches in flight"),
            (self.copies.loads_pending(), "loads in flight"),
            (
                self.l3.as_ref().map_or(0, L3::backups_in_flight),
                "L3 backups in flight",
            ),
        ];
        for (n, name) in busy {
            if n > 0 {
                return Err(HiCacheError::NotIdle(format!("cannot {what}: {n} {name}")));
            }
        }
        Ok(())
    }

    /// The namespace ids this cache's pages carry in L3: one per tenant the tree knows (the
    /// default tenant, and each extra key / cache salt seen), without repeats.
    pub fn storage_namespaces(&self) -> Vec<hicache_core::NamespaceId> {
        let tree = &self.tiers.tree;
        let mut ids = Vec::new();
        for t in 0u32.. {
            let Ok(start) = tree.chain_start(TenantId(t)) else {
                break;
            };
            if let Some(id) = start.map(|c| c.namespace_id)
                && !ids.contains(&id)
            {
                ids.push(id);
            }
        }
        ids
    }

    /// Removes from the attached L3 backend every page of this cache's namespaces (see
    /// [`storage_namespaces`](Self::storage_namespaces)): what this rank, and any earlier
    /// process serving the same model, shard and tenants, stored there. Other namespaces
    /// (other models, ranks, tenants not seen by this process) are never touched. Backups in
    /// flight are finished first (as by [`drain`](Self::drain)), so none lands after the
    /// clear; every rank calls it together. L1 and L2 are unchanged ([`flush`](Self::flush)
    /// drops those). Returns the pages removed. Errors: no backend attached, or a backend
    /// without the capability ([`StorageError::Unsupported`](hicache_storage::StorageError)).
    pub fn clear_storage(&mut self) -> Result<u64> {
        self.check_open()?;
        if self.l3.is_none() {
            return Err(HiCacheError::BadArgument(
                "clear_storage: no L3 storage backend is attached".into(),
            ));
        }
        self.drain()?;
        let ids = self.storage_namespaces();
        let l3 = self
            .l3
            .as_ref()
            .expect("checked above; drain keeps it attached");
        let removed = l3.clear(&ids);
        // Whatever was removed, nothing is known to be in L3 any more (tiering).
        self.tiers.tiering.known.forget_all();
        removed
    }

    /// Detaches the L3 backend: waits for backups in flight (nothing acknowledged is lost),
    /// revokes prefetches, releases every pin they held. Detaching without a backend does
    /// nothing. Requests may stay live; their prefetches are revoked. Refused under
    /// `buffer_only` and exclusive tiering, which need L3.
    pub fn detach_storage(&mut self) -> Result<()> {
        self.check_open()?;
        if let Some((field, value)) = self.cfg.needs_l3()
            && self.l3.is_some()
        {
            return Err(HiCacheError::config(
                field,
                value,
                "needs L3: the backend cannot be detached (shut the cache down instead)",
            ));
        }
        self.detach_l3()
    }

    /// Detaches L3 whatever the mode (shutdown).
    pub(super) fn detach_l3(&mut self) -> Result<()> {
        let Some(l3) = self.l3.take() else {
            return Ok(());
        };
        for end in l3.close(&mut self.tiers, &mut self.events)? {
            self.requests.prefetch_ended(end);
        }
        Ok(())
    }
}
