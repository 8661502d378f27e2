//! The in-memory index: committed pages, slot allocation in the slabs, capacity accounting
//! and eviction. Pure bookkeeping; the disk work it decides on (growing a slab, punching a
//! freed slot) is done through the [`SlabDisk`] it is handed, under the same lock.
//!
//! # Invariants
//! 1. **One owner per slot.** A slot is exactly one of: free (in its class's `free` list,
//!    blocks allocated), punched (in `punched`, a hole), reserved (handed out by
//!    [`Index::reserve`], not yet committed or aborted), committed (an entry's `loc`), or a
//!    zombie (its entry is gone but readers still pin it; it becomes free at the last unpin).
//!    So a slot is never rewritten while a reader of its old page may still be reading it.
//! 2. **Bounded.** `disk` is the bytes of every slot that is not punched (free, reserved,
//!    committed, zombie): the blocks the slabs hold. [`Index::reserve`] never lets it exceed
//!    the capacity; it makes room by punching free slots of other classes first, then by
//!    evicting committed pages in the evictor's order.
//! 3. **Evictor in step.** The evictor tracks exactly the keys of `entries`.

use std::collections::{HashMap, HashSet};
use std::io;

use crate::common::PageCount;
use hicache_storage::{EvictionPolicy, Evictor, PageKey, PageMeta};

/// Where a page lives: a slot of a class's slab.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    /// Index of the size class (its slab).
    pub class: u16,
    /// Slot index in the slab.
    pub slot: u32,
}

/// A committed page.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its slot.
    pub loc: Loc,
    /// Layout and length.
    pub meta: PageMeta,
    /// XXH3-64 of its bytes.
    pub sum: u64,
    /// Commit sequence number (identifies this version of the key).
    pub seq: u64,
    /// When it was written, Unix seconds (for a page whose record has none: the open time).
    pub written: u64,
}

/// The disk operations the index asks for while it holds its lock.
pub trait SlabDisk {
    /// Allocates blocks for slots `from..to` of `class` (extending the slab file), or for as
    /// many of them as the file system has room for; returns the end of the slots allocated
    /// (greater than `from`). With no room for one slot it fails with `ENOSPC` and leaves the
    /// slab as it was (no partial allocation left behind).
    fn grow(&self, class: u16, from: u32, to: u32) -> io::Result<u32>;
    /// Releases the blocks of `slot` of `class` (a hole; the file keeps its size).
    fn punch(&self, class: u16, slot: u32);
}

#[derive(Debug, Default)]
struct Class {
    slot_bytes: u64,
    /// Slots `0..next` exist in the file.
    next: u32,
    free: Vec<u32>,
    punched: Vec<u32>,
}

/// Why a reservation failed.
#[derive(Debug)]
pub enum ReserveError {
    /// Nothing left to evict or punch: everything is reserved or pinned.
    NoSpace,
    /// Growing the slab failed.
    Io(io::Error),
}

/// The index. See the [module documentation](self).
pub struct Index {
    capacity: u64,
    grow_bytes: u64,
    disk: u64,
    data_bytes: u64,
    entries: HashMap<PageKey, Entry>,
    evictor: Box<dyn Evictor<PageKey>>,
    classes: Vec<Class>,
    pins: HashMap<Loc, u32>,
    zombies: HashSet<Loc>,
    restoring: HashSet<Loc>,
    next_seq: u64,
}

impl Index {
    /// An empty index bounded by `capacity` bytes of slots; slabs grow by about `grow_bytes`.
    pub fn new(capacity: u64, grow_bytes: u64, policy: EvictionPolicy, next_seq: u64) -> Self {
        Self {
            capacity,
            grow_bytes,
            disk: 0,
            data_bytes: 0,
            entries: HashMap::new(),
            evictor: policy.build(),
            classes: Vec::new(),
            pins: HashMap::new(),
            zombies: HashSet::new(),
            restoring: HashSet::new(),
            next_seq,
        }
    }

    /// Adds a size class (in class-id order) whose slab holds `file_slots` slots, all free.
    /// At open, add every class, [`restore`](Self::restore) the pages, then
    /// [`finish_restore`](Self::finish_restore).
    pub fn add_class(&mut self, slot_bytes: u64, file_slots: u32) -> u16 {
        let id = self.classes.len() as u16;
        self.classes.push(Class {
            slot_bytes,
            next: file_slots,
            free: (0..file_slots).rev().collect(),
            punched: Vec::new(),
        });
        self.disk += file_slots as u64 * slot_bytes;
        id
    }

    /// Number of classes.
    pub fn classes(&self) -> usize {
        self.classes.len()
    }

    /// Slot size of `class`.
    pub fn slot_bytes(&self, class: u16) -> u64 {
        self.classes[class as usize].slot_bytes
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of slots holding blocks (free, reserved, committed, zombie).
    pub fn disk_bytes(&self) -> u64 {
        self.disk
    }

    /// Page bytes of committed pages.
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }

    /// Committed pages.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no page is committed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A new sequence number.
    pub fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// The entry of `key`.
    pub fn get(&self, key: &PageKey) -> Option<&Entry> {
        self.entries.get(key)
    }

    /// Whether `key` is committed.
    pub fn contains(&self, key: &PageKey) -> bool {
        self.entries.contains_key(key)
    }

    /// Records a use of `key`.
    pub fn touch(&mut self, key: &PageKey) {
        self.evictor.touch(key);
    }

    /// Every entry, oldest commit first (for a compacted log).
    pub fn entries_by_seq(&self) -> Vec<(PageKey, Entry)> {
        let mut v: Vec<(PageKey, Entry)> = self.entries.iter().map(|(k, e)| (*k, *e)).collect();
        v.sort_by_key(|(_, e)| e.seq);
        v
    }

    /// The keys and versions (`seq`) of the pages `expired` says yes to, given their write
    /// time (for the reclaim pass; remove them with [`remove_version`](Self::remove_version)).
    pub fn expired(&self, expired: impl Fn(u64) -> bool) -> Vec<(PageKey, u64)> {
        self.entries
            .iter()
            .filter(|(_, e)| expired(e.written))
            .map(|(k, e)| (*k, e.seq))
            .collect()
    }

    /// Reserves a slot of `class`, making room as needed. Evicted pages are appended to
    /// `evicted`.
    pub fn reserve(
        &mut self,
        class: u16,
        disk: &impl SlabDisk,
        evicted: &mut Vec<(PageKey, Entry)>,
    ) -> Result<Loc, ReserveError> {
        let c = class as usize;
        let b = self.classes[c].slot_bytes;
        loop {
            if let Some(slot) = self.classes[c].free.pop() {
                return Ok(Loc { class, slot });
            }
            if self.disk + b <= self.capacity {
                if let Some(slot) = self.classes[c].punched.pop() {
                    self.disk += b;
                    return Ok(Loc { class, slot });
                }
                // Extend the slab by up to `grow_bytes`, within the capacity.
                let room = (self.capacity - self.disk) / b;
                let step = (self.grow_bytes / b).clamp(1, room.max(1));
                let from = self.classes[c].next;
                let to = u32::try_from(from as u64 + step).map_err(|_| {
                    ReserveError::Io(io::Error::other("slab has 2^32 slots already"))
                })?;
                let to = match disk.grow(class, from, to) {
                    Ok(to) => to,
                    Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                        // The file system is full below the capacity: the capacity becomes
                        // what the slabs hold, and room comes from eviction from now on.
                        tracing::warn!(
                            capacity = self.capacity,
                            on_disk = self.disk,
                            "uring backend: file system full below the capacity; capacity \
                             lowered to the slabs' size, evicting to make room"
                        );
                        self.capacity = self.disk;
                        continue;
                    }
                    Err(e) => return Err(ReserveError::Io(e)),
                };
                let step = u64::from(to - from);
                let cl = &mut self.classes[c];
                cl.next = to;
                cl.free.extend((from + 1..to).rev());
                self.disk += step * b;
                return Ok(Loc { class, slot: from });
            }
            // Room first from idle blocks of other classes, then from committed pages.
            if let Some(d) = (0..self.classes.len()).find(|&d| !self.classes[d].free.is_empty()) {
                let cl = &mut self.classes[d];
                let slot = cl.free.pop().expect("checked non-empty");
                disk.punch(d as u16, slot);
                cl.punched.push(slot);
                self.disk -= cl.slot_bytes;
                continue;
            }
            match self.evictor.pop_victim() {
                Some(k) => {
                    let e = self.entries.remove(&k).expect("invariant 3");
                    self.data_bytes -= e.meta.len as u64;
                    self.free(e.loc);
                    evicted.push((k, e));
                }
                None => return Err(ReserveError::NoSpace),
            }
        }
    }

    /// Returns a reserved slot that was not committed.
    pub fn abort(&mut self, loc: Loc) {
        self.free(loc);
    }

    /// Commits `key` at the reserved `loc`; returns the entry it replaced (whose slot is
    /// freed).
    pub fn commit(&mut self, key: PageKey, entry: Entry) -> Option<Entry> {
        let old = self.entries.insert(key, entry);
        self.data_bytes += entry.meta.len as u64;
        if let Some(o) = &old {
            self.data_bytes -= o.meta.len as u64;
            self.free(o.loc);
        }
        self.evictor.insert(key);
        old
    }

    /// Removes `key`; its slot is freed (or becomes a zombie while pinned).
    pub fn remove(&mut self, key: &PageKey) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        self.evictor.remove(key);
        self.data_bytes -= e.meta.len as u64;
        self.free(e.loc);
        Some(e)
    }

    /// Background eviction: removes pages in the evictor's order (their slots freed, or
    /// zombies while pinned), at most `max` of them, while page bytes exceed `target`;
    /// appends them to `evicted`. Returns whether page bytes are now at most `target`.
    pub fn evict_down_to(
        &mut self,
        target: u64,
        max: usize,
        evicted: &mut Vec<(PageKey, Entry)>,
    ) -> bool {
        let mut n = 0;
        while self.data_bytes > target {
            if n == max {
                return false;
            }
            let Some(k) = self.evictor.pop_victim() else {
                return true;
            };
            let e = self.entries.remove(&k).expect("invariant 3");
            self.data_bytes -= e.meta.len as u64;
            self.free(e.loc);
            evicted.push((k, e));
            n += 1;
        }
        true
    }

    /// Removes `key` only if its current version is `seq`.
    pub fn remove_version(&mut self, key: &PageKey, seq: u64) -> Option<Entry> {
        if self.entries.get(key).is_some_and(|e| e.seq == seq) {
            self.remove(key)
        } else {
            None
        }
    }

    /// Keeps `loc` from being reused until [`unpin`](Self::unpin).
    pub fn pin(&mut self, loc: Loc) {
        *self.pins.entry(loc).or_insert(0) += 1;
    }

    /// Ends one pin of `loc`; a zombie slot is freed at its last unpin.
    pub fn unpin(&mut self, loc: Loc) {
        if let Some(n) = self.pins.get_mut(&loc) {
            *n -= 1;
            if *n == 0 {
                self.pins.remove(&loc);
                if self.zombies.remove(&loc) {
                    self.classes[loc.class as usize].free.push(loc.slot);
                }
            }
        }
    }

    fn free(&mut self, loc: Loc) {
        if self.pins.contains_key(&loc) {
            self.zombies.insert(loc);
        } else {
            self.classes[loc.class as usize].free.push(loc.slot);
        }
    }

    /// Restores a page at open (pages in commit order, before
    /// [`finish_restore`](Self::finish_restore)). Returns false, ignoring it, if its slot lies
    /// outside its slab or is taken.
    pub fn restore(&mut self, key: PageKey, entry: Entry) -> bool {
        let Some(cl) = self.classes.get(entry.loc.class as usize) else {
            return false;
        };
        if entry.loc.slot >= cl.next || !self.restoring.insert(entry.loc) {
            return false;
        }
        self.next_seq = self.next_seq.max(entry.seq);
        if let Some(old) = self.entries.insert(key, entry) {
            self.restoring.remove(&old.loc);
            self.data_bytes -= old.meta.len as u64;
            self.evictor.remove(&key);
        }
        self.data_bytes += entry.meta.len as u64;
        self.evictor.insert(key);
        true
    }

    /// Ends a restore: every slot not taken by a restored page is free, lowest first.
    pub fn finish_restore(&mut self) {
        let taken = std::mem::take(&mut self.restoring);
        for (ci, c) in self.classes.iter_mut().enumerate() {
            c.free = (0..c.next)
                .rev()
                .filter(|s| {
                    !taken.contains(&Loc {
                        class: ci as u16,
                        slot: *s,
                    })
                })
                .collect();
        }
    }

    /// Brings the disk use within the capacity after a restore (the capacity may have been
    /// lowered): punches free slots, then evicts. Returns the evicted pages.
    pub fn fit(&mut self, disk: &impl SlabDisk) -> Vec<(PageKey, Entry)> {
        let mut evicted = Vec::new();
        while self.disk > self.capacity {
            if let Some(d) = (0..self.classes.len()).find(|&d| !self.classes[d].free.is_empty()) {
                let cl = &mut self.classes[d];
                let slot = cl.free.pop().expect("checked non-empty");
                disk.punch(d as u16, slot);
                cl.punched.push(slot);
                self.disk -= cl.slot_bytes;
                continue;
            }
            match self.evictor.pop_victim() {
                Some(k) => {
                    let e = self.entries.remove(&k).expect("invariant 3");
                    self.data_bytes -= e.meta.len as u64;
                    self.free(e.loc);
                    evicted.push((k, e));
                }
                None => break,
            }
        }
        evicted
    }
}

impl PageCount for Index {
    fn bytes(&self) -> u64 {
        self.data_bytes
    }

    fn pages(&self) -> u64 {
        self.entries.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_storage::LayoutKind;
    use hicache_storage::pattern::{namespace, page_key};
    use proptest::prelude::*;
    use std::cell::RefCell;

    #[derive(Default)]
    struct FakeDisk {
        punched: RefCell<Vec<(u16, u32)>>,
        grown: RefCell<Vec<(u16, u32, u32)>>,
    }

    impl SlabDisk for FakeDisk {
        fn grow(&self, class: u16, from: u32, to: u32) -> io::Result<u32> {
            self.grown.borrow_mut().push((class, from, to));
            Ok(to)
        }
        fn punch(&self, class: u16, slot: u32) {
            self.punched.borrow_mut().push((class, slot));
        }
    }

    fn entry(loc: Loc, len: usize, seq: u64) -> Entry {
        Entry {
            loc,
            meta: PageMeta {
                layout: LayoutKind::PageFirst,
                len,
            },
            sum: 0,
            seq,
            written: 0,
        }
    }

    #[test]
    fn evicts_oldest_and_punches_idle_classes_first() {
        let disk = FakeDisk::default();
        let mut ix = Index::new(4 * 4096, 1 << 20, EvictionPolicy::Lru, 0);
        let small = ix.add_class(4096, 0);
        let big = ix.add_class(8192, 0);
        let mut ev = Vec::new();
        let keys: Vec<PageKey> = (0..8).map(|i| page_key(namespace(1), 0, i)).collect();
        for (i, k) in keys[..4].iter().enumerate() {
            let loc = ix.reserve(small, &disk, &mut ev).unwrap();
            ix.commit(*k, entry(loc, 4096, i as u64));
        }
        assert!(ev.is_empty());
        assert_eq!(ix.disk_bytes(), 4 * 4096);
        ix.touch(&keys[0]);
        // An 8 KiB page needs two 4 KiB slots' worth: evicts keys 1 and 2 (LRU), punching them.
        let loc = ix.reserve(big, &disk, &mut ev).unwrap();
        let victims: Vec<PageKey> = ev.iter().map(|(k, _)| *k).collect();
        assert_eq!(victims, vec![keys[1], keys[2]]);
        assert_eq!(disk.punched.borrow().len(), 2);
        ix.commit(keys[4], entry(loc, 8000, 9));
        assert!(ix.disk_bytes() <= ix.capacity());
        assert_eq!(ix.data_bytes(), 2 * 4096 + 8000);
    }

    #[test]
    fn pinned_slots_are_not_reused_until_unpinned() {
        let disk = FakeDisk::default();
        let mut ix = Index::new(4096, 4096, EvictionPolicy::Lru, 0);
        let c = ix.add_class(4096, 0);
        let mut ev = Vec::new();
        let a = page_key(namespace(1), 0, 1);
        let loc = ix.reserve(c, &disk, &mut ev).unwrap();
        ix.commit(a, entry(loc, 4096, 1));
        ix.pin(loc);
        assert!(ix.remove(&a).is_some());
        assert!(matches!(
            ix.reserve(c, &disk, &mut ev),
            Err(ReserveError::NoSpace)
        ));
        ix.unpin(loc);
        assert_eq!(ix.reserve(c, &disk, &mut ev).unwrap(), loc);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(u8, u8),
        Del(u8),
        Pin(u8),
        UnpinAll,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..24, 1u8..4).prop_map(|(k, c)| Op::Set(k, c)),
            1 => (0u8..24).prop_map(Op::Del),
            1 => (0u8..24).prop_map(Op::Pin),
            1 => Just(Op::UnpinAll),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// Slots are never shared, the disk use stays within capacity and matches the slots
        /// that hold blocks, and the accounting matches a naive model of the live pages.
        #[test]
        fn slots_unique_and_within_capacity(ops in proptest::collection::vec(op(), 0..300)) {
            let disk = FakeDisk::default();
            let cap = 10 * 4096;
            let mut ix = Index::new(cap, 3 * 4096, EvictionPolicy::Lru, 0);
            for b in [4096u64, 8192, 12288] {
                ix.add_class(b, 0);
            }
            let mut model: HashMap<PageKey, usize> = HashMap::new();
            let mut pinned: Vec<Loc> = Vec::new();
            for op in ops {
                match op {
                    Op::Set(k, c) => {
                        let key = page_key(namespace(1), 0, k as u64);
                        let mut ev = Vec::new();
                        let class = c as u16 - 1;
                        let len = 4096 * c as usize - 100;
                        let r = ix.reserve(class, &disk, &mut ev);
                        for (k, _) in ev {
                            model.remove(&k);
                        }
                        match r {
                            Ok(loc) => {
                                let seq = ix.next_seq();
                                ix.commit(key, entry(loc, len, seq));
                                model.insert(key, len);
                            }
                            Err(ReserveError::NoSpace) => prop_assert!(!pinned.is_empty()),
                            Err(ReserveError::Io(e)) => panic!("{e}"),
                        }
                    }
                    Op::Del(k) => {
                        let key = page_key(namespace(1), 0, k as u64);
                        prop_assert_eq!(ix.remove(&key).is_some(), model.remove(&key).is_some());
                    }
                    Op::Pin(k) => {
                        if let Some(e) = ix.get(&page_key(namespace(1), 0, k as u64)) {
                            let loc = e.loc;
                            ix.pin(loc);
                            pinned.push(loc);
                        }
                    }
                    Op::UnpinAll => {
                        for l in pinned.drain(..) {
                            ix.unpin(l);
                        }
                    }
                }
                prop_assert!(ix.disk_bytes() <= cap);
                prop_assert_eq!(ix.len(), model.len());
                prop_assert_eq!(ix.data_bytes(), model.values().map(|v| *v as u64).sum::<u64>());
                let mut seen = HashSet::new();
                let mut held = 0u64;
                for (ci, c) in ix.classes.iter().enumerate() {
                    for s in c.free.iter().chain(&c.punched) {
                        prop_assert!(seen.insert((ci as u16, *s)), "slot listed twice");
                    }
                    held += (c.next as u64 - c.punched.len() as u64) * c.slot_bytes;
                }
                for e in ix.entries.values() {
                    prop_assert!(seen.insert((e.loc.class, e.loc.slot)), "slot shared");
                }
                for z in &ix.zombies {
                    prop_assert!(seen.insert((z.class, z.slot)), "zombie shared");
                }
                prop_assert_eq!(held, ix.disk_bytes());
                let total: u64 = ix.classes.iter().map(|c| c.next as u64).sum();
                prop_assert_eq!(seen.len() as u64, total, "every slot accounted for");
            }
        }
    }
}
