//! One engine of the fleet: the scheduler of [`crate::engine`] (same loop, same rules), made
//! steppable so that many engines share one simulated clock, and fed by the router instead of
//! the workload.
//!
//! The rules of [`crate::engine`] hold per instance: FCFS prefill under the chunked-prefill
//! budget after the prompts cut last step, prefetches modelled from arrival on the instance's
//! L3 link, admission all or nothing, decode when no prefill is due, TTFT = end of the step
//! that computed the last prompt token − arrival, `hit + computed = prompt` per request.
//! What differs: requests arrive through [`Instance::arrive`] (the fleet routes them), and
//! [`Instance::step`] runs one iteration of the loop and says when the instance next has
//! something to do, instead of running to the end.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::adapter::HiCacheUnderTest;
use crate::cache::{CacheError, CacheUnderTest, DeviceSlot, PrefetchStatus};
use crate::engine::{EngineConfig, RequestRecord};
use crate::error::{Result, SimError};
use crate::links::Links;
use crate::model::ComputeModel;
use crate::trace::Conversation;
use crate::workload::Sent;

struct Waiting {
    sent: Sent,
    prefetch: Option<(usize, f64)>,
}

struct Active {
    sent: Sent,
    cached: usize,
    to_compute: usize,
    produced: usize,
    slots: Vec<DeviceSlot>,
}

/// What one call of [`Instance::step`] did.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Step {
    /// A forward step ran; the instance's clock moved to its end.
    Ran,
    /// Nothing can run before this time (a prefetch or a copy completes then).
    WaitUntil(f64),
    /// Nothing to do until a request arrives.
    Idle,
}

fn cache_err(e: CacheError) -> SimError {
    SimError::Cache(e.0)
}

/// One simulated engine with its own `hicache::HiCache`.
pub struct Instance {
    /// The cache (its KV events feed the fleet's index).
    pub cache: HiCacheUnderTest,
    now: f64,
    links: Links,
    page_size: usize,
    waiting: VecDeque<Waiting>,
    prefilling: Vec<Active>,
    decoding: Vec<Active>,
    stalled_since: Option<Instant>,
    /// Busy time: the sum of its forward steps (s).
    pub busy_s: f64,
}

impl Instance {
    /// An idle instance over `cache`, its links modelled from `compute`.
    pub fn new(cache: HiCacheUnderTest, compute: &ComputeModel, config: &EngineConfig) -> Self {
        Self {
            page_size: cache.page_size(),
            cache,
            now: 0.0,
            links: Links::new(compute, config.copy_time),
            waiting: VecDeque::new(),
            prefilling: Vec::new(),
            decoding: Vec::new(),
            stalled_since: None,
            busy_s: 0.0,
        }
    }

    /// The instance's clock (s).
    pub fn now(&self) -> f64 {
        self.now
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

    /// KV tokens of decoding requests.
    pub fn running_tokens(&self) -> usize {
        self.decoding.iter().map(|a| a.cached + a.produced).sum()
    }

    /// `sent` arrives (routed here) at `sent.time`; its record is `rec`.
    pub fn arrive(
        &mut self,
        sent: Sent,
        convs: &[Conversation],
        rec: &mut RequestRecord,
    ) -> Result<()> {
        self.now = self.now.max(sent.time);
        let conv = &convs[sent.conversation];
        rec.id = sent.id;
        rec.conversation = conv.id.clone();
        rec.round = sent.round;
        rec.prompt_tokens = conv.prompt(sent.round).len();
        rec.answer_tokens = conv.answer_len(sent.round);
        rec.arrival = sent.time;
        self.cache
            .arrive(sent.id, conv.prompt(sent.round))
            .map_err(cache_err)?;
        self.waiting.push_back(Waiting {
            sent,
            prefetch: None,
        });
        Ok(())
    }

    /// One iteration of the loop at time `max(now, at)`. Finished requests are appended to
    /// `finished` with their finish time; `records` is indexed by request id.
    pub fn step(
        &mut self,
        at: f64,
        convs: &[Conversation],
        compute: &ComputeModel,
        config: &EngineConfig,
        records: &mut [RequestRecord],
        finished: &mut Vec<(Sent, f64)>,
    ) -> Result<Step> {
        self.now = self.now.max(at);
        self.cache
            .advance(self.now, &mut self.links)
            .map_err(cache_err)?;
        let (load_bytes, refused) = self.schedule(convs, compute, config, records)?;
        if !self.prefilling.is_empty() {
            self.stalled_since = None;
            self.prefill_step(load_bytes, convs, compute, config, records, finished)?;
            return Ok(Step::Ran);
        }
        if !self.decoding.is_empty() {
            self.stalled_since = None;
            self.decode_step(convs, compute, records, finished)?;
            return Ok(Step::Ran);
        }
        if let Some(t) = refused
            .and(self.cache.next_completion())
            .filter(|&t| t > self.now)
        {
            self.stalled_since = None;
            return Ok(Step::WaitUntil(t));
        }
        if let Some(req) = refused {
            let since = *self.stalled_since.get_or_insert_with(Instant::now);
            if since.elapsed() > config.wall_wait_limit {
                return Err(SimError::Cache(format!(
                    "request {req}: the cache refused admission for {:?} with no request \
                     running ({} device pages)",
                    config.wall_wait_limit,
                    self.cache.device_pages()
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
            return Ok(Step::WaitUntil(self.now));
        }
        self.stalled_since = None;
        if self.waiting.is_empty() {
            return Ok(Step::Idle);
        }
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
        let next = next_prefetch.min(next_copy);
        if !next.is_finite() {
            return Err(SimError::Cache(format!(
                "an instance stalled at {:.3} s with {} requests waiting and none running",
                self.now,
                self.waiting.len()
            )));
        }
        Ok(Step::WaitUntil(next))
    }

    fn resolve_prefetch(
        &mut self,
        i: usize,
        compute: &ComputeModel,
        config: &EngineConfig,
        records: &mut [RequestRecord],
    ) -> Result<(usize, f64)> {
        if let Some(p) = self.waiting[i].prefetch {
            return Ok(p);
        }
        let sent = self.waiting[i].sent;
        let started = Instant::now();
        let l3_pages = loop {
            match self.cache.prefetch_status(sent.id).map_err(cache_err)? {
                PrefetchStatus::Ready { l3_pages } => break l3_pages,
                PrefetchStatus::Pending => {
                    if started.elapsed() > config.wall_wait_limit {
                        return Err(SimError::Cache(format!(
                            "request {}: prefetch still pending after {:?}",
                            sent.id, config.wall_wait_limit
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
                compute.l3_latency_s,
                l3_pages as u64 * config.page_bytes,
            )
        };
        let rec = &mut records[sent.id as usize];
        rec.prefetched_pages = l3_pages;
        rec.prefetch_done = done;
        self.waiting[i].prefetch = Some((l3_pages, done));
        Ok((l3_pages, done))
    }

    fn schedule(
        &mut self,
        convs: &[Conversation],
        compute: &ComputeModel,
        config: &EngineConfig,
        records: &mut [RequestRecord],
    ) -> Result<(u64, Option<u64>)> {
        let mut budget = config.max_prefill_tokens;
        for a in &self.prefilling {
            budget = budget.saturating_sub(a.to_compute);
        }
        let mut load_bytes = 0;
        let mut refused = None;
        let mut i = 0;
        while i < self.waiting.len() && budget > 0 {
            let (_, done) = self.resolve_prefetch(i, compute, config, records)?;
            if done > self.now {
                i += 1;
                continue;
            }
            let sent = self.waiting[i].sent;
            let conv = &convs[sent.conversation];
            let prompt = conv.prompt(sent.round);
            let answer = conv.answer_len(sent.round);
            let Some(adm) = self
                .cache
                .admit(sent.id, prompt, answer)
                .map_err(cache_err)?
            else {
                refused = Some(sent.id);
                break;
            };
            let ps = self.page_size;
            let prefix = adm.prefix_pages();
            if adm.prefix_slots.len() != prefix
                || prefix * ps >= prompt.len()
                || adm.new_slots.len() != (prompt.len() + answer).div_ceil(ps) - prefix
            {
                return Err(SimError::Cache(format!(
                    "request {}: admission breaks the cache contract ({prefix} prefix pages, \
                     {} prefix slots, {} new slots, {} prompt tokens)",
                    sent.id,
                    adm.prefix_slots.len(),
                    adm.new_slots.len(),
                    prompt.len()
                )));
            }
            self.waiting.remove(i);
            let rec = &mut records[sent.id as usize];
            rec.admitted = self.now;
            rec.hit_l1 = adm.l1_pages * ps;
            rec.hit_l2 = adm.l2_pages * ps;
            rec.hit_l3 = adm.l3_pages * ps;
            let cached = prefix * ps;
            rec.computed = prompt.len() - cached;
            load_bytes += adm
                .load_bytes
                .unwrap_or(adm.load_pages() as u64 * config.page_bytes);
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
        convs: &[Conversation],
        compute: &ComputeModel,
        config: &EngineConfig,
        records: &mut [RequestRecord],
        finished: &mut Vec<(Sent, f64)>,
    ) -> Result<()> {
        let mut budget = config.max_prefill_tokens;
        let mut work = 0.0;
        let mut takes = Vec::with_capacity(self.prefilling.len());
        for a in &self.prefilling {
            let take = a.to_compute.min(budget);
            budget -= take;
            work += compute.prefill_compute(a.cached, take);
            takes.push(take);
        }
        if let Some(idx) = self.cache.start_loading().map_err(cache_err)? {
            for layer in 0..config.layers as usize {
                self.cache.wait_layer(idx, layer).map_err(cache_err)?;
            }
        }
        let duration = compute.prefill_step(work, config.layers, load_bytes);
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
                self.finish(a, convs, records, finished)?;
            } else {
                self.decoding.push(a);
            }
        }
        self.prefilling = still;
        Ok(())
    }

    fn decode_step(
        &mut self,
        convs: &[Conversation],
        compute: &ComputeModel,
        records: &mut [RequestRecord],
        finished: &mut Vec<(Sent, f64)>,
    ) -> Result<()> {
        let context: usize = self.decoding.iter().map(|a| a.cached + a.produced).sum();
        let duration = compute.decode_step(context, self.decoding.len());
        self.now += duration;
        self.busy_s += duration;
        let mut still = Vec::with_capacity(self.decoding.len());
        for mut a in std::mem::take(&mut self.decoding) {
            a.produced += 1;
            if a.produced >= convs[a.sent.conversation].answer_len(a.sent.round) {
                self.finish(a, convs, records, finished)?;
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
        convs: &[Conversation],
        records: &mut [RequestRecord],
        finished: &mut Vec<(Sent, f64)>,
    ) -> Result<()> {
        let tokens = convs[a.sent.conversation].with_answer(a.sent.round);
        self.cache
            .cache_finished(a.sent.id, tokens, &a.slots)
            .map_err(cache_err)?;
        records[a.sent.id as usize].finished = self.now;
        finished.push((a.sent, self.now));
        Ok(())
    }

    /// Ends the instance's cache (what is still in flight completes after the run).
    pub fn shutdown(&mut self) -> Result<()> {
        self.cache.shutdown().map_err(cache_err)
    }
}
