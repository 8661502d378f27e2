//! The request sender of the multi-turn workload (after SGLang's `bench_multiturn.py`:
//! closed-loop clients, each sending its next turn when the answer to the last one arrived): conversations are released turn by turn to the simulated engine.
//!
//! # Rules (normative; the simulation is reproducible from them and the seed)
//!
//! 1. Every conversation's first turn is ready at time 0. A turn's successor becomes ready when
//!    the turn completes (closed loop per client); with the round barrier, the turns of round
//!    `r + 1` become ready only once every turn of round `r` has completed.
//! 2. The sender makes send attempts at times `t₀ = 0, t₁, …` with independent intervals:
//!    `Exp(rate)` (Poisson) or `U(0, 2/rate)` (uniform); `rate = inf` sends as fast as requests
//!    are ready. An attempt sends one ready request (the oldest, or a random one with the
//!    `random` ready policy) if fewer than `max_parallel` are in flight.
//! 3. An attempt that finds no ready request, or `max_parallel` in flight, waits until one is
//!    ready and a slot is free, sends then, and draws the next interval from that moment.
//!    (`bench_multiturn.py` polls instead; waiting keeps the rate exact and the run finite.)
//! 4. A request's arrival time is its attempt time, even when the engine looks at it later.

use std::collections::VecDeque;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::trace::Conversation;

/// Inter-arrival distribution of send attempts.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Distribution {
    /// Exponential intervals of mean `1/rate`.
    Poisson,
    /// Intervals uniform in `[0, 2/rate)`.
    Uniform,
}

/// Which ready request an attempt sends.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ReadyPolicy {
    /// The one ready longest.
    Fifo,
    /// A uniformly random one.
    Random,
}

/// How requests are released (rules 1–3 of the module docs).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Arrivals {
    /// Inter-arrival distribution.
    pub distribution: Distribution,
    /// Send attempts per second (`inf`: no pacing). Must be > 0.
    pub rate: f64,
    /// Most requests in flight at once. Must be ≥ 1.
    pub max_parallel: usize,
    /// Release round `r + 1` only after every request of round `r` completed.
    pub round_barrier: bool,
    /// Which ready request goes first.
    pub ready_policy: ReadyPolicy,
    /// Seed of the intervals and of the random ready policy.
    pub seed: u64,
}

impl Default for Arrivals {
    fn default() -> Self {
        Self {
            distribution: Distribution::Poisson,
            rate: 16.0,
            max_parallel: 4,
            round_barrier: false,
            ready_policy: ReadyPolicy::Fifo,
            seed: 1,
        }
    }
}

/// A request handed to the engine.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Sent {
    /// Sequence number in send order, from 0.
    pub id: u64,
    /// Index of the conversation.
    pub conversation: usize,
    /// Turn of the conversation.
    pub round: usize,
    /// Arrival time in seconds (the attempt time, rule 4).
    pub time: f64,
}

/// The sender's state over a set of conversations.
#[derive(Debug)]
pub struct Workload {
    conversations: Vec<Conversation>,
    arrivals: Arrivals,
    rng: ChaCha8Rng,
    ready: VecDeque<(usize, usize)>,
    /// Round barrier: turns waiting for their round to open, per round.
    held: Vec<Vec<(usize, usize)>>,
    /// Turns of each round not completed yet.
    outstanding: Vec<usize>,
    open_rounds: usize,
    next_attempt: f64,
    in_flight: usize,
    sent: u64,
    completed: usize,
    total: usize,
}

impl Workload {
    /// A sender over `conversations` (conversations without turns are ignored).
    pub fn new(conversations: Vec<Conversation>, arrivals: Arrivals) -> Result<Self, String> {
        if arrivals.rate.is_nan() || arrivals.rate <= 0.0 {
            return Err(format!(
                "request rate must be > 0 (or inf), got {}",
                arrivals.rate
            ));
        }
        if arrivals.max_parallel == 0 {
            return Err("max parallel requests must be at least 1".into());
        }
        let rounds = conversations
            .iter()
            .map(|c| c.turns.len())
            .max()
            .unwrap_or(0);
        let mut outstanding = vec![0; rounds];
        for c in &conversations {
            for o in &mut outstanding[..c.turns.len()] {
                *o += 1;
            }
        }
        let total = outstanding.iter().sum();
        let ready = (0..conversations.len())
            .filter(|&i| !conversations[i].turns.is_empty())
            .map(|i| (i, 0))
            .collect();
        Ok(Self {
            rng: ChaCha8Rng::seed_from_u64(arrivals.seed),
            conversations,
            arrivals,
            ready,
            held: vec![Vec::new(); rounds],
            outstanding,
            open_rounds: 1,
            next_attempt: 0.0,
            in_flight: 0,
            sent: 0,
            completed: 0,
            total,
        })
    }

    /// The conversations.
    pub fn conversations(&self) -> &[Conversation] {
        &self.conversations
    }

    /// The release rules.
    pub fn arrivals(&self) -> &Arrivals {
        &self.arrivals
    }

    /// Requests (turns) in the whole workload.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Requests sent so far.
    pub fn sent(&self) -> usize {
        self.sent as usize
    }

    /// Requests completed so far.
    pub fn completed(&self) -> usize {
        self.completed
    }

    /// Requests sent and not completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether every request has completed.
    pub fn is_done(&self) -> bool {
        self.completed == self.total
    }

    fn can_send(&self) -> bool {
        !self.ready.is_empty() && self.in_flight < self.arrivals.max_parallel
    }

    /// When the next request will be sent, if one can be sent before some request completes.
    pub fn next_send_time(&self) -> Option<f64> {
        self.can_send().then_some(self.next_attempt)
    }

    fn interval(&mut self) -> f64 {
        let rate = self.arrivals.rate;
        if rate.is_infinite() {
            return 0.0;
        }
        let u: f64 = self.rng.random();
        match self.arrivals.distribution {
            // 1 − u lies in (0, 1]: the logarithm is finite.
            Distribution::Poisson => -(1.0 - u).ln() / rate,
            Distribution::Uniform => u * 2.0 / rate,
        }
    }

    /// The next request due at or before `now`, if any (call until `None`).
    pub fn pop_due(&mut self, now: f64) -> Option<Sent> {
        if !self.can_send() || self.next_attempt > now {
            return None;
        }
        let pick = match self.arrivals.ready_policy {
            ReadyPolicy::Fifo => 0,
            ReadyPolicy::Random => self.rng.random_range(0..self.ready.len()),
        };
        let (conversation, round) = self.ready.remove(pick).expect("pick < ready.len()");
        let sent = Sent {
            id: self.sent,
            conversation,
            round,
            time: self.next_attempt,
        };
        self.sent += 1;
        self.in_flight += 1;
        self.next_attempt += self.interval();
        Some(sent)
    }

    /// Records that a sent request completed at `now`, releasing its successor (rule 1).
    pub fn complete(&mut self, sent: &Sent, now: f64) {
        let was_blocked = !self.can_send();
        self.in_flight -= 1;
        self.completed += 1;
        let (c, r) = (sent.conversation, sent.round);
        self.outstanding[r] -= 1;
        if r + 1 < self.conversations[c].turns.len() {
            if self.arrivals.round_barrier && r + 1 >= self.open_rounds {
                self.held[r + 1].push((c, r + 1));
            } else {
                self.ready.push_back((c, r + 1));
            }
        }
        if self.arrivals.round_barrier {
            while self.open_rounds < self.outstanding.len()
                && self.outstanding[self.open_rounds - 1] == 0
            {
                let opened = std::mem::take(&mut self.held[self.open_rounds]);
                self.ready.extend(opened);
                self.open_rounds += 1;
            }
        }
        if was_blocked && self.can_send() {
            // Rule 3: the waiting attempt goes now.
            self.next_attempt = self.next_attempt.max(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::MultiTurn;

    fn convs(clients: usize, rounds: usize) -> Vec<Conversation> {
        MultiTurn {
            clients,
            rounds,
            system_tokens: 4,
            user_tokens: 2,
            answer_tokens: 1,
            ..MultiTurn::default()
        }
        .conversations()
    }

    /// Runs the sender with a fixed service time per request, returning every send.
    fn drive(mut w: Workload, service: f64) -> Vec<Sent> {
        let mut sends = Vec::new();
        let mut running: Vec<(f64, Sent)> = Vec::new();
        let mut now = 0.0;
        while !w.is_done() {
            while let Some(s) = w.pop_due(now) {
                running.push((s.time + service, s));
                sends.push(s);
            }
            let next_done = running.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
            let next_send = w.next_send_time().unwrap_or(f64::INFINITY);
            now = next_done.min(next_send);
            assert!(now.is_finite(), "the sender must not stall");
            if next_done <= next_send {
                let i = running.iter().position(|r| r.0 == next_done).unwrap();
                let (t, s) = running.swap_remove(i);
                w.complete(&s, t);
            }
        }
        sends
    }

    #[test]
    fn closed_loop_sends_every_turn_in_order() {
        let w = Workload::new(convs(3, 4), Arrivals::default()).unwrap();
        assert_eq!(w.total(), 12);
        let sends = drive(w, 0.5);
        assert_eq!(sends.len(), 12);
        for c in 0..3 {
            let rounds: Vec<_> = sends.iter().filter(|s| s.conversation == c).collect();
            assert_eq!(rounds.len(), 4);
            for pair in rounds.windows(2) {
                assert_eq!(pair[1].round, pair[0].round + 1);
                assert!(pair[1].time >= pair[0].time + 0.5, "closed loop");
            }
        }
        assert!(sends.windows(2).all(|p| p[1].time >= p[0].time));
        assert!(sends.iter().enumerate().all(|(i, s)| s.id == i as u64));
    }

    #[test]
    fn seeded_and_rate_shaped() {
        let a = Arrivals {
            rate: 10.0,
            max_parallel: 1000,
            ..Arrivals::default()
        };
        let one = drive(Workload::new(convs(400, 1), a.clone()).unwrap(), 0.0);
        let two = drive(Workload::new(convs(400, 1), a.clone()).unwrap(), 0.0);
        assert_eq!(one, two);
        // 400 open-loop sends at 10/s take about 40 s.
        let span = one.last().unwrap().time;
        assert!((30.0..50.0).contains(&span), "{span}");
        let u = drive(
            Workload::new(
                convs(400, 1),
                Arrivals {
                    distribution: Distribution::Uniform,
                    ..a.clone()
                },
            )
            .unwrap(),
            0.0,
        );
        let span = u.last().unwrap().time;
        assert!((34.0..46.0).contains(&span), "{span}");
        let other = drive(
            Workload::new(convs(400, 1), Arrivals { seed: 9, ..a }).unwrap(),
            0.0,
        );
        assert_ne!(one, other);
    }

    #[test]
    fn infinite_rate_sends_at_once_up_to_max_parallel() {
        let a = Arrivals {
            rate: f64::INFINITY,
            max_parallel: 2,
            ..Arrivals::default()
        };
        let sends = drive(Workload::new(convs(5, 1), a).unwrap(), 1.0);
        let times: Vec<f64> = sends.iter().map(|s| s.time).collect();
        assert_eq!(times, vec![0.0, 0.0, 1.0, 1.0, 2.0]);
    }

    #[test]
    fn round_barrier_holds_the_next_round() {
        let a = Arrivals {
            rate: f64::INFINITY,
            round_barrier: true,
            ..Arrivals::default()
        };
        let mut w = Workload::new(convs(3, 3), a).unwrap();
        let first: Vec<Sent> = std::iter::from_fn(|| w.pop_due(0.0)).collect();
        assert_eq!(first.len(), 3);
        w.complete(&first[0], 1.0);
        w.complete(&first[1], 2.0);
        assert!(w.pop_due(2.0).is_none(), "round 1 waits for all of round 0");
        w.complete(&first[2], 3.0);
        let second: Vec<Sent> = std::iter::from_fn(|| w.pop_due(3.0)).collect();
        assert_eq!(second.len(), 3);
        assert!(second.iter().all(|s| s.round == 1 && s.time == 3.0));
    }

    #[test]
    fn random_ready_policy_is_seeded() {
        let a = Arrivals {
            rate: f64::INFINITY,
            max_parallel: 1,
            ready_policy: ReadyPolicy::Random,
            ..Arrivals::default()
        };
        let order = |a: Arrivals| -> Vec<usize> {
            drive(Workload::new(convs(8, 2), a).unwrap(), 1.0)
                .iter()
                .map(|s| s.conversation)
                .collect()
        };
        let one = order(a.clone());
        assert_eq!(one, order(a));
        assert_ne!(one[..8], (0..8).collect::<Vec<_>>()[..], "not FIFO");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Against the rules: every turn is sent once, turns of a conversation in order and
        /// after the previous one completed, never more than `max_parallel` in flight, send
        /// times never decrease, and with the barrier no turn before its round opened.
        #[test]
        fn the_sender_keeps_its_rules(
            clients in 1usize..6,
            rounds in 1usize..5,
            max_parallel in 1usize..5,
            rate in proptest::prop_oneof![proptest::prelude::Just(f64::INFINITY), 0.5f64..50.0],
            service in 0.0f64..2.0,
            barrier: bool,
            random: bool,
            seed: u64,
        ) {
            let a = Arrivals {
                distribution: if seed % 2 == 0 { Distribution::Poisson } else { Distribution::Uniform },
                rate,
                max_parallel,
                round_barrier: barrier,
                ready_policy: if random { ReadyPolicy::Random } else { ReadyPolicy::Fifo },
                seed,
            };
            let sends = drive(Workload::new(convs(clients, rounds), a).unwrap(), service);
            proptest::prop_assert_eq!(sends.len(), clients * rounds);
            let mut seen = std::collections::HashSet::new();
            for s in &sends {
                proptest::prop_assert!(seen.insert((s.conversation, s.round)));
                if s.round > 0 {
                    let prev = sends
                        .iter()
                        .find(|p| p.conversation == s.conversation && p.round == s.round - 1)
                        .unwrap();
                    proptest::prop_assert!(prev.id < s.id);
                    proptest::prop_assert!(s.time >= prev.time + service - 1e-9);
                }
                let in_flight = sends
                    .iter()
                    .filter(|p| p.time <= s.time && s.time < p.time + service)
                    .count();
                proptest::prop_assert!(in_flight <= max_parallel, "{} in flight", in_flight);
                if barrier && s.round > 0 {
                    let last_of_prev_round = sends
                        .iter()
                        .filter(|p| p.round == s.round - 1)
                        .map(|p| p.time + service)
                        .fold(0.0, f64::max);
                    proptest::prop_assert!(s.time >= last_of_prev_round - 1e-9);
                }
            }
            proptest::prop_assert!(sends.windows(2).all(|p| p[1].time >= p[0].time));
        }
    }

    #[test]
    fn bad_parameters_are_refused() {
        for rate in [0.0, -1.0, f64::NAN] {
            let a = Arrivals {
                rate,
                ..Arrivals::default()
            };
            assert!(Workload::new(convs(1, 1), a).is_err(), "{rate}");
        }
        let a = Arrivals {
            max_parallel: 0,
            ..Arrivals::default()
        };
        assert!(Workload::new(convs(1, 1), a).is_err());
    }
}
