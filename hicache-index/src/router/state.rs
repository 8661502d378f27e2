//! What a router knows that a restart must not lose: each instance's load (its last report
//! and the router's own deltas since), the requests routed and not finished, the sessions of
//! the tie-break and the turn of `round-robin`. Plain data ([`RouterState`]), serializable, so
//! the service keeps it in its snapshot.
//!
//! Invariants:
//! 1. **Exact.** A router restored from [`Router::state`] over the same instances decides
//!    every later request as the one that wrote it would (same load, same outstanding
//!    requests, same sessions, same turn); `sglang-cache-aware`'s approximate tree is not
//!    kept (a guess rebuilt by routing), and neither are the counters. Hybrid components are
//!    not the router's (they live with the overlap source: [`super::Components`]).
//! 2. **Positions are remapped.** [`Router::restore_state`] takes a map from the saved
//!    positions to the new ones, as [`Router::with_instances`] does; what belonged to an
//!    instance that is gone is dropped, never credited to another.

use serde::{Deserialize, Serialize};

use super::Router;
use super::load::LoadTracker;

/// One instance's load as the router holds it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotState {
    /// Last report: prompt tokens to compute.
    pub queued_prefill_tokens: u64,
    /// Last report: requests waiting or running.
    pub requests: u64,
    /// Last report: KV tokens of running requests.
    pub running_tokens: u64,
    /// The router's deltas since that report (prefill tokens, requests, running tokens).
    pub deltas: [i64; 3],
    /// Last report: requests waiting for their L3 prefetch (0 in a state saved before it).
    #[serde(default)]
    pub prefetching_requests: u64,
    /// The router's delta of those since that report.
    #[serde(default)]
    pub prefetching_delta: i64,
}

/// A request routed and not finished.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutedState {
    /// The gateway's request id.
    pub request: u64,
    /// The instance's position.
    pub instance: usize,
    /// Its prompt tokens.
    pub prompt_tokens: u64,
    /// Of which to compute.
    pub new_tokens: u64,
}

/// A session's last instance and when it was last routed (the router's decision clock).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionState {
    /// The gateway's session id.
    pub session: u64,
    /// The instance's position.
    pub instance: usize,
    /// The decision clock when it was last routed.
    pub stamp: u64,
}

/// A router's state by instance position (invariant 1 says what is kept).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterState {
    /// Load per instance, by position.
    pub slots: Vec<SlotState>,
    /// Requests routed and not finished, by request id.
    pub routed: Vec<RoutedState>,
    /// Sessions, oldest first.
    pub sessions: Vec<SessionState>,
    /// The decision clock of the sessions.
    pub session_clock: u64,
    /// The position `round-robin` gives next.
    pub round_robin_next: usize,
    /// `hicache`'s prompts in flight: request, instance position, the prompt's block hashes.
    #[serde(default)]
    pub in_flight: Vec<(u64, usize, Vec<u64>)>,
}

impl LoadTracker {
    /// The tracker's state: slots by position, routed requests by id.
    pub fn state(&self) -> (Vec<SlotState>, Vec<RoutedState>) {
        let mut routed: Vec<RoutedState> = self.routed_requests().collect();
        routed.sort_unstable_by_key(|r| r.request);
        (self.slot_states().collect(), routed)
    }

    /// A tracker for `len` instances from a saved state, positions mapped by `map`
    /// (invariant 2).
    pub fn from_state(
        len: usize,
        slots: &[SlotState],
        routed: &[RoutedState],
        map: impl Fn(usize) -> Option<usize>,
    ) -> LoadTracker {
        let mut out = LoadTracker::new(len);
        for (i, s) in slots.iter().enumerate() {
            if let Some(j) = map(i).filter(|&j| j < len) {
                out.set_slot(j, s);
            }
        }
        for r in routed {
            if let Some(j) = map(r.instance).filter(|&j| j < len) {
                out.set_routed(RoutedState { instance: j, ..*r });
            }
        }
        out
    }
}

impl Router {
    /// What a restart must keep (invariant 1).
    pub fn state(&self) -> RouterState {
        let (slots, routed) = self.load.state();
        let mut sessions: Vec<SessionState> = self
            .sessions
            .iter()
            .map(|(&session, &(instance, stamp))| SessionState {
                session,
                instance,
                stamp,
            })
            .collect();
        sessions.sort_unstable_by_key(|s| (s.stamp, s.session));
        RouterState {
            slots,
            routed,
            sessions,
            session_clock: self.session_clock,
            round_robin_next: self.rr.next(),
            in_flight: self.pending.state(),
        }
    }

    /// Takes over `state`, saved by a router whose position `i` is `map(i)` here (`None`: the
    /// instance is gone; invariant 2). What this router knew before is replaced.
    pub fn restore_state(&mut self, state: &RouterState, map: impl Fn(usize) -> Option<usize>) {
        let n = self.instances.len();
        let map = |i: usize| map(i).filter(|&j| j < n);
        self.load = LoadTracker::from_state(n, &state.slots, &state.routed, map);
        self.sessions = state
            .sessions
            .iter()
            .filter_map(|s| map(s.instance).map(|j| (s.session, (j, s.stamp))))
            .collect();
        self.session_clock = state
            .session_clock
            .max(state.sessions.iter().map(|s| s.stamp).max().unwrap_or(0));
        self.rr = super::round_robin::RoundRobin::starting_at(state.round_robin_next);
        self.pending = super::pending::Pending::new(n);
        for (request, i, hashes) in &state.in_flight {
            if let Some(j) = map(*i) {
                self.pending.routed(*request, j, hashes);
            }
        }
    }
}
