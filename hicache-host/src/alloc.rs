//! [`PageAllocator`]: a free list of page indices with double-free detection, shared by the
//! host pool ([`HostSlot`]) and the device pool ([`DeviceSlot`], `hicache-gpu`); both slot types
//! are `hicache-core`'s.
//!
//! Invariants (checked by the property tests against a naive model):
//! 1. Every page index in `0..capacity` is either allocated (its `used` bit set) or in exactly
//!    one of `free` / `released`, never both.
//! 2. `alloc(n)` returns `n` distinct free pages or `None` (nothing changes then).
//! 3. `free(slots)` is all-or-nothing: an out-of-range, unallocated or repeated slot fails the
//!    whole call with a typed error and changes nothing.
//! 4. Fresh pools hand out ascending pages (`0, 1, 2, …`), and released pages are merged back
//!    sorted when the free list runs short, so allocations stay mostly contiguous: the direct
//!    transfer path coalesces contiguous runs into single copies.

use std::fmt;
use std::marker::PhantomData;

use crate::error::AllocError;

/// A typed page index (host or device page).
pub trait Slot: Copy + Eq + Ord + std::hash::Hash + fmt::Debug + Send + Sync + 'static {
    /// The slot for page `index`.
    fn from_index(index: u32) -> Self;
    /// The page index.
    fn index(self) -> u32;
}

use hicache_core::DeviceSlot;
pub use hicache_core::HostSlot;

impl Slot for HostSlot {
    fn from_index(index: u32) -> Self {
        HostSlot(index)
    }
    fn index(self) -> u32 {
        self.0
    }
}

impl Slot for DeviceSlot {
    fn from_index(index: u32) -> Self {
        DeviceSlot(index)
    }
    fn index(self) -> u32 {
        self.0
    }
}

/// A free list of pages `0..capacity` (see the module invariants).
pub struct PageAllocator<S: Slot> {
    capacity: usize,
    /// Free pages, descending, so `pop()` yields the smallest.
    free: Vec<u32>,
    /// Pages freed since the last merge, in free order.
    released: Vec<u32>,
    /// One bit per page: allocated.
    used: Vec<u64>,
    _slot: PhantomData<S>,
}

impl<S: Slot> fmt::Debug for PageAllocator<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageAllocator")
            .field("capacity", &self.capacity)
            .field("available", &self.available())
            .finish()
    }
}

impl<S: Slot> PageAllocator<S> {
    /// An allocator of pages `0..capacity`, all free. `capacity` is clamped to `u32::MAX`
    /// pages (page indices are 32-bit).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.min(u32::MAX as usize);
        Self {
            capacity,
            free: (0..capacity as u32).rev().collect(),
            released: Vec::new(),
            used: vec![0; capacity.div_ceil(64)],
            _slot: PhantomData,
        }
    }

    /// Pages managed.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Pages free now.
    pub fn available(&self) -> usize {
        self.free.len() + self.released.len()
    }

    /// Whether `slot` is allocated now (false for out-of-range slots).
    pub fn is_allocated(&self, slot: S) -> bool {
        let i = slot.index() as usize;
        i < self.capacity && self.bit(i)
    }

    /// `n` distinct free pages, or `None` when fewer than `n` are free (nothing changes then).
    pub fn alloc(&mut self, n: usize) -> Option<Vec<S>> {
        if n > self.available() {
            return None;
        }
        if n > self.free.len() {
            self.merge_released();
        }
        let at = self.free.len() - n;
        // free is descending: the tail holds the n smallest, reversed gives ascending.
        let taken: Vec<u32> = self.free.drain(at..).rev().collect();
        for &i in &taken {
            self.set_bit(i as usize, true);
        }
        Some(taken.into_iter().map(S::from_index).collect())
    }

    /// Frees `slots`; all-or-nothing (invariant 3).
    pub fn free(&mut self, slots: &[S]) -> Result<(), AllocError> {
        for (k, s) in slots.iter().enumerate() {
            let i = s.index() as usize;
            let err = if i >= self.capacity {
                Some(AllocError::OutOfRange {
                    slot: s.index(),
                    capacity: self.capacity,
                })
            } else if !self.bit(i) {
                Some(AllocError::DoubleFree { slot: s.index() })
            } else {
                None
            };
            if let Some(e) = err {
                // Undo: the slots before k were allocated (their bits were cleared here).
                for s in &slots[..k] {
                    self.set_bit(s.index() as usize, true);
                }
                return Err(e);
            }
            self.set_bit(i, false);
        }
        self.released.extend(slots.iter().map(|s| s.index()));
        Ok(())
    }

    /// Frees every page.
    pub fn reset(&mut self) {
        *self = Self::new(self.capacity);
    }

    fn merge_released(&mut self) {
        self.free.append(&mut self.released);
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }

    fn bit(&self, i: usize) -> bool {
        self.used[i / 64] & (1 << (i % 64)) != 0
    }

    fn set_bit(&mut self, i: usize, v: bool) {
        if v {
            self.used[i / 64] |= 1 << (i % 64);
        } else {
            self.used[i / 64] &= !(1 << (i % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn fresh_allocations_are_ascending() {
        let mut a = PageAllocator::<HostSlot>::new(10);
        assert_eq!(
            a.alloc(3).unwrap(),
            vec![HostSlot(0), HostSlot(1), HostSlot(2)]
        );
        assert_eq!(a.alloc(0).unwrap(), vec![]);
        assert!(a.alloc(8).is_none());
        assert_eq!(a.available(), 7);
    }

    #[test]
    fn double_free_is_detected_and_changes_nothing() {
        let mut a = PageAllocator::<HostSlot>::new(4);
        let s = a.alloc(3).unwrap();
        a.free(&s[..1]).unwrap();
        assert_eq!(
            a.free(&[s[1], s[0]]),
            Err(AllocError::DoubleFree { slot: 0 })
        );
        assert!(
            a.is_allocated(s[1]),
            "failed free must not release earlier slots"
        );
        assert_eq!(
            a.free(&[s[1], s[1]]),
            Err(AllocError::DoubleFree { slot: 1 })
        );
        assert!(a.is_allocated(s[1]));
        assert_eq!(
            a.free(&[HostSlot(9)]),
            Err(AllocError::OutOfRange {
                slot: 9,
                capacity: 4
            })
        );
        assert_eq!(a.available(), 2);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        /// Free the allocation with this index (modulo live allocations), possibly twice.
        Free(usize, bool),
        /// Free a page chosen at random, allocated or not.
        FreeAny(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..12).prop_map(Op::Alloc),
            (any::<usize>(), any::<bool>()).prop_map(|(i, d)| Op::Free(i, d)),
            (0u32..40).prop_map(Op::FreeAny),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// The allocator against a naive set model.
        #[test]
        fn matches_naive_model(cap in 1usize..33, ops in proptest::collection::vec(op(), 1..80)) {
            let mut a = PageAllocator::<HostSlot>::new(cap);
            let mut model_used = BTreeSet::new();
            let mut live: Vec<Vec<HostSlot>> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let got = a.alloc(n);
                        if n > cap - model_used.len() {
                            prop_assert!(got.is_none());
                        } else {
                            let got = got.unwrap();
                            prop_assert_eq!(got.len(), n);
                            for s in &got {
                                prop_assert!((s.0 as usize) < cap);
                                prop_assert!(model_used.insert(s.0), "page handed out twice");
                            }
                            live.push(got);
                        }
                    }
                    Op::Free(i, twice) => {
                        if live.is_empty() { continue; }
                        let slots = live.swap_remove(i % live.len());
                        let mut req = slots.clone();
                        if twice && !slots.is_empty() { req.push(slots[0]); }
                        let r = a.free(&req);
                        if twice && !slots.is_empty() {
                            prop_assert_eq!(r, Err(AllocError::DoubleFree { slot: slots[0].0 }));
                            live.push(slots);
                        } else {
                            prop_assert!(r.is_ok());
                            for s in slots { model_used.remove(&s.0); }
                        }
                    }
                    Op::FreeAny(p) => {
                        let allocated = model_used.contains(&p);
                        let r = a.free(&[HostSlot(p)]);
                        if (p as usize) >= cap {
                            prop_assert_eq!(r, Err(AllocError::OutOfRange { slot: p, capacity: cap }));
                        } else if !allocated {
                            prop_assert_eq!(r, Err(AllocError::DoubleFree { slot: p }));
                        } else {
                            prop_assert!(r.is_ok());
                            model_used.remove(&p);
                            for l in live.iter_mut() { l.retain(|s| s.0 != p); }
                        }
                    }
                }
                prop_assert_eq!(a.available(), cap - model_used.len());
                for p in 0..cap as u32 {
                    prop_assert_eq!(a.is_allocated(HostSlot(p)), model_used.contains(&p));
                }
            }
        }
    }
}
