//! One event stream's bookkeeping as a pure state machine: connection events, live and
//! replayed batches and clock ticks in, [`Action`]s out. No sockets, no clock of its own: the
//! driver ([`crate::driver`]) feeds it and carries out what it asks, and the tests below feed it
//! by hand.
//!
//! A stream is one publisher: one dp rank of one engine instance. Its batches are numbered from
//! 0, one by one. Invariants:
//!
//! 1. **In order, once.** Batches are applied in sequence order, each at most once: `next` is
//!    the sequence number the stream expects; a live batch with a larger one is a *gap*, one
//!    with a smaller one a *restart*.
//! 2. **Gaps are replayed.** With a replay endpoint, a gap asks the publisher's replay buffer
//!    for every batch from `next` on, at once; live batches arriving meanwhile wait in a
//!    bounded queue ([`MAX_QUEUED`]) and are applied after the replay, duplicates skipped. A
//!    gap that cannot be replayed (no replay endpoint, the buffer no longer holds `next`, the
//!    replay failed or timed out) *fences* the stream: what the index holds for the instance
//!    may be stale, so it is cleared and the stream resumes from the batch at hand.
//! 3. **Restarts are fenced.** A sequence number going back means a new publisher: the
//!    instance's entries are cleared before its first batch is applied. A new connection may be
//!    a restart too: with a replay endpoint the stream *probes*, asking for the last batch it
//!    applied again; the same payload (by its fingerprint) proves continuity (and the replay
//!    catches up whatever the disconnection lost), anything else is a restart: fence, then
//!    replay the new publisher from 0. Without a replay endpoint the first batch decides.
//! 4. **Dead instances are dropped.** Disconnected for `dead_after` → its entries are dropped
//!    (once); a later connection starts afresh.
//! 5. Every replay request carries an id; replies to an older request are ignored.

use bytes::Bytes;
use std::collections::VecDeque;
use xxhash_rust::xxh3::xxh3_64;

/// Live batches queued while a replay runs; more fence the stream (invariant 2).
pub const MAX_QUEUED: usize = 4096;

/// The stream's timing settings, in milliseconds.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct StreamConfig {
    /// Whether the publisher serves replays.
    pub replay: bool,
    /// A replay not finished after this long has failed.
    pub replay_timeout_ms: u64,
    /// Disconnected this long, an instance is dead and its entries are dropped.
    pub dead_after_ms: u64,
}

/// Why a stream was fenced.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FenceReason {
    /// The sequence went back, or a probe found another publisher.
    Restart,
    /// A gap could not be replayed.
    LostGap,
}

/// What the driver does for the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Apply this batch to the index.
    Apply {
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        payload: Bytes,
    },
    /// Ask the replay endpoint for every batch from `start` on; answer with
    /// [`Input::ReplayBatch`]s and one [`Input::ReplayEnd`] or [`Input::ReplayFailed`] carrying
    /// `id`.
    Replay {
        /// The request's id.
        id: u64,
        /// The first sequence number wanted.
        start: u64,
    },
    /// Clear the instance's entries (its L1, L2, own L3 and engine-hash map).
    Fence(FenceReason),
    /// Drop a dead instance's entries.
    DropDead,
}

/// What happened to the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// The subscription (re)connected.
    Connected,
    /// The subscription lost its connection.
    Disconnected,
    /// A live batch.
    Live {
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        payload: Bytes,
    },
    /// A batch of a replay.
    ReplayBatch {
        /// The replay request's id.
        id: u64,
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        payload: Bytes,
    },
    /// A replay finished.
    ReplayEnd {
        /// The replay request's id.
        id: u64,
    },
    /// A replay could not be done.
    ReplayFailed {
        /// The replay request's id.
        id: u64,
    },
    /// Time passed.
    Tick,
}

/// The stream's counters, as `GET /instances` shows them.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StreamCounters {
    /// Batches applied.
    pub batches: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Replays asked for.
    pub replays: u64,
    /// Batches applied from replays.
    pub replayed_batches: u64,
    /// Replays that failed or timed out.
    pub replay_failures: u64,
    /// Restarts fenced.
    pub fenced_restarts: u64,
    /// Gaps that could not be replayed (fenced).
    pub lost_gaps: u64,
    /// Duplicate batches skipped.
    pub duplicates: u64,
    /// Times the instance was dropped as dead.
    pub dead_drops: u64,
    /// Connections made.
    pub connects: u64,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Purpose {
    /// Fill a gap from `next`.
    Gap,
    /// After a reconnect: is the last applied batch still there, unchanged?
    Probe,
    /// From 0, after a fence or at the start.
    Resync,
}

#[derive(Debug)]
struct InFlight {
    id: u64,
    purpose: Purpose,
    started_ms: u64,
    /// Whether a batch of this replay arrived yet.
    got_any: bool,
    queued: VecDeque<(u64, Bytes)>,
}

/// Where a stream stands, saved with a snapshot.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamPosition {
    /// The next sequence number expected (`None`: nothing applied since the start or a fence).
    pub next: Option<u64>,
    /// The fingerprint (XXH3-64) of the last batch applied (`next - 1`).
    pub last_fingerprint: u64,
}

/// One stream's state machine.
#[derive(Debug)]
pub struct StreamState {
    cfg: StreamConfig,
    pos: StreamPosition,
    connected: bool,
    /// Since when the stream is disconnected (ms), if it is.
    down_since: Option<u64>,
    dead: bool,
    next_id: u64,
    replay: Option<InFlight>,
    counters: StreamCounters,
    last_seq: Option<u64>,
}

impl StreamState {
    /// A stream starting at `pos` (`StreamPosition::default()` for a new one), disconnected
    /// since `now_ms`.
    pub fn new(cfg: StreamConfig, pos: StreamPosition, now_ms: u64) -> Self {
        Self {
            cfg,
            pos,
            connected: false,
            down_since: Some(now_ms),
            dead: false,
            next_id: 1,
            replay: None,
            counters: StreamCounters::default(),
            last_seq: pos.next.and_then(|n| n.checked_sub(1)),
        }
    }

    /// The stream's position.
    pub fn position(&self) -> StreamPosition {
        self.pos
    }

    /// The stream's counters.
    pub fn counters(&self) -> StreamCounters {
        self.counters
    }

    /// The last sequence number applied, if any.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Whether the subscription is connected.
    pub fn connected(&self) -> bool {
        self.connected
    }

    /// Whether the instance was dropped as dead (and has not reconnected since).
    pub fn dead(&self) -> bool {
        self.dead
    }

    /// Whether a replay is running.
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// Takes one input at `now_ms`, appending what to do to `out`.
    pub fn handle(&mut self, input: Input, now_ms: u64, out: &mut Vec<Action>) {
        match input {
            Input::Connected => {
                self.connected = true;
                self.down_since = None;
                self.counters.connects += 1;
                if self.dead {
                    self.dead = false;
                    self.pos = StreamPosition::default();
                }
                if self.cfg.replay && self.replay.is_none() {
                    match self.pos.next {
                        Some(n) if n > 0 => self.start_replay(Purpose::Probe, n - 1, now_ms, out),
                        _ => self.start_replay(Purpose::Resync, 0, now_ms, out),
                    }
                }
            }
            Input::Disconnected => {
                if self.connected {
                    self.connected = false;
                    self.down_since = Some(now_ms);
                }
            }
            Input::Live { seq, payload } => {
                if let Some(r) = &mut self.replay {
                    if r.queued.len() >= MAX_QUEUED {
                        // Invariant 2: the queue is full, the replay is no use any more.
                        self.replay = None;
                        self.counters.replay_failures += 1;
                        self.fence(FenceReason::LostGap, out);
                        self.apply(seq, payload, out);
                    } else {
                        r.queued.push_back((seq, payload));
                    }
                    return;
                }
                self.live(seq, payload, now_ms, out);
            }
            Input::ReplayBatch { id, seq, payload } => {
                self.replay_batch(id, seq, payload, now_ms, out)
            }
            Input::ReplayEnd { id } => {
                if self.replay.as_ref().is_some_and(|r| r.id == id) {
                    self.finish_replay(false, now_ms, out);
                }
            }
            Input::ReplayFailed { id } => {
                if self.replay.as_ref().is_some_and(|r| r.id == id) {
                    self.finish_replay(true, now_ms, out);
                }
            }
            Input::Tick => {
                if self.replay.as_ref().is_some_and(|r| {
                    now_ms.saturating_sub(r.started_ms) >= self.cfg.replay_timeout_ms
                }) {
                    self.finish_replay(true, now_ms, out);
                }
                if !self.dead
                    && let Some(since) = self.down_since
                    && now_ms.saturating_sub(since) >= self.cfg.dead_after_ms
                {
                    self.dead = true;
                    self.replay = None;
                    self.pos = StreamPosition::default();
                    self.counters.dead_drops += 1;
                    out.push(Action::DropDead);
                }
            }
        }
    }

    fn start_replay(&mut self, purpose: Purpose, start: u64, now_ms: u64, out: &mut Vec<Action>) {
        let id = self.next_id;
        self.next_id += 1;
        self.counters.replays += 1;
        self.replay = Some(InFlight {
            id,
            purpose,
            started_ms: now_ms,
            got_any: false,
            queued: VecDeque::new(),
        });
        out.push(Action::Replay { id, start });
    }

    fn apply(&mut self, seq: u64, payload: Bytes, out: &mut Vec<Action>) {
        self.pos = StreamPosition {
            next: Some(seq + 1),
            last_fingerprint: xxh3_64(&payload),
        };
        self.last_seq = Some(seq);
        self.counters.batches += 1;
        out.push(Action::Apply { seq, payload });
    }

    fn fence(&mut self, reason: FenceReason, out: &mut Vec<Action>) {
        match reason {
            FenceReason::Restart => self.counters.fenced_restarts += 1,
            FenceReason::LostGap => self.counters.lost_gaps += 1,
        }
        self.pos = StreamPosition::default();
        out.push(Action::Fence(reason));
    }

    /// A batch on a stream with nothing applied: from 0 it is applied; later, with a replay
    /// endpoint, the publisher is replayed from 0 first.
    fn accept_fresh(&mut self, seq: u64, payload: Bytes, now_ms: u64, out: &mut Vec<Action>) {
        if seq == 0 || !self.cfg.replay {
            self.apply(seq, payload, out);
        } else {
            self.start_replay(Purpose::Resync, 0, now_ms, out);
            if let Some(r) = &mut self.replay {
                r.queued.push_back((seq, payload));
            }
        }
    }

    fn live(&mut self, seq: u64, payload: Bytes, now_ms: u64, out: &mut Vec<Action>) {
        let Some(next) = self.pos.next else {
            self.accept_fresh(seq, payload, now_ms, out);
            return;
        };
        if seq == next {
            self.apply(seq, payload, out);
        } else if seq > next {
            self.counters.gaps += 1;
            if self.cfg.replay {
                self.start_replay(Purpose::Gap, next, now_ms, out);
                if let Some(r) = &mut self.replay {
                    r.queued.push_back((seq, payload));
                }
            } else {
                self.fence(FenceReason::LostGap, out);
                self.apply(seq, payload, out);
            }
        } else {
            self.fence(FenceReason::Restart, out);
            self.accept_fresh(seq, payload, now_ms, out);
        }
    }

    fn replay_batch(
        &mut self,
        id: u64,
        seq: u64,
        payload: Bytes,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(r) = &mut self.replay else { return };
        if r.id != id {
            return;
        }
        let first = !r.got_any;
        r.got_any = true;
        match (r.purpose, first) {
            (Purpose::Probe, true) => {
                let want = self.pos.next.unwrap_or(0).saturating_sub(1);
                if seq == want && xxh3_64(&payload) == self.pos.last_fingerprint {
                    // Continuity proven; what follows fills whatever was lost.
                    if let Some(r) = &mut self.replay {
                        r.purpose = Purpose::Gap;
                    }
                } else {
                    self.restart_during_replay(now_ms, out);
                }
                return;
            }
            (Purpose::Probe, false) => return,
            _ => {}
        }
        match self.pos.next {
            None => {
                self.apply(seq, payload, out);
                self.counters.replayed_batches += 1;
            }
            Some(next) if seq < next => self.counters.duplicates += 1,
            Some(next) if seq == next => {
                self.apply(seq, payload, out);
                self.counters.replayed_batches += 1;
            }
            Some(_) => {
                // The buffer no longer holds `next`: resume from here (invariant 2).
                self.fence(FenceReason::LostGap, out);
                self.apply(seq, payload, out);
                self.counters.replayed_batches += 1;
            }
        }
    }

    /// A probe found another publisher: fence, and replay it from 0 (keeping the live queue).
    fn restart_during_replay(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let queued = self.replay.take().map(|r| r.queued).unwrap_or_default();
        self.fence(FenceReason::Restart, out);
        self.start_replay(Purpose::Resync, 0, now_ms, out);
        if let Some(r) = &mut self.replay {
            r.queued = queued;
        }
    }

    fn finish_replay(&mut self, failed: bool, now_ms: u64, out: &mut Vec<Action>) {
        let Some(r) = self.replay.take() else { return };
        if failed {
            self.counters.replay_failures += 1;
        }
        match (r.purpose, r.got_any, failed) {
            // A probe answered with nothing at or after our last batch: that publisher is gone.
            (Purpose::Probe, false, false) => {
                self.replay = Some(r);
                self.restart_during_replay(now_ms, out);
                return;
            }
            // A gap not filled (failed, or nothing came back): the state is unknown.
            (Purpose::Gap, _, true) | (Purpose::Gap, false, false) | (Purpose::Probe, _, true) => {
                self.fence(FenceReason::LostGap, out);
            }
            _ => {}
        }
        // The batches that arrived live meanwhile, in order; older ones were replayed already.
        let mut queued = r.queued;
        while let Some((seq, payload)) = queued.pop_front() {
            match self.pos.next {
                Some(next) if seq < next => self.counters.duplicates += 1,
                Some(next) if seq > next && self.cfg.replay && !failed => {
                    // Still a hole (it came after the replay was served): replay again.
                    self.counters.gaps += 1;
                    self.start_replay(Purpose::Gap, next, now_ms, out);
                    if let Some(r) = &mut self.replay {
                        r.queued.push_back((seq, payload));
                        r.queued.extend(queued);
                    }
                    return;
                }
                Some(next) if seq > next => {
                    self.fence(FenceReason::LostGap, out);
                    self.apply(seq, payload, out);
                }
                Some(_) => self.apply(seq, payload, out),
                None => self.apply(seq, payload, out),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: StreamConfig = StreamConfig {
        replay: true,
        replay_timeout_ms: 1000,
        dead_after_ms: 10_000,
    };

    fn p(seq: u64) -> Bytes {
        Bytes::from(format!("batch-{seq}"))
    }

    fn live(seq: u64) -> Input {
        Input::Live {
            seq,
            payload: p(seq),
        }
    }

    fn applied(out: &[Action]) -> Vec<u64> {
        out.iter()
            .filter_map(|a| match a {
                Action::Apply { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect()
    }

    fn replay_id(out: &[Action]) -> Option<(u64, u64)> {
        out.iter().rev().find_map(|a| match a {
            Action::Replay { id, start } => Some((*id, *start)),
            _ => None,
        })
    }

    fn step(s: &mut StreamState, input: Input, now: u64) -> Vec<Action> {
        let mut out = Vec::new();
        s.handle(input, now, &mut out);
        out
    }

    /// A stream that connected (replay from 0 answered empty) and applied 0..n.
    fn running(n: u64) -> StreamState {
        let mut s = StreamState::new(CFG, StreamPosition::default(), 0);
        let out = step(&mut s, Input::Connected, 0);
        let (id, start) = replay_id(&out).unwrap();
        assert_eq!(start, 0);
        step(&mut s, Input::ReplayEnd { id }, 0);
        for q in 0..n {
            assert_eq!(applied(&step(&mut s, live(q), 0)), [q]);
        }
        s
    }

    #[test]
    fn a_gap_is_replayed_and_live_batches_wait_for_it() {
        let mut s = running(3);
        let out = step(&mut s, live(6), 5);
        assert_eq!(applied(&out), Vec::<u64>::new());
        let (id, start) = replay_id(&out).unwrap();
        assert_eq!(start, 3);
        assert!(applied(&step(&mut s, live(7), 6)).is_empty());
        let mut got = Vec::new();
        for q in 3..=6 {
            got.extend(applied(&step(
                &mut s,
                Input::ReplayBatch {
                    id,
                    seq: q,
                    payload: p(q),
                },
                7,
            )));
        }
        got.extend(applied(&step(&mut s, Input::ReplayEnd { id }, 8)));
        assert_eq!(got, [3, 4, 5, 6, 7]);
        let c = s.counters();
        assert_eq!(
            (c.gaps, c.duplicates, c.lost_gaps, c.fenced_restarts),
            (1, 1, 0, 0)
        );
        assert_eq!(s.position().next, Some(8));
    }

    #[test]
    fn a_gap_the_buffer_lost_is_fenced_and_resumed() {
        let mut s = running(3);
        let (id, _) = replay_id(&step(&mut s, live(9), 0)).unwrap();
        let out = step(
            &mut s,
            Input::ReplayBatch {
                id,
                seq: 8,
                payload: p(8),
            },
            0,
        );
        assert_eq!(out[0], Action::Fence(FenceReason::LostGap));
        assert_eq!(applied(&out), [8]);
        assert_eq!(applied(&step(&mut s, Input::ReplayEnd { id }, 0)), [9]);
    }

    #[test]
    fn a_replay_that_times_out_fences_and_resumes_live() {
        let mut s = running(2);
        let (id, _) = replay_id(&step(&mut s, live(5), 0)).unwrap();
        assert!(step(&mut s, Input::Tick, 999).is_empty());
        let out = step(&mut s, Input::Tick, 1000);
        assert_eq!(out[0], Action::Fence(FenceReason::LostGap));
        assert_eq!(applied(&out), [5]);
        // A late answer to the old request is ignored.
        assert!(
            step(
                &mut s,
                Input::ReplayBatch {
                    id,
                    seq: 2,
                    payload: p(2)
                },
                1001
            )
            .is_empty()
        );
        assert_eq!(s.counters().replay_failures, 1);
    }

    #[test]
    fn a_sequence_going_back_is_a_restart_fenced_before_its_batches() {
        let mut s = running(5);
        let out = step(&mut s, live(0), 0);
        assert_eq!(
            out,
            [
                Action::Fence(FenceReason::Restart),
                Action::Apply {
                    seq: 0,
                    payload: p(0)
                }
            ]
        );
        // Restarted and already past 0 when we first hear it: fence, then replay from 0.
        let mut s = running(5);
        let out = step(&mut s, live(2), 0);
        assert_eq!(out[0], Action::Fence(FenceReason::Restart));
        let (id, start) = replay_id(&out).unwrap();
        assert_eq!(start, 0);
        let mut got = Vec::new();
        for q in 0..3 {
            got.extend(applied(&step(
                &mut s,
                Input::ReplayBatch {
                    id,
                    seq: q,
                    payload: p(q),
                },
                0,
            )));
        }
        got.extend(applied(&step(&mut s, Input::ReplayEnd { id }, 0)));
        assert_eq!(got, [0, 1, 2]);
        assert_eq!(s.counters().fenced_restarts, 1);
    }

    #[test]
    fn a_reconnect_probes_the_last_batch_same_publisher_continues() {
        let mut s = running(4);
        step(&mut s, Input::Disconnected, 10);
        let out = step(&mut s, Input::Connected, 20);
        let (id, start) = replay_id(&out).unwrap();
        assert_eq!(start, 3);
        assert!(
            step(
                &mut s,
                Input::ReplayBatch {
                    id,
                    seq: 3,
                    payload: p(3)
                },
                21
            )
            .is_empty()
        );
        // What the disconnection lost comes with the same replay.
        let out = step(
            &mut s,
            Input::ReplayBatch {
                id,
                seq: 4,
                payload: p(4),
            },
            21,
        );
        assert_eq!(applied(&out), [4]);
        step(&mut s, Input::ReplayEnd { id }, 22);
        assert_eq!(s.counters().fenced_restarts, 0);
        assert_eq!(s.position().next, Some(5));
    }

    #[test]
    fn a_reconnect_to_a_new_publisher_is_fenced_without_any_batch() {
        // The new publisher has published nothing yet: the probe comes back empty.
        let mut s = running(4);
        step(&mut s, Input::Disconnected, 10);
        let (id, _) = replay_id(&step(&mut s, Input::Connected, 20)).unwrap();
        let out = step(&mut s, Input::ReplayEnd { id }, 21);
        assert_eq!(out[0], Action::Fence(FenceReason::Restart));
        let (id2, start) = replay_id(&out).unwrap();
        assert_eq!(start, 0);
        assert!(step(&mut s, Input::ReplayEnd { id: id2 }, 22).is_empty());
        assert_eq!(applied(&step(&mut s, live(0), 23)), [0]);
        // The new publisher got as far as our position, with other batches: fenced too.
        let mut s = running(4);
        let (id, _) = replay_id(&step(&mut s, Input::Connected, 20)).unwrap();
        let out = step(
            &mut s,
            Input::ReplayBatch {
                id,
                seq: 3,
                payload: Bytes::from("other"),
            },
            21,
        );
        assert_eq!(out[0], Action::Fence(FenceReason::Restart));
    }

    #[test]
    fn a_dead_instance_is_dropped_once_after_the_timeout() {
        let mut s = running(2);
        step(&mut s, Input::Disconnected, 100);
        assert!(step(&mut s, Input::Tick, 10_099).is_empty());
        assert_eq!(step(&mut s, Input::Tick, 10_100), [Action::DropDead]);
        assert!(step(&mut s, Input::Tick, 20_000).is_empty());
        assert!(s.dead());
        // It comes back: a fresh stream, replayed from 0.
        let out = step(&mut s, Input::Connected, 30_000);
        assert_eq!(replay_id(&out).unwrap().1, 0);
        assert!(!s.dead());
        // Connected streams never die, however quiet.
        let mut s = running(1);
        assert!(step(&mut s, Input::Tick, 1_000_000).is_empty());
    }

    #[test]
    fn without_replay_a_gap_fences_and_continues() {
        let cfg = StreamConfig {
            replay: false,
            ..CFG
        };
        let mut s = StreamState::new(cfg, StreamPosition::default(), 0);
        assert!(step(&mut s, Input::Connected, 0).is_empty());
        assert_eq!(applied(&step(&mut s, live(4), 0)), [4]);
        let out = step(&mut s, live(6), 0);
        assert_eq!(out[0], Action::Fence(FenceReason::LostGap));
        assert_eq!(applied(&out), [6]);
        let out = step(&mut s, live(1), 0);
        assert_eq!(out[0], Action::Fence(FenceReason::Restart));
        assert_eq!(applied(&out), [1]);
    }

    #[test]
    fn a_flood_during_a_replay_is_bounded() {
        let mut s = running(1);
        step(&mut s, live(3), 0);
        let mut fenced = false;
        for q in 4..(4 + MAX_QUEUED as u64 + 1) {
            let out = step(&mut s, live(q), 0);
            fenced |= out.contains(&Action::Fence(FenceReason::LostGap));
        }
        assert!(fenced);
        assert!(!s.replaying());
    }

    #[test]
    fn a_saved_position_resumes_through_a_probe() {
        let mut s = running(3);
        let pos = s.position();
        let mut r = StreamState::new(CFG, pos, 0);
        let (id, start) = replay_id(&step(&mut r, Input::Connected, 0)).unwrap();
        assert_eq!(start, 2);
        step(
            &mut r,
            Input::ReplayBatch {
                id,
                seq: 2,
                payload: p(2),
            },
            0,
        );
        let out = step(
            &mut r,
            Input::ReplayBatch {
                id,
                seq: 3,
                payload: p(3),
            },
            0,
        );
        assert_eq!(applied(&out), [3]);
        s.handle(live(3), 0, &mut Vec::new());
        assert_eq!(r.position(), s.position());
    }
}
