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
//! mark their tick's boundaries on the engine ([`L3Engine::begin_scheduling`] at `poll`,
//! [`L3Engine::end_scheduling`] at `start_loading`, each a flush) and flush before every wait
//! for queued work (queued work never runs by itself). A lookup a request starts
//! ([`L3Engine::lookup`]) waits for `start_loading`'s flush when it starts between the two, and
//! is handed over at once otherwise, where no flush follows before the next tick.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

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
    /// Between `begin_scheduling` and `end_scheduling` (a tick's `poll` .. `start_loading`):
    /// a lookup started then is queued for `end_scheduling`'s flush. Only the controller's
    /// thread reads and writes it (relaxed: no other memory is published through it).
    scheduling: AtomicBool,
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
            scheduling: AtomicBool::new(false),
        }
    }

    /// The start of a tick's scheduling part (its `poll`): hands over what was queued since
    /// the last flush, then queues the lookups started from now on for
    /// [`L3Engine::end_scheduling`].
    pub fn begin_scheduling(&self) {
        self.flush();
        self.scheduling.store(true, Ordering::Relaxed);
    }

    /// The end of a tick's scheduling part (its `start_loading`): everything queued during it
    /// (the poll's backups, the tick's lookups) in one hand-off; lookups started after it are
    /// handed over at once.
    pub fn end_scheduling(&self) {
        self.scheduling.store(false, Ordering::Relaxed);
        self.flush();
    }

    /// Queues a lookup a request started (an arrival's prefetch): it waits for the tick's
    /// flush when started in the scheduling part of a tick, and is handed over at once
    /// outside it (no flush follows before the next tick).
    pub fn lookup(&self, f: impl Future<Output = ()> + Send + 'static) {
        self.defer(f);
        if !self.scheduling.load(Ordering::Relaxed) {
            self.flush();
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

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use hicache_storage::memory::{MemoryBackend, MemoryOptions};

    use super::*;

    fn engine() -> L3Engine {
        let storage: Arc<dyn Storage> = Arc::new(MemoryBackend::new(MemoryOptions::default()));
        L3Engine::new(storage, crate::l3::new_runtime().unwrap(), None)
    }

    fn queued(e: &L3Engine) -> usize {
        e.deferred.lock().len()
    }

    /// The submission rule: a lookup started outside a tick's scheduling part runs without
    /// any later flush; one started inside it is queued until `end_scheduling`, then runs.
    #[test]
    fn lookups_wait_for_the_ticks_flush_only_inside_its_scheduling_part() {
        let e = engine();
        let (tx, rx) = mpsc::channel();

        let t = tx.clone();
        e.lookup(async move { t.send("outside").unwrap() });
        assert_eq!(
            queued(&e),
            0,
            "outside the scheduling part: handed over at once"
        );
        assert_eq!(rx.recv().unwrap(), "outside");

        e.begin_scheduling();
        let t = tx.clone();
        e.lookup(async move { t.send("inside").unwrap() });
        let t = tx.clone();
        e.defer(async move { t.send("backup").unwrap() });
        assert_eq!(queued(&e), 2, "inside: queued for start_loading's flush");
        e.end_scheduling();
        assert_eq!(queued(&e), 0);
        let mut got = [rx.recv().unwrap(), rx.recv().unwrap()];
        got.sort();
        assert_eq!(got, ["backup", "inside"]);

        // After the tick, arrivals are handed over at once again.
        e.lookup(async move { tx.send("after").unwrap() });
        assert_eq!(queued(&e), 0);
        assert_eq!(rx.recv().unwrap(), "after");
        e.close();
    }

    /// `begin_scheduling` hands over what arrivals queued before it (nothing is left for
    /// the tick after).
    #[test]
    fn begin_scheduling_flushes_what_was_queued_before() {
        let e = engine();
        let (tx, rx) = mpsc::channel();
        e.defer(async move { tx.send(1).unwrap() });
        assert_eq!(queued(&e), 1);
        e.begin_scheduling();
        assert_eq!(queued(&e), 0);
        assert_eq!(rx.recv().unwrap(), 1);
        e.end_scheduling();
        e.close();
    }
}
