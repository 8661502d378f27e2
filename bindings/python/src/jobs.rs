//! Asynchronous batch jobs and their completion queue (vLLM's secondary tier).
//!
//! vLLM's `SecondaryTierManager` submits loads and stores without waiting and later collects
//! what finished (`get_finished_jobs`). [`Jobs`] is the queue behind that: a job is counted in
//! flight from [`Jobs::start`] until its [`Ticket`] is finished, and its [`Completion`] is
//! queued for [`Jobs::take`]; [`Jobs::wait_idle`] blocks until nothing is in flight (vLLM's
//! `drain_jobs`, and `close`), woken by the last job to finish, never by polling.
//!
//! Invariants:
//! 1. Every started job yields exactly one completion: a [`Ticket`] dropped unfinished (a job
//!    that panicked or was cancelled) queues a failed completion, so `wait_idle` never waits
//!    for a job that cannot finish and vLLM always hears of every job it submitted.
//! 2. The in-flight count and the queue change together, under one lock: once `wait_idle`
//!    returns, every job started before it has its completion queued.

use std::sync::Arc;
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
}
