//! The slab layout's reclaim pass, run by the shared reclaim thread
//! ([`ReclaimStage`](crate::common::ReclaimStage)). It owns handles to what it changes: the
//! index, the queue of `del` records, the counters and the clock.
//!
//! A pass first removes the expired pages (`ttl_s`), then takes pages out of the index in
//! eviction order, 64 per hold of the index lock, until page bytes are at most the low
//! watermark, and queues a `del` record for each removed page (appended with the next
//! index-log write, as evictions by writes are, or at close). It does no I/O, so batches only
//! ever wait for one chunk's bookkeeping.

use std::sync::Arc;
use std::time::Duration;

use hicache_storage::backend::bump;
use hicache_storage::lifecycle::Clock;
use hicache_storage::{PageKey, StatsCounters};
use parking_lot::Mutex;

use crate::slab::NANOS;
use crate::slab::format::Record;
use crate::slab::index::Index;

/// Pages taken out of the index per hold of its lock.
const CHUNK: usize = 64;

/// The reclaim pass's state. See the [module docs](self).
pub(crate) struct Reclaim {
    /// Pages expire this long after their write.
    pub(crate) ttl: Option<Duration>,
    /// Evict down to this many page bytes (the low watermark), if set.
    pub(crate) low: Option<u64>,
    pub(crate) index: Arc<Mutex<Index>>,
    pub(crate) dels: Arc<Mutex<Vec<Record>>>,
    pub(crate) counters: Arc<StatsCounters>,
    pub(crate) clock: Clock,
}

impl Reclaim {
    /// One pass: expiry, then eviction down to the low watermark.
    pub(crate) fn pass(&self) {
        if self.ttl.is_some() {
            self.expire();
        }
        if let Some(low) = self.low {
            while !self.evict_chunk(low) {}
        }
    }

    /// Removes every expired page and queues its `del`.
    fn expire(&self) {
        let mut ix = self.index.lock();
        let doomed = ix.expired(|w| self.clock.expired(w.saturating_mul(NANOS), self.ttl));
        let mut d = self.dels.lock();
        let mut n = 0;
        for (key, seq) in doomed {
            if ix.remove_version(&key, seq).is_some() {
                n += 1;
                d.push(Record::Del {
                    seq: ix.next_seq(),
                    key,
                });
            }
        }
        bump(&self.counters.expired_pages, n);
    }

    /// Evicts up to [`CHUNK`] pages towards `low`; true once page bytes are at most `low`.
    fn evict_chunk(&self, low: u64) -> bool {
        let mut evicted: Vec<(PageKey, _)> = Vec::new();
        let reached = {
            let mut ix = self.index.lock();
            let reached = ix.evict_down_to(low, CHUNK, &mut evicted);
            let mut d = self.dels.lock();
            for (key, _) in &evicted {
                d.push(Record::Del {
                    seq: ix.next_seq(),
                    key: *key,
                });
            }
            reached
        };
        bump(&self.counters.evicted_pages, evicted.len() as u64);
        bump(
            &self.counters.evicted_bytes,
            evicted.iter().map(|(_, e)| e.meta.len as u64).sum(),
        );
        reached
    }
}
