//! One engine of the fleet: its own `hicache::HiCache` under the scheduler of
//! [`crate::engine`] ([`Scheduler`]: the same loop and rules as the single-engine run),
//! driven step by step on the fleet's clock and fed by the router instead of a workload.

use crate::adapter::HiCacheUnderTest;
use crate::cache::CacheUnderTest;
use crate::engine::{EngineConfig, RequestRecord, Scheduler, Step};
use crate::error::{Result, SimError};
use crate::model::ComputeModel;
use crate::trace::Conversation;
use crate::workload::Sent;

/// One simulated engine with its own `hicache::HiCache`.
pub struct Instance {
    /// The cache (its KV events feed the fleet's index).
    pub cache: HiCacheUnderTest,
    /// Its scheduler (load figures: [`Scheduler::queued_prefill_tokens`] and the like).
    pub sched: Scheduler,
}

impl Instance {
    /// An idle instance over `cache`.
    pub fn new(
        cache: HiCacheUnderTest,
        compute: &ComputeModel,
        config: &EngineConfig,
    ) -> Result<Self> {
        let sched = Scheduler::new(&cache, compute, config, false)?;
        Ok(Self { cache, sched })
    }

    /// `sent` arrives (routed here) at `sent.time`; its record is `rec`.
    pub fn arrive(
        &mut self,
        sent: Sent,
        convs: &[Conversation],
        rec: &mut RequestRecord,
    ) -> Result<()> {
        self.sched.arrive(sent, convs, &mut self.cache, rec)
    }

    /// One iteration of the loop at time `max(now, at)`; returns when the instance next has
    /// something to do (`None`: nothing until a request arrives). Finished requests are
    /// appended to `finished` with their finish time; `records` is indexed by request id.
    pub fn step(
        &mut self,
        at: f64,
        convs: &[Conversation],
        records: &mut [RequestRecord],
        finished: &mut Vec<(Sent, f64)>,
    ) -> Result<Option<f64>> {
        self.sched.advance_to(at, &mut self.cache)?;
        Ok(
            match self.sched.step(&mut self.cache, convs, records, finished)? {
                Step::Ran => Some(self.sched.now()),
                Step::WaitUntil(t) => Some(t),
                Step::Idle if self.sched.waiting() == 0 => None,
                Step::Idle => Some(self.sched.next_event(&self.cache).ok_or_else(|| {
                    SimError::Cache(format!(
                        "an instance stalled at {:.3} s with {} requests waiting and none \
                         running",
                        self.sched.now(),
                        self.sched.waiting()
                    ))
                })?),
            },
        )
    }

    /// Ends the instance's cache (what is still in flight completes after the run).
    pub fn shutdown(&mut self) -> Result<()> {
        self.cache.shutdown().map_err(|e| SimError::Cache(e.0))
    }
}
