//! Unit tests of the unified tree and proptest model tests of its invariants.

use proptest::prelude::*;

use super::*;

fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
    r.collect()
}

fn swa(ps: u32, w: u32) -> UnifiedTree {
    UnifiedTree::new(UnifiedConfig {
        swa_window: Some(w),
        ..UnifiedConfig::full(ps)
    })
    .unwrap()
}

fn mamba(ps: u32, chunk: u32) -> UnifiedTree {
    UnifiedTree::new(UnifiedConfig {
        mamba_chunk: Some(chunk),
        ..UnifiedConfig::full(ps)
    })
    .unwrap()
}

#[test]
fn full_only_match_insert_evict() {
    let mut t = UnifiedTree::new(UnifiedConfig::full(4)).unwrap();
    let k = toks(0..16);
    assert_eq!(t.match_prefix(&k).unwrap().device_prefix_len, 0);
    let r = t.insert(&k, &InsertParams::default()).unwrap();
    assert_eq!(r.prefix_len, 0);
    assert_eq!(t.size(Component::Full), 16);
    let m = t.match_prefix(&k[..10]).unwrap();
    assert_eq!((m.device_prefix_len, m.full_hit_len), (8, 8));
    t.check_invariants().unwrap();
    let e = t.evict(EvictRequest {
        full: 1,
        ..Default::default()
    });
    assert_eq!(e.full, 8, "the split-off tail leaf goes first");
    t.check_invariants().unwrap();
}

#[test]
fn bad_configs_and_unaligned_keys_are_errors() {
    assert!(UnifiedTree::new(UnifiedConfig::full(0)).is_err());
    let zero_window = UnifiedConfig {
        swa_window: Some(0),
        ..UnifiedConfig::full(4)
    };
    assert!(UnifiedTree::new(zero_window).is_err());
    let mut t = UnifiedTree::new(UnifiedConfig::full(4)).unwrap();
    assert!(t.insert(&toks(0..6), &InsertParams::default()).is_err());
    let mut m = mamba(4, 4);
    assert!(
        m.insert(&toks(0..8), &InsertParams::default()).is_err(),
        "Mamba needs a state slot"
    );
}

#[test]
fn swa_leaf_is_capped_at_one_window_and_tombstones_gate_the_match() {
    // Window 6 tokens, page 4: a new 16-token leaf splits into 8 + 8 (tail = ceil(6/4)*4).
    let mut t = swa(4, 6);
    t.insert(&toks(0..16), &InsertParams::default()).unwrap();
    assert_eq!(t.node_count(), 3);
    assert_eq!(t.size(Component::Swa), 16);
    // Evict SWA from the older (internal) node: it becomes a tombstone, Full stays.
    let e = t.evict(EvictRequest {
        swa: 1,
        ..Default::default()
    });
    assert_eq!((e.full, e.swa), (0, 8));
    assert_eq!(t.size(Component::Full), 16);
    t.check_invariants().unwrap();
    // The match cannot end on the tombstone; the leaf after it covers 8 >= 6 live tokens.
    let m = t.match_prefix(&toks(0..16)).unwrap();
    assert_eq!((m.device_prefix_len, m.full_hit_len), (16, 16));
    let m = t.match_prefix(&toks(0..8)).unwrap();
    assert_eq!((m.device_prefix_len, m.full_hit_len), (0, 8));
    assert_eq!(m.swa_branching, Some(8));
    // Re-inserting the prefix recovers the tombstone (window floor 0).
    let r = t
        .insert(
            &toks(0..8),
            &InsertParams {
                prev_prefix_len: 0,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(r.duplicate_tokens, 0, "the tombstone took the request's KV");
    assert_eq!(t.size(Component::Swa), 16);
    t.check_invariants().unwrap();
}

#[test]
fn swa_floor_leaves_a_tombstone_below_it() {
    // The request's SWA KV starts at 8: the leaf splits there, the older part a tombstone.
    let mut t = swa(4, 6);
    let p = InsertParams {
        swa_evicted_len: 8,
        ..Default::default()
    };
    t.insert(&toks(0..16), &p).unwrap();
    assert_eq!((t.size(Component::Full), t.size(Component::Swa)), (16, 8));
    let m = t.match_prefix(&toks(0..16)).unwrap();
    assert_eq!(
        m.device_prefix_len, 16,
        "8 live tokens after the tombstone cover 6"
    );
    let m = t.match_prefix(&toks(0..8)).unwrap();
    assert_eq!(m.device_prefix_len, 0);
    t.check_invariants().unwrap();
}

#[test]
fn swa_window_lock_protects_only_the_window() {
    let mut t = swa(4, 4);
    t.insert(&toks(0..16), &InsertParams::default()).unwrap();
    // Leaf capped at 4 tokens: nodes of 12 + 4.
    let m = t.match_prefix(&toks(0..16)).unwrap();
    let r = t.lock(m.node, false).unwrap();
    assert_eq!(t.protected_size(Component::Full), 16);
    assert_eq!(
        t.protected_size(Component::Swa),
        4,
        "only the window is locked"
    );
    let e = t.evict(EvictRequest {
        full: 100,
        swa: 100,
        mamba: 0,
    });
    assert_eq!(
        (e.full, e.swa),
        (0, 12),
        "the unlocked older SWA goes, Full stays"
    );
    t.unlock(&r).unwrap();
    assert!(t.unlock(&r).is_err(), "a second release is refused");
    assert_eq!(t.protected_size(Component::Full), 0);
    t.check_invariants().unwrap();
}

#[test]
fn mamba_branching_and_copy_on_write_source() {
    let mut t = mamba(4, 8);
    let p = |slot| InsertParams {
        mamba_slot: Some(slot),
        ..Default::default()
    };
    t.insert(&toks(0..16), &p(7)).unwrap();
    let m = t.match_prefix(&toks(0..16)).unwrap();
    assert_eq!((m.device_prefix_len, m.mamba_slot), (16, Some(7)));
    // A prefix ends inside the node: the split-off prefix has no state.
    let m = t.match_prefix(&toks(0..12)).unwrap();
    assert_eq!((m.device_prefix_len, m.full_hit_len), (0, 12));
    assert_eq!(m.mamba_branching, Some(8), "Full hit aligned to lcm(8, 4)");
    // The same key again: the state exists, the handed slot is not taken.
    let r = t.insert(&toks(0..16), &p(9)).unwrap();
    assert!(r.mamba_exist);
    let e = t.evict(EvictRequest {
        mamba: 1,
        ..Default::default()
    });
    assert_eq!(
        (e.full, e.mamba, e.mamba_slots.clone()),
        (4, 1, vec![7]),
        "a leaf goes whole"
    );
    t.check_invariants().unwrap();
}

/// One step of the model test.
#[derive(Clone, Debug)]
enum Op {
    /// A request: match, lock, insert the key, unlock (or keep the lock held).
    Request { seq: usize, len: usize, hold: bool },
    /// Release the oldest held lock.
    Release,
    /// Evict (Full tokens, SWA tokens, Mamba states).
    Evict(u64, u64, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..4, 1usize..12, any::<bool>())
            .prop_map(|(seq, len, hold)| Op::Request { seq, len, hold }),
        1 => Just(Op::Release),
        2 => (0u64..40, 0u64..40, 0u64..4).prop_map(|(a, b, c)| Op::Evict(a, b, c)),
    ]
}

/// Key pages of sequence `seq`: 4 sequences sharing prefixes of different lengths.
fn key(seq: usize, pages: usize, ps: usize) -> Vec<u32> {
    (0..pages * ps)
        .map(|i| {
            if i < seq * 2 * ps {
                i as u32
            } else {
                (seq * 1000 + i) as u32
            }
        })
        .collect()
}

/// Components present on `node` and on its path (Full), to compare after an eviction.
fn snapshot(t: &UnifiedTree, r: &LockReceipt) -> Vec<bool> {
    [Component::Full, Component::Swa, Component::Mamba]
        .iter()
        .map(|&c| t.has(c) && t.present(r.node, c).unwrap())
        .collect()
}

/// Every device slot the tree holds, per component (Full, SWA).
fn held_slots(t: &UnifiedTree) -> [Vec<u32>; 2] {
    let mut out = [Vec::new(), Vec::new()];
    for n in t.arena.nodes.iter().filter(|n| n.live) {
        out[0].extend(&n.full_pages);
        out[1].extend(&n.swa_pages);
    }
    out.iter_mut().for_each(|v| v.sort_unstable());
    out
}

/// The request's slots: the tree's own on the matched prefix, fresh ones elsewhere.
fn request_slots(t: &UnifiedTree, m: &UnifiedMatch, pages: usize, next: &mut u32) -> [Vec<u32>; 2] {
    let mut fresh = |x: Option<u32>| {
        x.unwrap_or_else(|| {
            *next += 1;
            *next
        })
    };
    let mut out = [Vec::new(), Vec::new()];
    for (c, comp) in [Component::Full, Component::Swa].into_iter().enumerate() {
        if !t.has(comp) {
            continue;
        }
        let mut v = t.prefix_pages(m.node, comp).unwrap();
        v.resize(pages, None);
        out[c] = v.into_iter().map(&mut fresh).collect();
    }
    out
}

/// Inserts `k` with slots and checks the ledger: the tree's slots before plus the fresh
/// handed ones equal the tree's slots after plus the returned ones.
fn insert_tracked(
    t: &mut UnifiedTree,
    m: &UnifiedMatch,
    k: &[u32],
    p: &InsertParams,
    next: &mut u32,
) -> std::result::Result<UnifiedInsert, TestCaseError> {
    let before = held_slots(t);
    let s = request_slots(t, m, k.len() / t.ps(), next);
    let ins = t
        .insert_with_slots(
            k,
            p,
            InsertSlots {
                full: &s[0],
                swa: &s[1],
            },
        )
        .unwrap();
    let after = held_slots(t);
    let released = [&ins.release_full, &ins.release_swa];
    for c in 0..2 {
        let mut lhs = before[c].clone();
        lhs.extend(s[c].iter().filter(|x| !before[c].contains(x)));
        lhs.sort_unstable();
        lhs.dedup();
        let mut rhs = after[c].clone();
        rhs.extend(released[c]);
        rhs.sort_unstable();
        prop_assert_eq!(lhs, rhs, "slot ledger of component {} on insert", c);
    }
    Ok(ins)
}

fn run_model(
    cfg: UnifiedConfig,
    ops: &[Op],
    slots: bool,
) -> std::result::Result<(), TestCaseError> {
    let ps = cfg.page_size as usize;
    let mut t = if slots {
        UnifiedTree::with_device_slots(cfg.clone()).unwrap()
    } else {
        UnifiedTree::new(cfg.clone()).unwrap()
    };
    let mut next = 1_000_000u32;
    let mut held: Vec<(LockReceipt, Vec<bool>)> = Vec::new();
    let mut slot = 0u32;
    for op in ops {
        match *op {
            Op::Request { seq, len, hold } => {
                let k = key(seq, len, ps);
                let m = t.match_prefix(&k).unwrap();
                check_match(&t, &m)?;
                let r = t.lock(m.node, false).unwrap();
                slot += 1;
                let p = InsertParams {
                    prev_prefix_len: m.device_prefix_len,
                    swa_evicted_len: 0,
                    mamba_slot: Some(slot),
                };
                let ins = if slots {
                    insert_tracked(&mut t, &m, &k, &p, &mut next)?
                } else {
                    t.insert(&k, &p).unwrap()
                };
                prop_assert!(ins.prefix_len >= m.device_prefix_len);
                if hold {
                    let snap = snapshot(&t, &r);
                    held.push((r, snap));
                } else {
                    t.unlock(&r).unwrap();
                }
            }
            Op::Release => {
                if !held.is_empty() {
                    let (r, _) = held.remove(0);
                    t.unlock(&r).unwrap();
                }
            }
            Op::Evict(f, s, m) => {
                let before = t.clone();
                let e = t.evict(EvictRequest {
                    full: f,
                    swa: s,
                    mamba: m,
                });
                check_eviction(&before, &t, &e)?;
                let (mut lhs, mut rhs) = (held_slots(&before), held_slots(&t));
                for (c, freed) in [&e.full_pages, &e.swa_pages].into_iter().enumerate() {
                    rhs[c].extend(freed);
                    rhs[c].sort_unstable();
                    lhs[c].sort_unstable();
                    prop_assert_eq!(&lhs[c], &rhs[c], "slot ledger of component {} on evict", c);
                }
                for (r, snap) in &held {
                    prop_assert_eq!(&snapshot(&t, r), snap, "a locked component was evicted");
                }
            }
        }
        t.check_invariants().map_err(TestCaseError::fail)?;
    }
    for (r, _) in held.drain(..) {
        t.unlock(&r).unwrap();
    }
    for c in [Component::Full, Component::Swa, Component::Mamba] {
        prop_assert_eq!(t.protected_size(c), 0, "all locks released");
    }
    t.check_invariants().map_err(TestCaseError::fail)?;
    Ok(())
}

/// A match never ends where a component has no data (a tombstone serves nothing).
fn check_match(t: &UnifiedTree, m: &UnifiedMatch) -> std::result::Result<(), TestCaseError> {
    prop_assert!(m.full_hit_len >= m.device_prefix_len);
    if m.node != t.root() {
        prop_assert!(t.present(m.node, Component::Full).unwrap());
        if t.has(Component::Swa) {
            prop_assert!(
                t.present(m.node, Component::Swa).unwrap(),
                "match ended on an SWA tombstone"
            );
        }
        if t.has(Component::Mamba) {
            prop_assert!(
                m.mamba_slot.is_some(),
                "match ended on a node without state"
            );
        }
    }
    Ok(())
}

/// What an eviction freed equals what left the tree, and Full leaves only with whole leaves.
fn check_eviction(
    before: &UnifiedTree,
    after: &UnifiedTree,
    e: &Evicted,
) -> std::result::Result<(), TestCaseError> {
    for (c, n) in [
        (Component::Full, e.full),
        (Component::Swa, e.swa),
        (Component::Mamba, e.mamba),
    ] {
        prop_assert_eq!(
            before.size(c) - after.size(c),
            n,
            "sizes add up for {:?}",
            c
        );
    }
    // Cascade: on a surviving node, SWA dropped by this eviction takes Mamba with it; Full
    // never leaves a surviving node.
    for (i, n) in after.arena.nodes.iter().enumerate() {
        let b = &before.arena.nodes[i];
        if !n.live || !b.live || n.generation != b.generation {
            continue;
        }
        prop_assert!(n.comp[0].present);
        if b.comp[1].present && !n.comp[1].present && b.comp[2].present {
            prop_assert!(
                !n.comp[2].present,
                "SWA went without its Mamba on node {}",
                i
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn model_full_swa(ops in proptest::collection::vec(op(), 1..40), w in 1u32..20, slots: bool) {
        run_model(UnifiedConfig { swa_window: Some(w), ..UnifiedConfig::full(2) }, &ops, slots)?;
    }

    #[test]
    fn model_full_mamba(ops in proptest::collection::vec(op(), 1..40), slots: bool) {
        run_model(UnifiedConfig { mamba_chunk: Some(4), ..UnifiedConfig::full(2) }, &ops, slots)?;
    }

    #[test]
    fn model_full_swa_mamba(ops in proptest::collection::vec(op(), 1..40), w in 1u32..12, slots: bool) {
        let cfg = UnifiedConfig { swa_window: Some(w), mamba_chunk: Some(2), ..UnifiedConfig::full(2) };
        run_model(cfg, &ops, slots)?;
    }

    #[test]
    fn lru_order_puts_the_matched_window_first(w in 1u32..16) {
        let mut t = swa(2, w);
        t.insert(&key(0, 10, 2), &InsertParams::default()).unwrap();
        t.insert(&key(1, 10, 2), &InsertParams::default()).unwrap();
        let m = t.match_prefix(&key(0, 10, 2)).unwrap();
        let (i, _) = m.node.parts();
        prop_assert_eq!(t.lrus[0].order().first().copied(), Some(i));
    }
}

#[test]
fn device_slots_follow_split_recovery_and_eviction() {
    let cfg = UnifiedConfig {
        swa_window: Some(4),
        ..UnifiedConfig::full(2)
    };
    assert!(
        UnifiedTree::new(cfg.clone())
            .unwrap()
            .insert_with_slots(
                &toks(0..2),
                &InsertParams::default(),
                InsertSlots {
                    full: &[1],
                    swa: &[1]
                }
            )
            .is_err()
    );
    let mut t = UnifiedTree::with_device_slots(cfg).unwrap();
    assert!(t.insert(&toks(0..2), &InsertParams::default()).is_err());
    let k = toks(0..8);
    let s = InsertSlots {
        full: &[10, 11, 12, 13],
        swa: &[20, 21, 22, 23],
    };
    let ins = t
        .insert_with_slots(&k, &InsertParams::default(), s)
        .unwrap();
    assert!(ins.release_full.is_empty() && ins.release_swa.is_empty());
    // The leaf is capped at one window (2 pages): the older part holds pages 0..2.
    let full: Vec<_> = t.prefix_pages(ins.node, Component::Full).unwrap();
    assert_eq!(full, [10, 11, 12, 13].map(Some));
    // Evict SWA only: the LRU tail is the older internal node; it becomes a tombstone and
    // hands its slots back.
    let e = t.evict(EvictRequest {
        swa: 4,
        ..EvictRequest::default()
    });
    assert_eq!(e.full_pages, Vec::<u32>::new());
    let mut freed = e.swa_pages.clone();
    freed.sort_unstable();
    assert_eq!(freed, [20, 21]);
    assert_eq!(
        t.prefix_pages(ins.node, Component::Swa).unwrap(),
        [None, None, Some(22), Some(23)]
    );
    // Re-inserting recovers the tombstones (unlocked Full): the tree takes the request's
    // Full and SWA slots there and returns its old Full slots and the duplicate tail.
    let s = InsertSlots {
        full: &[30, 31, 32, 33],
        swa: &[40, 41, 42, 43],
    };
    let ins = t
        .insert_with_slots(&k, &InsertParams::default(), s)
        .unwrap();
    let mut rf = ins.release_full.clone();
    rf.sort_unstable();
    assert_eq!(rf, [10, 11, 32, 33]);
    let mut rs = ins.release_swa.clone();
    rs.sort_unstable();
    assert_eq!(rs, [42, 43]);
    assert_eq!(
        t.prefix_pages(ins.node, Component::Full).unwrap(),
        [30, 31, 12, 13].map(Some)
    );
    assert_eq!(
        t.prefix_pages(ins.node, Component::Swa).unwrap(),
        [40, 41, 22, 23].map(Some)
    );
    // A match that ends inside a node splits it; the prefix keeps the first slots.
    let m = t.match_prefix(&toks(0..2)).unwrap();
    assert_eq!(t.prefix_pages(m.node, Component::Swa).unwrap(), [Some(40)]);
    t.check_invariants().unwrap();
    // Evicting everything returns every slot the tree holds.
    let e = t.evict(EvictRequest {
        full: 100,
        ..EvictRequest::default()
    });
    let mut all = e.full_pages.clone();
    all.sort_unstable();
    assert_eq!(all, [12, 13, 30, 31]);
    assert_eq!(t.size(Component::Full), 0);
}
