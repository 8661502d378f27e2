//! Asynchronous batch jobs and their completion queue (vLLM's secondary tier).
//!
//! vLLM's `SecondaryTierManager` submits loads and stores without waiting and later collects
//! what finished (`get_finished_jobs`). [`Jobs`] is the queue behind that: a job is counted in
//! flight from [`Jobs::start`] until its [`Ticket`] is finished, and its [`Completion`] is
//! queued for [`Jobs::take`]; [`Jobs::wait_idle`] blocks until nothing is in flight (vLLM's
//! `drain_jobs`, and `close`), woken by the last job to finish, never by polling.
//!
//! Jobs run on a [`JobQueue`]: a bounded queue ([`JOB_QUEUE_CAPACITY`] jobs) and a fixed set
//! of worker threads ([`JOB_WORKERS`]), started with the first job. A job that finds the queue
//! full is refused at once ([`Submit::Full`]), never waited for: vLLM's tier turns the refusal
//! into a failed job, so a stalled backend costs the caller failed jobs, not a stalled
//! scheduler, and costs the process [`JOB_WORKERS`] threads, not one per job.
//!
//! Invariants:
//! 1. Every started job yields exactly one completion: a [`Ticket`] dropped unfinished (a job
//!    that panicked or was cancelled) queues a failed completion, so `wait_idle` never waits
//!    for a job that cannot finish and vLLM always hears of every job it submitted. A job the
//!    queue refused is un-started ([`Ticket::abandon`]): no completion, the caller was told.
//! 2. The in-flight count and the queue change together, under one lock: once `wait_idle`
//!    returns, every job started before it has its completion queued.
//! 3. At most [`JOB_WORKERS`] threads ever run jobs, and at most [`JOB_QUEUE_CAPACITY`] jobs
//!    wait for them; after [`JobQueue::stop_accepting`] no job is accepted, and after
//!    [`JobQueue::fail_waiting`] every job still waiting fails at once when a worker takes it ("closed before it started"), without running.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// How one job ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The caller's id of the job.
    pub job_id: u64,
    /// One flag per key: `true` when the page was read in full (load) or stored (store).
    pub ok: Vec<bool>,
    /// Seconds from start to finish.
    pub seconds: f64,
    /// Why the whole job failed (a backend error, a closed store), when it did.
    pub error: Option<String>,
}

#[derive(Default)]
struct State {
    in_flight: usize,
    done: Vec<Completion>,
}

/// The jobs of one store: the in-flight count and the queue of completions.
#[derive(Default)]
pub struct Jobs {
    state: Mutex<State>,
    idle: Condvar,
}

impl Jobs {
    /// Counts a job of `keys` pages in flight; its ticket reports how it ended.
    pub fn start(self: &Arc<Self>, job_id: u64, keys: usize) -> Ticket {
        self.state.lock().in_flight += 1;
        Ticket {
            jobs: Arc::clone(self),
            job_id,
            keys,
            started: Instant::now(),
            finished: false,
        }
    }

    /// The completions queued since the last call, oldest first.
    pub fn take(&self) -> Vec<Completion> {
        std::mem::take(&mut self.state.lock().done)
    }

    /// Jobs started and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.state.lock().in_flight
    }

    /// Blocks until no job is in flight (invariant 2).
    pub fn wait_idle(&self) {
        let mut s = self.state.lock();
        while s.in_flight > 0 {
            self.idle.wait(&mut s);
        }
    }

    /// Blocks until no job is in flight or `deadline` passed; whether none is in flight.
    pub fn wait_idle_until(&self, deadline: Instant) -> bool {
        let mut s = self.state.lock();
        while s.in_flight > 0 {
            if self.idle.wait_until(&mut s, deadline).timed_out() {
                return s.in_flight == 0;
            }
        }
        true
    }

    /// Un-counts a job that never ran and whose caller was told so (invariant 1).
    fn unstart(&self) {
        let mut s = self.state.lock();
        s.in_flight -= 1;
        if s.in_flight == 0 {
            self.idle.notify_all();
        }
    }

    fn finish(&self, c: Completion) {
        let mut s = self.state.lock();
        s.done.push(c);
        s.in_flight -= 1;
        if s.in_flight == 0 {
            self.idle.notify_all();
        }
    }
}

/// One job in flight: finish it with its outcome; dropped unfinished it reports a failure
/// (invariant 1).
pub struct Ticket {
    jobs: Arc<Jobs>,
    job_id: u64,
    keys: usize,
    started: Instant,
    finished: bool,
}

impl Ticket {
    /// Withdraws a job that was never run and whose caller was told it was refused: no
    /// completion is queued (invariant 1).
    pub fn abandon(mut self) {
        self.finished = true;
        self.jobs.unstart();
    }

    /// Queues the job's completion: per-key flags, or the error that failed all of it.
    pub fn finish(mut self, outcome: Result<Vec<bool>, String>) {
        self.finished = true;
        self.jobs.finish(self.completion(outcome));
    }

    fn completion(&self, outcome: Result<Vec<bool>, String>) -> Completion {
        let seconds = self.started.elapsed().as_secs_f64();
        match outcome {
            Ok(ok) => Completion {
                job_id: self.job_id,
                ok,
                seconds,
                error: None,
            },
            Err(e) => Completion {
                job_id: self.job_id,
                ok: vec![false; self.keys],
                seconds,
                error: Some(e),
            },
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.finished {
            let c = self.completion(Err("the job ended without a result".into()));
            self.jobs.finish(c);
        }
    }
}

/// Worker threads that run jobs (invariant 3): enough to overlap a few backend calls, few
/// enough that a stalled backend holds no more threads than this.
pub const JOB_WORKERS: usize = 4;

/// Jobs that may wait for a worker (invariant 3): beyond them a job is refused at once.
pub const JOB_QUEUE_CAPACITY: usize = 1024;

/// The work of one job: run on a worker, its outcome goes to its ticket; after
/// [`JobQueue::fail_waiting`] a job still waiting is dropped unrun (invariant 3).
pub type Work = Box<dyn FnOnce() -> Result<Vec<bool>, String> + Send + 'static>;

struct Job {
    ticket: Ticket,
    work: Work,
}

/// What became of a job handed to [`JobQueue::submit`].
pub enum Submit {
    /// Queued: its completion will come.
    Queued,
    /// The queue holds [`JOB_QUEUE_CAPACITY`] jobs: refused, no completion will come.
    Full,
    /// The queue was closed: refused, no completion will come.
    Closed,
}

struct Channel {
    tx: SyncSender<Job>,
    workers: Vec<JoinHandle<()>>,
}

/// The bounded queue and fixed worker threads of one store's jobs (invariant 3).
#[derive(Default)]
pub struct JobQueue {
    channel: Mutex<Option<Channel>>,
    /// No job is accepted any more.
    refusing: AtomicBool,
    /// Jobs still waiting fail unrun.
    closed: Arc<AtomicBool>,
}

impl JobQueue {
    /// Queues `work` under `ticket`, starting the workers with the first job; a full or
    /// closed queue refuses it at once (the ticket is withdrawn, invariant 1).
    pub fn submit(&self, ticket: Ticket, work: Work) -> Result<Submit, std::io::Error> {
        let mut channel = self.channel.lock();
        if self.refusing.load(Ordering::Acquire) {
            ticket.abandon();
            return Ok(Submit::Closed);
        }
        if channel.is_none() {
            *channel = Some(self.start()?);
        }
        let Some(c) = channel.as_ref() else {
            ticket.abandon();
            return Ok(Submit::Closed);
        };
        match c.tx.try_send(Job { ticket, work }) {
            Ok(()) => Ok(Submit::Queued),
            Err(TrySendError::Full(job)) => {
                job.ticket.abandon();
                Ok(Submit::Full)
            }
            Err(TrySendError::Disconnected(job)) => {
                job.ticket.abandon();
                Ok(Submit::Closed)
            }
        }
    }

    fn start(&self) -> Result<Channel, std::io::Error> {
        let (tx, rx) = sync_channel::<Job>(JOB_QUEUE_CAPACITY);
        let rx = Arc::new(Mutex::new(rx));
        let mut workers = Vec::with_capacity(JOB_WORKERS);
        for i in 0..JOB_WORKERS {
            let rx = Arc::clone(&rx);
            let closed = Arc::clone(&self.closed);
            let spawned = std::thread::Builder::new()
                .name(format!("hicache-py-job-{i}"))
                .spawn(move || work_loop(&rx, &closed));
            match spawned {
                Ok(h) => workers.push(h),
                // The workers already started exit once `tx` is dropped.
                Err(e) => return Err(e),
            }
        }
        Ok(Channel { tx, workers })
    }

    /// Accepts no more jobs; the jobs queued still run. Returns at once.
    pub fn stop_accepting(&self) {
        self.refusing.store(true, Ordering::Release);
    }

    /// Accepts no more jobs, and every job still waiting for a worker fails without running
    /// when a worker takes it (invariant 3). Returns at once: the jobs running go on until
    /// they end (see [`JobQueue::join`]).
    pub fn fail_waiting(&self) {
        self.stop_accepting();
        self.closed.store(true, Ordering::Release);
    }

    /// After [`JobQueue::stop_accepting`]: drops the queue's sender, so that the workers exit once the
    /// queue is empty, and waits for them. Call only once no job is in flight.
    pub fn join(&self) {
        let channel = self.channel.lock().take();
        if let Some(Channel { tx, workers }) = channel {
            drop(tx);
            for w in workers {
                // A worker that panicked already failed its job (its ticket's drop).
                let _ = w.join();
            }
        }
    }

    /// Worker threads started (0 before the first job, [`JOB_WORKERS`] after).
    pub fn workers(&self) -> usize {
        self.channel.lock().as_ref().map_or(0, |c| c.workers.len())
    }
}

/// One worker: takes jobs until the queue's sender is gone; after `fail_waiting` a job taken fails
/// without running (invariant 3).
fn work_loop(rx: &Mutex<Receiver<Job>>, closed: &AtomicBool) {
    loop {
        // The lock is held while waiting: the other workers wait on it instead of the
        // channel, and the first to get it takes the next job.
        let job = rx.lock().recv();
        let Ok(Job { ticket, work }) = job else {
            return;
        };
        if closed.load(Ordering::Acquire) {
            drop(work);
            ticket.finish(Err("the store was closed before the job started".into()));
            continue;
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
            .unwrap_or_else(|_| Err("the job panicked".into()));
        ticket.finish(outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_job_completes_once_with_its_outcome() {
        let jobs = Arc::new(Jobs::default());
        let a = jobs.start(1, 2);
        let b = jobs.start(2, 3);
        assert_eq!(jobs.in_flight(), 2);
        a.finish(Ok(vec![true, false]));
        b.finish(Err("server gone".into()));
        let done = jobs.take();
        assert_eq!(done.len(), 2);
        assert_eq!((done[0].job_id, done[0].ok.clone()), (1, vec![true, false]));
        assert_eq!(done[0].error, None);
        assert_eq!((done[1].job_id, done[1].ok.clone()), (2, vec![false; 3]));
        assert_eq!(done[1].error.as_deref(), Some("server gone"));
        assert!(jobs.take().is_empty());
        assert_eq!(jobs.in_flight(), 0);
    }

    #[test]
    fn a_ticket_dropped_unfinished_is_a_failed_job() {
        let jobs = Arc::new(Jobs::default());
        drop(jobs.start(7, 1));
        let done = jobs.take();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].ok, vec![false]);
        assert!(done[0].error.is_some());
        assert_eq!(jobs.in_flight(), 0);
    }

    #[test]
    fn wait_idle_returns_once_every_job_finished_on_other_threads() {
        let jobs = Arc::new(Jobs::default());
        std::thread::scope(|s| {
            for id in 0..8u64 {
                let t = jobs.start(id, 1);
                s.spawn(move || t.finish(Ok(vec![true])));
            }
            jobs.wait_idle();
            assert_eq!(jobs.in_flight(), 0);
            let mut ids: Vec<u64> = jobs.take().iter().map(|c| c.job_id).collect();
            ids.sort_unstable();
            assert_eq!(ids, (0..8).collect::<Vec<_>>());
        });
    }

    /// A gate the test opens once; jobs block on it and count themselves in when they start.
    #[derive(Default)]
    struct Gate {
        state: Mutex<(usize, bool)>,
        cv: Condvar,
    }

    impl Gate {
        fn enter_and_wait(&self) {
            let mut s = self.state.lock();
            s.0 += 1;
            self.cv.notify_all();
            while !s.1 {
                self.cv.wait(&mut s);
            }
        }
        fn wait_started(&self, n: usize) {
            let mut s = self.state.lock();
            while s.0 < n {
                self.cv.wait(&mut s);
            }
        }
        fn open(&self) {
            self.state.lock().1 = true;
            self.cv.notify_all();
        }
    }

    #[test]
    fn a_full_queue_refuses_at_once_and_close_fails_the_waiting_jobs_unrun() {
        let jobs = Arc::new(Jobs::default());
        let queue = JobQueue::default();
        let gate = Arc::new(Gate::default());
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let job = |id: u64| {
            let (gate, ran) = (Arc::clone(&gate), Arc::clone(&ran));
            let work: Work = Box::new(move || {
                ran.fetch_add(1, Ordering::SeqCst);
                gate.enter_and_wait();
                Ok(vec![true])
            });
            (jobs.start(id, 1), work)
        };
        for id in 0..JOB_WORKERS as u64 {
            let (t, w) = job(id);
            assert!(matches!(queue.submit(t, w).unwrap(), Submit::Queued));
        }
        // Every worker holds a job: the rest wait in the queue.
        gate.wait_started(JOB_WORKERS);
        assert_eq!(queue.workers(), JOB_WORKERS);
        for id in 0..JOB_QUEUE_CAPACITY as u64 {
            let (t, w) = job(100 + id);
            assert!(matches!(queue.submit(t, w).unwrap(), Submit::Queued));
        }
        let (t, w) = job(9999);
        assert!(matches!(queue.submit(t, w).unwrap(), Submit::Full));
        // The refused job is not in flight and will have no completion.
        assert_eq!(jobs.in_flight(), JOB_WORKERS + JOB_QUEUE_CAPACITY);
        queue.fail_waiting();
        let (t, w) = job(10_000);
        assert!(matches!(queue.submit(t, w).unwrap(), Submit::Closed));
        gate.open();
        jobs.wait_idle();
        queue.join();
        let done = jobs.take();
        assert_eq!(done.len(), JOB_WORKERS + JOB_QUEUE_CAPACITY);
        let ok = done.iter().filter(|c| c.error.is_none()).count();
        assert_eq!(ok, JOB_WORKERS);
        assert!(
            done.iter().filter(|c| c.error.is_some()).all(|c| {
                c.job_id >= 100 && c.error.as_deref().unwrap().contains("closed before")
            })
        );
        assert_eq!(ran.load(Ordering::SeqCst), JOB_WORKERS);
        assert!(!done.iter().any(|c| c.job_id >= 9999));
    }

    #[test]
    fn the_workers_are_few_and_fixed_however_many_jobs_pass() {
        let jobs = Arc::new(Jobs::default());
        let queue = JobQueue::default();
        assert_eq!(queue.workers(), 0);
        let mut queued = 0;
        for id in 0..20_000u64 {
            let w: Work = Box::new(|| Ok(vec![true]));
            match queue.submit(jobs.start(id, 1), w).unwrap() {
                Submit::Queued => queued += 1,
                Submit::Full => jobs.wait_idle(),
                Submit::Closed => unreachable!("never closed here"),
            }
            assert!(queue.workers() == JOB_WORKERS);
        }
        jobs.wait_idle();
        assert_eq!(jobs.take().len(), queued);
        queue.stop_accepting();
        queue.join();
        assert_eq!(queue.workers(), 0);
    }

    #[test]
    fn a_deadline_bounds_the_wait_for_idle() {
        let jobs = Arc::new(Jobs::default());
        let t = jobs.start(1, 1);
        assert!(!jobs.wait_idle_until(Instant::now()));
        t.finish(Ok(vec![true]));
        assert!(jobs.wait_idle_until(Instant::now()));
    }
}
