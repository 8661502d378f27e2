//! The simulated engine: an SGLang-style scheduler loop on a simulated clock, driving a
//! [`CacheUnderTest`] with the requests of a [`Workload`].
//!
//! # The loop (normative)
//!
//! Each iteration, at simulated time `now`:
//!
//! 1. [`CacheUnderTest::advance`] to `now` (copies completed on the simulated links by `now`
//!    finish; see [`crate::links`]); then every request the workload sends at or before
//!    `now` joins the waiting queue ([`CacheUnderTest::arrive`]).
//! 2. A prefill batch is built under a budget of `max_prefill_tokens` computed tokens:
//!    requests whose prompt was cut by the budget in an earlier step (chunked prefill) continue
//!    first; then the waiting queue is scanned in arrival order (FCFS). For each request its
//!    prefetch is resolved (the engine waits in wall time for `Ready`: the prefetch's duration is
//!    modelled in simulated time instead, rule 4); a request whose modelled prefetch has not
//!    finished by `now` is skipped and stays queued; otherwise it is admitted
//!    ([`CacheUnderTest::admit`], reserving pages for its prompt and whole answer). `None`
//!    (no device memory) ends the scan. The last request admitted may be cut by the budget.
//! 3. If the batch is not empty, one prefill step runs: loads start
//!    ([`CacheUnderTest::start_loading`]), the forward waits for each layer
//!    ([`CacheUnderTest::wait_layer`]), and its duration is
//!    [`ComputeModel::prefill_step`] of the batch's compute and the bytes its admissions load
//!    from host memory. A request whose prompt is complete gets its first token at the end of
//!    the step.
//! 4. Otherwise, if requests are decoding, one decode step produces a token for each;
//!    requests that produced their whole answer finish ([`CacheUnderTest::cache_finished`]
//!    with prompt and answer) and the workload releases their successors.
//! 5. Otherwise, if the cache refused a request that is due while no request runs (its memory
//!    is held by copies in flight), the clock jumps to the cache's next copy completion
//!    ([`CacheUnderTest::next_completion`]); a cache that holds none is polled in wall time
//!    without advancing the clock, for at most [`EngineConfig::wall_wait_limit`]. Else the
//!    clock jumps to the next arrival, modelled prefetch completion or copy completion.
//!
//! The run ends when every request has finished; then [`CacheUnderTest::shutdown`].
//!
//! # Rules
//!
//! 1. Time-to-first-token of a request = end of the step that computed its last prompt token −
//!    its arrival time.
//! 2. Tokens: every prompt token is either a hit (L1, L2 or L3, by the tier of its page at
//!    admission) or computed; `hit + computed = prompt` per request.
//! 3. Device memory is reserved at admission for the prompt and the whole answer, so a running
//!    request never waits for memory.
//! 4. Prefetches: a request's L3 prefetch starts at its arrival and takes
//!    [`ComputeModel::l3_latency_s`] plus its pages at [`ComputeModel::l3_bytes_per_s`] on the
//!    L3 link, shared with backups in the order transfers are issued ([`Links::prefetch`]);
//!    the request is not admitted before it ends.
//! 5. Every admission is checked against the rules of [`CacheUnderTest`]; a violation stops the
//!    run with an error naming the request.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cache::{Admission, CacheError, CacheStats, CacheUnderTest, PrefetchStatus};
use crate::error::{Result, SimError};
use crate::links::{CopyTime, Links};
use crate::model::ComputeModel;
use crate::workload::{Sent, Workload};

/// Scheduler settings.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineConfig {
    /// Most tokens computed in one prefill step (SGLang's chunked prefill size).
    pub max_prefill_tokens: usize,
    /// Whether write-through copies and L3 backups take simulated time ([`crate::links`]).
    pub copy_time: CopyTime,
    /// Layers of the model (layer-wise load overlap).
    pub layers: u32,
    /// Bytes of one page.
    pub page_bytes: u64,
    /// Longest wall time the engine waits for the cache to make progress on its own (a pending
    /// prefetch, or device memory held by in-flight copies while no request runs) before it
    /// gives up with an error.
    #[serde(skip)]
    pub wall_wait_limit: Duration,
}

/// What happened to one request.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Request id (send order).
    pub id: u64,
    /// Conversation id.
    pub conversation: String,
    /// Turn of the conversation.
    pub round: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Answer tokens.
    pub answer_tokens: usize,
    /// Arrival time (s).
    pub arrival: f64,
    /// Admission time (s).
    pub admitted: f64,
    /// End of the step that produced the first token (s).
    pub first_token: f64,
    /// Time the last token was produced (s).
    pub finished: f64,
    /// Prompt tokens served from L1.
    pub hit_l1: usize,
    /// Prompt tokens served from L2.
    pub hit_l2: usize,
    /// Prompt tokens served from L3.
    pub hit_l3: usize,
    /// Prompt tokens computed.
    pub computed: usize,
    /// Pages the request's prefetch fetched from L3.
    pub prefetched_pages: usize,
    /// When its modelled prefetch ended (s).
    pub prefetch_done: f64,
}

impl RequestRecord {
    /// Time to first token (s).
    pub fn ttft(&self) -> f64 {
        self.first_token - self.arrival
    }

    /// Prompt tokens served from any tier.
    pub fn hit(&self) -> usize {
        self.hit_l1 + self.hit_l2 + self.hit_l3
    }
}

/// Kind of a forward step.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// Prompt tokens.
    Prefill,
    /// One token for every decoding request.
    Decode,
}

/// One forward step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepRecord {
    /// Prefill or decode.
    pub kind: StepKind,
    /// Start time (s).
    pub start: f64,
    /// Duration (s).
    pub duration: f64,
    /// Tokens computed (prefill) or produced (decode).
    pub tokens: usize,
    /// Requests in the step.
    pub requests: usize,
    /// Bytes loaded from host memory for the step (prefill).
    pub load_bytes: u64,
    /// Time the step lost waiting for loads beyond its compute (s).
    pub load_stall: f64,
}

/// The outcome of one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RunResult {
    /// Every request, in send order.
    pub requests: Vec<RequestRecord>,
    /// Every forward step.
    pub steps: Vec<StepRecord>,
    /// The cache's totals after shutdown.
    pub cache: CacheStats,
    /// Simulated time from the first arrival to the last finish (s).
    pub sim_seconds: f64,
    /// Wall time of the run on this machine (s).
    pub wall_seconds: f64,
    /// The simulated links after the run (bytes and busy time per link).
    pub links: Links,
}

struct Waiting {
    sent: Sent,
    /// `(pages fetched from L3, modelled end of the prefetch)` once resolved.
    prefetch: Option<(usize, f64)>,
}

struct Active {
    sent: Sent,
    /// Prompt tokens served from the cache.
    cached: usize,
    /// Prompt tokens still to compute.
    to_compute: usize,
    /// Answer tokens produced so far.
    produced: usize,
    slots: Vec<crate::cache::DeviceSlot>,
}

fn cache_err(e: CacheError) -> SimError {
    SimError::Cache(e.0)
}

/// Runs `workload` through `cache` to the end. `progress` is called with (finished, total)
/// after every finished request.
pub fn run(
    workload: &mut Workload,
    cache: &mut dyn CacheUnderTest,
    compute: &ComputeModel,
    config: &EngineConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<RunResult> {
    Engine::new(workload, cache, compute, config)?.run(progress)
}

struct Engine<'a> {
    workload: &'a mut Workload,
    cache: &'a mut dyn CacheUnderTest,
    compute: &'a ComputeModel,
    config: &'a EngineConfig,
    page_size: usize,
    now: f64,
    links: Links,
    waiting: VecDeque<Waiting>,
    prefilling: Vec<Active>,
    decoding: Vec<Active>,
    requests: Vec<RequestRecord>,
    steps: Vec<StepRecord>,
}

impl<'a> Engine<'a> {
    fn new(
        workload: &'a mut Workload,
        cache: &'a mut dyn CacheUnderTest,
        compute: &'a ComputeModel,
        config: &'a EngineConfig,
    ) -> Result<Self> {
        compute.validate().map_err(SimError::Usage)?;
        if config.max_prefill_tokens == 0 {
            return Err(SimError::Usage(
                "the prefill token budget must be at least 1".into(),
            ));
        }
        let page_size = cache.page_size();
        if page_size == 0 {
            return Err(SimError::Cache("the cache reports page size 0".into()));
        }
        check_fits(workload, page_size, cache.device_pages())?;
        Ok(Self {
            workload,
            cache,
            compute,
            config,
            page_size,
            now: 0.0,
            links: Links::new(compute, config.copy_time),
            waiting: VecDeque::new(),
            prefilling: Vec::new(),
            decoding: Vec::new(),
            requests: Vec::new(),
            steps: Vec::new(),
        })
    }

    fn prompt(&self, s: &Sent) -> &[u32] {
        self.workload.conversations()[s.conversation].prompt(s.round)
    }

    fn answer_len(&self, s: &Sent) -> usize {
        self.workload.conversations()[s.conversation].answer_len(s.round)
    }

    fn run(mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<RunResult> {
        let wall = Instant::now();
        let mut stalled_since: Option<Instant> = None;
        while !self.workload.is_done() {
            self.cache
                .advance(self.now, &mut self.links)
                .map_err(cache_err)?;
            self.accept_arrivals()?;
            let (admitted, refused) = self.schedule()?;
            if !self.prefilling.is_empty() {
                stalled_since = None;
                self.prefill_step(admitted, progress)?;
            } else if !self.decoding.is_empty() {
                stalled_since = None;
                self.decode_step(progress)?;
            } else if let Some(t) = refused
                .and(self.cache.next_completion())
                .filter(|&t| t > self.now)
            {
                // Nothing runs, yet the cache refused a request that is due: its memory is
                // held by copies in flight. They complete at `t` on the simulated links.
                stalled_since = None;
                self.now = t;
            } else if let Some(req) = refused {
                // Nothing runs, yet the cache refused a request that is due: its memory is
                // held by work in flight (copies awaiting acknowledgement). Wait in wall time,
                // polling, without advancing the simulated clock.
                let since = *stalled_since.get_or_insert_with(Instant::now);
                if since.elapsed() > self.config.wall_wait_limit {
                    let r = &self.requests[req as usize];
                    return Err(SimError::Cache(format!(
                        "request {req} ({}, {} prompt tokens): the cache refused admission for \
                         {:?} with no request running ({} device pages)",
                        r.conversation,
                        r.prompt_tokens,
                        self.config.wall_wait_limit,
                        self.cache.device_pages()
                    )));
                }
                std::thread::sleep(Duration::from_micros(50));
            } else {
                stalled_since = None;
                self.idle()?;
            }
        }
        self.cache.shutdown().map_err(cache_err)?;
        let first = self
            .requests
            .iter()
            .map(|r| r.arrival)
            .fold(f64::INFINITY, f64::min);
        let last = self.requests.iter().map(|r| r.finished).fold(0.0, f64::max);
        Ok(RunResult {
            cache: self.cache.stats(),
            sim_seconds: if first.is_finite() { last - first } else { 0.0 },
            wall_seconds: wall.elapsed().as_secs_f64(),
            links: self.links,
            requests: self.requests,
            steps: self.steps,
        })
    }

    fn accept_arrivals(&mut self) -> Result<()> {
        while let Some(sent) = self.workload.pop_due(self.now) {
            let conv = &self.workload.conversations()[sent.conversation];
            self.requests.push(RequestRecord {
                id: sent.id,
                conversation: conv.id.clone(),
                round: sent.round,
                prompt_tokens: conv.prompt(sent.round).len(),
                answer_tokens: conv.answer_len(sent.round),
                arrival: sent.time,
                ..RequestRecord::default()
            });
            debug_assert_eq!(self.requests.len() as u64, sent.id + 1);
            let prompt = self.workload.conversations()[sent.conversation].prompt(sent.round);
            self.cache.arrive(sent.id, prompt).map_err(cache_err)?;
            self.waiting.push_back(Waiting {
                sent,
                prefetch: None,
            });
        }
        Ok(())
    }

    /// Waits (wall time) until the cache says the request's prefetch is done, then models its
    /// duration (rule 4).
    fn resolve_prefetch(&mut self, i: usize) -> Result<(usize, f64)> {
        if let Some(p) = self.waiting[i].prefetch {
            return Ok(p);
        }
        let sent = self.waiting[i].sent;
        let started = Instant::now();
        let l3_pages = loop {
            match self.cache.prefetch_status(sent.id).map_err(cache_err)? {
                PrefetchStatus::Ready { l3_pages } => break l3_pages,
                PrefetchStatus::Pending => {
                    if started.elapsed() > self.config.wall_wait_limit {
                        return Err(SimError::Cache(format!(
                            "request {} ({}): prefetch still pending after {:?}",
                            sent.id,
                            self.requests[sent.id as usize].conversation,
                            self.config.wall_wait_limit
                        )));
                    }
                    std::thread::sleep(Duration::from_micros(50));
                    self.cache
                        .advance(self.now, &mut self.links)
                        .map_err(cache_err)?;
                }
            }
        };
        let done = if l3_pages == 0 {
            sent.time
        } else {
            self.links.prefetch(
                sent.time,
                self.compute.l3_latency_s,
                l3_pages as u64 * self.config.page_bytes,
            )
        };
        let rec = &mut self.requests[sent.id as usize];
        rec.prefetched_pages = l3_pages;
        rec.prefetch_done = done;
        self.waiting[i].prefetch = Some((l3_pages, done));
        Ok((l3_pages, done))
    }

    /// Builds this step's prefill batch (rule 2 of the loop); returns the bytes its new
    /// admissions load from host memory and the request the cache refused, if the scan ended
    /// on a refusal. The batch is `self.prefilling` with per-request token counts decided in
    /// `prefill_step`.
    fn schedule(&mut self) -> Result<(u64, Option<u64>)> {
        let mut budget = self.config.max_prefill_tokens;
        for a in &self.prefilling {
            budget = budget.saturating_sub(a.to_compute);
        }
        let mut load_bytes = 0;
        let mut refused = None;
        let mut i = 0;
        while i < self.waiting.len() && budget > 0 {
            let (_, done) = self.resolve_prefetch(i)?;
            if done > self.now {
                i += 1;
                continue;
            }
            let sent = self.waiting[i].sent;
            let answer = self.answer_len(&sent);
            let prompt_len = self.prompt(&sent).len();
            let prompt = self.workload.conversations()[sent.conversation].prompt(sent.round);
            let Some(adm) = self
                .cache
                .admit(sent.id, prompt, answer)
                .map_err(cache_err)?
            else {
                refused = Some(sent.id);
                break;
            };
            self.check_admission(&sent, prompt_len, answer, &adm)?;
            self.waiting.remove(i);
            let ps = self.page_size;
            let rec = &mut self.requests[sent.id as usize];
            rec.admitted = self.now;
            rec.hit_l1 = adm.l1_pages * ps;
            rec.hit_l2 = adm.l2_pages * ps;
            rec.hit_l3 = adm.l3_pages * ps;
            let cached = adm.prefix_pages() * ps;
            rec.computed = prompt_len - cached;
            load_bytes += adm
                .load_bytes
                .unwrap_or(adm.load_pages() as u64 * self.config.page_bytes);
            budget = budget.saturating_sub(prompt_len - cached);
            let mut slots = adm.prefix_slots;
            slots.extend_from_slice(&adm.new_slots);
            self.prefilling.push(Active {
                sent,
                cached,
                to_compute: prompt_len - cached,
                produced: 0,
                slots,
            });
        }
        Ok((load_bytes, refused))
    }

    fn check_admission(
        &self,
        sent: &Sent,
        prompt_len: usize,
        answer: usize,
        adm: &Admission,
    ) -> Result<()> {
        let ps = self.page_size;
        let prefix = adm.prefix_pages();
        let total = (prompt_len + answer).div_ceil(ps);
        let fail = |what: String| {
            Err(SimError::Cache(format!(
                "request {} ({}): admission breaks the cache contract: {what}",
                sent.id, self.requests[sent.id as usize].conversation
            )))
        };
        if adm.prefix_slots.len() != prefix {
            return fail(format!(
                "{} prefix slots for {prefix} prefix pages",
                adm.prefix_slots.len()
            ));
        }
        if prefix * ps >= prompt_len {
            return fail(format!(
                "a prefix of {prefix} pages covers the whole {prompt_len}-token prompt"
            ));
        }
        if adm.new_slots.len() != total - prefix {
            return fail(format!(
                "{} new slots, expected {} ({total} pages for prompt and answer − {prefix})",
                adm.new_slots.len(),
                total - prefix
            ));
        }
        Ok(())
    }

    fn prefill_step(
        &mut self,
        load_bytes: u64,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<()> {
        let mut budget = self.config.max_prefill_tokens;
        let mut compute = 0.0;
        let mut tokens = 0;
        let mut takes = Vec::with_capacity(self.prefilling.len());
        for a in &self.prefilling {
            let take = a.to_compute.min(budget);
            budget -= take;
            compute += self.compute.prefill_compute(a.cached, take);
            tokens += take;
            takes.push(take);
        }
        let producer = self.cache.start_loading().map_err(cache_err)?;
        if let Some(idx) = producer {
            for layer in 0..self.config.layers as usize {
                self.cache.wait_layer(idx, layer).map_err(cache_err)?;
            }
        }
        let duration = self
            .compute
            .prefill_step(compute, self.config.layers, load_bytes);
        let plain = self.compute.step_overhead_s + compute;
        self.steps.push(StepRecord {
            kind: StepKind::Prefill,
            start: self.now,
            duration,
            tokens,
            requests: self.prefilling.len(),
            load_bytes,
            load_stall: (duration - plain).max(0.0),
        });
        self.now += duration;
        let mut still = Vec::new();
        for (mut a, take) in std::mem::take(&mut self.prefilling).into_iter().zip(takes) {
            a.to_compute -= take;
            a.cached += take;
            if a.to_compute > 0 {
                still.push(a);
                continue;
            }
            self.requests[a.sent.id as usize].first_token = self.now;
            a.produced = 1;
            if a.produced >= self.answer_len(&a.sent) {
                self.finish(a, progress)?;
            } else {
                self.decoding.push(a);
            }
        }
        self.prefilling = still;
        Ok(())
    }

    fn decode_step(&mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<()> {
        let context: usize = self.decoding.iter().map(|a| a.cached + a.produced).sum();
        let duration = self.compute.decode_step(context, self.decoding.len());
        self.steps.push(StepRecord {
            kind: StepKind::Decode,
            start: self.now,
            duration,
            tokens: self.decoding.len(),
            requests: self.decoding.len(),
            load_bytes: 0,
            load_stall: 0.0,
        });
        self.now += duration;
        let mut still = Vec::with_capacity(self.decoding.len());
        for mut a in std::mem::take(&mut self.decoding) {
            a.produced += 1;
            if a.produced >= self.answer_len(&a.sent) {
                self.finish(a, progress)?;
            } else {
                still.push(a);
            }
        }
        self.decoding = still;
        Ok(())
    }

    fn finish(&mut self, a: Active, progress: &mut dyn FnMut(usize, usize)) -> Result<()> {
        let conv = &self.workload.conversations()[a.sent.conversation];
        let tokens = conv.with_answer(a.sent.round);
        self.cache
            .cache_finished(a.sent.id, tokens, &a.slots)
            .map_err(cache_err)?;
        self.requests[a.sent.id as usize].finished = self.now;
        self.workload.complete(&a.sent, self.now);
        progress(self.workload.completed(), self.workload.total());
        Ok(())
    }

    fn idle(&mut self) -> Result<()> {
        let next_prefetch = self
            .waiting
            .iter()
            .filter_map(|w| w.prefetch.map(|p| p.1))
            .filter(|&d| d > self.now)
            .fold(f64::INFINITY, f64::min);
        let next_copy = self
            .cache
            .next_completion()
            .filter(|&t| t > self.now)
            .unwrap_or(f64::INFINITY);
        let next = self
            .workload
            .next_send_time()
            .unwrap_or(f64::INFINITY)
            .min(next_prefetch)
            .min(next_copy);
        if !next.is_finite() {
            return Err(SimError::Cache(format!(
                "the simulation stalled at {:.3} s with {} requests waiting and none running",
                self.now,
                self.waiting.len()
            )));
        }
        self.now = self.now.max(next);
        Ok(())
    }
}

/// Checks that every request's prompt and answer fit in device memory (else no schedule can
/// ever run it).
fn check_fits(workload: &Workload, page_size: usize, device_pages: usize) -> Result<()> {
    for c in workload.conversations() {
        for (round, t) in c.turns.iter().enumerate() {
            if t.prompt_end == 0 {
                return Err(SimError::Usage(format!(
                    "request {} round {round}: empty prompt",
                    c.id
                )));
            }
            let pages = t.answer_end.div_ceil(page_size);
            if pages > device_pages {
                return Err(SimError::Usage(format!(
                    "request {} round {round}: {} prompt and answer tokens need {pages} pages of \
                     {page_size} tokens but the device holds {device_pages} pages; raise \
                     --device-pages/--device-gb or shorten the workload",
                    c.id, t.answer_end
                )));
            }
        }
    }
    Ok(())
}
