//! Batch classification, once for every backend: which pages of a `batch_set` need no write
//! (empty, too large, already present with the same metadata, repeated within the batch) and
//! which do, and how the outcomes of a batch are gathered and finished.
//!
//! # Invariants
//! 1. **One outcome per page, in order.** [`Outcomes::finish`] returns exactly one outcome
//!    per key; a slot nobody filled becomes `Failed(Backend("internal: no outcome"))`, never
//!    a silent success.
//! 2. **Duplicates follow their first.** A key repeated in one batch is written once (its
//!    first occurrence); the repeats report the first's outcome, with `Stored` seen as
//!    `Present` (the page is there, this occurrence did not store it).

use std::collections::HashMap;

use crate::{PageBuf, PageError, PageKey, PageMeta, PageOutcome};

/// The outcomes of a batch as they are decided, one optional slot per page.
#[derive(Clone, Debug, Default)]
pub struct Outcomes {
    out: Vec<Option<PageOutcome>>,
}

impl Outcomes {
    /// `n` undecided outcomes.
    pub fn new(n: usize) -> Self {
        Self { out: vec![None; n] }
    }

    /// Decides page `i`'s outcome (a later call replaces it).
    pub fn set(&mut self, i: usize, o: PageOutcome) {
        self.out[i] = Some(o);
    }

    /// Page `i`'s outcome, if decided.
    pub fn get(&self, i: usize) -> Option<&PageOutcome> {
        self.out[i].as_ref()
    }

    /// Whether page `i`'s outcome is decided.
    pub fn is_set(&self, i: usize) -> bool {
        self.out[i].is_some()
    }

    /// One outcome per page (invariant 1).
    pub fn finish(self) -> Vec<PageOutcome> {
        self.out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    PageOutcome::Failed(PageError::Backend("internal: no outcome".into()))
                })
            })
            .collect()
    }
}

/// A classified `batch_set`: the outcomes decided without writing, the pages to write.
#[derive(Clone, Debug)]
pub struct SetBatch {
    /// Outcomes decided so far (the backend fills in those of [`todo`](Self::todo)).
    pub outcomes: Outcomes,
    /// Indices of the pages to write, in batch order, each key once.
    pub todo: Vec<usize>,
    /// `(repeat, first)`: pages repeating the key of an earlier page of the batch.
    dups: Vec<(usize, usize)>,
}

impl SetBatch {
    /// Classifies a batch: an empty page fails with `EmptyPage`; a page `too_large` refuses
    /// (it returns the largest accepted length) fails with `TooLarge`; a page `present`
    /// reports stored with the same metadata is `Present` (`present` may refresh its
    /// recency); a repeated key follows its first occurrence; every other page is to write.
    pub fn classify(
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        too_large: impl Fn(usize) -> Option<usize>,
        mut present: impl FnMut(&PageKey, PageMeta) -> bool,
    ) -> Self {
        let mut outcomes = Outcomes::new(keys.len());
        let mut todo = Vec::new();
        let mut dups = Vec::new();
        let mut first: HashMap<PageKey, usize> = HashMap::new();
        for (i, (k, p)) in keys.iter().zip(src).enumerate() {
            if p.is_empty() {
                outcomes.set(i, PageOutcome::Failed(PageError::EmptyPage));
            } else if let Some(max) = too_large(p.len()) {
                let len = p.len();
                outcomes.set(i, PageOutcome::Failed(PageError::TooLarge { len, max }));
            } else if present(k, p.meta()) {
                outcomes.set(i, PageOutcome::Present);
            } else if let Some(&f) = first.get(k) {
                dups.push((i, f));
            } else {
                first.insert(*k, i);
                todo.push(i);
            }
        }
        Self {
            outcomes,
            todo,
            dups,
        }
    }

    /// The outcomes, one per page, repeats resolved (invariants 1 and 2).
    pub fn finish(mut self) -> Vec<PageOutcome> {
        for (i, f) in self.dups {
            let o = match self.outcomes.get(f) {
                Some(PageOutcome::Stored) => PageOutcome::Present,
                Some(o) => o.clone(),
                None => PageOutcome::Failed(PageError::Backend(
                    "internal: duplicate without outcome".into(),
                )),
            };
            self.outcomes.set(i, o);
        }
        self.outcomes.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pattern::{namespace, page_key};
    use hicache_core::LayoutKind;

    #[test]
    fn every_class_of_page_gets_its_outcome() {
        let ks: Vec<PageKey> = (0..5).map(|i| page_key(namespace(1), 1, i)).collect();
        let big = vec![1u8; 100];
        let small = vec![2u8; 10];
        // 0 empty, 1 too large, 2 present, 3 to write, 4 repeats 3.
        let keys = [ks[0], ks[1], ks[2], ks[3], ks[3]];
        let src = [
            PageBuf::contiguous(LayoutKind::PageFirst, &[]),
            PageBuf::contiguous(LayoutKind::PageFirst, &big),
            PageBuf::contiguous(LayoutKind::PageFirst, &small),
            PageBuf::contiguous(LayoutKind::PageFirst, &small),
            PageBuf::contiguous(LayoutKind::PageFirst, &small),
        ];
        let mut b = SetBatch::classify(
            &keys,
            &src,
            |len| (len > 50).then_some(50),
            |k, _| *k == ks[2],
        );
        assert_eq!(b.todo, vec![3]);
        b.outcomes.set(3, PageOutcome::Stored);
        let out = b.finish();
        assert_eq!(out[0], PageOutcome::Failed(PageError::EmptyPage));
        assert_eq!(
            out[1],
            PageOutcome::Failed(PageError::TooLarge { len: 100, max: 50 })
        );
        assert_eq!(
            out[2..],
            [
                PageOutcome::Present,
                PageOutcome::Stored,
                PageOutcome::Present
            ]
        );
    }

    #[test]
    fn an_undecided_page_is_an_internal_failure() {
        let out = Outcomes::new(1).finish();
        assert!(
            matches!(&out[0], PageOutcome::Failed(PageError::Backend(m)) if m.contains("internal"))
        );
    }
}
