//! The index against its naive model over random operation sequences.

use hicache_index::reference::ReferenceIndex;
use hicache_index::{Answer, HolderId, HolderKind, Index, Tier};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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
        let mut out = Answer::new();
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
                    prop_assert_eq!(out.to_vec(), model.query(&hashes(&c)));
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
    let mut out = Answer::new();
    idx.query(&[1, 2, 3], &mut out);
    assert_eq!(out.len(), 1);
    let m = out.get(i).unwrap();
    assert_eq!((m.l1, m.l2, m.l3), (1, 1, 2));
}

/// Random chains that overlap the way cached prefixes do: 24 template chains built from a
/// small alphabet, several sharing their first blocks; an event takes a slice of one.
struct Chains {
    templates: Vec<Vec<u64>>,
}

impl Chains {
    fn new(rng: &mut StdRng) -> Self {
        let mut templates: Vec<Vec<u64>> = Vec::new();
        for t in 0..24 {
            let shared = if t > 0 && rng.random_bool(0.5) {
                let other = &templates[rng.random_range(0..templates.len())];
                other[..rng.random_range(1..other.len())].to_vec()
            } else {
                Vec::new()
            };
            let mut c = shared;
            while c.len() < 16 {
                c.push(rng.random_range(1..80));
            }
            templates.push(c);
        }
        Self { templates }
    }

    /// A chain: usually a template's prefix, sometimes a slice from its middle (an L3 store
    /// filled out of order), sometimes with a repeated block.
    fn pick(&self, rng: &mut StdRng) -> Vec<u64> {
        let t = &self.templates[rng.random_range(0..self.templates.len())];
        let start = if rng.random_bool(0.2) {
            rng.random_range(0..t.len())
        } else {
            0
        };
        let end = rng.random_range(start..=t.len());
        let mut c = t[start..end].to_vec();
        if !c.is_empty() && rng.random_bool(0.05) {
            let dup = c[rng.random_range(0..c.len())];
            c.insert(rng.random_range(0..=c.len()), dup);
        }
        c
    }
}

/// One long seeded run per capacity: 10^6 events in all (stores with refreshes and
/// duplicates, removals of held and absent blocks, clears as restarts, holders removed and
/// replaced, shared stores attached and detached, queries), every answer and count compared.
#[test]
fn a_million_random_events_match_the_naive_model() {
    // (capacity, instances, stores, events): the larger fleets give blocks held by more than
    // 32 holders and queries with many candidates (the query's dense and merge paths).
    let runs = [
        (None, 6, 3, 240_000),
        (Some(5), 6, 3, 200_000),
        (Some(60), 6, 3, 200_000),
        (Some(400), 6, 3, 200_000),
        (None, 40, 6, 80_000),
        (Some(2_000), 40, 6, 80_000),
    ];
    let mut rng = StdRng::seed_from_u64(0x6869_6361_6368_6549);
    let mut events = 0u64;
    let mut out = Answer::new();
    for (capacity, n_instances, n_stores, per_run) in runs {
        let chains = Chains::new(&mut rng);
        let mut idx = Index::new(capacity);
        let mut model = ReferenceIndex::new(capacity);
        let (mut instances, mut stores) = (Vec::new(), Vec::new());
        for i in 0..n_instances + n_stores {
            let kind = if i < n_instances {
                HolderKind::Instance
            } else {
                HolderKind::Store
            };
            let h = idx.add_holder(kind).unwrap();
            assert_eq!(h, model.add_holder(kind));
            if i < n_instances {
                instances.push(h)
            } else {
                stores.push(h)
            }
        }
        for step in 0..per_run {
            events += 1;
            let any = |rng: &mut StdRng, i: &[HolderId], s: &[HolderId]| {
                let n = rng.random_range(0..i.len() + s.len());
                if n < i.len() {
                    (i[n], true)
                } else {
                    (s[n - i.len()], false)
                }
            };
            let tier = |rng: &mut StdRng| [Tier::L1, Tier::L2, Tier::L3][rng.random_range(0..3)];
            match rng.random_range(0..1000) {
                0..450 => {
                    let (h, inst) = any(&mut rng, &instances, &stores);
                    let t = if inst { tier(&mut rng) } else { Tier::L3 };
                    let c = chains.pick(&mut rng);
                    assert_eq!(
                        idx.store(h, t, &c).unwrap(),
                        model.store(h, t, &c),
                        "store #{step}"
                    );
                }
                450..600 => {
                    let (h, _) = any(&mut rng, &instances, &stores);
                    let t = tier(&mut rng);
                    let mut c = chains.pick(&mut rng);
                    if rng.random_bool(0.3) {
                        c.push(rng.random_range(80..100));
                    }
                    assert_eq!(
                        idx.remove(h, t, &c).unwrap(),
                        model.remove(h, t, &c),
                        "remove #{step}"
                    );
                }
                600..615 => {
                    let (h, _) = any(&mut rng, &instances, &stores);
                    assert_eq!(idx.clear(h).unwrap(), model.clear(h), "clear #{step}");
                }
                615..618 => {
                    // A holder goes away and a new one of the same kind takes its place.
                    let (h, inst) = any(&mut rng, &instances, &stores);
                    idx.remove_holder(h).unwrap();
                    model.remove_holder(h);
                    let kind = if inst {
                        HolderKind::Instance
                    } else {
                        HolderKind::Store
                    };
                    let new = idx.add_holder(kind).unwrap();
                    assert_eq!(new, model.add_holder(kind));
                    let list = if inst { &mut instances } else { &mut stores };
                    *list.iter_mut().find(|x| **x == h).unwrap() = new;
                }
                618..640 => {
                    let i = instances[rng.random_range(0..instances.len())];
                    let s = stores[rng.random_range(0..stores.len())];
                    if rng.random_bool(0.6) {
                        idx.attach(i, s).unwrap();
                        model.attach(i, s);
                    } else {
                        idx.detach(i, s).unwrap();
                        model.detach(i, s);
                    }
                }
                _ => {
                    let mut c = chains.pick(&mut rng);
                    if rng.random_bool(0.1) {
                        c.push(rng.random_range(1..100));
                    }
                    idx.query(&c, &mut out);
                    assert_eq!(out.to_vec(), model.query(&c), "query #{step} {c:?}");
                }
            }
            let stats = idx.stats();
            assert_eq!(stats.holder_blocks, model.holder_blocks(), "after #{step}");
            assert_eq!(stats.evicted, model.evicted, "after #{step}");
            if step % 4_096 == 0 {
                assert_eq!(stats.blocks, model.blocks(), "after #{step}");
            }
        }
    }
    assert!(events >= 1_000_000);
}
