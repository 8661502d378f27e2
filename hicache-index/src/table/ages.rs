//! Age logs: for each (holder, tier), its holder-blocks in the order they were last stored.
//!
//! A log is a queue of block slots in *batches*, one per `store` call (consecutive calls with
//! nothing stored elsewhere in between share one), each batch tagged with the call's clock, its
//! blocks pushed deepest first. So the front of the log whose front batch has the lowest clock
//! is the holder-block the model evicts first: least recently stored, a chain's tail before
//! its head. A holder-block's entry in the block table carries the *stamp* (sequence number in
//! its log) of its one live log entry; a refresh or a removal turns the old log entry into a
//! tombstone, and the log is compacted (live entries renumbered) when tombstones outnumber the
//! live entries, so a log never holds more than about twice its live holder-blocks.
//!
//! Invariants: a log entry that is not [`TOMBSTONE`] is live, and its block's entry for the
//! log's `ht` has the entry's stamp; `live + dead == entries.len()`; the batch lengths sum to
//! `entries.len()`; a stamp is `head_seq + index` (wrapping), unique within the log.

use std::collections::VecDeque;

/// A log entry whose holder-block was refreshed or removed since.
pub(crate) const TOMBSTONE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Batch {
    /// The clock of the last `store` call merged into the batch.
    pub(crate) clock: u64,
    pub(crate) len: u32,
}

/// One (holder, tier)'s age log.
#[derive(Debug, Default)]
pub(crate) struct AgeLog {
    pub(crate) entries: VecDeque<u32>,
    pub(crate) batches: VecDeque<Batch>,
    /// Stamp of `entries[0]`.
    pub(crate) head_seq: u32,
    /// Live entries (holder-blocks of this holder and tier).
    pub(crate) live: u64,
    /// Tombstones.
    pub(crate) dead: u64,
    /// The front clock this log is registered under in the index's eviction order.
    pub(crate) key: Option<u64>,
}

impl AgeLog {
    /// The stamp the next pushed entry gets.
    #[inline]
    pub(crate) fn next_stamp(&self) -> u32 {
        self.head_seq.wrapping_add(self.entries.len() as u32)
    }

    /// Index in `entries` of a stamp of this log.
    #[inline]
    pub(crate) fn index_of(&self, stamp: u32) -> usize {
        stamp.wrapping_sub(self.head_seq) as usize
    }

    /// Appends `slot` as a live entry; returns its stamp.
    #[inline]
    pub(crate) fn push(&mut self, slot: u32) -> u32 {
        let stamp = self.next_stamp();
        self.entries.push_back(slot);
        self.live += 1;
        stamp
    }

    /// Closes the entries pushed since the log had `before` entries as one batch of `clock`.
    pub(crate) fn close_batch(&mut self, before: usize, clock: u64) {
        let n = (self.entries.len() - before) as u32;
        if n == 0 {
            return;
        }
        match self.batches.back_mut() {
            Some(last) if last.clock + 1 == clock => {
                last.clock = clock;
                last.len += n;
            }
            _ => self.batches.push_back(Batch { clock, len: n }),
        }
    }

    /// Turns the live entry with `stamp` into a tombstone.
    #[inline]
    pub(crate) fn kill(&mut self, stamp: u32) {
        let i = self.index_of(stamp);
        debug_assert_ne!(self.entries[i], TOMBSTONE);
        self.entries[i] = TOMBSTONE;
        self.live -= 1;
        self.dead += 1;
    }

    /// Whether compaction is due.
    #[inline]
    pub(crate) fn wants_compaction(&self) -> bool {
        self.dead > self.live + 64
    }

    /// The clock of the front batch.
    #[inline]
    pub(crate) fn front_clock(&self) -> Option<u64> {
        self.batches.front().map(|b| b.clock)
    }

    /// Pops the front entry (tombstone or live); `None` when empty.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let slot = self.entries.pop_front()?;
        self.head_seq = self.head_seq.wrapping_add(1);
        let front = self.batches.front_mut().expect("entries imply a batch");
        front.len -= 1;
        if front.len == 0 {
            self.batches.pop_front();
        }
        if slot == TOMBSTONE {
            self.dead -= 1;
        } else {
            self.live -= 1;
        }
        Some(slot)
    }

    /// Drops the tombstones, renumbering the live entries from `head_seq`; `restamp(slot,
    /// stamp)` is called for each live entry with its new stamp.
    pub(crate) fn compact(&mut self, mut restamp: impl FnMut(u32, u32)) {
        let mut kept = VecDeque::with_capacity(self.live as usize);
        let mut batches = VecDeque::new();
        let mut entries = self.entries.iter();
        for b in &self.batches {
            let mut n = 0;
            for &slot in entries.by_ref().take(b.len as usize) {
                if slot != TOMBSTONE {
                    restamp(slot, self.head_seq.wrapping_add(kept.len() as u32));
                    kept.push_back(slot);
                    n += 1;
                }
            }
            if n > 0 {
                batches.push_back(Batch {
                    clock: b.clock,
                    len: n,
                });
            }
        }
        self.entries = kept;
        self.batches = batches;
        self.dead = 0;
    }

    /// Empties the log, releasing its memory.
    pub(crate) fn reset(&mut self) {
        let (head_seq, key) = (self.head_seq, self.key);
        *self = Self::default();
        (self.head_seq, self.key) = (head_seq, key);
    }

    /// Bytes allocated.
    pub(crate) fn bytes(&self) -> u64 {
        (self.entries.capacity() * size_of::<u32>() + self.batches.capacity() * size_of::<Batch>())
            as u64
    }
}
