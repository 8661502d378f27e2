//! [`Events`]: the KV events of the hybrid facade, for KV-aware routers — `BlockStored` /
//! `BlockRemoved` of Full-attention pages per medium (GPU, CPU_PINNED), as the dense tree
//! emits them: one event per run of pages an operation stores or removes, hashes from the
//! page-hash chain of the cache's namespace. SWA pages and Mamba states emit nothing: SGLang
//! 0.5.23's `UnifiedRadixCache` records one store / remove per node with the node's page
//! hashes (GPU on insert and load-back, CPU_PINNED on backup and host insert, removals on
//! device and host eviction), and its `BlockStored` has no field naming a component.
//!
//! Invariant: a device (host) Full slot has an entry in `dev` (`host`) exactly while the
//! tree holds it — set when the tree adopts the slot (insert, load-back, backup,
//! prefetch), removed when an eviction reports it.

use std::collections::HashMap;

use hicache_core::{KvEvent, Medium, PageHash, PageHasher, TenantId};

/// One page's identity in the events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PageInfo {
    hash: PageHash,
    parent: Option<PageHash>,
    tokens: Vec<u32>,
}

/// The events buffer and the page identity of every Full slot the tree holds.
pub(crate) struct Events {
    hasher: PageHasher,
    prior: Option<PageHash>,
    page_size: u32,
    enabled: bool,
    dev: HashMap<u32, PageInfo>,
    host: HashMap<u32, PageInfo>,
    out: Vec<KvEvent>,
}

impl Events {
    /// Events with `hasher`'s chain (started at `prior`); nothing is kept unless `enabled`.
    pub fn new(hasher: PageHasher, prior: Option<PageHash>, enabled: bool) -> Self {
        Self {
            page_size: hasher.page_size(),
            hasher,
            prior,
            enabled,
            dev: HashMap::new(),
            host: HashMap::new(),
            out: Vec::new(),
        }
    }

    /// The identities of the whole pages of `tokens` (from the root).
    pub fn pages(&self, tokens: &[u32]) -> Vec<PageInfo> {
        if !self.enabled {
            return Vec::new();
        }
        let hashes = self.hasher.hash_pages(self.prior, tokens);
        let ps = self.page_size as usize;
        let mut parent = None;
        hashes
            .into_iter()
            .enumerate()
            .map(|(k, hash)| {
                let info = PageInfo {
                    hash,
                    parent,
                    tokens: tokens[k * ps..(k + 1) * ps].to_vec(),
                };
                parent = Some(hash);
                info
            })
            .collect()
    }

    fn map(&mut self, medium: Medium) -> &mut HashMap<u32, PageInfo> {
        match medium {
            Medium::Gpu => &mut self.dev,
            _ => &mut self.host,
        }
    }

    /// The tree now holds `slots` in `medium` with identities `infos` (paired in order).
    pub fn stored(&mut self, medium: Medium, slots: &[u32], infos: Vec<PageInfo>) {
        if !self.enabled || infos.is_empty() {
            return;
        }
        let event = KvEvent::BlockStored {
            tenant: TenantId::DEFAULT,
            block_hashes: infos.iter().map(|i| i.hash).collect(),
            parent_block_hash: infos[0].parent,
            token_ids: infos
                .iter()
                .flat_map(|i| i.tokens.iter().copied())
                .collect(),
            block_size: self.page_size,
            medium,
        };
        let map = self.map(medium);
        for (&s, info) in slots.iter().zip(infos) {
            map.insert(s, info);
        }
        self.out.push(event);
    }

    /// Copies the identities of `from` slots (in `src`) to `to` slots (in `dst`): a backup
    /// or load-back; emits the stored event.
    pub fn copied(&mut self, src: Medium, from: &[u32], dst: Medium, to: &[u32]) {
        if !self.enabled {
            return;
        }
        let map = self.map(src);
        let infos: Option<Vec<PageInfo>> = from.iter().map(|s| map.get(s).cloned()).collect();
        if let Some(infos) = infos {
            self.stored(dst, to, infos);
        }
    }

    /// Whether device slot `slot` has an identity (the tree held it before).
    pub fn on_device(&self, slot: u32) -> bool {
        self.dev.contains_key(&slot)
    }

    /// The tree released `slots` of `medium`.
    pub fn removed(&mut self, medium: Medium, slots: &[u32]) {
        if !self.enabled || slots.is_empty() {
            return;
        }
        let map = self.map(medium);
        let hashes: Vec<PageHash> = slots
            .iter()
            .filter_map(|s| map.remove(s).map(|i| i.hash))
            .collect();
        if !hashes.is_empty() {
            self.out.push(KvEvent::BlockRemoved {
                tenant: TenantId::DEFAULT,
                block_hashes: hashes,
                medium,
            });
        }
    }

    /// The events since the last call.
    pub fn drain(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.out)
    }
}
