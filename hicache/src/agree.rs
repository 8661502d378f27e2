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
        agree(&group, &mut fixed, &mut items).unwrap();
        assert_eq!(fixed, [1, 2]);
        assert_eq!(items, [pair(4, false), pair(2, true)]);
        // A different shape on the peer is the group's error, passed on.
        let err = agree(&group, &mut [1], &mut [pair(0, false)]).unwrap_err();
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
