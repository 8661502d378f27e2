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
    /// Back up the n-th live node (ancestors first); finish the pending backups or not.
    Backup(usize, bool),
    /// Match a key and load its host hit back to device; finish the load or keep it pending.
    LoadBack {
        seq: usize,
        len: usize,
        finish: bool,
    },
    /// Free host copies of a component (0 Full, 1 SWA, 2 Mamba): tokens, or states.
    EvictHost(usize, u64),
    /// Pin the host copy of the n-th node on host.
    PinHost(usize),
}

fn op() -> impl Strategy<Value = Op> {
    op_weighted(1)
}

/// Operations with the host-tier ones (backup, load-back, host eviction) `host` times as
/// likely as in [`op`].
fn op_weighted(host: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..4, 1usize..12, any::<bool>())
            .prop_map(|(seq, len, hold)| Op::Request { seq, len, hold }),
        1 => Just(Op::Release),
        2 => (0u64..40, 0u64..40, 0u64..4).prop_map(|(a, b, c)| Op::Evict(a, b, c)),
        2 * host => (0usize..64, any::<bool>()).prop_map(|(n, f)| Op::Backup(n, f)),
        2 * host => (0usize..4, 1usize..12, any::<bool>())
            .prop_map(|(seq, len, finish)| Op::LoadBack { seq, len, finish }),
        host => (0usize..3, 0u64..40).prop_map(|(c, n)| Op::EvictHost(c, n)),
        host => (0usize..64).prop_map(Op::PinHost),
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

/// `Op::EvictHost`: per-component host eviction; Full against the scanning model, and no
/// host-locked copy freed, no device slot moved, every freed host slot accounted for.
fn evict_host_step(
    t: &mut UnifiedTree,
    c: usize,
    n: u64,
    pins: &[HostLockReceipt],
) -> std::result::Result<(), TestCaseError> {
    let c = [Component::Full, Component::Swa, Component::Mamba][c];
    let before = held_slots(t);
    let locked = host_locked(t);
    let mut naive = t.clone();
    let e = t.evict_host_of(c, n);
    if c == Component::Full {
        prop_assert_eq!(&naive_evict_host(&mut naive, n), &e, "heap vs scan");
    }
    prop_assert_eq!(locked, host_locked(t), "a host-locked copy was freed");
    let after = held_slots(t);
    prop_assert_eq!(
        &before[..2],
        &after[..2],
        "host eviction moves no device slot"
    );
    prop_assert_eq!((e.full, e.swa, e.mamba), (0, 0, 0));
    let freed = [&e.host_full_pages, &e.host_swa_pages, &e.host_mamba_slots];
    for (c, f) in freed.into_iter().enumerate() {
        let mut rhs = after[c + 2].clone();
        rhs.extend(f);
        rhs.sort_unstable();
        prop_assert_eq!(
            &before[c + 2],
            &rhs,
            "host slot ledger of {} on evict_host",
            c
        );
    }
    for r in pins {
        prop_assert!(
            t.backed_up(r.node, Component::Full).unwrap(),
            "a pinned host copy was freed"
        );
    }
    Ok(())
}

/// `Op::Evict`: device eviction checked against the tree before, the slot ledger and the
/// held locks.
fn evict_step(
    t: &mut UnifiedTree,
    [f, s, m]: [u64; 3],
    held: &[(LockReceipt, Vec<bool>)],
) -> std::result::Result<(), TestCaseError> {
    let before = t.clone();
    let e = t.evict(EvictRequest {
        full: f,
        swa: s,
        mamba: m,
    });
    check_eviction(&before, t, &e)?;
    let (mut lhs, mut rhs) = (held_slots(&before), held_slots(t));
    let freed_lists = [
        &e.full_pages,
        &e.swa_pages,
        &e.host_full_pages,
        &e.host_swa_pages,
        &e.host_mamba_slots,
    ];
    for (c, freed) in freed_lists.into_iter().enumerate() {
        rhs[c].extend(freed);
        rhs[c].sort_unstable();
        lhs[c].sort_unstable();
        prop_assert_eq!(&lhs[c], &rhs[c], "slot ledger of component {} on evict", c);
    }
    for (r, snap) in held {
        prop_assert_eq!(&snapshot(t, r), snap, "a locked component was evicted");
    }
    Ok(())
}

/// Host Full host-leaf eviction by scanning every node for the oldest host leaf each step
/// (the model of the heap `evict_host` keeps).
fn naive_evict_host(t: &mut UnifiedTree, want: u64) -> Evicted {
    let mut out = Evicted::default();
    while ((out.host_full_pages.len() * t.ps()) as u64) < want {
        let oldest = (0..t.arena.nodes.len() as u32)
            .filter(|&i| t.is_host_leaf(i))
            .min_by_key(|&i| (t.arena.nodes[i as usize].time, i));
        let Some(i) = oldest else { break };
        t.delete_leaf(i, &mut out);
    }
    out
}

/// The host slots of every component with a host lock, per node.
fn host_locked(t: &UnifiedTree) -> Vec<(u32, usize, Vec<u32>)> {
    let mut out = Vec::new();
    for (i, n) in t.arena.nodes.iter().enumerate().filter(|(_, n)| n.live) {
        let lists = [
            n.host_full.clone(),
            n.host_swa.clone(),
            n.host_mamba.into_iter().collect(),
        ];
        for (c, list) in lists.into_iter().enumerate() {
            if n.host_lock[c] > 0 {
                out.push((i as u32, c, list));
            }
        }
    }
    out
}

/// Every slot the tree holds: device Full, device SWA, host Full, host SWA, host Mamba.
fn held_slots(t: &UnifiedTree) -> [Vec<u32>; 5] {
    let mut out: [Vec<u32>; 5] = Default::default();
    for n in t.arena.nodes.iter().filter(|n| n.live) {
        out[0].extend(&n.full_pages);
        out[1].extend(&n.swa_pages);
        out[2].extend(&n.host_full);
        out[3].extend(&n.host_swa);
        out[4].extend(n.host_mamba);
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
    prop_assert_eq!(&before[2..], &after[2..], "an insert moves no host slot");
    Ok(ins)
}

/// Backs up the `n`-th live node and its unbacked ancestors (ancestors first) with fresh
/// host slots; checks that each plan copies exactly the device slots of what it backs up.
/// What each host slot holds, recorded when its backup commits: (component, slot) → the
/// page's tokens (Full, SWA) or the node's depth in tokens (Mamba).
type HostIds = std::collections::HashMap<(usize, u32), Vec<u32>>;

/// The tokens of each page of `node`.
fn page_tokens(t: &UnifiedTree, node: NodeId) -> Vec<Vec<u32>> {
    let (i, _) = node.parts();
    t.arena.nodes[i as usize]
        .key
        .chunks(t.ps())
        .map(<[u32]>::to_vec)
        .collect()
}

/// Records (`record`) or checks what the host slots of `lists` (per node, one per page)
/// and `mamba` (at `node`) hold.
fn host_ids(
    t: &UnifiedTree,
    ids: &mut HostIds,
    lists: [&[(NodeId, Vec<u32>)]; 2],
    mamba: Option<(NodeId, u32)>,
    record: bool,
) -> std::result::Result<(), TestCaseError> {
    let mut entries = Vec::new();
    for (c, list) in lists.into_iter().enumerate() {
        for (node, slots) in list {
            entries.extend(slots.iter().map(|&h| (c, h)).zip(page_tokens(t, *node)));
        }
    }
    if let Some((node, h)) = mamba {
        entries.push(((2, h), vec![t.depth_tokens(node).unwrap() as u32]));
    }
    for (k, v) in entries {
        if record {
            prop_assert!(
                ids.insert(k, v).is_none(),
                "host slot {:?} written twice",
                k
            );
        } else {
            prop_assert_eq!(ids.get(&k), Some(&v), "host slot {:?} holds other bytes", k);
        }
    }
    Ok(())
}

fn backup_nth(
    t: &mut UnifiedTree,
    n: usize,
    next: &mut u32,
    pending: &mut Vec<BackupId>,
    ids: &mut HostIds,
) -> std::result::Result<(), TestCaseError> {
    let live: Vec<u32> = (1..t.arena.nodes.len() as u32)
        .filter(|&i| t.arena.nodes[i as usize].live && t.arena.nodes[i as usize].comp[0].present)
        .collect();
    let Some(&i) = live.get(n % live.len().max(1)) else {
        return Ok(());
    };
    let node = t.id(i);
    let mut chain = t.unbacked_chain(node).unwrap();
    if chain.last() != Some(&node) {
        chain.push(node);
    }
    for id in chain {
        let Some(plan) = t.plan_backup(id).unwrap() else {
            continue;
        };
        let mut fresh = |k: usize| -> Vec<u32> {
            (0..k)
                .map(|_| {
                    *next += 1;
                    *next
                })
                .collect()
        };
        let (full, swa) = (fresh(plan.full.len()), fresh(plan.swa_pages()));
        let mamba = plan.mamba.map(|_| fresh(1)[0]);
        let host = HostBackup {
            full: &full,
            swa: &swa,
            mamba,
        };
        pending.push(t.commit_backup(&plan, host).unwrap());
        let full = [(id, full.clone())];
        let lists = [
            &full[..usize::from(!plan.full.is_empty())],
            &host_swa_lists(&plan, &swa),
        ];
        host_ids(t, ids, lists, mamba.map(|h| (id, h)), true)?;
        prop_assert!(t.backed_up(id, Component::Full).unwrap());
        prop_assert!(t.plan_backup(id).unwrap().is_none(), "backed up twice");
        prop_assert!(
            t.lock_count(id, Component::Full).unwrap() > 0,
            "backup not locked"
        );
    }
    Ok(())
}

/// The host SWA slots of a backup, split per node as its plan lists them.
fn host_swa_lists(plan: &UnifiedBackupPlan, swa: &[u32]) -> Vec<(NodeId, Vec<u32>)> {
    host::per_node(&plan.swa, swa)
        .map(|(node, mine)| (node, mine.to_vec()))
        .collect()
}

/// Matches `k` and loads its host hit back: the plan reads exactly the host slots the
/// backups wrote for those pages; host slots stay, fresh device slots are adopted, and the
/// device match then reaches the loaded node.
fn load_back(
    t: &mut UnifiedTree,
    k: &[u32],
    next: &mut u32,
    ids: &mut HostIds,
) -> std::result::Result<Option<UnifiedLoadId>, TestCaseError> {
    let m = t.match_prefix(k).unwrap();
    check_match(t, &m)?;
    let Some(plan) = t.plan_load_back(m.host_node).unwrap() else {
        prop_assert_eq!(m.host_hit_len, 0);
        return Ok(None);
    };
    host_ids(
        t,
        ids,
        [&plan.full, &plan.swa],
        plan.mamba.map(|h| (plan.node, h)),
        false,
    )?;
    let before = held_slots(t);
    let mut fresh = |k: usize| -> Vec<u32> {
        (0..k)
            .map(|_| {
                *next += 1;
                *next
            })
            .collect()
    };
    let (full, swa) = (fresh(plan.full_pages()), fresh(plan.swa_pages()));
    let mamba = plan.mamba.map(|_| fresh(1)[0]);
    let dev = DeviceLoad {
        full: &full,
        swa: &swa,
        mamba,
    };
    let id = t.commit_load_back(&plan, dev).unwrap();
    let after = held_slots(t);
    prop_assert_eq!(&before[2..], &after[2..], "a load-back moves no host slot");
    for (c, new) in [full, swa].into_iter().enumerate() {
        let mut want = before[c].clone();
        want.extend(new);
        want.sort_unstable();
        prop_assert_eq!(&want, &after[c], "device slots adopted by the load-back");
    }
    let depth = t.depth_tokens(plan.node).unwrap();
    let again = t.match_prefix(k).unwrap();
    prop_assert!(
        again.device_prefix_len >= depth,
        "loaded prefix not a device hit"
    );
    Ok(Some(id))
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
    let mut pending = Vec::new();
    let mut loads = Vec::new();
    let mut pins: Vec<HostLockReceipt> = Vec::new();
    let mut ids = HostIds::new();
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
                if !pending.is_empty() {
                    t.finish_backup(pending.remove(0)).unwrap();
                }
                if !loads.is_empty() {
                    t.finish_load_back(loads.remove(0)).unwrap();
                }
                if !pins.is_empty() {
                    t.unlock_host(&pins.remove(0)).unwrap();
                }
            }
            Op::PinHost(n) => {
                let on_host: Vec<NodeId> = (1..t.arena.nodes.len() as u32)
                    .filter(|&i| t.arena.nodes[i as usize].live)
                    .map(|i| t.id(i))
                    .filter(|&id| t.backed_up(id, Component::Full).unwrap())
                    .collect();
                if let Some(&id) = on_host.get(n % on_host.len().max(1)) {
                    pins.push(t.lock_host(id).unwrap());
                }
            }
            Op::LoadBack { seq, len, finish } => {
                if slots
                    && let Some(id) = load_back(&mut t, &key(seq, len, ps), &mut next, &mut ids)?
                {
                    if finish {
                        t.finish_load_back(id).unwrap();
                    } else {
                        loads.push(id);
                    }
                }
            }
            Op::EvictHost(c, n) => evict_host_step(&mut t, c, n, &pins)?,
            Op::Backup(n, finish) => {
                if slots {
                    backup_nth(&mut t, n, &mut next, &mut pending, &mut ids)?;
                }
                if finish {
                    for id in pending.drain(..) {
                        t.finish_backup(id).unwrap();
                    }
                }
            }
            Op::Evict(f, s, m) => evict_step(&mut t, [f, s, m], &held)?,
        }
        t.check_invariants().map_err(TestCaseError::fail)?;
    }
    for (r, _) in held.drain(..) {
        t.unlock(&r).unwrap();
    }
    for id in pending.drain(..) {
        t.finish_backup(id).unwrap();
    }
    for id in loads.drain(..) {
        t.finish_load_back(id).unwrap();
    }
    let last = pins.last().cloned();
    for r in pins.drain(..) {
        t.unlock_host(&r).unwrap();
    }
    prop_assert!(
        last.is_none_or(|r| t.unlock_host(&r).is_err()),
        "an unbalanced host unlock is an error"
    );
    prop_assert_eq!(t.pending_backups() + t.pending_load_backs(), 0);
    for c in [Component::Full, Component::Swa, Component::Mamba] {
        prop_assert_eq!(t.protected_size(c), 0, "all locks released");
    }
    t.check_invariants().map_err(TestCaseError::fail)?;
    Ok(())
}

/// A match never ends where a component has no data (a tombstone serves nothing).
fn check_match(t: &UnifiedTree, m: &UnifiedMatch) -> std::result::Result<(), TestCaseError> {
    prop_assert!(m.full_hit_len >= m.device_prefix_len + m.host_hit_len);
    if t.tracks_slots() {
        let pages = t.prefix_pages(m.node, Component::Full).unwrap();
        prop_assert!(
            pages.iter().all(Option::is_some),
            "a host-only node matched as a device hit"
        );
        prop_assert_eq!(pages.len() * t.ps(), m.device_prefix_len);
    }
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
    // leaves a surviving node only by demotion (backed up, host slots kept).
    for (i, n) in after.arena.nodes.iter().enumerate() {
        let b = &before.arena.nodes[i];
        if !n.live || !b.live || n.generation != b.generation {
            continue;
        }
        if !n.comp[0].present {
            prop_assert!(
                !b.host_full.is_empty(),
                "only a backed-up node leaves the device and stays (demoted)"
            );
            prop_assert_eq!(&n.host_full, &b.host_full, "demotion keeps host slots");
            prop_assert_eq!(&n.host_swa, &b.host_swa, "demotion keeps host slots");
            prop_assert_eq!(n.host_mamba, b.host_mamba, "demotion keeps host slots");
        }
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
    fn model_host_tier(ops in proptest::collection::vec(op_weighted(3), 1..60), w in 0u32..12, mamba: bool) {
        let cfg = UnifiedConfig {
            swa_window: (w > 0).then_some(w),
            mamba_chunk: mamba.then_some(2),
            ..UnifiedConfig::full(2)
        };
        run_model(cfg, &ops, true)?;
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

#[test]
fn write_through_backs_up_each_component_ancestors_first() {
    let cfg = UnifiedConfig {
        swa_window: Some(4),
        mamba_chunk: Some(2),
        ..UnifiedConfig::full(2)
    };
    let mut plain = UnifiedTree::new(cfg.clone()).unwrap();
    let p = InsertParams {
        mamba_slot: Some(7),
        ..InsertParams::default()
    };
    let ins = plain.insert(&toks(0..4), &p).unwrap();
    assert!(
        plain.plan_backup(ins.node).is_err(),
        "no device slots to copy"
    );
    let mut t = UnifiedTree::with_device_slots(cfg).unwrap();
    let s = InsertSlots {
        full: &[10, 11, 12, 13],
        swa: &[20, 21, 22, 23],
    };
    let leaf = t.insert_with_slots(&toks(0..8), &p, s).unwrap().node;
    // The leaf was capped at one window: its parent holds pages 0..2 and must go first.
    let chain = t.unbacked_chain(leaf).unwrap();
    assert_eq!(chain.len(), 2);
    assert_eq!(chain[1], leaf);
    assert!(t.plan_backup(leaf).is_err(), "parent not backed up");
    let first = t.plan_backup(chain[0]).unwrap().unwrap();
    assert_eq!((first.full.clone(), first.mamba), (vec![10, 11], None));
    assert_eq!(first.swa, vec![(chain[0], vec![20, 21])]);
    let bad = HostBackup {
        full: &[100],
        swa: &[200, 201],
        mamba: None,
    };
    assert!(
        t.commit_backup(&first, bad).is_err(),
        "one host slot per page"
    );
    let host = HostBackup {
        full: &[100, 101],
        swa: &[200, 201],
        mamba: None,
    };
    let a = t.commit_backup(&first, host).unwrap();
    assert!(
        t.commit_backup(&first, host).is_err(),
        "a stale plan is refused"
    );
    assert_eq!(t.lock_count(chain[0], Component::Full).unwrap(), 1);
    let second = t.plan_backup(leaf).unwrap().unwrap();
    assert_eq!(second.full, vec![12, 13]);
    assert_eq!(second.swa, vec![(leaf, vec![22, 23])]);
    assert_eq!(second.mamba, Some(7));
    let b = t
        .commit_backup(
            &second,
            HostBackup {
                full: &[102, 103],
                swa: &[202, 203],
                mamba: Some(300),
            },
        )
        .unwrap();
    assert_eq!(t.pending_backups(), 2);
    for c in [Component::Full, Component::Swa, Component::Mamba] {
        assert!(t.backed_up(leaf, c).unwrap());
    }
    assert_eq!(t.plan_backup(leaf).unwrap(), None);
    // Locked while the copies run: nothing can be evicted.
    let e = t.evict(EvictRequest {
        full: 100,
        swa: 100,
        mamba: 10,
    });
    assert_eq!((e.full, e.swa, e.mamba), (0, 0, 0));
    t.finish_backup(a).unwrap();
    t.finish_backup(b).unwrap();
    assert!(t.finish_backup(b).is_err(), "finished twice");
    t.check_invariants().unwrap();
    assert_eq!(t.protected_size(Component::Full), 0);
    // Device eviction demotes the backed-up nodes: device slots freed, host slots kept.
    let e = t.evict(EvictRequest {
        full: 100,
        ..EvictRequest::default()
    });
    let mut dev_full = e.full_pages.clone();
    dev_full.sort_unstable();
    assert_eq!(dev_full, [10, 11, 12, 13]);
    assert_eq!(
        (e.mamba_slots.clone(), e.host_full_pages.len()),
        (vec![7], 0)
    );
    assert_eq!(t.size(Component::Full), 0);
    assert_eq!(t.node_count(), 3, "demoted nodes stay, host-only");
    t.check_invariants().unwrap();
    // A host-only node is no device hit; the match reports the host extent per component.
    let m = t.match_prefix(&toks(0..8)).unwrap();
    assert_eq!((m.device_prefix_len, m.node), (0, t.root()));
    assert_eq!((m.host_node, m.host_hit_len), (leaf, 8));
    assert_eq!((m.swa_host_hit_len, m.mamba_host_hit), (4, true));
    // Load-back copies exactly the backed-up host slots, ancestors first.
    let plan = t.plan_load_back(m.host_node).unwrap().unwrap();
    assert_eq!(
        plan.full,
        vec![(chain[0], vec![100, 101]), (leaf, vec![102, 103])]
    );
    assert_eq!(plan.swa, vec![(leaf, vec![202, 203])]);
    assert_eq!(plan.mamba, Some(300));
    let dev = DeviceLoad {
        full: &[40, 41, 42, 43],
        swa: &[50, 51],
        mamba: Some(60),
    };
    let id = t.commit_load_back(&plan, dev).unwrap();
    assert!(t.commit_load_back(&plan, dev).is_err(), "a stale plan");
    assert_eq!(t.plan_load_back(leaf).unwrap(), None);
    let e = t.evict(EvictRequest {
        full: 100,
        ..EvictRequest::default()
    });
    assert_eq!(e.full, 0, "locked while the load runs");
    t.finish_load_back(id).unwrap();
    t.check_invariants().unwrap();
    let m = t.match_prefix(&toks(0..8)).unwrap();
    assert_eq!((m.device_prefix_len, m.node, m.host_hit_len), (8, leaf, 0));
    assert_eq!(m.mamba_slot, Some(60));
    assert_eq!(
        t.prefix_pages(leaf, Component::Full).unwrap(),
        [40, 41, 42, 43].map(Some)
    );
    // Demote again, then free the host copies: whole host-only leaves, children first.
    t.evict(EvictRequest {
        full: 100,
        ..EvictRequest::default()
    });
    let pin = t.lock_host(leaf).unwrap();
    assert!(
        t.evict_host(100).host_full_pages.is_empty(),
        "a pin keeps the path"
    );
    t.unlock_host(&pin).unwrap();
    let e = t.evict_host(100);
    let mut host_full = e.host_full_pages.clone();
    host_full.sort_unstable();
    assert_eq!(host_full, [100, 101, 102, 103]);
    assert_eq!(e.host_mamba_slots, [300]);
    assert_eq!(e.host_swa_pages.len(), 4);
    assert_eq!(t.node_count(), 1);
    t.check_invariants().unwrap();
}

#[test]
fn an_insert_puts_a_host_only_node_back_on_device_with_the_request_slots() {
    let cfg = UnifiedConfig {
        swa_window: Some(4),
        ..UnifiedConfig::full(2)
    };
    let mut t = UnifiedTree::with_device_slots(cfg).unwrap();
    let s = InsertSlots {
        full: &[10, 11],
        swa: &[20, 21],
    };
    let node = t
        .insert_with_slots(&toks(0..4), &InsertParams::default(), s)
        .unwrap()
        .node;
    let plan = t.plan_backup(node).unwrap().unwrap();
    let host = HostBackup {
        full: &[100, 101],
        swa: &[200, 201],
        mamba: None,
    };
    let id = t.commit_backup(&plan, host).unwrap();
    t.finish_backup(id).unwrap();
    t.evict(EvictRequest {
        full: 4,
        ..EvictRequest::default()
    });
    assert!(!t.present(node, Component::Full).unwrap());
    let s = InsertSlots {
        full: &[30, 31],
        swa: &[40, 41],
    };
    let ins = t
        .insert_with_slots(&toks(0..4), &InsertParams::default(), s)
        .unwrap();
    assert_eq!(
        (ins.prefix_len, ins.duplicate_tokens),
        (4, 0),
        "the tree took the KV"
    );
    assert!(ins.release_full.is_empty() && ins.release_swa.is_empty());
    assert_eq!(
        t.prefix_pages(ins.node, Component::Full).unwrap(),
        [Some(30), Some(31)]
    );
    assert_eq!(
        t.prefix_pages(ins.node, Component::Swa).unwrap(),
        [Some(40), Some(41)]
    );
    assert!(
        t.backed_up(ins.node, Component::Full).unwrap(),
        "host copy kept"
    );
    assert_eq!(t.size(Component::Full), 4);
    t.check_invariants().unwrap();
}
