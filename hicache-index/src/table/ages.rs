//! Age logs: for each (holder, tier), its holder-blocks in the order they were last stored.
//!
//! A log is a queue of block slots in *batches*, one per `store` call (consecutive calls with
//! nothing stored elsewhere in between share one), each batch tagged with the call's clock, its
//! blocks pushed deepest first. So the front of the log whose front batch has the lowest clock
//! is the holder-block the model evicts first: least recently stored, a chain's tail before
//! its head.
//!
//! The block table keeps no position of a holder-block in its log (that would cost 4 bytes on
//! every holder-block). A log entry's *stamp* is its sequence number in the log; the log's
//! `moved` map records, for the few holder-blocks whose log has more than one entry of their
//! slot (refreshed, or removed while an entry stays), the stamp of the one live entry (or
//! [`DEAD`]). An entry is live when its slot is not in `moved`, or `moved` names its stamp.
//! The log is compacted (live entries kept, `moved` emptied) when its dead entries outnumber
//! the live ones or `moved` grows beyond a quarter of them, so a log never holds more than
//! about twice its live holder-blocks and `moved` stays small.
//!
//! Invariants: a slot not in `moved` appears at most once in `entries`, live; a slot in
//! `moved` with a stamp appears there live at that stamp (its other entries dead), with
//! [`DEAD`] only dead; `live + dead == entries.len()`; the batch lengths sum to
//! `entries.len()`; a stamp is `head_seq + index` (wrapping), unique within the log;
//! `front == batches.front().map(Batch::clock)` (kept in the log's own record, which every
//! call touches anyway: the eviction order is checked after every `store` and `remove`, and
//! reading the front batch itself cost a cache miss per call).

use hashbrown::HashTable;
use std::collections::VecDeque;

/// `moved` value of a slot the log's holder no longer holds.
const DEAD: u32 = u32::MAX;
/// Bits of a batch's length (the clock above them).
const LEN_BITS: u32 = 24;
const MAX_BATCH: u64 = (1 << LEN_BITS) - 1;

/// A batch: the clock of the last `store` call merged into it (above bit 24) and its length.
#[derive(Clone, Copy, Debug)]
struct Batch(u64);

impl Batch {
    fn new(clock: u64, len: u64) -> Self {
        Self(clock << LEN_BITS | len)
    }
    fn clock(self) -> u64 {
        self.0 >> LEN_BITS
    }
    fn len(self) -> u64 {
        self.0 & MAX_BATCH
    }
}

#[inline]
fn slot_hash(slot: u32) -> u64 {
    let m = u128::from(slot) * 0x9E37_79B9_7F4A_7C15_u128;
    (m as u64) ^ ((m >> 64) as u64)
}

/// Slots pushed as new entries during one `store` call, as a 1,024-bit filter: a refresh of a
/// slot whose bit is set searches the call's entries for an earlier (deeper) position.
#[derive(Default)]
pub(crate) struct CallSeen([u64; 16]);

impl CallSeen {
    #[inline]
    fn bit(slot: u32) -> (usize, u64) {
        let i = (slot.wrapping_mul(0x9E37_79B1) >> 22) as usize;
        (i >> 6, 1 << (i & 63))
    }
    #[inline]
    fn set(&mut self, slot: u32) {
        let (w, b) = Self::bit(slot);
        self.0[w] |= b;
    }
    #[inline]
    fn maybe(&self, slot: u32) -> bool {
        let (w, b) = Self::bit(slot);
        self.0[w] & b != 0
    }
}

/// One (holder, tier)'s age log.
#[derive(Debug, Default)]
pub(crate) struct AgeLog {
    entries: VecDeque<u32>,
    batches: VecDeque<Batch>,
    /// Stamp of `entries[0]`.
    head_seq: u32,
    /// (slot, stamp of its live entry or [`DEAD`]) of slots with more than one entry.
    moved: HashTable<(u32, u32)>,
    /// Live entries (holder-blocks of this holder and tier).
    pub(crate) live: u64,
    /// Dead entries.
    dead: u64,
    /// The front clock this log is registered under in the index's eviction order.
    pub(crate) key: Option<u64>,
    /// The clock of the front batch (see the invariants).
    front: Option<u64>,
}

/// Grows a deque by an eighth at least (not doubling): a log's slack stays small.
fn reserve_gently<T>(v: &mut VecDeque<T>) {
    if v.len() == v.capacity() {
        v.reserve_exact((v.capacity() / 8).max(8));
    }
}

impl AgeLog {
    /// Entries pushed so far (live and dead): a mark for [`AgeLog::close_batch`].
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    #[inline]
    fn next_stamp(&self) -> u32 {
        self.head_seq.wrapping_add(self.entries.len() as u32)
    }

    #[inline]
    fn moved_mut(&mut self, slot: u32) -> Option<&mut u32> {
        self.moved
            .find_mut(slot_hash(slot), |e| e.0 == slot)
            .map(|e| &mut e.1)
    }

    fn set_moved(&mut self, slot: u32, stamp: u32) {
        match self.moved_mut(slot) {
            Some(s) => *s = stamp,
            None => {
                self.moved
                    .insert_unique(slot_hash(slot), (slot, stamp), |e| slot_hash(e.0));
            }
        }
    }

    #[inline]
    fn push(&mut self, slot: u32) {
        reserve_gently(&mut self.entries);
        self.entries.push_back(slot);
    }

    /// The holder starts holding `slot`: a new live entry.
    #[inline]
    pub(crate) fn push_new(&mut self, slot: u32, seen: &mut CallSeen) {
        let stamp = self.next_stamp();
        match self.moved_mut(slot) {
            Some(s) => *s = stamp,
            None => seen.set(slot),
        }
        self.push(slot);
        self.live += 1;
    }

    /// The holder, which holds `slot`, stores it again in the call that started when the log
    /// had `before` entries: its entry moves to the back, unless the call stored it already
    /// (deeper in the chain: that position stands).
    #[inline]
    pub(crate) fn refresh(&mut self, slot: u32, before: usize, seen: &CallSeen) {
        let stamp = self.next_stamp();
        let head = self.head_seq;
        match self.moved_mut(slot) {
            Some(s) => {
                if *s != DEAD && s.wrapping_sub(head) as usize >= before {
                    return;
                }
                *s = stamp;
            }
            None => {
                if seen.maybe(slot) && self.entries.range(before..).any(|&e| e == slot) {
                    return;
                }
                self.set_moved(slot, stamp);
            }
        }
        self.push(slot);
        self.dead += 1;
    }

    /// The holder no longer holds `slot` (which it held): its entry dies. The dead entries at
    /// the front go first; when the live entry is then the front one (a holder dropping its
    /// oldest blocks, as an LRU does), it goes too, and `moved` learns nothing.
    #[inline]
    pub(crate) fn remove(&mut self, slot: u32) {
        while let Some(&front) = self.entries.front()
            && !self.is_live(0, front)
        {
            self.pop_front();
        }
        if self.entries.front() == Some(&slot) {
            self.pop_front();
            return;
        }
        self.set_moved(slot, DEAD);
        self.live -= 1;
        self.dead += 1;
    }

    /// Whether the entry at `index` is live.
    #[inline]
    fn is_live(&self, index: usize, slot: u32) -> bool {
        let stamp = self.head_seq.wrapping_add(index as u32);
        match self.moved.find(slot_hash(slot), |e| e.0 == slot) {
            None => true,
            Some(&(_, s)) => s == stamp,
        }
    }

    /// The live slots, oldest first.
    pub(crate) fn live_slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter(|&(i, &slot)| self.is_live(i, slot))
            .map(|(_, &slot)| slot)
    }

    /// Closes the entries pushed since the log had `before` entries as one batch of `clock`.
    pub(crate) fn close_batch(&mut self, before: usize, clock: u64) {
        let mut n = (self.entries.len() - before) as u64;
        if let Some(last) = self.batches.back_mut()
            && last.clock() + 1 == clock
        {
            let add = n.min(MAX_BATCH - last.len());
            *last = Batch::new(clock, last.len() + add);
            n -= add;
            if self.batches.len() == 1 {
                // The merged batch is the front one: its clock moved.
                self.front = Some(clock);
            }
        }
        while n > 0 {
            let add = n.min(MAX_BATCH);
            self.batches.push_back(Batch::new(clock, add));
            n -= add;
            if self.batches.len() == 1 {
                self.front = Some(clock);
            }
        }
        self.check_front();
    }

    /// The front-clock invariant (debug builds).
    #[inline]
    fn check_front(&self) {
        debug_assert_eq!(self.front, self.batches.front().map(|b| b.clock()));
    }

    /// Whether compaction is due.
    #[inline]
    pub(crate) fn wants_compaction(&self) -> bool {
        self.dead > self.live + 64 || self.moved.len() as u64 > self.live / 4 + 64
    }

    /// The clock of the front batch.
    #[inline]
    pub(crate) fn front_clock(&self) -> Option<u64> {
        self.check_front();
        self.front
    }

    /// Pops the front entry: its slot, and whether it was live. `None` when empty.
    pub(crate) fn pop_front(&mut self) -> Option<(u32, bool)> {
        let slot = *self.entries.front()?;
        let stamp = self.head_seq;
        let live = match self.moved.find_entry(slot_hash(slot), |e| e.0 == slot) {
            Err(_) => true,
            Ok(e) if e.get().1 == stamp => {
                e.remove();
                true
            }
            Ok(_) => false,
        };
        self.entries.pop_front();
        self.head_seq = self.head_seq.wrapping_add(1);
        let front = self.batches.front_mut().expect("entries imply a batch");
        *front = Batch::new(front.clock(), front.len() - 1);
        if front.len() == 0 {
            self.batches.pop_front();
            self.front = self.batches.front().map(|b| b.clock());
        }
        if live {
            self.live -= 1;
        } else {
            self.dead -= 1;
        }
        Some((slot, live))
    }

    /// Drops the dead entries and empties `moved`.
    pub(crate) fn compact(&mut self) {
        let mut kept = VecDeque::with_capacity(self.live as usize + self.live as usize / 8);
        let mut batches = VecDeque::new();
        let mut index = 0;
        for b in &self.batches {
            let mut n = 0;
            for _ in 0..b.len() {
                let slot = self.entries[index];
                if self.is_live(index, slot) {
                    kept.push_back(slot);
                    n += 1;
                }
                index += 1;
            }
            if n > 0 {
                batches.push_back(Batch::new(b.clock(), n));
            }
        }
        self.entries = kept;
        self.batches = batches;
        self.front = self.batches.front().map(|b| b.clock());
        self.moved = HashTable::new();
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
        (self.entries.capacity() * size_of::<u32>()
            + self.batches.capacity() * size_of::<Batch>()
            + self.moved.allocation_size()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(log: &AgeLog) -> Vec<u32> {
        log.live_slots().collect()
    }

    #[test]
    fn refreshes_and_removals_leave_one_live_entry_per_slot() {
        let mut log = AgeLog::default();
        let mut seen = CallSeen::default();
        for s in [1, 2, 3] {
            log.push_new(s, &mut seen);
        }
        log.close_batch(0, 1);
        let before = log.len();
        let seen = CallSeen::default();
        log.refresh(1, before, &seen);
        log.close_batch(before, 3);
        assert_eq!(live(&log), [2, 3, 1]);
        log.remove(3);
        assert_eq!(live(&log), [2, 1]);
        assert_eq!(log.len(), 3);
        let mut seen = CallSeen::default();
        let before = log.len();
        log.push_new(3, &mut seen);
        // The same call stores 3 again (shallower): the deeper position stands.
        log.refresh(3, before, &seen);
        log.close_batch(before, 5);
        assert_eq!(live(&log), [2, 1, 3]);
        assert_eq!(log.live, 3);
        let order: Vec<_> = std::iter::from_fn(|| log.pop_front()).collect();
        // (The removal of 3 dropped the dead front entry of 1 already.)
        assert_eq!(order, [(2, true), (3, false), (1, true), (3, true)]);
        assert!(log.moved.is_empty());
        assert_eq!((log.live, log.dead), (0, 0));
    }

    #[test]
    fn dropping_the_oldest_first_leaves_moved_empty() {
        let mut log = AgeLog::default();
        let mut seen = CallSeen::default();
        for s in 0..100 {
            log.push_new(s, &mut seen);
        }
        log.close_batch(0, 1);
        // An LRU's evictions: oldest first.
        for s in 0..60 {
            log.remove(s);
        }
        assert!(log.moved.is_empty());
        assert_eq!((log.len(), log.live, log.dead), (40, 40, 0));
        assert_eq!(live(&log), (60..100).collect::<Vec<_>>());
    }

    #[test]
    fn compaction_keeps_the_live_order_and_empties_moved() {
        let mut log = AgeLog::default();
        let mut seen = CallSeen::default();
        for s in 0..200 {
            log.push_new(s, &mut seen);
        }
        log.close_batch(0, 1);
        let before = log.len();
        let seen = CallSeen::default();
        for s in (0..200).step_by(2) {
            log.refresh(s, before, &seen);
        }
        log.close_batch(before, 3);
        for s in (1..200).step_by(4) {
            log.remove(s);
        }
        assert!(log.wants_compaction());
        let expected = live(&log);
        log.compact();
        assert_eq!(live(&log), expected);
        assert!(log.moved.is_empty());
        assert_eq!(log.len() as u64, log.live);
        assert_eq!(log.front_clock(), Some(1));
    }
}
