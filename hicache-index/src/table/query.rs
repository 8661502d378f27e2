//! Prefix queries: the walk down a chain, and the [`Answer`] it writes.
//!
//! The walk works on bitsets over holder ids, one word per 64 holders (a fleet of 1,152
//! holders is 18 words a set):
//! - the *current set*, per tier the instances holding the current block themselves (`B1`,
//!   `B2`, `B3`), the stores holding it (`SP`), and the instances reading one of them (`ST`);
//! - the *runs*: `R1` the instances holding every block so far in L1, `R2` in L1 or L2, `R3`
//!   in any tier or through a store they read; and the same at the first block (`F1`, `F2`,
//!   `F3`, where `F3` are the answer's instances).
//!
//! The first block's set, when it is big (held by most of the fleet), is kept in the
//! [`Answer`] with a key that names its content exactly (the chunk's stamp, the readers'
//! epoch), so the next query starting at the same head copies its planes instead of filling
//! them from thousands of entries.
//!
//! The chain's blocks are looked up first, as far as anyone holds them, in batches whose
//! table reads overlap (see [`BlockTable::lookup_batch`](super::blocks::BlockTable::lookup_batch)). The first block's set fills the current set and the runs.
//! The walk then compares each block's holder set with the previous distinct one (a run of
//! blocks sharing one set costs one comparison of two references) and applies only the
//! *difference* of the two sorted sets to the current set (or rebuilds it, when the new set is
//! much smaller), then narrows the runs word by word where the current set changed (`R1 &=
//! B1`, …): the instances whose run ended are written at this depth in `ends`, and only they.
//! So a query costs its lookups, one pass over the first block's holders, the differences
//! between consecutive sets, and one write per run that ends: never a pass over every
//! instance per set change, and nothing for the runs that go on to the chain's end.
//!
//! [`Answer::get`] reads an instance's answer from the bits and `ends` in O(1), so a router's
//! per-instance cost loop needs no map from holder to answer; [`Answer::iter`] lists the
//! answers in holder order (the set bits of `F3`).
//!
//! Invariants (after a query or a push): for holder `h` and tier `t` (0: L1, 1: L2 cumulative,
//! 2: L3 cumulative), `R_t ⊆ F_t`, `F1 ⊆ F2 ⊆ F3`; its answer's `l_t` is `total` where `R_t`
//! holds `h`, `ends[h][t]` where only `F_t` does (written when the run ended, or by a push),
//! 0 where neither does.

use super::blocks::BigSetKey;
use super::{HolderId, Index, KIND_STORE, QueryMatch};
use crate::chain::BlockHash;

/// Planes of [`Answer::bits`], `words` words each (see the module docs).
const B1: usize = 0;
const B2: usize = 1;
const B3: usize = 2;
const SP: usize = 3;
const ST: usize = 4;
const R1: usize = 5;
const R3: usize = 7;
const F1: usize = 8;
const F3: usize = 10;
const PLANES: usize = 11;

/// A query's answer: for each instance holding a prefix of the chain, its leading blocks per
/// tier, each cumulative through the faster ones (see [`QueryMatch`]). Reuse one across
/// queries; [`Index::query`] overwrites it.
///
/// [`get`](Self::get) reads one instance's answer in O(1); [`iter`](Self::iter) lists them
/// in holder order. A remote source of overlaps fills one with [`clear`](Self::clear) and
/// [`push`](Self::push).
#[derive(Clone, Debug, Default)]
pub struct Answer {
    /// Words per plane (64 holder ids a word).
    words: usize,
    /// `PLANES` bitsets of `words` words (see the module docs).
    bits: Vec<u64>,
    /// Per holder: where its runs ended (L1, L2, L3 cumulative), valid per the invariants.
    ends: Vec<[u32; 3]>,
    /// The chain's matched length (blocks anyone holds from the first).
    total: u32,
    /// Scratch of the walk: the chain's slots, the words whose current set changed, the
    /// stores that came or went at this block.
    slots: Vec<u32>,
    dirty: Vec<u32>,
    stores: Vec<u32>,
    /// The current set's planes (`B1` to `ST`) at the first block of the last query whose
    /// first block had a big set (see [`BigSetKey`]), and what they were computed from: that
    /// set, the index's readers epoch and the words per plane.
    first: Option<(BigSetKey, u64, usize)>,
    first_planes: Vec<u64>,
}

#[inline]
fn bit(h: u32) -> (usize, u64) {
    ((h / 64) as usize, 1 << (h % 64))
}

/// Calls `f(h)` for each bit set in `word`, `base` the holder id of its bit 0.
#[inline]
fn each_bit(mut word: u64, base: u32, mut f: impl FnMut(u32)) {
    while word != 0 {
        f(base + word.trailing_zeros());
        word &= word - 1;
    }
}

impl Answer {
    /// An empty answer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the answer (its buffers kept).
    pub fn clear(&mut self) {
        self.bits.fill(0);
        self.total = 0;
    }

    /// Empties the answer and sizes it for holder ids below `holders`.
    fn reset(&mut self, holders: usize) {
        self.words = holders.div_ceil(64).max(self.words);
        self.bits.clear();
        self.bits.resize(PLANES * self.words, 0);
        if self.ends.len() < self.words * 64 {
            self.ends.resize(self.words * 64, [0; 3]);
        }
        self.total = 0;
    }

    /// Makes room for holder id `h`, keeping what the answer holds.
    fn grow(&mut self, h: u32) {
        let words = (h as usize / 64 + 1).max(self.words);
        if words == self.words {
            return;
        }
        let mut bits = vec![0; PLANES * words];
        for p in 0..PLANES {
            bits[p * words..p * words + self.words]
                .copy_from_slice(&self.bits[p * self.words..(p + 1) * self.words]);
        }
        self.bits = bits;
        self.words = words;
        self.ends.resize(words * 64, [0; 3]);
    }

    /// Adds (or replaces) an instance's answer; one with `l3 == 0` is left out, as
    /// [`Index::query`] leaves out instances that match nothing.
    pub fn push(&mut self, m: QueryMatch) {
        let h = m.holder.0;
        self.grow(h);
        let (w, b) = bit(h);
        let words = self.words;
        for (t, l) in [m.l1, m.l2, m.l3].into_iter().enumerate() {
            self.bits[(R1 + t) * words + w] &= !b;
            let f = &mut self.bits[(F1 + t) * words + w];
            if l > 0 && m.l3 > 0 {
                *f |= b;
            } else {
                *f &= !b;
            }
        }
        self.ends[h as usize] = [m.l1, m.l2, m.l3];
    }

    /// Instance `holder`'s answer, if it holds a prefix of the chain.
    #[inline]
    pub fn get(&self, holder: HolderId) -> Option<QueryMatch> {
        let (w, b) = bit(holder.0);
        if w >= self.words || self.bits[F3 * self.words + w] & b == 0 {
            return None;
        }
        let ends = self.ends[holder.0 as usize];
        let l = |t: usize| {
            if self.bits[(R1 + t) * self.words + w] & b != 0 {
                self.total
            } else if self.bits[(F1 + t) * self.words + w] & b != 0 {
                ends[t]
            } else {
                0
            }
        };
        Some(QueryMatch {
            holder,
            l1: l(0),
            l2: l(1),
            l3: l(2),
        })
    }

    /// Instances in the answer.
    pub fn len(&self) -> usize {
        self.plane(F3).iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether no instance holds a prefix of the chain.
    pub fn is_empty(&self) -> bool {
        self.plane(F3).iter().all(|&w| w == 0)
    }

    fn plane(&self, p: usize) -> &[u64] {
        &self.bits[p * self.words..(p + 1) * self.words]
    }

    /// The answers, in holder order.
    pub fn iter(&self) -> impl Iterator<Item = QueryMatch> + '_ {
        self.plane(F3)
            .iter()
            .enumerate()
            .flat_map(move |(i, &word)| {
                let mut word = word;
                std::iter::from_fn(move || {
                    (word != 0).then(|| {
                        let h = i as u32 * 64 + word.trailing_zeros();
                        word &= word - 1;
                        h
                    })
                })
                .filter_map(|h| self.get(HolderId(h)))
            })
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
            words,
            bits,
            ends,
            total,
            slots,
            dirty,
            stores,
            first: first_key,
            first_planes,
        } = answer;
        let w = *words;
        slots.clear();
        self.blocks
            .lookup_batch(hashes, |s| s.map(|s| slots.push(s)).is_some());
        let Some(&first) = slots.first() else {
            return;
        };
        *total = slots.len() as u32;
        let (cur, runs) = bits.split_at_mut(R1 * w);
        // The first block's set: from the answer's cache when it is the same big set (the
        // head of a chain most of the fleet holds, the same for query after query).
        let key = self
            .blocks
            .big_set_key(first)
            .map(|k| (k, self.readers_epoch, w));
        if key.is_some() && *first_key == key {
            cur.copy_from_slice(first_planes);
        } else {
            self.fill_set(self.blocks.entries(first), cur, w);
            self.readers_of_present(cur, w);
            if key.is_some() {
                *first_key = key;
                first_planes.clear();
                first_planes.extend_from_slice(cur);
            }
        }
        let mut live = 0usize;
        for i in 0..w {
            let b1 = cur[B1 * w + i];
            let b12 = b1 | cur[B2 * w + i];
            let all = b12 | cur[B3 * w + i] | cur[ST * w + i];
            for (p, v) in [b1, b12, all].into_iter().enumerate() {
                runs[p * w + i] = v;
                runs[(F1 - R1 + p) * w + i] = v;
            }
            live += all.count_ones() as usize;
        }
        let mut prev = first;
        for (d, &slot) in slots.iter().enumerate().skip(1) {
            if self.blocks.same_set(slot, prev) {
                continue;
            }
            let (a, b) = (self.blocks.entries(prev), self.blocks.entries(slot));
            dirty.clear();
            // Rebuilding the current set costs its `4w` words and the new set; applying the
            // difference, both sets.
            if a.len() > 4 * w + b.len() {
                cur[..ST * w].fill(0);
                self.fill_set(b, cur, w);
                self.readers_of_present(cur, w);
                dirty.extend(0..w as u32);
            } else {
                stores.clear();
                diff(a, b, |e, _| {
                    let h = e >> 2;
                    let (i, m) = bit(h);
                    if self.kinds[h as usize] == KIND_STORE {
                        cur[SP * w + i] ^= m;
                        stores.push(h);
                    } else {
                        cur[(e & 3) as usize * w + i] ^= m;
                        if dirty.last() != Some(&(i as u32)) {
                            dirty.push(i as u32);
                        }
                    }
                });
                for &s in stores.iter() {
                    self.store_changed(s, cur, w, dirty);
                }
            }
            let d = d as u32;
            for &i in dirty.iter() {
                let i = i as usize;
                let b1 = cur[B1 * w + i];
                let b12 = b1 | cur[B2 * w + i];
                let all = b12 | cur[B3 * w + i] | cur[ST * w + i];
                for (t, held) in [b1, b12, all].into_iter().enumerate() {
                    let run = &mut runs[t * w + i];
                    let ended = *run & !held;
                    if ended != 0 {
                        *run &= held;
                        each_bit(ended, i as u32 * 64, |h| ends[h as usize][t] = d);
                        if t == R3 - R1 {
                            live -= ended.count_ones() as usize;
                        }
                    }
                }
            }
            if live == 0 {
                break;
            }
            prev = slot;
        }
    }

    /// Sets the bits of a set's entries in the current set's planes (`B1`, `B2`, `B3` for
    /// instances, `SP` for stores); `ST` is left to [`Self::readers_of_present`].
    ///
    /// A set's entries are live holders' (a removed holder was cleared first), so an entry
    /// that is not a store's is an instance's; a store's is L3 (tier 2), whose plane plus one
    /// is `SP`.
    #[inline]
    fn fill_set(&self, entries: &[u32], cur: &mut [u64], w: usize) {
        for &e in entries {
            let h = e >> 2;
            let (i, m) = bit(h);
            let plane = (e & 3) as usize + usize::from(self.kinds[h as usize] == KIND_STORE);
            cur[plane * w + i] |= m;
        }
    }

    /// Store `s` came into `SP` or left it: its readers' `ST` bits follow (a reader keeps its
    /// bit while another store it reads is in `SP`); their words are marked `dirty`.
    fn store_changed(&self, s: u32, cur: &mut [u64], w: usize, dirty: &mut Vec<u32>) {
        let Some(Some(store)) = self.holders.get(s as usize) else {
            return;
        };
        let (i, m) = bit(s);
        let came = cur[SP * w + i] & m != 0;
        for &r in &store.readers {
            let (j, mr) = bit(r);
            let held = came
                || self.holders[r as usize].as_ref().is_some_and(|reader| {
                    reader.stores.iter().any(|&o| {
                        let (k, mo) = bit(o);
                        cur[SP * w + k] & mo != 0
                    })
                });
            if held {
                cur[ST * w + j] |= mr;
            } else {
                cur[ST * w + j] &= !mr;
            }
            if dirty.last() != Some(&(j as u32)) {
                dirty.push(j as u32);
            }
        }
    }

    /// `ST` from `SP`: the instances reading a store that holds the current block.
    fn readers_of_present(&self, cur: &mut [u64], w: usize) {
        let (sp, st) = cur[SP * w..(ST + 1) * w].split_at_mut(w);
        st.fill(0);
        for (i, &word) in sp.iter().enumerate() {
            each_bit(word, i as u32 * 64, |s| {
                if let Some(Some(store)) = self.holders.get(s as usize) {
                    for &r in &store.readers {
                        let (j, m) = bit(r);
                        st[j] |= m;
                    }
                }
            });
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
