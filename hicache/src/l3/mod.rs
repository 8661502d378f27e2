//! [`L3`]: the attached storage backend, its prefetches (L3 → L2, [`prefetch`]) and backups
//! (L2 → L3, [`backup`]).
//!
//! Background work runs on a small tokio runtime owned by the tier ([`jobs`]); the engine
//! thread never blocks on storage. The lookups and backups a tick starts are handed to the
//! runtime together at the tick's flush points ([`L3::flush`]): one wake-up of a worker per
//! tick instead of one per task. Every operation has a shared state the engine thread reads
//! in `poll`; every decision that changes the tree is taken on the engine thread from counts
//! all ranks agreed on (see [`crate::tick`]). The invariants of each direction are written in
//! its module.

mod backup;
mod engine;
mod jobs;
mod prefetch;

use std::sync::Arc;
use std::time::Duration;

use hicache_core::{KvKind, KvShape, PrefetchConfig};
use hicache_storage::{LayoutKind, Storage, StorageConfig};

pub use backup::L3_WRITE_BATCHES_IN_FLIGHT;
pub(crate) use engine::L3Engine;
pub(crate) use jobs::{
    BackupShared, Chain, FetchShared, Fetcher, PageSource, QueryResult, get_batch, present_run,
    run_prefetch,
};
pub use prefetch::RequestId;
pub(crate) use prefetch::{
    LookedUp, MAX_TRACKED_PREFETCHES, PrefetchCounts, PrefetchEnd, prefetch_counts,
};

use crate::agree::{Fifo, Tracked};
use crate::config::HiCacheConfig;
use crate::error::{HiCacheError, Result};
use crate::metrics::PrefetchOutcome;
use crate::tree_pools::Tiers;
use backup::BackupOp;
use prefetch::PrefetchOp;

/// L3 worker threads: lookups, fetches and backups are I/O-bound tasks.
const WORKER_THREADS: usize = 2;
/// How long detaching waits for the runtime's tasks to stop.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(10);
/// Shortest interval between two warnings of L3 pages lost to storage errors (per direction);
/// the pages of the failures in between are summed into the next warning.
const FAILURE_WARN_INTERVAL: Duration = Duration::from_secs(5);

/// Rate limit of one kind of warning: at most one per [`FAILURE_WARN_INTERVAL`]; what is not
/// logged is summed into the next one (so every lost page is in some warning or still
/// pending, and always in the metric).
#[derive(Debug, Default)]
pub(crate) struct WarnLimit {
    last: Option<std::time::Instant>,
    /// Failures and pages not logged since the last warning.
    held_failures: u64,
    held_pages: u64,
}

impl WarnLimit {
    /// Records a failure of `pages`; returns the failures and pages to log now (including
    /// those held back since the last warning), or `None` within the interval.
    pub fn record(&mut self, pages: u64, now: std::time::Instant) -> Option<(u64, u64)> {
        self.held_failures += 1;
        self.held_pages += pages;
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < FAILURE_WARN_INTERVAL)
        {
            return None;
        }
        self.last = Some(now);
        Some((
            std::mem::take(&mut self.held_failures),
            std::mem::take(&mut self.held_pages),
        ))
    }

    /// Records `lost` pages that `what` (prefetches, backups) lost to storage errors
    /// (`error`: the first, for the log) and warns, rate-limited: both controllers' L3
    /// failures are logged here.
    pub fn warn_loss(&mut self, what: &'static str, lost: u64, error: Option<&str>) {
        if let Some((ops, pages)) = self.record(lost, std::time::Instant::now()) {
            tracing::warn!(
                ops,
                pages,
                error = error.unwrap_or(""),
                "L3 {what} lost pages to storage errors (since the last warning; a backup's \
                 pages stay in L2)"
            );
        }
    }
}

/// The attached L3 tier.
pub(crate) struct L3 {
    /// The backend, the tasks' runtime, the write permits, pages per call.
    engine: L3Engine,
    config: StorageConfig,
    prefetch: PrefetchConfig,
    page_size: usize,
    page_bytes: usize,
    layout: LayoutKind,
    prefetches: Tracked<PrefetchOp>,
    backups: Fifo<BackupOp>,
    /// Finished or revoked prefetches whose task may still hand pages back.
    draining: Vec<Arc<FetchShared>>,
    /// Host pages held by in-flight prefetches, and the most they may hold.
    occupied_pages: usize,
    capacity_pages: usize,
    /// MLA KV is the same on every TP rank: only rank 0 writes it to L3.
    backup_skip: bool,
    /// Host pages of exclusive-tiering demotions in flight.
    demoting_pages: usize,
    /// Polls left before demoting again after a demotion that did not store every page.
    demote_pause: u32,
    /// Warnings of backups that lost pages to storage errors.
    write_warn: WarnLimit,
    /// Warnings of prefetches that lost pages to storage errors.
    read_warn: WarnLimit,
}

/// A new L3 runtime.
pub(crate) fn new_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .thread_name("hicache-l3")
        .enable_all()
        .build()
        .map_err(HiCacheError::Runtime)
}

impl L3 {
    /// The tier over `storage`, after checking that it takes our pages and registering the
    /// host pool with it.
    pub fn open(
        cfg: &HiCacheConfig,
        shape: KvShape,
        rank: usize,
        config: StorageConfig,
        storage: Arc<dyn Storage>,
        runtime: tokio::runtime::Runtime,
        tiers: &Tiers,
    ) -> Result<Self> {
        let info = storage.info();
        if info.max_page_bytes != 0 && info.max_page_bytes < shape.page_bytes() {
            return Err(HiCacheError::config(
                "storage_backend",
                &info.name,
                format!(
                    "pages of {} bytes exceed the backend's maximum of {}",
                    shape.page_bytes(),
                    info.max_page_bytes
                ),
            ));
        }
        storage.register_memory(tiers.host_pool.region())?;
        let engine = L3Engine::new(storage, runtime, Some(cfg.storage_batch_pages));
        let batch = engine.batch;
        let capacity_pages =
            ((tiers.host_pool.num_pages() as f64) * cfg.prefetch_capacity_ratio) as usize;
        let backup_skip = matches!(shape.kind, KvKind::Mla { .. }) && rank != 0;
        tracing::info!(backend = %info.name, batch, capacity_pages, "L3 attached");
        if config.common.pass_prefix_keys && !info.batch_context {
            tracing::info!(
                backend = %info.name,
                "hicache_storage_pass_prefix_keys is on, but the backend does not use prefix keys"
            );
        }
        tiers.metrics.set_storage(Some(engine.storage.clone()));
        Ok(Self {
            engine,
            prefetch: prefetch_config(cfg, &config),
            config,
            page_size: cfg.page_size as usize,
            page_bytes: shape.page_bytes(),
            layout: cfg.mem_layout,
            prefetches: Tracked::new(MAX_TRACKED_PREFETCHES),
            backups: Fifo::default(),
            draining: Vec::new(),
            occupied_pages: 0,
            capacity_pages: capacity_pages.max(1),
            backup_skip,
            demoting_pages: 0,
            demote_pause: 0,
            write_warn: WarnLimit::default(),
            read_warn: WarnLimit::default(),
        })
    }

    /// Hands the lookups and backups queued since the last flush to the runtime, with one
    /// wake-up (see [`L3Engine::flush`]). Besides the tick's boundaries below, the controller
    /// flushes before it reports what is in flight; every blocking wait of this tier flushes
    /// first.
    pub fn flush(&self) {
        self.engine.flush();
    }

    /// The start of a tick's scheduling part (`poll`): see [`L3Engine::begin_scheduling`].
    pub fn begin_scheduling(&self) {
        self.engine.begin_scheduling();
    }

    /// The end of a tick's scheduling part (`start_loading`): see
    /// [`L3Engine::end_scheduling`].
    pub fn end_scheduling(&self) {
        self.engine.end_scheduling();
    }

    /// The backend's name.
    pub fn backend_name(&self) -> String {
        self.engine.storage.info().name
    }

    /// The name the tier was attached under (`StorageConfig::backend`).
    pub fn config_name(&self) -> &str {
        &self.config.backend
    }

    /// Clears every namespace of `ids` in the backend (on the tier's runtime); returns the
    /// pages removed.
    pub fn clear(&self, ids: &[hicache_core::NamespaceId]) -> Result<u64> {
        let storage = self.engine.storage.clone();
        let ids = ids.to_vec();
        self.engine.block_on(async move {
            let mut n = 0;
            for id in ids {
                n += storage.clear(id).await?;
            }
            Ok(n)
        })
    }

    /// Updates the policy fields from `config` (the same backend attached again).
    pub fn update(&mut self, cfg: &HiCacheConfig, config: StorageConfig) {
        self.prefetch = prefetch_config(cfg, &config);
        self.config = config;
    }

    /// Revokes every prefetch (their pages released), waits for every backup and finishes
    /// it (nothing acknowledged is lost), then stops the runtime. Returns the revoked
    /// prefetches' ends.
    pub fn close(
        mut self,
        tiers: &mut Tiers,
        events: &mut Vec<hicache_core::KvEvent>,
    ) -> Result<Vec<PrefetchEnd>> {
        self.engine.flush();
        let mut ends = Vec::new();
        for seq in self.prefetch_seqs() {
            ends.push(self.end_prefetch(seq, 0, PrefetchOutcome::aborted, tiers)?);
        }
        let n = self.backups_in_flight();
        self.wait_backups(n);
        let complete = self.first_incomplete_backup();
        self.finish_backups(n, complete, tiers, events)?;
        self.collect_leftovers(true, tiers)?;
        tiers.metrics.set_storage(None);
        self.engine.close();
        tracing::info!("L3 detached");
        Ok(ends)
    }
}

fn prefetch_config(cfg: &HiCacheConfig, sc: &StorageConfig) -> PrefetchConfig {
    PrefetchConfig {
        policy: cfg.storage_prefetch_policy,
        prefetch_threshold: sc.common.prefetch_threshold.min(u32::MAX as u64) as u32,
        prefetch_timeout_base: sc.common.prefetch_timeout_base,
        prefetch_timeout_per_ki_token: sc.common.prefetch_timeout_per_ki_token,
        prefetch_timeout_max: sc.common.prefetch_timeout_max,
    }
}

impl std::fmt::Debug for L3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L3")
            .field("backend", &self.backend_name())
            .field("prefetches", &self.prefetches.len())
            .field("backups", &self.backups.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn failure_warnings_are_rate_limited_and_sum_what_they_held() {
        let mut w = WarnLimit::default();
        let t0 = Instant::now();
        assert_eq!(w.record(3, t0), Some((1, 3)));
        assert_eq!(w.record(4, t0 + Duration::from_secs(1)), None);
        assert_eq!(w.record(5, t0 + Duration::from_secs(2)), None);
        assert_eq!(
            w.record(1, t0 + FAILURE_WARN_INTERVAL + Duration::from_secs(1)),
            Some((3, 10))
        );
    }
}
