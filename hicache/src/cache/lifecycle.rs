//! The per-tick pump ([`HiCache::poll`]), the load launch of a tick
//! ([`HiCache::start_loading`]) and the cache's lifecycle (drain, flush, shutdown).

use std::time::Duration;

use super::HiCache;
use crate::error::{HiCacheError, Result};
use crate::tick::{InFlight, PollReport, TickCounts, TickParts};

/// Pause between polls while draining.
const DRAIN_PAUSE: Duration = Duration::from_micros(100);

impl HiCache {
    /// The per-tick pump; call it once per scheduler iteration, before scheduling: finishes
    /// the copies and L3 operations that completed on every rank, advances prefetches per
    /// policy, and launches the D2H batch of the nodes that became due since the last poll.
    pub fn poll(&mut self) -> Result<PollReport> {
        self.check_open()?;
        self.poll_inner()
    }

    /// What is in flight now (see [`InFlight`]); L3 work queued for the tick's flush is
    /// handed to the runtime first, so it is in flight.
    pub fn in_flight(&self) -> Result<InFlight> {
        if let Some(l3) = &self.l3 {
            l3.flush();
        }
        InFlight::of(&self.copies, self.l3.as_ref())
    }

    #[tracing::instrument(level = "trace", skip_all)]
    fn poll_inner(&mut self) -> Result<PollReport> {
        if let Some(l3) = &mut self.l3 {
            // L3 work queued since the last flush (arrivals after `start_loading`) is handed
            // over; this tick's lookups wait for `start_loading`.
            l3.begin_scheduling();
            l3.collect_leftovers(false, &self.tiers)?;
        }
        let scratch = std::mem::take(&mut self.tick_scratch);
        let agreed = TickCounts::gather(&self.copies, self.l3.as_ref(), &self.tiers, scratch)?
            .agree(&*self.rank)?;
        let report = agreed.apply(TickParts {
            tiers: &mut self.tiers,
            copies: &mut self.copies,
            l3: self.l3.as_mut(),
            requests: &mut self.requests,
            events: &mut self.events,
        });
        self.tick_scratch = agreed.into_scratch();
        let report = report?;
        self.tiers.refresh_gauges();
        self.publish_events();
        Ok(report)
    }

    /// Launches the H2D copies of every load-back admitted since the last call as one batch,
    /// layer by layer with an event per layer, and publishes it to the layer counter.
    /// Returns the producer id the engine passes to `LayerDoneCounter::set_consumer`, or
    /// `None` when nothing is to be loaded.
    pub fn start_loading(&mut self) -> Result<Option<usize>> {
        self.check_open()?;
        let producer = self.copies.start_loading()?;
        if let Some(l3) = &self.l3 {
            // The tick's L3 work (this poll's backups, this tick's lookups) in one hand-off.
            l3.end_scheduling();
        }
        Ok(producer)
    }

    /// Whether anything is in flight (copies, L3 operations, due writes).
    pub fn busy(&self) -> bool {
        self.copies.busy()
            || self
                .l3
                .as_ref()
                .is_some_and(|l| l.backups_in_flight() > 0 || l.has_prefetches())
    }

    /// Polls until nothing is in flight except prefetches of live requests: every due write
    /// is launched and finished, every L3 backup finished. Every rank must call it together.
    pub fn drain(&mut self) -> Result<()> {
        self.check_open()?;
        loop {
            self.poll_inner()?;
            let pending = self.copies.writing_or_loading()
                || self.l3.as_ref().is_some_and(|l| l.backups_in_flight() > 0);
            if !pending {
                return Ok(());
            }
            std::thread::sleep(DRAIN_PAUSE);
        }
    }

    /// Drops every cached page in L1 and L2 (SGLang's `flush_cache`; L3 is kept). Idle only:
    /// no live requests; in-flight copies are drained first.
    pub fn flush(&mut self) -> Result<()> {
        self.check_open()?;
        if !self.requests.is_empty() {
            return Err(HiCacheError::NotIdle(format!(
                "cannot flush: {} live requests",
                self.requests.len()
            )));
        }
        if self.copies.has_queued_loads() {
            self.start_loading()?;
        }
        self.drain()?;
        self.tiers.reset()?;
        // Pages handed back by prefetch tasks go to the pool only: a task stuck in its
        // backend keeps its pages on one rank, and the budget stays what every rank has.
        if let Some(l3) = &mut self.l3 {
            l3.collect_leftovers(true, &self.tiers)?;
        }
        self.events.push(hicache_core::KvEvent::AllBlocksCleared);
        Ok(())
    }

    /// Graceful shutdown: launches and finishes every due write, waits for every L3 backup
    /// (nothing acknowledged is lost), revokes prefetches, detaches L3. Afterwards every call
    /// returns [`HiCacheError::Closed`]. Calling it twice is an error.
    pub fn shutdown(&mut self) -> Result<()> {
        self.check_open()?;
        if self.copies.has_queued_loads() {
            self.start_loading()?;
        }
        self.drain()?;
        self.detach_l3()?;
        self.closed = true;
        Ok(())
    }
}
