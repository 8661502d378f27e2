//! `hicache`: the expected time to first token of the request on each instance, from what we
//! know and the others do not: the exact per-tier overlap (the index), what a page costs from
//! each tier (the link and store rates our benches measure), and the instance's load.
//!
//! For a prompt of `n` tokens on an instance whose overlap is `h1` tokens in L1, `h2` more in
//! L2 and `h3` more in L3 (cumulative runs from the index, the L3 from the store the instance
//! reads), with `c = h1 + h2 + h3` cached and `r = n − c` to compute (`b` KV bytes per token):
//!
//! ```text
//! fetch   = h3 > 0 ? l3_latency + h3·b / store_read_rate : 0        (L3 → L2, from arrival)
//! load    = (h2 + h3)·b / h2d_rate                                  (L2 → L1, layer-wise)
//! compute = r·prefill_per_token + (r·c + r(r+1)/2)·attention_per_pair
//! wait    = queued_prefill_tokens·prefill_per_token + (running ? decode_step/2 : 0)
//!           + (need > free ? decode_step·answer_tokens/2 : 0)
//! ttft    = max(wait, fetch) + max(compute, load)
//! ```
//!
//! (`decode_step = decode_per_step + running_tokens·decode_per_context_token`: a prefill waits
//! on average half of the decode step in progress, as engines run prefill first.)
//!
//! **Device memory.** Where the instance's KV capacity is known (`kv_capacity_tokens` at
//! registration, e.g. SGLang's `max_total_num_tokens`), `free = capacity − running_tokens −
//! queued_prefill_tokens` and the request needs `need = n − h1 + answer_tokens` new KV tokens
//! (its L1 prefix is shared, its answer grows in place). An engine admits a request only with
//! room for it, so one that does not fit waits for running requests to finish: on average
//! half an answer's decode (`answer_tokens` is the mean answer length, an operator's figure).
//! Without a capacity the term is 0. Cache affinity alone would pile conversations onto the
//! instance that holds them until its memory is full; this term is what stops it.
//!
//! **The delay imposed on others.** `ttft` is the request's own; the time its step occupies
//! the instance, `work = max(compute, load)`, also delays every request that will queue
//! behind it there. Under load a router that minimises each request's own `ttft` spreads
//! requests by queue length and pays for it in recomputed work that lengthens every later
//! queue; the score adds that delay:
//!
//! ```text
//! behind = Σ_instances queued_prefill_tokens / (instances · n)   (the fleet's backlog per
//!                                                                  instance, in requests of
//!                                                                  this size)
//! score  = ttft + queue_externality · behind · work
//! ```
//!
//! An idle fleet has `behind = 0`: the score is the request's own `ttft`; an overloaded one
//! weighs saved work (cache affinity) by how many requests it will serve sooner.
//!
//! **Requests it overtakes.** An engine admits a request whose L3 prefetch is still running
//! only once the prefetch ends, and meanwhile prefills what arrives after it; once a prompt's
//! prefill has started its chunks go first. So a request sent to an instance where
//! `prefetching` requests wait for their prefetch (the instance's report, plus the requests
//! the router sent there with an L3 overlap since) delays each of them by its own prefill:
//!
//! ```text
//! overtaken = prefetching · work
//! score     = ttft + overtaken + queue_externality · behind · work
//! ```
//!
//! (Each waits at most `work` more; one whose prefetch ends after the newcomer's prefill waits
//! less: the term is an upper bound, weighed 1:1 with the request's own time.) The lowest
//! `score` wins. **Session tie-break**: among instances within `tie_tolerance` of the best
//! (relative) the one that served the request's session last wins, so a conversation stays
//! where its next turn will hit; else fewest requests, then the lowest index.

/// What a page costs on each path, and the engine's compute rates: the inputs of the
/// expected-TTFT model (figures the simulator uses, or an operator's measured ones).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Prefill time per computed token, without attention (s).
    pub prefill_s_per_token: f64,
    /// Attention time per (query, key) pair (s).
    pub attention_s_per_pair: f64,
    /// Decode step time, weights only (s).
    pub decode_s_per_step: f64,
    /// Decode step time per running KV token (s).
    pub decode_s_per_context_token: f64,
    /// KV bytes per token.
    pub kv_bytes_per_token: f64,
    /// L2 → L1 rate (bytes/s).
    pub h2d_bytes_per_s: f64,
    /// Latency of an L3 read before its first byte (s).
    pub l3_latency_s: f64,
    /// Relative margin within which the session's instance wins the tie.
    pub tie_tolerance: f64,
    /// Weight of the delay a request's work imposes on the requests queued behind it
    /// (0: each request's own `ttft` only).
    pub queue_externality: f64,
    /// Mean answer length in tokens: the KV a request adds while it decodes, and twice the
    /// decode steps a request that does not fit waits for on average.
    pub answer_tokens: f64,
}

impl Default for CostModel {
    /// Llama-3-8B on an H100 (the simulator's model): 32.5 µs per prefill token, 1.06 ns per
    /// attention pair, 5.99 ms per decode step plus 48.9 ns per context token, 128 KiB of KV
    /// per token, 50 GB/s H2D, 0.5 ms L3 latency; 2 % tie tolerance; the delay imposed on
    /// others weighed 1:1 with the request's own time; answers of 128 tokens (the multi-turn
    /// bench's default output length).
    fn default() -> Self {
        Self {
            prefill_s_per_token: 32.5e-6,
            attention_s_per_pair: 1.06e-9,
            decode_s_per_step: 5.99e-3,
            decode_s_per_context_token: 48.9e-9,
            kv_bytes_per_token: 131_072.0,
            h2d_bytes_per_s: 50e9,
            l3_latency_s: 0.5e-3,
            tie_tolerance: 0.02,
            queue_externality: 1.0,
            answer_tokens: 128.0,
        }
    }
}

/// One instance's overlap with a prompt, in tokens, each tier cumulative through the faster.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Leading tokens in L1.
    pub l1: usize,
    /// Leading tokens in L1 or L2.
    pub l2: usize,
    /// Leading tokens in L1, L2 or the L3 the instance reads.
    pub l3: usize,
}

/// An instance's load, as the cost needs it.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct Busy {
    /// Prompt tokens still to compute.
    pub queued_prefill_tokens: f64,
    /// Requests waiting or running.
    pub requests: f64,
    /// KV tokens of running requests.
    pub running_tokens: f64,
    /// KV tokens its device memory holds, when known (`None`: no memory term).
    pub kv_capacity_tokens: Option<f64>,
    /// Requests waiting for their L3 prefetch before admission.
    pub prefetching_requests: f64,
}

/// What the model expects of one request on one instance.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct Expected {
    /// Its time to first token (s).
    pub ttft: f64,
    /// The time its prefill occupies the instance, `max(compute, load)` (s).
    pub work: f64,
    /// The delay it adds to the first tokens of the requests waiting there for their L3
    /// prefetch, `prefetching · work` (s).
    pub overtaken: f64,
}

impl CostModel {
    /// Expected TTFT (s) of a prompt of `prompt` tokens with `overlap` on an instance that
    /// reads its L3 at `l3_read_bytes_per_s` and is `busy`.
    pub fn ttft(&self, prompt: usize, o: &Overlap, l3_read_bytes_per_s: f64, busy: &Busy) -> f64 {
        self.expect(prompt, o, l3_read_bytes_per_s, busy).ttft
    }

    /// The score of the module docs: `ttft + overtaken + queue_externality · behind · work`,
    /// `behind` being the fleet's backlog per instance in requests of this size.
    pub fn score(&self, e: &Expected, behind: f64) -> f64 {
        e.ttft + e.overtaken + self.queue_externality * behind * e.work
    }

    /// Expected TTFT and work of a prompt of `prompt` tokens with `overlap` on an instance
    /// that reads its L3 at `l3_read_bytes_per_s` and is `busy`.
    pub fn expect(
        &self,
        prompt: usize,
        o: &Overlap,
        l3_read_bytes_per_s: f64,
        busy: &Busy,
    ) -> Expected {
        let b = self.kv_bytes_per_token;
        let (h2, h3) = (o.l2 - o.l1, o.l3 - o.l2);
        let cached = o.l3.min(prompt) as f64;
        let r = prompt as f64 - cached;
        let fetch = if h3 > 0 {
            self.l3_latency_s + h3 as f64 * b / l3_read_bytes_per_s.max(1.0)
        } else {
            0.0
        };
        let load = (h2 + h3) as f64 * b / self.h2d_bytes_per_s.max(1.0);
        let compute = r * self.prefill_s_per_token
            + (r * cached + r * (r + 1.0) / 2.0) * self.attention_s_per_pair;
        let decode_step =
            self.decode_s_per_step + busy.running_tokens * self.decode_s_per_context_token;
        let decode = if busy.requests > 0.0 {
            decode_step / 2.0
        } else {
            0.0
        };
        let memory = match busy.kv_capacity_tokens {
            Some(capacity) => {
                let free = capacity - busy.running_tokens - busy.queued_prefill_tokens;
                let need = (prompt - o.l1.min(prompt)) as f64 + self.answer_tokens;
                if need > free {
                    decode_step * self.answer_tokens / 2.0
                } else {
                    0.0
                }
            }
            None => 0.0,
        };
        let wait = busy.queued_prefill_tokens * self.prefill_s_per_token + decode + memory;
        let work = compute.max(load);
        Expected {
            ttft: wait.max(fetch) + work,
            work,
            overtaken: busy.prefetching_requests * work,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        CostModel {
            prefill_s_per_token: 1e-3,
            attention_s_per_pair: 0.0,
            decode_s_per_step: 0.0,
            decode_s_per_context_token: 0.0,
            kv_bytes_per_token: 1000.0,
            h2d_bytes_per_s: 1e6,
            l3_latency_s: 0.01,
            tie_tolerance: 0.02,
            queue_externality: 1.0,
            answer_tokens: 0.0,
        }
    }

    /// The worked example: 1000 tokens at 1 ms each, 1 ms/token of H2D, L3 at 0.5 ms/token
    /// after 10 ms. All in L1: nothing to compute (0 s). 600 in L2: load 0.6 s vs compute
    /// 0.4 s: 0.6 s. 600 in L3: fetch 0.31 s, then max(0.4, 0.6) = 0.91 s. Nothing cached:
    /// 1 s; behind 500 queued tokens: 1.5 s.
    #[test]
    fn worked_example_of_the_ttft_model() {
        let m = model();
        let idle = Busy::default();
        let t = |o: Overlap, busy: &Busy| m.ttft(1000, &o, 2e6, busy);
        let all = Overlap {
            l1: 1000,
            l2: 1000,
            l3: 1000,
        };
        assert!(t(all, &idle).abs() < 1e-12);
        let host = Overlap {
            l1: 0,
            l2: 600,
            l3: 600,
        };
        assert!((t(host, &idle) - 0.6).abs() < 1e-9);
        let store = Overlap {
            l1: 0,
            l2: 0,
            l3: 600,
        };
        assert!((t(store, &idle) - 0.91).abs() < 1e-9);
        let none = Overlap::default();
        assert!((t(none, &idle) - 1.0).abs() < 1e-9);
        let queued = Busy {
            queued_prefill_tokens: 500.0,
            requests: 1.0,
            running_tokens: 0.0,
            kv_capacity_tokens: None,
            ..Busy::default()
        };
        assert!((t(none, &queued) - 1.5).abs() < 1e-9);
    }

    /// Requests it overtakes: an instance where two requests wait for their L3 prefetch and
    /// nothing is queued, against one 200 tokens behind. A 1000-token prompt with 600 tokens
    /// in L2 on both: 0.6 s of work (the load; compute 0.4 s). First instance: ttft 0.6 s, but
    /// it delays both waiting requests by its 0.6 s: score 1.8 s. Second: ttft 0.2 + 0.6 =
    /// 0.8 s, nobody overtaken: score 0.8 s, it wins. The same prompt wholly in L1 (no work)
    /// delays nobody: score 0 on the first.
    #[test]
    fn a_request_is_charged_the_delay_it_adds_to_requests_awaiting_their_prefetch() {
        let m = model();
        let host = Overlap {
            l1: 0,
            l2: 600,
            l3: 600,
        };
        let prefetching = Busy {
            requests: 2.0,
            prefetching_requests: 2.0,
            ..Busy::default()
        };
        let behind = Busy {
            queued_prefill_tokens: 200.0,
            requests: 1.0,
            ..Busy::default()
        };
        let a = m.expect(1000, &host, 2e6, &prefetching);
        let b = m.expect(1000, &host, 2e6, &behind);
        assert!((a.ttft - 0.6).abs() < 1e-9 && (a.overtaken - 1.2).abs() < 1e-9);
        assert!((m.score(&a, 0.0) - 1.8).abs() < 1e-9);
        assert!((b.ttft - 0.8).abs() < 1e-9 && b.overtaken == 0.0);
        assert!(m.score(&b, 0.0) < m.score(&a, 0.0));
        let all = Overlap {
            l1: 1000,
            l2: 1000,
            l3: 1000,
        };
        assert!(m.score(&m.expect(1000, &all, 2e6, &prefetching), 0.0).abs() < 1e-12);
    }

    /// The delay imposed on others: an instance holding 600 tokens in L2 but 500 tokens
    /// behind (1.1 s to first token, 0.6 s of work) against an idle one without them (1 s,
    /// 1 s of work). Idle fleet (`behind` 0): the idle instance wins, 1.0 < 1.1. With two
    /// requests of this size queued per instance: 1.1 + 2·0.6 = 2.3 < 1 + 2·1 = 3: the one
    /// that saves work wins; without the term (weight 0) the scores are the TTFTs again.
    #[test]
    fn the_work_a_request_saves_weighs_with_the_fleets_backlog() {
        let mut m = model();
        let host = Overlap {
            l1: 0,
            l2: 600,
            l3: 600,
        };
        let queued = Busy {
            queued_prefill_tokens: 500.0,
            requests: 1.0,
            running_tokens: 0.0,
            kv_capacity_tokens: None,
            ..Busy::default()
        };
        let a = m.expect(1000, &host, 2e6, &queued);
        let b = m.expect(1000, &Overlap::default(), 2e6, &Busy::default());
        assert!((a.ttft - 1.1).abs() < 1e-9 && (a.work - 0.6).abs() < 1e-9);
        assert!((b.ttft - 1.0).abs() < 1e-9 && (b.work - 1.0).abs() < 1e-9);
        assert!(m.score(&b, 0.0) < m.score(&a, 0.0));
        assert!((m.score(&a, 2.0) - 2.3).abs() < 1e-9);
        assert!((m.score(&b, 2.0) - 3.0).abs() < 1e-9);
        m.queue_externality = 0.0;
        assert_eq!(m.score(&a, 2.0), a.ttft);
    }

    /// The memory term: capacity 3000 tokens, 1000 running, 500 queued (free 1500); decode
    /// step 10 ms + 1 µs per running token = 11 ms; answers of 200 tokens. A 1000-token prompt
    /// with 400 in L1 needs 600 + 200 = 800 ≤ 1500: no wait for memory. With nothing in L1
    /// it needs 1200 ≤ 1500: none either. With 1000 running more (free 500) both wait
    /// half an answer's decode: 100 steps of 12 ms = 1.2 s. Unknown capacity: no term.
    #[test]
    fn a_request_that_does_not_fit_waits_half_an_answers_decode() {
        let mut m = model();
        m.decode_s_per_step = 0.010;
        m.decode_s_per_context_token = 1e-6;
        m.answer_tokens = 200.0;
        let l1 = Overlap {
            l1: 400,
            l2: 400,
            l3: 400,
        };
        let busy = |running: f64, capacity: Option<f64>| Busy {
            queued_prefill_tokens: 500.0,
            requests: 2.0,
            running_tokens: running,
            kv_capacity_tokens: capacity,
            ..Busy::default()
        };
        let base = |running: f64| 0.5 + (0.010 + running * 1e-6) / 2.0;
        let t = |o: &Overlap, b: &Busy| m.ttft(1000, o, 2e6, b);
        let fits = busy(1000.0, Some(3000.0));
        assert!((t(&l1, &fits) - (base(1000.0) + 0.6)).abs() < 1e-9);
        assert!((t(&Overlap::default(), &fits) - (base(1000.0) + 1.0)).abs() < 1e-9);
        let full = busy(2000.0, Some(3000.0));
        assert!((t(&l1, &full) - (base(2000.0) + 1.2 + 0.6)).abs() < 1e-9);
        assert!((t(&Overlap::default(), &full) - (base(2000.0) + 1.2 + 1.0)).abs() < 1e-9);
        let unknown = busy(2000.0, None);
        assert!((t(&l1, &unknown) - (base(2000.0) + 0.6)).abs() < 1e-9);
    }
}
