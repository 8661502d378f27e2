//! The pieces of the per-tick rank agreement both controllers (`HiCache` and `HybridCache`)
//! share: [`agree`] (one fixed-shape exchange of a tick's fixed values and one record of
//! [`Counts`] per tracked prefetch) and [`leading`] (how many work items, from the oldest,
//! have finished — what every queue of copies or L3 jobs reports before the exchange).
//!
//! Rules (see [`crate::rank`]):
//! 1. A tick exchanges **once**: every value it needs is gathered before the call, and only
//!    the agreed values (every rank's minimum) are applied after it.
//! 2. The shape is the same on every rank: the fixed values are a constant number, and the
//!    prefetches tracked are the same on every rank, in the same (creation) order.
//! 3. Work finishes oldest first: a queue reports its leading run of finished items, so the
//!    agreed minimum names the same items on every rank.

use crate::error::Result;
use crate::rank::RankGroup;

/// One tracked item's values in the exchange (reduced with `min` over ranks).
pub(crate) trait Counts: Sized {
    /// Values per item in the exchange.
    const LEN: usize;

    /// Appends the item's `LEN` exchanged values to `out`.
    fn encode_into(&self, out: &mut Vec<u64>);

    /// The item from its `LEN` exchanged values.
    fn decode(v: &[u64]) -> Self;
}

/// Replaces `fixed` and every one of `items` with every rank's minimum, through one
/// exchange of `fixed.len() + C::LEN * items.len()` values (rules 1 and 2).
pub(crate) fn agree<C: Counts>(
    rank: &dyn RankGroup,
    fixed: &mut [u64],
    items: &mut [C],
) -> Result<()> {
    let mut v = Vec::with_capacity(fixed.len() + C::LEN * items.len());
    v.extend_from_slice(fixed);
    for item in items.iter() {
        item.encode_into(&mut v);
    }
    rank.exchange(&mut v, &mut [])?;
    let (head, per) = v.split_at(fixed.len());
    fixed.copy_from_slice(head);
    for (item, agreed) in items.iter_mut().zip(per.chunks_exact(C::LEN)) {
        *item = C::decode(agreed);
    }
    Ok(())
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

    /// Two values per item.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct Pair(u64, u64);

    impl Counts for Pair {
        const LEN: usize = 2;
        fn encode_into(&self, out: &mut Vec<u64>) {
            out.extend([self.0, self.1]);
        }
        fn decode(v: &[u64]) -> Self {
            Pair(v[0], v[1])
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
            peer: vec![1, 9, 4, 0, 3, 3],
        };
        let mut fixed = [5, 2];
        let mut items = [Pair(7, 1), Pair(2, 8)];
        agree(&group, &mut fixed, &mut items).unwrap();
        assert_eq!(fixed, [1, 2]);
        assert_eq!(items, [Pair(4, 0), Pair(2, 3)]);
        // A different shape on the peer is the group's error, passed on.
        let err = agree(&group, &mut [1], &mut [Pair(0, 0)]).unwrap_err();
        assert!(err.to_string().contains("shape 3"), "{err}");
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
