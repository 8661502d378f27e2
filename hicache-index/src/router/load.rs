//! What the router knows of each instance's load.
//!
//! Two sources, combined (invariant: every figure is the last report plus what the router
//! did since, never below zero):
//! 1. the router's own accounting: a routed request adds its prompt tokens still to compute
//!    (`queued_prefill_tokens`) and its prompt to the KV the instance holds for running
//!    requests; [`LoadTracker::finished`] takes the request back;
//! 2. load reports from the instances ([`LoadReport`]), which replace the estimate: the deltas
//!    since the previous report are dropped.

use std::collections::HashMap;

/// An instance's own account of its load (an engine's per-iteration metrics).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Prompt tokens admitted or waiting and not computed yet.
    pub queued_prefill_tokens: u64,
    /// Requests waiting or running.
    pub requests: u64,
    /// Tokens of KV the running requests hold (prompt and answer so far).
    pub running_tokens: u64,
    /// Requests waiting for their L3 prefetch before admission (0 when not reported).
    pub prefetching_requests: u64,
}

/// One instance's load as the router sees it.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct InstanceLoad {
    /// Prompt tokens still to compute.
    pub queued_prefill_tokens: f64,
    /// Requests waiting or running.
    pub requests: f64,
    /// KV tokens of running requests.
    pub running_tokens: f64,
    /// Requests waiting for their L3 prefetch.
    pub prefetching_requests: f64,
}

#[derive(Clone, Debug, Default)]
struct Slot {
    report: LoadReport,
    d_prefill: i64,
    d_requests: i64,
    d_running: i64,
    /// Requests routed since the report with an L3 overlap credited (their prefetch runs).
    d_prefetching: i64,
}

/// A routed request the router still counts.
#[derive(Copy, Clone, Debug)]
struct Routed {
    instance: usize,
    new_tokens: u64,
    prompt_tokens: u64,
}

/// Load per instance: the last report plus the router's own deltas since.
#[derive(Clone, Debug, Default)]
pub struct LoadTracker {
    slots: Vec<Slot>,
    routed: HashMap<u64, Routed>,
}

impl LoadTracker {
    /// A tracker for `instances` instances, all idle.
    pub fn new(instances: usize) -> Self {
        Self {
            slots: vec![Slot::default(); instances],
            routed: HashMap::new(),
        }
    }

    /// Instances tracked.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no instance is tracked.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Requests routed and not finished.
    pub fn outstanding(&self) -> usize {
        self.routed.len()
    }

    /// `request` went to `instance` with `prompt_tokens`, of which `new_tokens` are to compute.
    /// A request id routed again replaces its earlier record.
    pub fn routed(&mut self, request: u64, instance: usize, prompt_tokens: u64, new_tokens: u64) {
        self.finished(request);
        let s = &mut self.slots[instance];
        s.d_prefill += new_tokens as i64;
        s.d_requests += 1;
        s.d_running += prompt_tokens as i64;
        self.routed.insert(
            request,
            Routed {
                instance,
                new_tokens,
                prompt_tokens,
            },
        );
    }

    /// The request routed last to `instance` waits for an L3 prefetch there (until the
    /// instance's next report, which counts it if it still waits).
    pub fn prefetching(&mut self, instance: usize) {
        if let Some(s) = self.slots.get_mut(instance) {
            s.d_prefetching += 1;
        }
    }

    /// `request` finished (or was cancelled). Returns the instance it had gone to; an unknown
    /// request is ignored (`None`).
    pub fn finished(&mut self, request: u64) -> Option<usize> {
        let r = self.routed.remove(&request)?;
        let s = &mut self.slots[r.instance];
        // Its prefill is done by now (a finished request computed its prompt).
        s.d_prefill -= r.new_tokens as i64;
        s.d_requests -= 1;
        s.d_running -= r.prompt_tokens as i64;
        Some(r.instance)
    }

    /// `instance` reported its load: the estimate restarts from it.
    pub fn report(&mut self, instance: usize, report: LoadReport) {
        if let Some(s) = self.slots.get_mut(instance) {
            *s = Slot {
                report,
                ..Slot::default()
            };
        }
    }

    /// A tracker for `len` instances that carries this one's reports and routed requests
    /// over: `map` gives each old position's new one (`None`: the instance is gone and its
    /// requests are forgotten). Invariant: a kept instance keeps its figures exactly.
    pub fn remap(&self, len: usize, map: impl Fn(usize) -> Option<usize>) -> LoadTracker {
        let mut out = LoadTracker::new(len);
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(j) = map(i).filter(|&j| j < len) {
                out.slots[j] = s.clone();
            }
        }
        for (&request, r) in &self.routed {
            if let Some(j) = map(r.instance).filter(|&j| j < len) {
                out.routed.insert(request, Routed { instance: j, ..*r });
            }
        }
        out
    }

    /// Each slot's report and deltas, by position.
    pub(crate) fn slot_states(&self) -> impl Iterator<Item = super::state::SlotState> + '_ {
        self.slots.iter().map(|s| super::state::SlotState {
            queued_prefill_tokens: s.report.queued_prefill_tokens,
            requests: s.report.requests,
            running_tokens: s.report.running_tokens,
            deltas: [s.d_prefill, s.d_requests, s.d_running],
            prefetching_requests: s.report.prefetching_requests,
            prefetching_delta: s.d_prefetching,
        })
    }

    /// The routed requests not finished, in no order.
    pub(crate) fn routed_requests(&self) -> impl Iterator<Item = super::state::RoutedState> + '_ {
        self.routed
            .iter()
            .map(|(&request, r)| super::state::RoutedState {
                request,
                instance: r.instance,
                prompt_tokens: r.prompt_tokens,
                new_tokens: r.new_tokens,
            })
    }

    /// Sets slot `i` (in range) from a saved state.
    pub(crate) fn set_slot(&mut self, i: usize, s: &super::state::SlotState) {
        self.slots[i] = Slot {
            report: LoadReport {
                queued_prefill_tokens: s.queued_prefill_tokens,
                requests: s.requests,
                running_tokens: s.running_tokens,
                prefetching_requests: s.prefetching_requests,
            },
            d_prefill: s.deltas[0],
            d_requests: s.deltas[1],
            d_running: s.deltas[2],
            d_prefetching: s.prefetching_delta,
        };
    }

    /// Records a routed request from a saved state without moving the load (the saved
    /// deltas already count it).
    pub(crate) fn set_routed(&mut self, r: super::state::RoutedState) {
        self.routed.insert(
            r.request,
            Routed {
                instance: r.instance,
                new_tokens: r.new_tokens,
                prompt_tokens: r.prompt_tokens,
            },
        );
    }

    /// The load of `instance`.
    pub fn load(&self, instance: usize) -> InstanceLoad {
        let s = &self.slots[instance];
        let f = |base: u64, d: i64| (base as i64 + d).max(0) as f64;
        let requests = f(s.report.requests, s.d_requests);
        InstanceLoad {
            queued_prefill_tokens: f(s.report.queued_prefill_tokens, s.d_prefill),
            requests,
            running_tokens: f(s.report.running_tokens, s.d_running),
            // A request that finished before the next report no longer waits: never more
            // than the requests the instance holds.
            prefetching_requests: f(s.report.prefetching_requests, s.d_prefetching).min(requests),
        }
    }

    /// The least-loaded instance: fewest requests, then fewest queued prefill tokens, then
    /// the lowest index.
    pub fn least_loaded(&self) -> usize {
        (0..self.slots.len())
            .min_by(|&a, &b| {
                let (la, lb) = (self.load(a), self.load(b));
                la.requests
                    .total_cmp(&lb.requests)
                    .then(
                        la.queued_prefill_tokens
                            .total_cmp(&lb.queued_prefill_tokens),
                    )
                    .then(a.cmp(&b))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_and_finished_requests_move_the_estimate_and_reports_reset_it() {
        let mut t = LoadTracker::new(2);
        t.routed(1, 0, 100, 60);
        t.routed(2, 0, 50, 50);
        assert_eq!(t.load(0).requests, 2.0);
        assert_eq!(t.load(0).queued_prefill_tokens, 110.0);
        assert_eq!(t.least_loaded(), 1);
        assert_eq!(t.finished(1), Some(0));
        assert_eq!(t.finished(1), None);
        assert_eq!(t.load(0).requests, 1.0);
        t.report(
            0,
            LoadReport {
                queued_prefill_tokens: 7,
                requests: 3,
                running_tokens: 900,
                ..LoadReport::default()
            },
        );
        assert_eq!(t.load(0).queued_prefill_tokens, 7.0);
        assert_eq!(t.load(0).requests, 3.0);
        // A request the report already counted finishes: the estimate goes below the report
        // but never below zero.
        t.finished(2);
        assert_eq!(t.load(0).requests, 2.0);
        assert_eq!(t.load(0).queued_prefill_tokens, 0.0);
    }

    #[test]
    fn requests_awaiting_a_prefetch_count_until_the_next_report() {
        let mut t = LoadTracker::new(2);
        t.routed(1, 0, 100, 10);
        t.prefetching(0);
        t.routed(2, 0, 100, 100);
        assert_eq!(t.load(0).prefetching_requests, 1.0);
        assert_eq!(t.load(1).prefetching_requests, 0.0);
        // The report says which still wait: here none (request 1 was admitted).
        t.report(
            0,
            LoadReport {
                queued_prefill_tokens: 50,
                requests: 2,
                running_tokens: 100,
                prefetching_requests: 0,
            },
        );
        assert_eq!(t.load(0).prefetching_requests, 0.0);
        t.report(
            0,
            LoadReport {
                requests: 2,
                prefetching_requests: 1,
                ..LoadReport::default()
            },
        );
        assert_eq!(t.load(0).prefetching_requests, 1.0);
        // Never more than the requests it holds.
        t.finished(1);
        t.finished(2);
        assert_eq!(t.load(0).prefetching_requests, 0.0);
    }

    #[test]
    fn a_remapped_tracker_keeps_the_instances_that_stay_and_forgets_the_others() {
        let mut t = LoadTracker::new(3);
        t.routed(1, 0, 10, 10);
        t.routed(2, 1, 20, 5);
        t.routed(3, 2, 30, 30);
        // 0 leaves, 1 moves to 0, 2 moves to 2, a new instance takes 1.
        let mut u = t.remap(3, |i| [None, Some(0), Some(2)][i]);
        assert_eq!(u.outstanding(), 2);
        assert_eq!(u.load(0).queued_prefill_tokens, 5.0);
        assert_eq!(u.load(1), InstanceLoad::default());
        assert_eq!(u.load(2).running_tokens, 30.0);
        assert_eq!(u.finished(1), None);
        assert_eq!(u.finished(3), Some(2));
        assert_eq!(u.load(2), InstanceLoad::default());
    }
}
