//! The index against its naive model over random operation sequences.

use hicache_index::reference::ReferenceIndex;
use hicache_index::{HolderId, HolderKind, Index, Tier};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Store(u8, Tier, Vec<u8>),
    Remove(u8, Tier, Vec<u8>),
    Clear(u8),
    Attach(u8, u8),
    Detach(u8, u8),
    Query(Vec<u8>),
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::L1), Just(Tier::L2), Just(Tier::L3)]
}

fn op() -> impl Strategy<Value = Op> {
    let chain = prop::collection::vec(0u8..12, 0..8);
    prop_oneof![
        4 => (0u8..6, tier(), chain.clone()).prop_map(|(h, t, c)| Op::Store(h, t, c)),
        2 => (0u8..6, tier(), chain.clone()).prop_map(|(h, t, c)| Op::Remove(h, t, c)),
        1 => (0u8..6).prop_map(Op::Clear),
        1 => (0u8..4, 4u8..6).prop_map(|(i, s)| Op::Attach(i, s)),
        1 => (0u8..4, 4u8..6).prop_map(|(i, s)| Op::Detach(i, s)),
        3 => chain.prop_map(Op::Query),
    ]
}

/// Small block alphabet so chains overlap: block `x` of a chain is hash `x + 1`.
fn hashes(c: &[u8]) -> Vec<u64> {
    c.iter().map(|x| u64::from(*x) + 1).collect()
}

proptest! {
    #[test]
    fn index_matches_the_naive_model(
        ops in prop::collection::vec(op(), 1..200),
        capacity in prop_oneof![Just(None), (1u64..40).prop_map(Some)],
    ) {
        let mut idx = Index::new(capacity);
        let mut model = ReferenceIndex::new(capacity);
        // Holders 0..4 are instances, 4..6 stores.
        for i in 0..6 {
            let kind = if i < 4 { HolderKind::Instance } else { HolderKind::Store };
            prop_assert_eq!(idx.add_holder(kind).unwrap(), model.add_holder(kind));
        }
        let mut out = Vec::new();
        for op in ops {
            match op {
                Op::Store(h, t, c) => {
                    let t = if h >= 4 { Tier::L3 } else { t };
                    let a = idx.store(HolderId(h.into()), t, &hashes(&c)).unwrap();
                    let b = model.store(HolderId(h.into()), t, &hashes(&c));
                    prop_assert_eq!(a, b);
                }
                Op::Remove(h, t, c) => {
                    let a = idx.remove(HolderId(h.into()), t, &hashes(&c)).unwrap();
                    let b = model.remove(HolderId(h.into()), t, &hashes(&c));
                    prop_assert_eq!(a, b);
                }
                Op::Clear(h) => {
                    let a = idx.clear(HolderId(h.into())).unwrap();
                    prop_assert_eq!(a, model.clear(HolderId(h.into())));
                }
                Op::Attach(i, s) => {
                    idx.attach(HolderId(i.into()), HolderId(s.into())).unwrap();
                    model.attach(HolderId(i.into()), HolderId(s.into()));
                }
                Op::Detach(i, s) => {
                    idx.detach(HolderId(i.into()), HolderId(s.into())).unwrap();
                    model.detach(HolderId(i.into()), HolderId(s.into()));
                }
                Op::Query(c) => {
                    idx.query(&hashes(&c), &mut out);
                    prop_assert_eq!(&out, &model.query(&hashes(&c)));
                }
            }
            prop_assert_eq!(idx.stats().holder_blocks, model.holder_blocks());
            prop_assert_eq!(idx.stats().evicted, model.evicted);
        }
    }
}

#[test]
fn a_store_holds_l3_only_and_kinds_are_checked() {
    let mut idx = Index::new(None);
    let i = idx.add_holder(HolderKind::Instance).unwrap();
    let s = idx.add_holder(HolderKind::Store).unwrap();
    assert!(idx.store(s, Tier::L1, &[1]).is_err());
    assert!(idx.attach(s, i).is_err());
    assert!(idx.store(HolderId(99), Tier::L1, &[1]).is_err());
    idx.attach(i, s).unwrap();
    idx.store(s, Tier::L3, &[1, 2]).unwrap();
    idx.store(i, Tier::L1, &[1]).unwrap();
    let mut out = Vec::new();
    idx.query(&[1, 2, 3], &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].l1, out[0].l2, out[0].l3), (1, 1, 2));
}
