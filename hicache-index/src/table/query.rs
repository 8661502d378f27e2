//! Prefix queries: the walk down a chain, and the [`Answer`] it writes.
//!
//! The answer is a dense row per holder id (reused across queries: only the rows of the last
//! answer's instances are reset), so a consumer reads an instance's overlap in O(1)
//! ([`Answer::get`]) and a router's per-instance cost loop needs no map from holder to answer.
//!
//! The walk (see [`Index::query`]): the chain's blocks are looked up first, as far as anyone
//! holds them (independent probes, which the processor overlaps). The first block's holders
//! are the candidates: each gets its row, its tier bits and its count of attached stores
//! holding the block, and an answer as if its runs went on to the end of the chain. The walk
//! then compares each block's holder set with the previous distinct one (a run of blocks
//! sharing one set costs one comparison of two references) and applies only the *difference*
//! of the two sorted sets: the candidates it touches are re-evaluated (a run that ends is
//! written at this depth, a candidate holding nothing more leaves); everyone else is not
//! visited. Equal stretches of the two sets are skipped eight words at a time. So a query
//! costs its lookups, one pass over the first block's holders, and the differences between
//! consecutive sets, never a pass over every candidate per set change.
//!
//! Invariants (kept by [`Answer::reset`] and the walk):
//! 1. Outside a query, every row is zero except the rows named in `cands`, which hold the
//!    last answer (`l3 > 0`); a row with `l3 == 0` is no answer.
//! 2. During the walk, for a live candidate `h` at depth `d`: `own` is its tier bits in the
//!    set of the last distinct block, `stores` the number of its attached stores holding that
//!    block; `RUN1` / `RUN2` say whether its L1 / L1-or-L2 runs still go on (then its `l1` /
//!    `l2` are the chain's matched length, else where they ended), and its `l3` is the chain's
//!    matched length until it leaves.

use super::{HolderId, Index, KIND_INSTANCE, KIND_STORE, QueryMatch};
use crate::chain::BlockHash;

/// The row's candidate still matches.
const LIVE: u8 = 1 << 2;
/// Its L1 run goes on.
const RUN1: u8 = 1;
/// Its L1-or-L2 run goes on.
const RUN2: u8 = 1 << 1;
/// It is in the list of rows to re-evaluate at this depth.
const TOUCHED: u8 = 1 << 3;
/// The row is named in the answer's list (`cands`).
const LISTED: u8 = 1 << 4;

/// One holder's row: its answer, and the walk's state for it.
#[derive(Clone, Copy, Debug, Default)]
struct Row {
    /// Tier bits of the holder itself in the current set (bit 0 L1, 1 L2, 2 L3).
    own: u8,
    /// `LIVE`, `RUN1`, `RUN2`, `TOUCHED`, `LISTED`.
    state: u8,
    /// Its attached stores holding the current block.
    stores: u32,
    l1: u32,
    l2: u32,
    l3: u32,
}

/// A query's answer: for each instance holding a prefix of the chain, its leading blocks per
/// tier, each cumulative through the faster ones (see [`QueryMatch`]). Reuse one across
/// queries; [`Index::query`] overwrites it.
///
/// [`get`](Self::get) reads one instance's answer in O(1); [`iter`](Self::iter) lists them
/// in holder order. A remote source of overlaps fills one with [`clear`](Self::clear) and
/// [`push`](Self::push).
#[derive(Clone, Debug, Default)]
pub struct Answer {
    /// Per holder id (see the module's invariants).
    rows: Vec<Row>,
    /// The holders with a row in this answer.
    cands: Vec<u32>,
    /// Whether `cands` is in ascending order.
    sorted: bool,
    /// Scratch of the walk: the chain's slots, the rows to re-evaluate.
    slots: Vec<u32>,
    touched: Vec<u32>,
}

impl Answer {
    /// An empty answer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the answer (its rows reset, its buffers kept).
    pub fn clear(&mut self) {
        for &h in &self.cands {
            self.rows[h as usize] = Row::default();
        }
        self.cands.clear();
        self.sorted = true;
    }

    /// Empties the answer and makes room for holder ids below `holders`.
    fn reset(&mut self, holders: usize) {
        self.clear();
        if self.rows.len() < holders {
            self.rows.resize(holders, Row::default());
        }
    }

    /// Adds (or replaces) an instance's answer; one with `l3 == 0` is left out, as
    /// [`Index::query`] leaves out instances that match nothing.
    pub fn push(&mut self, m: QueryMatch) {
        let h = m.holder.0 as usize;
        if self.rows.len() <= h {
            self.rows.resize(h + 1, Row::default());
        }
        let row = &mut self.rows[h];
        if row.state & LISTED == 0 {
            if m.l3 == 0 {
                return;
            }
            self.sorted &= self.cands.last().is_none_or(|&last| last < m.holder.0);
            self.cands.push(m.holder.0);
        }
        // A replaced answer with l3 == 0 stays listed but reads as none.
        *row = Row {
            own: 0,
            state: LISTED,
            stores: 0,
            l1: m.l1,
            l2: m.l2,
            l3: m.l3,
        };
    }

    /// Instance `holder`'s answer, if it holds a prefix of the chain.
    #[inline]
    pub fn get(&self, holder: HolderId) -> Option<QueryMatch> {
        let row = self.rows.get(holder.0 as usize)?;
        (row.l3 != 0).then_some(QueryMatch {
            holder,
            l1: row.l1,
            l2: row.l2,
            l3: row.l3,
        })
    }

    /// Instances in the answer.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether no instance holds a prefix of the chain.
    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    /// The answers, in holder order.
    pub fn iter(&self) -> impl Iterator<Item = QueryMatch> + '_ {
        // Few answers among many rows, listed in order: walk the list; otherwise the rows.
        let listed = self.sorted && self.cands.len() * 8 < self.rows.len();
        let (by_list, by_rows) = if listed {
            (&self.cands[..], 0..0)
        } else {
            (&[][..], 0..self.rows.len() as u32)
        };
        by_list
            .iter()
            .copied()
            .chain(by_rows)
            .filter_map(|h| self.get(HolderId(h)))
    }

    /// The answers in holder order, collected.
    pub fn to_vec(&self) -> Vec<QueryMatch> {
        self.iter().collect()
    }
}

/// Calls `f(word, added)` for each word in exactly one of the sorted sets `a` (then `added`
/// is false) and `b` (true), in ascending order.
#[inline]
fn diff(a: &[u32], b: &[u32], mut f: impl FnMut(u32, bool)) {
    const STRIDE: usize = 8;
    let (mut i, mut j) = (0, 0);
    loop {
        while i + STRIDE <= a.len() && j + STRIDE <= b.len() && a[i..i + STRIDE] == b[j..j + STRIDE]
        {
            i += STRIDE;
            j += STRIDE;
        }
        let (Some(&x), Some(&y)) = (a.get(i), b.get(j)) else {
            break;
        };
        if x == y {
            i += 1;
            j += 1;
        } else if x < y {
            f(x, false);
            i += 1;
        } else {
            f(y, true);
            j += 1;
        }
    }
    a[i..].iter().for_each(|&x| f(x, false));
    b[j..].iter().for_each(|&y| f(y, true));
}

impl Index {
    /// The instances holding a prefix of `hashes`, written to `answer` (emptied first); see
    /// the [module docs](self) for the walk and its cost.
    pub fn query(&self, hashes: &[BlockHash], answer: &mut Answer) {
        answer.reset(self.holders.len());
        let Answer {
            rows,
            cands,
            sorted,
            slots,
            touched,
        } = answer;
        slots.clear();
        slots.extend(hashes.iter().map_while(|b| self.blocks.lookup(*b)));
        let Some(&first) = slots.first() else {
            return;
        };
        let total = slots.len() as u32;
        // The first block's holders are the candidates.
        self.for_holders(self.blocks.entries(first), |h, bit| {
            let row = &mut rows[h as usize];
            if row.state & LISTED == 0 {
                row.state = LISTED | LIVE;
                cands.push(h);
            }
            if bit == 0 {
                row.stores += 1;
            } else {
                row.own |= bit;
            }
        });
        for &h in cands.iter() {
            let row = &mut rows[h as usize];
            let l1 = row.own & 1 != 0;
            let l2 = row.own & 3 != 0;
            row.state |= u8::from(l1) * RUN1 | u8::from(l2) * RUN2;
            row.l1 = if l1 { total } else { 0 };
            row.l2 = if l2 { total } else { 0 };
            row.l3 = total;
        }
        *sorted = cands.is_sorted();
        if !*sorted && cands.len() * 8 < rows.len() {
            cands.sort_unstable();
            *sorted = true;
        }
        let mut live = cands.len();
        let mut prev = first;
        for (d, &slot) in slots.iter().enumerate().skip(1) {
            if self.blocks.same_set(slot, prev) {
                continue;
            }
            let d = d as u32;
            touched.clear();
            diff(
                self.blocks.entries(prev),
                self.blocks.entries(slot),
                |e, added| {
                    self.for_holders(&[e], |h, bit| {
                        let row = &mut rows[h as usize];
                        if row.state & LIVE == 0 {
                            return;
                        }
                        match (bit, added) {
                            (0, true) => row.stores += 1,
                            (0, false) => row.stores -= 1,
                            (_, true) => row.own |= bit,
                            (_, false) => row.own &= !bit,
                        }
                        if row.state & TOUCHED == 0 {
                            row.state |= TOUCHED;
                            touched.push(h);
                        }
                    });
                },
            );
            for &h in touched.iter() {
                let row = &mut rows[h as usize];
                row.state &= !TOUCHED;
                if row.state & RUN1 != 0 && row.own & 1 == 0 {
                    row.l1 = d;
                    row.state &= !RUN1;
                }
                if row.state & RUN2 != 0 && row.own & 3 == 0 {
                    row.l2 = d;
                    row.state &= !RUN2;
                }
                if row.own == 0 && row.stores == 0 {
                    row.l3 = d;
                    row.state = LISTED;
                    live -= 1;
                }
            }
            if live == 0 {
                break;
            }
            prev = slot;
        }
    }

    /// Calls `f(instance, bit)` for every instance holding a block through these entries:
    /// `bit` is its own tier's bit, or 0 for a store it reads.
    #[inline]
    fn for_holders(&self, entries: &[u32], mut f: impl FnMut(u32, u8)) {
        for &e in entries {
            let h = e >> 2;
            match self.kinds[h as usize] {
                KIND_INSTANCE => f(h, 1 << (e & 3)),
                KIND_STORE => {
                    if let Some(Some(store)) = self.holders.get(h as usize) {
                        store.readers.iter().for_each(|&r| f(r, 0));
                    }
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn diffs(a: &[u32], b: &[u32]) -> Vec<(u32, bool)> {
        let mut out = Vec::new();
        diff(a, b, |w, added| out.push((w, added)));
        out
    }

    #[test]
    fn diff_lists_the_symmetric_difference_in_order() {
        assert_eq!(diffs(&[], &[]), vec![]);
        assert_eq!(diffs(&[1, 3], &[]), vec![(1, false), (3, false)]);
        assert_eq!(diffs(&[], &[2]), vec![(2, true)]);
        assert_eq!(
            diffs(&[1, 2, 4, 7], &[2, 3, 4, 8]),
            vec![(1, false), (3, true), (7, false), (8, true)]
        );
        // Long equal stretches around the differences (the eight-word skip).
        let a: Vec<u32> = (0..100).collect();
        let mut b: Vec<u32> = (0..100).filter(|&x| x != 37 && x != 80).collect();
        b.push(150);
        assert_eq!(diffs(&a, &b), vec![(37, false), (80, false), (150, true)]);
        assert_eq!(diffs(&a, &a), vec![]);
    }

    #[test]
    fn pushed_answers_read_back_in_holder_order() {
        let mut a = Answer::new();
        let m = |h, l3| QueryMatch {
            holder: HolderId(h),
            l1: 0,
            l2: l3,
            l3,
        };
        a.push(m(5, 2));
        a.push(m(1, 3));
        a.push(m(3, 0));
        assert_eq!(a.to_vec(), vec![m(1, 3), m(5, 2)]);
        assert_eq!(a.get(HolderId(5)), Some(m(5, 2)));
        assert_eq!(a.get(HolderId(3)), None);
        assert_eq!(a.get(HolderId(99)), None);
        assert_eq!(a.len(), 2);
        a.clear();
        assert!(a.is_empty());
        assert_eq!(a.get(HolderId(1)), None);
    }
}
