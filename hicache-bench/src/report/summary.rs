//! Per-configuration figures computed from one run: tokens and hits per tier, TTFT
//! percentiles, throughput, bytes moved per direction, per-round hit ratios, and the
//! consistency checks a report must pass.

use serde::Serialize;

use hicache_sim::cache::{CacheStats, TransferStats};
use hicache_sim::engine::{RequestRecord, RunResult, StepKind};
use hicache_sim::links::Links;
use hicache_sim::setup::PayloadUsed;

/// Nearest-rank percentiles of a sample, in the sample's unit.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

/// The nearest-rank `p`-th percentile (0 < p ≤ 100) of an ascending sample: the value at rank
/// `ceil(p/100 · n)`. 0 for an empty sample.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Percentiles {
    /// Percentiles of an ascending sample.
    pub fn of_sorted(sorted: &[f64]) -> Self {
        if sorted.is_empty() {
            return Self::default();
        }
        Self {
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: percentile(sorted, 50.0),
            p90: percentile(sorted, 90.0),
            p99: percentile(sorted, 99.0),
            max: sorted[sorted.len() - 1],
        }
    }
}

/// Hit tokens per tier.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Hits {
    /// Served from L1.
    pub l1: u64,
    /// Served from L2.
    pub l2: u64,
    /// Served from L3.
    pub l3: u64,
}

impl Hits {
    /// Served from any tier.
    pub fn total(&self) -> u64 {
        self.l1 + self.l2 + self.l3
    }
}

/// Figures of one round (turn index) across conversations.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RoundSummary {
    /// Turn index, from 0.
    pub round: usize,
    /// Requests of that round.
    pub requests: usize,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Their hit tokens per tier.
    pub hits: Hits,
    /// Mean TTFT (s).
    pub ttft_mean: f64,
}

impl RoundSummary {
    /// Hit tokens over prompt tokens.
    pub fn hit_ratio(&self) -> f64 {
        ratio(self.hits.total(), self.prompt_tokens)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Everything the report shows about one configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Configuration name (`no cache`, `L1`, `L1+L2`, `L1+L2+L3`).
    pub label: String,
    /// Requests run.
    pub requests: usize,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Answer tokens.
    pub answer_tokens: u64,
    /// Hit tokens per tier (from the engine's admissions).
    pub hits: Hits,
    /// Prompt tokens computed.
    pub computed_tokens: u64,
    /// TTFT percentiles (s).
    pub ttft: Percentiles,
    /// Every TTFT, ascending (s).
    pub ttft_sorted: Vec<f64>,
    /// What happened to each request, in send order (hits per tier, arrival, admission and
    /// first-token times): the data behind every figure of the column.
    pub per_request: Vec<RequestRecord>,
    /// Simulated time from first arrival to last finish (s).
    pub sim_seconds: f64,
    /// Requests per simulated second.
    pub request_throughput: f64,
    /// Prompt tokens per simulated second.
    pub input_throughput: f64,
    /// Answer tokens per simulated second.
    pub output_throughput: f64,
    /// Prefill steps.
    pub prefill_steps: usize,
    /// Decode steps.
    pub decode_steps: usize,
    /// Simulated time prefill steps spent waiting for host loads beyond their compute (s).
    pub load_stall_seconds: f64,
    /// Per round.
    pub rounds: Vec<RoundSummary>,
    /// The cache's own totals.
    pub cache: CacheStats,
    /// Wall time of the run on this machine (s).
    pub wall_seconds: f64,
    /// The simulated links of the run (bytes and busy time per link).
    pub links: Links,
    /// Hit tokens per tier of the same configuration run again with copy time free (the
    /// main job's counterfactual): `free − hits` is what charging copy time cost per tier.
    pub free_copy_hits: Option<Hits>,
    /// TTFT of that counterfactual run (s).
    pub free_copy_ttft: Option<Percentiles>,
    /// What that counterfactual run did with page bytes.
    pub free_copy_payload: Option<PayloadUsed>,
}

impl Summary {
    /// Summarises a run.
    pub fn new(label: impl Into<String>, run: &RunResult) -> Self {
        let mut ttft: Vec<f64> = run.requests.iter().map(|r| r.ttft()).collect();
        ttft.sort_by(f64::total_cmp);
        let mut hits = Hits::default();
        let (mut prompt, mut answer, mut computed) = (0u64, 0u64, 0u64);
        let rounds_n = run.requests.iter().map(|r| r.round + 1).max().unwrap_or(0);
        let mut rounds: Vec<RoundSummary> = (0..rounds_n)
            .map(|round| RoundSummary {
                round,
                ..RoundSummary::default()
            })
            .collect();
        for r in &run.requests {
            hits.l1 += r.hit_l1 as u64;
            hits.l2 += r.hit_l2 as u64;
            hits.l3 += r.hit_l3 as u64;
            prompt += r.prompt_tokens as u64;
            answer += r.answer_tokens as u64;
            computed += r.computed as u64;
            let s = &mut rounds[r.round];
            s.requests += 1;
            s.prompt_tokens += r.prompt_tokens as u64;
            s.hits.l1 += r.hit_l1 as u64;
            s.hits.l2 += r.hit_l2 as u64;
            s.hits.l3 += r.hit_l3 as u64;
            s.ttft_mean += r.ttft();
        }
        for s in &mut rounds {
            if s.requests > 0 {
                s.ttft_mean /= s.requests as f64;
            }
        }
        let per_s = |x: f64| {
            if run.sim_seconds > 0.0 {
                x / run.sim_seconds
            } else {
                0.0
            }
        };
        Self {
            label: label.into(),
            requests: run.requests.len(),
            prompt_tokens: prompt,
            answer_tokens: answer,
            hits,
            computed_tokens: computed,
            ttft: Percentiles::of_sorted(&ttft),
            ttft_sorted: ttft,
            per_request: run.requests.clone(),
            sim_seconds: run.sim_seconds,
            request_throughput: per_s(run.requests.len() as f64),
            input_throughput: per_s(prompt as f64),
            output_throughput: per_s(answer as f64),
            prefill_steps: run
                .steps
                .iter()
                .filter(|s| s.kind == StepKind::Prefill)
                .count(),
            decode_steps: run
                .steps
                .iter()
                .filter(|s| s.kind == StepKind::Decode)
                .count(),
            load_stall_seconds: run.steps.iter().map(|s| s.load_stall).sum(),
            rounds,
            cache: run.cache,
            wall_seconds: run.wall_seconds,
            links: run.links.clone(),
            free_copy_hits: None,
            free_copy_ttft: None,
            free_copy_payload: None,
        }
    }

    /// Hit tokens over prompt tokens.
    pub fn hit_ratio(&self) -> f64 {
        ratio(self.hits.total(), self.prompt_tokens)
    }

    /// Share of the prompt tokens served by one tier's hit count.
    pub fn share(&self, tokens: u64) -> f64 {
        ratio(tokens, self.prompt_tokens)
    }

    /// The four transfer directions with their names.
    pub fn transfers(&self) -> [(&'static str, TransferStats); 4] {
        [
            ("d2h", self.cache.metrics.d2h),
            ("h2d", self.cache.metrics.h2d),
            ("l2_to_l3", self.cache.metrics.l2_to_l3),
            ("l3_to_l2", self.cache.metrics.l3_to_l2),
        ]
    }

    /// The consistency checks (empty when all hold):
    /// 1. hits + computed = prompt tokens;
    /// 2. the cache's hit tokens per tier and admitted prompt tokens equal the engine's;
    /// 3. for every direction, bytes = pages × page bytes;
    /// 4. every L2 and L3 hit page was loaded to the device once: H2D pages × page size =
    ///    L2 + L3 hit tokens (`page_size` given).
    pub fn check(&self, page_size: usize) -> Vec<String> {
        let mut bad = Vec::new();
        let l = &self.label;
        if self.hits.total() + self.computed_tokens != self.prompt_tokens {
            bad.push(format!(
                "{l}: hits {} + computed {} != prompt tokens {}",
                self.hits.total(),
                self.computed_tokens,
                self.prompt_tokens
            ));
        }
        let c = &self.cache;
        for (tier, engine, cache) in [
            ("L1", self.hits.l1, c.metrics.hit_tokens_l1),
            ("L2", self.hits.l2, c.metrics.hit_tokens_l2),
            ("L3", self.hits.l3, c.metrics.hit_tokens_l3),
            ("prompt", self.prompt_tokens, c.metrics.request_tokens),
        ] {
            if engine != cache {
                bad.push(format!(
                    "{l}: {tier} tokens: engine counted {engine}, cache counted {cache}"
                ));
            }
        }
        for (name, t) in self.transfers() {
            if t.bytes != t.pages * c.page_bytes {
                bad.push(format!(
                    "{l}: {name}: {} bytes != {} pages × {} bytes",
                    t.bytes, t.pages, c.page_bytes
                ));
            }
        }
        let loaded = c.metrics.h2d.pages * page_size as u64;
        // A hybrid model's host hit may load only the components missing on device (a Mamba
        // state, SWA pages) over Full pages already there: its Full pages loaded are at most
        // its L2 + L3 hits.
        let hybrid = c.components.is_some();
        let host_hits = self.hits.l2 + self.hits.l3;
        if (!hybrid && loaded != host_hits) || (hybrid && loaded > host_hits) {
            bad.push(format!(
                "{l}: H2D moved {} pages ({loaded} tokens) for {} L2 + L3 hit tokens",
                c.metrics.h2d.pages,
                self.hits.l2 + self.hits.l3
            ));
        }
        bad
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache::metrics::MetricsSnapshot;
    use hicache_sim::engine::{RequestRecord, StepRecord};

    fn rec(id: u64, round: usize, prompt: usize, hits: [usize; 3], ttft: f64) -> RequestRecord {
        RequestRecord {
            id,
            conversation: format!("c{id}"),
            round,
            prompt_tokens: prompt,
            answer_tokens: 10,
            arrival: 1.0,
            admitted: 1.0,
            first_token: 1.0 + ttft,
            finished: 2.0 + ttft,
            hit_l1: hits[0],
            hit_l2: hits[1],
            hit_l3: hits[2],
            computed: prompt - hits.iter().sum::<usize>(),
            ..RequestRecord::default()
        }
    }

    fn run() -> RunResult {
        RunResult {
            requests: vec![
                rec(0, 0, 100, [0, 0, 0], 0.4),
                rec(1, 0, 100, [64, 0, 0], 0.1),
                rec(2, 1, 200, [64, 64, 0], 0.2),
                rec(3, 1, 200, [0, 64, 64], 0.3),
            ],
            steps: vec![StepRecord {
                kind: StepKind::Prefill,
                start: 1.0,
                duration: 0.5,
                tokens: 10,
                requests: 1,
                load_bytes: 0,
                load_stall: 0.25,
            }],
            cache: CacheStats {
                page_bytes: 1000,
                metrics: MetricsSnapshot {
                    h2d: TransferStats {
                        pages: 3,
                        bytes: 3000,
                        seconds: 0.5,
                        batches: 2,
                    },
                    hit_tokens_l1: 128,
                    hit_tokens_l2: 128,
                    hit_tokens_l3: 64,
                    request_tokens: 600,
                    ..MetricsSnapshot::default()
                },
                ..CacheStats::default()
            },
            sim_seconds: 4.0,
            wall_seconds: 0.1,
            links: Default::default(),
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of_sorted(&s);
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(p.mean, 50.5);
        assert_eq!(percentile(&[3.0], 50.0), 3.0);
        assert_eq!(percentile(&[1.0, 2.0], 99.0), 2.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(Percentiles::of_sorted(&[]), Percentiles::default());
    }

    #[test]
    fn summary_counts_tokens_rounds_and_throughput() {
        let s = Summary::new("L1+L2+L3", &run());
        assert_eq!(s.requests, 4);
        assert_eq!(s.prompt_tokens, 600);
        assert_eq!(
            s.hits,
            Hits {
                l1: 128,
                l2: 128,
                l3: 64
            }
        );
        assert_eq!(s.computed_tokens, 280);
        assert!((s.hit_ratio() - 320.0 / 600.0).abs() < 1e-12);
        assert_eq!(s.ttft_sorted.len(), 4);
        assert!((s.ttft.p50 - 0.2).abs() < 1e-12);
        assert!((s.ttft.max - 0.4).abs() < 1e-12);
        assert_eq!(s.request_throughput, 1.0);
        assert_eq!(s.input_throughput, 150.0);
        assert_eq!(s.rounds.len(), 2);
        assert_eq!(s.rounds[1].prompt_tokens, 400);
        assert!((s.rounds[0].hit_ratio() - 0.32).abs() < 1e-12);
        assert!((s.rounds[1].ttft_mean - 0.25).abs() < 1e-12);
        assert_eq!(s.prefill_steps, 1);
        assert_eq!(s.load_stall_seconds, 0.25);
        assert!(s.check(64).is_empty(), "{:?}", s.check(64));
    }

    #[test]
    fn checks_catch_each_inconsistency() {
        let mut r = run();
        r.cache.metrics.h2d.bytes += 1;
        r.cache.metrics.hit_tokens_l3 = 0;
        r.requests[0].computed = 0;
        let bad = Summary::new("x", &r).check(64);
        assert_eq!(bad.len(), 3, "{bad:#?}");
        assert!(bad.iter().any(|b| b.contains("hits")));
        assert!(bad.iter().any(|b| b.contains("L3 tokens")));
        assert!(bad.iter().any(|b| b.contains("h2d")));
        let mut r = run();
        r.cache.metrics.h2d.pages = 2;
        r.cache.metrics.h2d.bytes = 2000;
        let bad = Summary::new("x", &r).check(64);
        assert_eq!(bad.len(), 1);
        assert!(bad[0].contains("H2D moved 2 pages"), "{bad:?}");
        // A hybrid model may load fewer Full pages than its host hits (only the components
        // missing on device), never more.
        r.cache.components = Some(Default::default());
        assert!(Summary::new("x", &r).check(64).is_empty());
        r.cache.metrics.h2d.pages = 4;
        r.cache.metrics.h2d.bytes = 4000;
        assert_eq!(Summary::new("x", &r).check(64).len(), 1);
    }
}
