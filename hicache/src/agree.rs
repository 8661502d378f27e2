//! The pieces of the per-tick rank agreement both controllers (`HiCache` and `HybridCache`)
//! share: [`agree`] (one fixed-shape exchange of a tick's fixed values and one record of
//! [`Counts`] per tracked prefetch), [`Tracked`] (the prefetches tracked across ticks, by
//! sequence number, capped by [`max_tracked`] so the exchange fits one round, gathered into
//! [`Gathered`]), [`Fifo`] (work in flight, finished oldest first) and [`leading`] (how many
//! work items, from the oldest, have finished — what every queue of copies or L3 jobs reports
//! before the exchange).
//!
//! Rules (see [`crate::rank`]):
//! 1. A tick exchanges **once**: every value it needs is gathered before the call, and only
//!    the agreed values (every rank's minimum) are applied after it.
//! 2. The shape is the same on every rank: the fixed values are a constant number, and the
//!    prefetches tracked are the same on every rank, in the same (creation) order.
//! 3. Work finishes oldest first: a queue reports its leading run of finished items, so the
//!    agreed minimum names the same items on every rank.

use std::collections::VecDeque;

use crate::error::Result;
use crate::rank::{MAX_EXCHANGE_LEN, RankGroup};

/// One tracked item's values in the exchange (reduced with `min` over ranks).
pub(crate) trait Counts: Sized {
    /// Values per item in the exchange.
    const LEN: usize;

    /// Appends the item's `LEN` exchanged values to `out`.
    fn encode_into(&self, out: &mut Vec<u64>);

    /// The item from its `LEN` exchanged values.
    fn decode(v: &[u64]) -> Self;
}

/// A value of a [`Counts`] field: a count, or a flag (1 when set).
pub(crate) trait Value: Copy {
    /// The exchanged value.
    fn to_u64(self) -> u64;
    /// From the exchanged value.
    fn from_u64(v: u64) -> Self;
}

impl Value for u64 {
    fn to_u64(self) -> u64 {
        self
    }
    fn from_u64(v: u64) -> Self {
        v
    }
}

impl Value for bool {
    fn to_u64(self) -> u64 {
        u64::from(self)
    }
    fn from_u64(v: u64) -> Self {
        v == 1
    }
}

/// Declares a struct of exchanged values (fields of `u64` or `bool`, each one value of the
/// exchange, in declaration order) and its [`Counts`] impl.
macro_rules! exchanged_counts {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)* }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        $vis struct $name { $($(#[$fmeta])* pub $field: $ty,)* }

        impl $crate::agree::Counts for $name {
            const LEN: usize = [$(stringify!($field)),*].len();

            fn encode_into(&self, out: &mut Vec<u64>) {
                $(out.push($crate::agree::Value::to_u64(self.$field));)*
            }

            fn decode(v: &[u64]) -> Self {
                let mut v = v.iter().copied();
                Self { $($field: $crate::agree::Value::from_u64(v.next().unwrap_or(0)),)* }
            }
        }
    };
}
pub(crate) use exchanged_counts;

/// Replaces `fixed` and every one of `items` with every rank's minimum, through one
/// exchange of `fixed.len() + C::LEN * items.len()` values (rules 1 and 2), encoded into
/// `wire` (cleared first; kept by the caller so that a tick allocates nothing). A group whose
/// exchange is the identity ([`RankGroup::is_identity`]) leaves every value as it is, so
/// nothing is encoded.
pub(crate) fn agree<C: Counts>(
    rank: &dyn RankGroup,
    fixed: &mut [u64],
    items: &mut [C],
    wire: &mut Vec<u64>,
) -> Result<()> {
    if rank.is_identity() {
        return Ok(());
    }
    wire.clear();
    wire.reserve(fixed.len() + C::LEN * items.len());
    wire.extend_from_slice(fixed);
    for item in items.iter() {
        item.encode_into(wire);
    }
    rank.exchange(wire, &mut [])?;
    let (head, per) = wire.split_at(fixed.len());
    fixed.copy_from_slice(head);
    for (item, agreed) in items.iter_mut().zip(per.chunks_exact(C::LEN)) {
        *item = C::decode(agreed);
    }
    Ok(())
}

/// Most tracked items of `per` values each that an exchange with `fixed` values before them
/// carries in one round ([`MAX_EXCHANGE_LEN`]).
pub(crate) const fn max_tracked(fixed: usize, per: usize) -> usize {
    (MAX_EXCHANGE_LEN - fixed) / per
}

/// Work tracked across ticks and advanced by agreed values (prefetches): each item has a
/// sequence number, handed out in creation order.
///
/// Invariants:
/// 1. Iteration is in creation (sequence) order, so every rank that created and removed the
///    same items lists them alike (rule 2).
/// 2. At most `max` items are tracked: [`is_full`](Self::is_full) is checked before an
///    insert, and the caller's exchange is sized for `max` (see [`max_tracked`]).
/// 3. `seqs` is strictly increasing and `items[i]` is the item of `seqs[i]`: an item is found
///    by a binary search over the contiguous sequence numbers (a poll looks up every agreed
///    item), and items, which mostly end oldest first, leave from the front in O(1).
#[derive(Debug)]
pub(crate) struct Tracked<T> {
    seqs: VecDeque<u64>,
    items: VecDeque<T>,
    next: u64,
    max: usize,
}

impl<T> Tracked<T> {
    /// An empty table of at most `max` items.
    pub fn new(max: usize) -> Self {
        Self {
            seqs: VecDeque::new(),
            items: VecDeque::new(),
            next: 0,
            max,
        }
    }

    /// Whether no item can be added (invariant 2): every rank tracks the same items, so every
    /// rank refuses alike.
    pub fn is_full(&self) -> bool {
        self.items.len() >= self.max
    }

    /// Tracks `item`; its sequence number.
    pub fn insert(&mut self, item: T) -> u64 {
        debug_assert!(!self.is_full(), "checked by the caller (invariant 2)");
        let seq = self.next;
        self.next += 1;
        // Invariant 3: the new number is the largest.
        self.seqs.push_back(seq);
        self.items.push_back(item);
        seq
    }

    /// Where `seq` is. Panics when it is not tracked (a caller's bug: sequence numbers come
    /// from this table).
    fn index(&self, seq: u64) -> usize {
        self.seqs.binary_search(&seq).expect("tracked")
    }

    /// The item `seq`. Panics when it is not tracked (a caller's bug: sequence numbers come
    /// from this table).
    pub fn get(&self, seq: u64) -> &T {
        &self.items[self.index(seq)]
    }

    /// The item `seq`, mutably. Panics as [`get`](Self::get).
    pub fn get_mut(&mut self, seq: u64) -> &mut T {
        let i = self.index(seq);
        &mut self.items[i]
    }

    /// Stops tracking `seq`. Panics as [`get`](Self::get).
    pub fn remove(&mut self, seq: u64) -> T {
        let i = self.index(seq);
        self.seqs.remove(i);
        self.items.remove(i).expect("found")
    }

    /// Number of items tracked.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether none is tracked.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The items, in creation order.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.items.iter()
    }

    /// The sequence numbers, in creation order.
    pub fn seqs(&self) -> Vec<u64> {
        self.seqs.iter().copied().collect()
    }

    /// This rank's [`Counts`] of every item (by `counts`), in creation order, for
    /// [`agree`], into `out` (its previous contents replaced; its buffers reused, so that a
    /// tick allocates nothing once they have grown to the tracked count).
    pub fn gather_into<C>(&self, out: &mut Gathered<C>, counts: impl FnMut(&T) -> C) {
        out.seqs.clear();
        out.seqs.extend(self.seqs.iter().copied());
        out.counts.clear();
        out.counts.extend(self.items.iter().map(counts));
    }
}

/// The counts of every tracked item, with their sequence numbers: this rank's from
/// [`Tracked::gather_into`], every rank's minimum after [`Gathered::agree`]. Kept by its
/// owner from tick to tick and refilled (no allocation per tick).
///
/// Invariant: `seqs[i]` is the sequence number of `counts[i]` (both filled together by
/// [`Tracked::gather_into`]; [`agree`] replaces counts in place).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Gathered<C> {
    seqs: Vec<u64>,
    counts: Vec<C>,
    /// The exchange's buffer ([`agree`]), reused.
    wire: Vec<u64>,
}

impl<C> Default for Gathered<C> {
    fn default() -> Self {
        Self {
            seqs: Vec::new(),
            counts: Vec::new(),
            wire: Vec::new(),
        }
    }
}

impl<C: Counts + Copy> Gathered<C> {
    /// Replaces `fixed` and the counts with every rank's minimum ([`agree`]).
    pub fn agree(&mut self, rank: &dyn RankGroup, fixed: &mut [u64]) -> Result<()> {
        agree(rank, fixed, &mut self.counts, &mut self.wire)
    }

    /// Each item's sequence number and counts, in creation order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, C)> + '_ {
        self.seqs.iter().copied().zip(self.counts.iter().copied())
    }

    /// Forgets every item (the buffers are kept).
    pub fn clear(&mut self) {
        self.seqs.clear();
        self.counts.clear();
    }
}

/// Work in flight, launched in order and finished oldest first (rule 3): copies, L3 backups,
/// ended prefetches whose task may still run.
///
/// Invariant: items leave only from the front, one at a time ([`pop`](Self::pop)), after
/// the caller agreed how many of the leading ones finished ([`leading`](Self::leading)), so
/// every rank finishes the same items.
#[derive(Debug)]
pub(crate) struct Fifo<T>(VecDeque<T>);

impl<T> Default for Fifo<T> {
    fn default() -> Self {
        Self(VecDeque::new())
    }
}

impl<T> Fifo<T> {
    /// Appends a launched item.
    pub fn push(&mut self, item: T) {
        self.0.push_back(item);
    }

    /// Removes the oldest item (one the agreed count says finished).
    pub fn pop(&mut self) -> Option<T> {
        self.0.pop_front()
    }

    /// Number of items in flight.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The items, oldest first.
    pub fn iter(&self) -> std::collections::vec_deque::Iter<'_, T> {
        self.0.iter()
    }

    /// How many items, from the oldest, `done` says finished ([`leading`]).
    pub fn leading(&self, done: impl FnMut(&T) -> Result<bool>) -> Result<usize> {
        leading(&self.0, done)
    }

    /// As [`leading`](Self::leading), for a `done` that cannot fail.
    pub fn leading_ok(&self, mut done: impl FnMut(&T) -> bool) -> usize {
        self.0.iter().take_while(|t| done(t)).count()
    }
}

impl<T> std::ops::Index<usize> for Fifo<T> {
    type Output = T;

    fn index(&self, i: usize) -> &T {
        &self.0[i]
    }
}

impl<T> IntoIterator for Fifo<T> {
    type Item = T;
    type IntoIter = std::collections::vec_deque::IntoIter<T>;

    /// The items, oldest first.
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a, T> IntoIterator for &'a Fifo<T> {
    type Item = &'a T;
    type IntoIter = std::collections::vec_deque::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// How many of `items`, from the first, are finished by `done` (rule 3); stops at the first
/// unfinished one and at the first error.
pub(crate) fn leading<T>(
    items: impl IntoIterator<Item = T>,
    mut done: impl FnMut(T) -> Result<bool>,
) -> Result<usize> {
    let mut n = 0;
    for item in items {
        if !done(item)? {
            break;
        }
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rank::RankError;

    exchanged_counts! {
        /// Two values per item.
        struct Pair {
            pub n: u64,
            pub flag: bool,
        }
    }

    /// A group whose peer reports `peer` (the same shape) for every exchange.
    struct Peer {
        peer: Vec<u64>,
    }

    impl RankGroup for Peer {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            2
        }
        fn exchange(&self, min: &mut [u64], max: &mut [u64]) -> Result<(), RankError> {
            if min.len() != self.peer.len() || !max.is_empty() {
                return Err(RankError::Setup(format!("shape {}", min.len())));
            }
            for (m, p) in min.iter_mut().zip(&self.peer) {
                *m = (*m).min(*p);
            }
            Ok(())
        }
    }

    #[test]
    fn one_exchange_gives_every_value_its_minimum() {
        let group = Peer {
            peer: vec![1, 9, 4, 0, 3, 1],
        };
        let pair = |n, flag| Pair { n, flag };
        let mut fixed = [5, 2];
        let mut items = [pair(7, true), pair(2, true)];
        assert_eq!(Pair::LEN, 2);
        let mut wire = vec![42; 9];
        agree(&group, &mut fixed, &mut items, &mut wire).unwrap();
        assert_eq!(fixed, [1, 2]);
        assert_eq!(items, [pair(4, false), pair(2, true)]);
        // A different shape on the peer is the group's error, passed on.
        let err = agree(&group, &mut [1], &mut [pair(0, false)], &mut wire).unwrap_err();
        assert!(err.to_string().contains("shape 3"), "{err}");
    }

    #[test]
    fn tracked_items_keep_creation_order_and_their_cap() {
        let mut t = Tracked::new(2);
        let a = t.insert("a");
        let b = t.insert("b");
        assert!(t.is_full());
        assert_eq!(t.remove(a), "a");
        let c = t.insert("c");
        // Sequence numbers are never reused; iteration is creation order.
        assert!(a < b && b < c);
        assert_eq!(t.seqs(), [b, c]);
        assert_eq!(t.values().copied().collect::<Vec<_>>(), ["b", "c"]);
        *t.get_mut(c) = "c2";
        let group = Peer {
            peer: vec![0, 1, 9, 1, 0],
        };
        // A gather replaces what the buffers held before.
        let mut g = Gathered::default();
        t.gather_into(&mut g, |_| Pair { n: 7, flag: false });
        t.gather_into(&mut g, |s| Pair {
            n: s.len() as u64,
            flag: true,
        });
        let mut fixed = [3];
        g.agree(&group, &mut fixed).unwrap();
        assert_eq!(fixed, [0]);
        let pair = |n, flag| Pair { n, flag };
        let agreed: Vec<_> = g.iter().collect();
        assert_eq!(agreed, [(b, pair(1, true)), (c, pair(1, false))]);
        // The single rank's exchange is the identity: the values stay this rank's.
        g.agree(&crate::rank::SingleRank, &mut fixed).unwrap();
        assert_eq!(g.iter().collect::<Vec<_>>(), agreed);
        g.clear();
        assert_eq!(g.iter().count(), 0);
        assert_eq!(max_tracked(5, 4), 1022);
    }

    #[test]
    fn tracked_items_leave_in_any_order() {
        let mut t = Tracked::new(8);
        let seqs: Vec<u64> = (0..6).map(|i| t.insert(i)).collect();
        // From the middle, the back and the front; the rest stay found, in order.
        assert_eq!(t.remove(seqs[2]), 2);
        assert_eq!(t.remove(seqs[5]), 5);
        assert_eq!(t.remove(seqs[0]), 0);
        assert_eq!(t.seqs(), [seqs[1], seqs[3], seqs[4]]);
        assert_eq!(*t.get(seqs[3]), 3);
        *t.get_mut(seqs[4]) = 40;
        let n = t.insert(6);
        assert!(n > seqs[5]);
        assert_eq!(t.values().copied().collect::<Vec<_>>(), [1, 3, 40, 6]);
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn fifo_finishes_from_the_oldest() {
        let mut q = Fifo::default();
        for done in [true, true, false, true] {
            q.push(done);
        }
        assert_eq!(q.leading_ok(|d| *d), 2);
        assert_eq!(q.leading(|d| Ok(*d)).unwrap(), 2);
        assert_eq!((q.len(), q[2]), (4, false));
        assert_eq!(q.pop(), Some(true));
        assert_eq!(q.iter().count(), 3);
        assert_eq!(q.into_iter().collect::<Vec<_>>(), [true, false, true]);
    }

    #[test]
    fn leading_counts_the_finished_run_from_the_oldest() {
        let ok = |x: &bool| Ok(*x);
        assert_eq!(leading(&[true, true, false, true], ok).unwrap(), 2);
        assert_eq!(leading(&[false, true], ok).unwrap(), 0);
        assert_eq!(leading(&[] as &[bool], ok).unwrap(), 0);
        let err = leading(&[true, false], |x: &bool| {
            if *x {
                Err(crate::HiCacheError::Closed)
            } else {
                Ok(true)
            }
        });
        assert!(err.is_err());
    }
}
