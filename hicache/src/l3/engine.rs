//! [`L3Engine`]: what the L3 parts of both controllers (`HiCache`'s [`super::L3`], the
//! hybrid facade's `L3Part`) run their background I/O on — the backend, the runtime its tasks
//! run on, the write permits every backup shares, and the pages per backend call — and the
//! one way a backup starts ([`L3Engine::backup`], a [`BackupJob`] over any [`PageSource`]).

use std::future::Future;
use std::sync::Arc;

use hicache_core::HostSlot;
use hicache_storage::{LayoutKind, STORAGE_BATCH_SIZE, Storage};
use tokio::sync::Semaphore;

use super::jobs::{BackupJob, BackupShared, Chain, PageSource};
use super::{L3_WRITE_BATCHES_IN_FLIGHT, SHUTDOWN_WAIT};

/// The backend and the runtime of one cache's L3 tasks (see the module docs).
pub(crate) struct L3Engine {
    /// The backend.
    pub storage: Arc<dyn Storage>,
    runtime: tokio::runtime::Runtime,
    /// One permit per write batch in flight, over every backup of the tier.
    write_permits: Arc<Semaphore>,
    /// Pages per backend call (at least 1).
    pub batch: usize,
}

impl L3Engine {
    /// The engine of `storage` on `runtime`, `batch` pages per call (at most the backend's
    /// limit; `None`: the backend's limit, at most SGLang's batch).
    pub fn new(
        storage: Arc<dyn Storage>,
        runtime: tokio::runtime::Runtime,
        batch: Option<usize>,
    ) -> Self {
        let limit = storage.info().max_batch.max(1);
        let batch = batch.unwrap_or(STORAGE_BATCH_SIZE).clamp(1, limit);
        Self {
            storage,
            runtime,
            write_permits: Arc::new(Semaphore::new(L3_WRITE_BATCHES_IN_FLIGHT)),
            batch,
        }
    }

    /// Spawns a task on the runtime.
    pub fn spawn(&self, f: impl Future<Output = ()> + Send + 'static) {
        self.runtime.spawn(f);
    }

    /// Runs `f` on the runtime to its end (blocking the caller).
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.runtime.block_on(f)
    }

    /// Starts storing the pages of `slots` (read from `pool`, stored with `layout`) under the
    /// keys of `chain` in the background; the job's shared state tells when it is done and
    /// what it stored. The caller keeps the slots host-protected until then.
    pub fn backup(
        &self,
        pool: Arc<dyn PageSource>,
        chain: Chain,
        slots: Vec<HostSlot>,
        layout: LayoutKind,
    ) -> Arc<BackupShared> {
        let shared = Arc::new(BackupShared::default());
        let job = BackupJob {
            storage: self.storage.clone(),
            pool,
            chain: Arc::new(chain),
            slots,
            batch: self.batch,
            layout,
            shared: shared.clone(),
            in_flight: self.write_permits.clone(),
        };
        self.runtime.spawn(job.run());
        shared
    }

    /// Stops the runtime (its tasks awaited by the caller first; a task still running is
    /// given a bounded wait).
    pub fn close(self) {
        self.runtime.shutdown_timeout(SHUTDOWN_WAIT);
    }
}
