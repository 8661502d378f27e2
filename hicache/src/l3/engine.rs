//! [`L3Engine`]: what the L3 parts of both controllers (`HiCache`'s [`super::L3`], the
//! hybrid facade's `L3Part`) run their background I/O on — the backend, the runtime its tasks
//! run on, the write permits every backup shares, and the pages per backend call — and the
//! one way a backup starts ([`L3Engine::backup`], a [`BackupJob`] over any [`PageSource`]).
//!
//! **Submission.** Handing a task to the runtime wakes a parked worker thread: a futex wake
//! that costs the engine thread several microseconds on a loaded machine. Work a controller
//! starts during one tick (lookups at arrival, backups at poll) is therefore queued
//! ([`L3Engine::defer`], [`L3Engine::backup`]) and handed over together by
//! [`L3Engine::flush`]: one wake per flush, whatever the number of tasks. Both controllers
//! flush at their tick's boundaries and before every wait for queued work (queued work never
//! runs by itself).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use hicache_core::HostSlot;
use hicache_storage::{LayoutKind, STORAGE_BATCH_SIZE, Storage};
use parking_lot::Mutex;
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
    /// Tasks queued by `defer`, handed to the runtime by `flush`.
    deferred: Mutex<Vec<Task>>,
}

/// A task queued for the runtime.
type Task = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

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
            deferred: Mutex::new(Vec::new()),
        }
    }

    /// Queues a task for the next [`L3Engine::flush`] (see the module's submission rule).
    pub fn defer(&self, f: impl Future<Output = ()> + Send + 'static) {
        self.deferred.lock().push(Box::pin(f));
    }

    /// Hands every queued task to the runtime with one wake-up: a single task is spawned
    /// as it is; several are spawned by one task on the runtime, each as its own task (they
    /// run concurrently, as if spawned one by one).
    pub fn flush(&self) {
        let mut queued = self.deferred.lock();
        match queued.len() {
            0 => {}
            1 => {
                let task = queued.pop().expect("one queued");
                drop(queued);
                self.runtime.spawn(task);
            }
            _ => {
                let tasks = std::mem::take(&mut *queued);
                drop(queued);
                self.runtime.spawn(async move {
                    for task in tasks {
                        tokio::spawn(task);
                    }
                });
            }
        }
    }

    /// Runs `f` on the runtime to its end (blocking the caller).
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.runtime.block_on(f)
    }

    /// Queues the storing of the pages of `slots` (read from `pool`, stored with `layout`)
    /// under the keys of `chain` for the next [`L3Engine::flush`], then in the background;
    /// the job's shared state tells when it is done and what it stored. The caller keeps the
    /// slots host-protected until then.
    pub fn backup(
        &self,
        pool: Arc<dyn PageSource>,
        chain: Chain,
        slots: Vec<HostSlot>,
        layout: LayoutKind,
    ) -> Arc<BackupShared> {
        let (job, shared) = self.backup_job(pool, chain, slots, layout);
        self.defer(job.run());
        shared
    }

    fn backup_job(
        &self,
        pool: Arc<dyn PageSource>,
        chain: Chain,
        slots: Vec<HostSlot>,
        layout: LayoutKind,
    ) -> (BackupJob, Arc<BackupShared>) {
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
        (job, shared)
    }

    /// Stops the runtime (its tasks awaited by the caller first; a task still running is
    /// given a bounded wait). Queued tasks are handed over first, so none is lost unrun.
    pub fn close(self) {
        self.flush();
        self.runtime.shutdown_timeout(SHUTDOWN_WAIT);
    }
}
