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
use crate::trace::Conversation;
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
///
/// The loop of the module docs, on one [`Scheduler`]: the workload is the only source of
/// requests, and the clock jumps to its next arrival when the scheduler has nothing to do.
pub fn run(
    workload: &mut Workload,
    cache: &mut dyn CacheUnderTest,
    compute: &ComputeModel,
    config: &EngineConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<RunResult> {
    let mut sched = Scheduler::new(&*cache, compute, config, true)?;
    check_fits(workload, sched.page_size, cache.device_pages())?;
    let wall = Instant::now();
    let mut requests: Vec<RequestRecord> = Vec::new();
    let mut finished = Vec::new();
    let mut at = 0.0;
    while !workload.is_done() {
        sched.advance_to(at, cache)?;
        while let Some(sent) = workload.pop_due(sched.now()) {
            requests.push(RequestRecord::default());
            debug_assert_eq!(requests.len() as u64, sent.id + 1);
            let rec = &mut requests[sent.id as usize];
            sched.arrive(sent, workload.conversations(), cache, rec)?;
        }
        at = match sched.step(
            cache,
            workload.conversations(),
            &mut requests,
            &mut finished,
        )? {
            Step::Ran => sched.now(),
            Step::WaitUntil(t) => t,
            Step::Idle => {
                let next = workload
                    .next_send_time()
                    .unwrap_or(f64::INFINITY)
                    .min(sched.next_event(&*cache).unwrap_or(f64::INFINITY));
                if !next.is_finite() {
                    return Err(SimError::Cache(format!(
                        "the simulation stalled at {:.3} s with {} requests waiting and none \
                         running",
                        sched.now(),
                        sched.waiting()
                    )));
                }
                sched.now().max(next)
            }
        };
        for (sent, t) in finished.drain(..) {
            workload.complete(&sent, t);
            progress(workload.completed(), workload.total());
        }
    }
    cache.shutdown().map_err(cache_err)?;
    let first = requests
        .iter()
        .map(|r| r.arrival)
        .fold(f64::INFINITY, f64::min);
    let last = requests.iter().map(|r| r.finished).fold(0.0, f64::max);
    let (links, steps) = sched.into_parts();
    Ok(RunResult {
        cache: cache.stats(),
        sim_seconds: if first.is_finite() { last - first } else { 0.0 },
        wall_seconds: wall.elapsed().as_secs_f64(),
        links,
        requests,
        steps,
    })
}

/// What one [`Scheduler::step`] did.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Step {
    /// A forward step ran; the scheduler's clock moved to its end.
    Ran,
    /// Nothing can run before this time: the cache refused a due request while none runs,
    /// and copies in flight that hold its memory complete then (or, when it holds none, the
    /// scheduler polled in wall time and the time is its clock).
    WaitUntil(f64),
    /// Nothing runs: no request is due, or every waiting one waits for its prefetch
    /// ([`Scheduler::next_event`] says until when).
    Idle,
}

/// One engine's scheduler (the loop of the module docs), steppable: the driver delivers
/// requests ([`Scheduler::arrive`]), moves the clock ([`Scheduler::advance_to`]) and runs one
/// iteration at a time ([`Scheduler::step`]). [`run`] drives one with a [`Workload`]; the
/// fleet ([`crate::fleet`]) drives many on one clock, with requests a router places.
///
/// The cache is passed to every call rather than held, so the driver keeps its concrete
/// type (the fleet drains its KV events between steps). Requests' records live with the
/// driver, indexed by request id (`records[id]`).
pub struct Scheduler {
    compute: ComputeModel,
    config: EngineConfig,
    page_size: usize,
    now: f64,
    links: Links,
    waiting: VecDeque<Waiting>,
    prefilling: Vec<Active>,
    decoding: Vec<Active>,
    stalled_since: Option<Instant>,
    steps: Option<Vec<StepRecord>>,
    busy_s: f64,
}

impl Scheduler {
    /// An idle scheduler at time 0 for `cache`; with `record_steps`, every forward step is
    /// kept ([`Scheduler::into_parts`]).
    pub fn new(
        cache: &dyn CacheUnderTest,
        compute: &ComputeModel,
        config: &EngineConfig,
        record_steps: bool,
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
        Ok(Self {
            compute: compute.clone(),
            config: config.clone(),
            page_size,
            now: 0.0,
            links: Links::new(compute, config.copy_time),
            waiting: VecDeque::new(),
            prefilling: Vec::new(),
            decoding: Vec::new(),
            stalled_since: None,
            steps: record_steps.then(Vec::new),
            busy_s: 0.0,
        })
    }

    /// The scheduler's clock (s).
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Busy time: the sum of its forward steps (s).
    pub fn busy_s(&self) -> f64 {
        self.busy_s
    }

    /// Requests waiting (not admitted).
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests waiting or running.
    pub fn requests(&self) -> usize {
        self.waiting.len() + self.prefilling.len() + self.decoding.len()
    }

    /// Prompt tokens still to compute: every waiting prompt (its hits are not known before
    /// admission) and what admitted ones have left.
    pub fn queued_prefill_tokens(&self, convs: &[Conversation]) -> usize {
        let waiting: usize = self
            .waiting
            .iter()
            .map(|w| convs[w.sent.conversation].prompt(w.sent.round).len())
            .sum();
        waiting + self.prefilling.iter().map(|a| a.to_compute).sum::<usize>()
    }

    /// Waiting requests whose modelled L3 prefetch ends after the clock.
    pub fn prefetching_requests(&self) -> usize {
        self.waiting
            .iter()
            .filter(|w| {
                w.prefetch
                    .is_some_and(|(pages, done)| pages > 0 && done > self.now)
            })
            .count()
    }

    /// KV tokens of decoding requests.
    pub fn running_tokens(&self) -> usize {
        self.decoding.iter().map(|a| a.cached + a.produced).sum()
    }

    /// The links and (when recorded) the forward steps, at the end of a run.
    pub fn into_parts(self) -> (Links, Vec<StepRecord>) {
        (self.links, self.steps.unwrap_or_default())
    }

    /// Moves the clock to `max(now, at)` and lets the cache finish what is due by then
    /// (step 1 of the loop, before arrivals).
    pub fn advance_to(&mut self, at: f64, cache: &mut dyn CacheUnderTest) -> Result<()> {
        self.now = self.now.max(at);
        cache.advance(self.now, &mut self.links).map_err(cache_err)
    }

    /// `sent` joins the waiting queue at `sent.time` (the clock moves there if behind); its
    /// record `rec` is filled in.
    pub fn arrive(
        &mut self,
        sent: Sent,
        convs: &[Conversation],
        cache: &mut dyn CacheUnderTest,
        rec: &mut RequestRecord,
    ) -> Result<()> {
        self.now = self.now.max(sent.time);
        let conv = &convs[sent.conversation];
        *rec = RequestRecord {
            id: sent.id,
            conversation: conv.id.clone(),
            round: sent.round,
            prompt_tokens: conv.prompt(sent.round).len(),
            answer_tokens: conv.answer_len(sent.round),
            arrival: sent.time,
            ..RequestRecord::default()
        };
        cache
            .arrive(sent.id, conv.prompt(sent.round))
            .map_err(cache_err)?;
        self.waiting.push_back(Waiting {
            sent,
            prefetch: None,
        });
        Ok(())
    }

    /// Steps 2–5 of the loop at the current time: build the prefill batch, then run a
    /// prefill or a decode step, or say what the scheduler waits for. Requests that
    /// finished are appended to `finished` with their finish time, in finishing order.
    pub fn step(
        &mut self,
        cache: &mut dyn CacheUnderTest,
        convs: &[Conversation],
        records: &mut [RequestRecord],
        finished: &mut Vec<(Sent, f64)>,
    ) -> Result<Step> {
        let (load_bytes, refused) = self.schedule(cache, convs, records)?;
        if !self.prefilling.is_empty() {
            self.stalled_since = None;
            self.prefill_step(load_bytes, cache, convs, records, finished)?;
            return Ok(Step::Ran);
        }
        if !self.decoding.is_empty() {
            self.stalled_since = None;
            self.decode_step(cache, convs, records, finished)?;
            return Ok(Step::Ran);
        }
        if let Some(t) = refused
            .and(cache.next_completion())
            .filter(|&t| t > self.now)
        {
            // Nothing runs, yet the cache refused a request that is due: its memory is
            // held by copies in flight. They complete at `t` on the simulated links.
            self.stalled_since = None;
            return Ok(Step::WaitUntil(t));
        }
        if let Some(req) = refused {
            // Nothing runs, yet the cache refused a request that is due: its memory is
            // held by work in flight (copies awaiting acknowledgement). Wait in wall time,
            // polling, without advancing the simulated clock.
            let since = *self.stalled_since.get_or_insert_with(Instant::now);
            if since.elapsed() > self.config.wall_wait_limit {
                let r = &records[req as usize];
                return Err(SimError::Cache(format!(
                    "request {req} ({}, {} prompt tokens): the cache refused admission for \
                     {:?} with no request running ({} device pages)",
                    r.conversation,
                    r.prompt_tokens,
                    self.config.wall_wait_limit,
                    cache.device_pages()
                )));
            }
            std::thread::sleep(crate::poll::pause(since.elapsed()));
            return Ok(Step::WaitUntil(self.now));
        }
        self.stalled_since = None;
        Ok(Step::Idle)
    }

    /// The next time something the scheduler waits for completes on its own: a waiting
    /// request's modelled prefetch or a copy of the cache, after the clock; `None` when
    /// nothing is in flight.
    pub fn next_event(&self, cache: &dyn CacheUnderTest) -> Option<f64> {
        let next_prefetch = self
            .waiting
            .iter()
            .filter_map(|w| w.prefetch.map(|p| p.1))
            .filter(|&d| d > self.now)
            .fold(f64::INFINITY, f64::min);
        let next_copy = cache
            .next_completion()
            .filter(|&t| t > self.now)
            .unwrap_or(f64::INFINITY);
        let next = next_prefetch.min(next_copy);
        next.is_finite().then_some(next)
    }

    /// Waits (wall time) until the cache says the request's prefetch is done, then models its
    /// duration (rule 4).
    fn resolve_prefetch(
        &mut self,
        i: usize,
        cache: &mut dyn CacheUnderTest,
        records: &mut [RequestRecord],
    ) -> Result<(usize, f64)> {
        if let Some(p) = self.waiting[i].prefetch {
            return Ok(p);
        }
        let sent = self.waiting[i].sent;
        let started = Instant::now();
        let l3_pages = loop {
            match cache.prefetch_status(sent.id).map_err(cache_err)? {
                PrefetchStatus::Ready { l3_pages } => break l3_pages,
                PrefetchStatus::Pending => {
                    if started.elapsed() > self.config.wall_wait_limit {
                        return Err(SimError::Cache(format!(
                            "request {} ({}): prefetch still pending after {:?}",
                            sent.id,
                            records[sent.id as usize].conversation,
                            self.config.wall_wait_limit
                        )));
                    }
                    std::thread::sleep(crate::poll::pause(started.elapsed()));
                    cache
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
        let rec = &mut records[sent.id as usize];
        rec.prefetched_pages = l3_pages;
        rec.prefetch_done = done;
        self.waiting[i].prefetch = Some((l3_pages, done));
        Ok((l3_pages, done))
    }

    /// Builds this step's prefill batch (rule 2 of the loop); returns the bytes its new
    /// admissions load from host memory and the request the cache refused, if the scan ended
    /// on a refusal. The batch is `self.prefilling` with per-request token counts decided in
    /// `prefill_step`.
    fn schedule(
        &mut self,
        cache: &mut dyn CacheUnderTest,
        convs: &[Conversation],
        records: &mut [RequestRecord],
    ) -> Result<(u64, Option<u64>)> {
        let mut budget = self.config.max_prefill_tokens;
        for a in &self.prefilling {
            budget = budget.saturating_sub(a.to_compute);
        }
        let mut load_bytes = 0;
        let mut refused = None;
        let mut i = 0;
        while i < self.waiting.len() && budget > 0 {
            let (_, done) = self.resolve_prefetch(i, cache, records)?;
            if done > self.now {
                i += 1;
                continue;
            }
            let sent = self.waiting[i].sent;
            let conv = &convs[sent.conversation];
            let prompt = conv.prompt(sent.round);
            let answer = conv.answer_len(sent.round);
            let Some(adm) = cache.admit(sent.id, prompt, answer).map_err(cache_err)? else {
                refused = Some(sent.id);
                break;
            };
            check_admission(
                &sent,
                &records[sent.id as usize],
                prompt.len(),
                answer,
                &adm,
                self.page_size,
            )?;
            self.waiting.remove(i);
            let ps = self.page_size;
            let rec = &mut records[sent.id as usize];
            rec.admitted = self.now;
            rec.hit_l1 = adm.l1_pages * ps;
            rec.hit_l2 = adm.l2_pages * ps;
            rec.hit_l3 = adm.l3_pages * ps;
            let cached = adm.prefix_pages() * ps;
            rec.computed = prompt.len() - cached;
            load_bytes += adm
                .load_bytes
                .unwrap_or(adm.load_pages() as u64 * self.config.page_bytes);
            budget = budget.saturating_sub(prompt.len() - cached);
            let mut slots = adm.prefix_slots;
            slots.extend_from_slice(&adm.new_slots);
            self.prefilling.push(Active {
                sent,
                cached,
                to_compute: prompt.len() - cached,
                produced: 0,
                slots,
            });
        }
        Ok((load_bytes, refused))
    }

    fn prefill_step(
        &mut self,
        load_bytes: u64,
        cache: &mut dyn CacheUnderTest,
        convs: &[Conversation],
        records: &mut [RequestRecord],
        finished: &mut Vec<(Sent, f64)>,
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
        if let Some(idx) = cache.start_loading().map_err(cache_err)? {
            for layer in 0..self.config.layers as usize {
                cache.wait_layer(idx, layer).map_err(cache_err)?;
            }
        }
        let duration = self
            .compute
            .prefill_step(compute, self.config.layers, load_bytes);
        let plain = self.compute.step_overhead_s + compute;
        if let Some(steps) = &mut self.steps {
            steps.push(StepRecord {
                kind: StepKind::Prefill,
                start: self.now,
                duration,
                tokens,
                requests: self.prefilling.len(),
                load_bytes,
                load_stall: (duration - plain).max(0.0),
            });
        }
        self.now += duration;
        self.busy_s += duration;
        let mut still = Vec::new();
        for (mut a, take) in std::mem::take(&mut self.prefilling).into_iter().zip(takes) {
            a.to_compute -= take;
            a.cached += take;
            if a.to_compute > 0 {
                still.push(a);
                continue;
            }
            records[a.sent.id as usize].first_token = self.now;
            a.produced = 1;
            if a.produced >= convs[a.sent.conversation].answer_len(a.sent.round) {
                self.finish(a, cache, convs, records, finished)?;
            } else {
                self.decoding.push(a);
            }
        }
        self.prefilling = still;
        Ok(())
    }

    fn decode_step(
        &mut self,
        cache: &mut dyn CacheUnderTest,
        convs: &[Conversation],
        records: &mut [RequestRecord],
        finished: &mut Vec<(Sent, f64)>,
    ) -> Result<()> {
        let context: usize = self.decoding.iter().map(|a| a.cached + a.produced).sum();
        let duration = self.compute.decode_step(context, self.decoding.len());
        if let Some(steps) = &mut self.steps {
            steps.push(StepRecord {
                kind: StepKind::Decode,
                start: self.now,
                duration,
                tokens: self.decoding.len(),
                requests: self.decoding.len(),
                load_bytes: 0,
                load_stall: 0.0,
            });
        }
        self.now += duration;
        self.busy_s += duration;
        let mut still = Vec::with_capacity(self.decoding.len());
        for mut a in std::mem::take(&mut self.decoding) {
            a.produced += 1;
            if a.produced >= convs[a.sent.conversation].answer_len(a.sent.round) {
                self.finish(a, cache, convs, records, finished)?;
            } else {
                still.push(a);
            }
        }
        self.decoding = still;
        Ok(())
    }

    fn finish(
        &mut self,
        a: Active,
        cache: &mut dyn CacheUnderTest,
        convs: &[Conversation],
        records: &mut [RequestRecord],
        finished: &mut Vec<(Sent, f64)>,
    ) -> Result<()> {
        let tokens = convs[a.sent.conversation].with_answer(a.sent.round);
        cache
            .cache_finished(a.sent.id, tokens, &a.slots)
            .map_err(cache_err)?;
        records[a.sent.id as usize].finished = self.now;
        finished.push((a.sent, self.now));
        Ok(())
    }
}

/// Checks an admission against the cache contract (rule 5).
fn check_admission(
    sent: &Sent,
    rec: &RequestRecord,
    prompt_len: usize,
    answer: usize,
    adm: &Admission,
    ps: usize,
) -> Result<()> {
    let prefix = adm.prefix_pages();
    let total = (prompt_len + answer).div_ceil(ps);
    let fail = |what: String| {
        Err(SimError::Cache(format!(
            "request {} ({}): admission breaks the cache contract: {what}",
            sent.id, rec.conversation
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
