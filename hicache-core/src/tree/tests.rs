//! Unit tests of every tree operation and eviction path.

use super::*;
use crate::error::CoreError;
use crate::eviction::StrategyKind;
use crate::hash::PageHasher;
use crate::policy::WritePolicy;

const PS: u32 = 4;

fn cfg(policy: WritePolicy) -> TreeConfig {
    TreeConfig {
        write_policy: policy,
        ..TreeConfig::new(PS)
    }
}

fn tree(policy: WritePolicy) -> HiRadixTree {
    HiRadixTree::new(cfg(policy)).unwrap()
}

/// `pages` pages whose tokens start at `base` (distinct bases give distinct pages).
fn toks(base: u32, pages: usize) -> Vec<u32> {
    (0..pages as u32 * PS).map(|t| base * 1000 + t).collect()
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    [a, b].concat()
}

/// Slots `[from, from + n)` (device or host).
fn slots<S: From<u32>>(from: u32, n: usize) -> Vec<S> {
    (from..from + n as u32).map(S::from).collect()
}

/// Device slots with these indices.
fn ds<const N: usize>(v: [u32; N]) -> Vec<DeviceSlot> {
    v.into_iter().map(DeviceSlot).collect()
}

/// Host slots with these indices.
fn hs<const N: usize>(v: [u32; N]) -> Vec<HostSlot> {
    v.into_iter().map(HostSlot).collect()
}

const T: TenantId = TenantId::DEFAULT;

fn ins(t: &mut HiRadixTree, tokens: &[u32], first_slot: u32) -> InsertResult {
    let r = t
        .insert(
            T,
            tokens,
            &slots(first_slot, tokens.len() / PS as usize),
            InsertOptions::default(),
        )
        .unwrap();
    t.check_invariants().unwrap();
    r
}

fn ok(t: &HiRadixTree) {
    t.check_invariants().unwrap();
}

/// Backs a node up completely (begin, commit with `host_from`, finish).
fn backup(t: &mut HiRadixTree, n: NodeId, host_from: u32) -> FinishedBackup {
    let plan = t.begin_backup(n).unwrap().expect("backup allowed");
    let w = t.commit_backup(n, &slots(host_from, plan.pages())).unwrap();
    ok(t);
    let f = t.finish_backup(w).unwrap();
    ok(t);
    f
}

#[test]
fn insert_then_match_returns_slots_and_splits_on_partial_match() {
    let mut t = tree(WritePolicy::WriteThroughSelective);
    let a = toks(1, 3);
    let r = ins(&mut t, &a, 100);
    assert_eq!(r.prefix_pages, 0);
    let m = t.match_prefix(T, &a).unwrap();
    assert_eq!(m.device_slots, ds([100, 101, 102]));
    assert_eq!(m.last_node, r.last_node);
    assert_eq!(m.host_hit_pages, 0);
    // A key sharing 2 pages then diverging splits the node after page 2.
    let b = cat(&a[..8], &toks(2, 1));
    let m = t.match_prefix(T, &b).unwrap();
    ok(&t);
    assert_eq!(m.device_slots, ds([100, 101]));
    assert_eq!(t.node_info(m.last_node).unwrap().pages, 2);
    assert_eq!(t.node_info(r.last_node).unwrap().pages, 1);
    assert_eq!(t.node_info(r.last_node).unwrap().parent, Some(m.last_node));
    // A key that differs inside the first page matches nothing (siblings by whole page).
    let mut c = a.clone();
    c[1] = 999_999;
    let m = t.match_prefix(T, &c).unwrap();
    assert!(m.device_slots.is_empty());
    assert_eq!(m.last_node, t.tenant_root(T).unwrap());
    // Empty key.
    let m = t.match_prefix(T, &[]).unwrap();
    assert_eq!(m.last_device_node, t.tenant_root(T).unwrap());
}

#[test]
fn insert_reports_cached_prefix_and_new_leaf() {
    let mut t = tree(WritePolicy::WriteThroughSelective);
    let a = toks(1, 2);
    ins(&mut t, &a, 0);
    let b = cat(&a, &toks(2, 2));
    let r = ins(&mut t, &b, 10);
    assert_eq!(r.prefix_pages, 2);
    assert_eq!(t.device_slots(r.last_node).unwrap(), ds([12, 13]));
    let m = t.match_prefix(T, &b).unwrap();
    assert_eq!(m.device_slots, ds([0, 1, 12, 13]));
    assert_eq!(t.stats().device_pages, 4);
    assert_eq!(t.evictable_pages(), 4);
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let mut t = tree(WritePolicy::WriteThrough);
    let a = toks(1, 2);
    ins(&mut t, &a, 0);
    let before = format!("{:?}", t.stats());
    let clock = t.clock();
    assert!(matches!(
        t.match_prefix(T, &a[..5]),
        Err(CoreError::Unaligned { len: 5, .. })
    ));
    assert!(matches!(
        t.insert(T, &a[..6], &ds([1]), InsertOptions::default()),
        Err(CoreError::Unaligned { .. })
    ));
    assert!(matches!(
        t.insert(T, &a, &ds([1]), InsertOptions::default()),
        Err(CoreError::LengthMismatch { .. })
    ));
    assert!(matches!(
        t.match_prefix(TenantId(9), &a),
        Err(CoreError::UnknownTenant(9))
    ));
    let leaf = t.match_prefix(T, &a).unwrap().last_node;
    assert!(matches!(
        t.unlock(leaf),
        Err(CoreError::InvalidState { .. })
    ));
    assert!(matches!(
        t.release_host(leaf),
        Err(CoreError::InvalidState { .. })
    ));
    assert!(matches!(
        t.split(leaf, 0),
        Err(CoreError::InvalidState { .. })
    ));
    assert!(matches!(
        t.split(leaf, 2),
        Err(CoreError::InvalidState { .. })
    ));
    assert!(t.finish_backup(WriteId(77)).is_err());
    assert!(t.finish_load_back(LoadId(77)).is_err());
    assert_eq!(format!("{:?}", t.stats()), before);
    assert_eq!(t.clock(), clock + 1);
    ok(&t);
    assert_eq!(page_aligned(&a[..7], PS), &a[..4]);
    // Config validation.
    assert!(HiRadixTree::new(TreeConfig::new(0)).is_err());
    let mut c = TreeConfig::new(4);
    c.events = true;
    assert!(matches!(
        HiRadixTree::new(c.clone()),
        Err(CoreError::InvalidPolicy {
            field: "events",
            ..
        })
    ));
    c.hasher = Some(PageHasher::sglang(8).unwrap());
    assert!(matches!(
        HiRadixTree::new(c),
        Err(CoreError::InvalidPolicy {
            field: "hasher",
            ..
        })
    ));
}

#[test]
fn tenants_never_share_nodes() {
    let mut t = tree(WritePolicy::WriteThroughSelective);
    let lora = t.tenant(Some("lora-a"), None).unwrap();
    let salt = t.tenant(None, Some("lora-a")).unwrap();
    assert_ne!(lora, salt);
    assert_eq!(t.tenant(Some("lora-a"), None).unwrap(), lora);
    assert_eq!(t.tenant_info(salt).unwrap(), (None, Some("lora-a")));
    let a = toks(1, 2);
    ins(&mut t, &a, 0);
    assert!(t.match_prefix(lora, &a).unwrap().device_slots.is_empty());
    let r = t
        .insert(lora, &a, &ds([5, 6]), InsertOptions::default())
        .unwrap();
    assert_eq!(r.prefix_pages, 0);
    assert_eq!(t.match_prefix(lora, &a).unwrap().device_slots, ds([5, 6]));
    assert_eq!(t.match_prefix(T, &a).unwrap().device_slots, ds([0, 1]));
    // A host insert under another tenant's anchor is refused.
    let root = t.tenant_root(T).unwrap();
    assert!(matches!(
        t.insert_host_only(lora, root, &toks(3, 1), &hs([1]), None),
        Err(CoreError::WrongTenant { .. })
    ));
    ok(&t);
}

#[test]
fn locks_propagate_and_protect_from_eviction() {
    let mut t = tree(WritePolicy::WriteThroughSelective);
    let a = toks(1, 2);
    let b = cat(&a, &toks(2, 1));
    ins(&mut t, &a, 0);
    let leaf = ins(&mut t, &b, 10).last_node;
    t.lock(leaf).unwrap();
    ok(&t);
    assert_eq!(t.protected_pages(), 3);
    assert_eq!(t.evictable_pages(), 0);
    let out = t.evict(10, &mut NoHost);
    assert_eq!(out.freed_pages, 0);
    t.lock(leaf).unwrap();
    t.unlock(leaf).unwrap();
    t.unlock(leaf).unwrap();
    ok(&t);
    assert_eq!(t.evictable_pages(), 3);
    assert!(t.unlock(leaf).is_err());
    // Locking the root is a no-op (SGLang stops at the root).
    let root = t.tenant_root(T).unwrap();
    t.lock(root).unwrap();
    t.unlock(root).unwrap();
    ok(&t);
}

#[test]
fn evict_deletes_lru_leaves_and_promotes_parents() {
    let mut t = tree(WritePolicy::WriteThroughSelective);
    let a = toks(1, 2);
    let b = cat(&a, &toks(2, 1));
    let c = cat(&a, &toks(3, 1));
    ins(&mut t, &b, 0); // [a][b'] after split below
    ins(&mut t, &c, 10);
    // Touch b so that c is the oldest leaf.
    t.match_prefix(T, &b).unwrap();
    let out = t.evict(1, &mut NoHost);
    ok(&t);
    assert_eq!(out.freed_pages, 1);
    assert_eq!(out.deleted_pages, 1);
    assert_eq!(out.device_slots, ds([12]));
    assert_eq!(t.match_prefix(T, &c).unwrap().device_slots, ds([0, 1]));
    // Evict everything: b's leaf, then the shared parent once childless.
    let out = t.evict(100, &mut NoHost);
    ok(&t);
    assert_eq!(out.freed_pages, 3);
    let mut freed = out.device_slots.clone();
    freed.sort();
    assert_eq!(freed, ds([0, 1, 2]));
    assert_eq!(t.stats().nodes, 0);
}

#[test]
fn write_through_due_lists_follow_policy_and_thresholds() {
    let a = toks(1, 1);
    let b = cat(&a, &toks(2, 1));
    // write_through: new leaves are due at once.
    let mut t = tree(WritePolicy::WriteThrough);
    let r = ins(&mut t, &a, 0);
    assert_eq!(r.write_through, vec![r.last_node]);
    // selective: due on the second hit.
    let mut t = tree(WritePolicy::WriteThroughSelective);
    let r1 = ins(&mut t, &a, 0);
    assert!(r1.write_through.is_empty());
    let r2 = ins(&mut t, &b, 10);
    assert_eq!(r2.write_through, vec![r1.last_node]);
    assert_eq!(t.node_info(r1.last_node).unwrap().hit_count, 2);
    // chunked inserts do not count.
    let r3 = t
        .insert(
            T,
            &b,
            &ds([20, 21]),
            InsertOptions {
                chunked: true,
                priority: 0,
            },
        )
        .unwrap();
    assert!(r3.write_through.is_empty());
    assert_eq!(t.node_info(r1.last_node).unwrap().hit_count, 2);
    // write_back: never.
    let mut t = tree(WritePolicy::WriteBack);
    ins(&mut t, &a, 0);
    assert!(ins(&mut t, &a, 5).write_through.is_empty());
    assert_eq!(t.node_info(r1.last_node).unwrap().hit_count, 0);
}

#[test]
fn backup_requires_backed_parent_and_survives_splits() {
    let mut t = tree(WritePolicy::WriteThrough);
    let a = toks(1, 3);
    let b = cat(&a, &toks(2, 1));
    let na = ins(&mut t, &a, 0).last_node;
    let nb = ins(&mut t, &b, 10).last_node;
    // Child before parent: refused.
    assert!(t.begin_backup(nb).unwrap().is_none());
    assert!(t.commit_backup(nb, &hs([1])).is_err());
    let plan = t.begin_backup(na).unwrap().unwrap();
    assert_eq!(plan.device_slots, ds([0, 1, 2]));
    assert!(t.commit_backup(na, &hs([7])).is_err());
    let w = t.commit_backup(na, &hs([50, 51, 52])).unwrap();
    ok(&t);
    let info = t.node_info(na).unwrap();
    assert!(info.backed_up && info.write_pending && info.lock_ref == 1);
    assert_eq!(t.protected_pages(), 3);
    // A second backup of the same node is refused while (and after) it is backed up.
    assert!(t.begin_backup(na).unwrap().is_none());
    // Split the pending node: the write still covers both fragments.
    let upper = t.split(na, 1).unwrap();
    ok(&t);
    let f = t.finish_backup(w).unwrap();
    ok(&t);
    assert_eq!(f.node, na);
    assert_eq!(f.fragments.len(), 2);
    assert_eq!(f.fragments[0].node, upper);
    assert_eq!(f.host_slots(), hs([50, 51, 52]));
    assert_eq!(f.pages(), 3);
    // By value: the nodes root-first, the slots and hashes concatenated in page order.
    let (nodes, slots, hashes) = f.clone().into_parts();
    assert_eq!(nodes, vec![upper, na]);
    assert_eq!(slots, f.host_slots());
    assert_eq!(hashes, f.hashes());
    assert_eq!(t.protected_pages(), 0);
    assert!(!t.node_info(upper).unwrap().write_pending);
    assert!(t.finish_backup(w).is_err());
    // Now the child may go.
    let plan = t.begin_backup(nb).unwrap().unwrap();
    assert_eq!(plan.pages(), 1);
    let w = t.commit_backup(nb, &hs([60])).unwrap();
    t.finish_backup(w).unwrap();
    ok(&t);
    assert_eq!(t.host_pages(), 4);
    assert!(t.begin_backup(t.tenant_root(T).unwrap()).is_err());
}

#[test]
fn backed_up_leaves_are_demoted_and_rematerialised_by_insert() {
    let mut t = tree(WritePolicy::WriteThrough);
    let a = toks(1, 2);
    let b = cat(&a, &toks(2, 2));
    let na = ins(&mut t, &a, 0).last_node;
    let nb = ins(&mut t, &b, 10).last_node;
    backup(&mut t, na, 100);
    backup(&mut t, nb, 200);
    let out = t.evict(2, &mut NoHost);
    ok(&t);
    assert_eq!(out.demoted_pages, 2);
    assert_eq!(out.device_slots, ds([12, 13]));
    let info = t.node_info(nb).unwrap();
    assert!(!info.on_device && info.backed_up);
    let m = t.match_prefix(T, &b).unwrap();
    assert_eq!(m.device_slots, ds([0, 1]));
    assert_eq!(m.last_device_node, na);
    assert_eq!(m.last_host_node, nb);
    assert_eq!(m.last_node, nb);
    assert_eq!(m.host_hit_pages, 2);
    assert_eq!(t.stats().host_candidates, 1);
    // Insert recomputed KV: the evicted node takes the request's slots; not counted as prefix.
    let r = ins(&mut t, &b, 30);
    assert_eq!(r.prefix_pages, 2);
    assert_eq!(t.device_slots(nb).unwrap(), ds([32, 33]));
    assert_eq!(t.stats().host_candidates, 0);
    assert_eq!(t.evictable_pages(), 4);
}

#[test]
fn evict_host_removes_host_only_leaves_and_cascades() {
    let mut t = tree(WritePolicy::WriteThrough);
    let a = toks(1, 1);
    let b = cat(&a, &toks(2, 1));
    let na = ins(&mut t, &a, 0).last_node;
    let nb = ins(&mut t, &b, 10).last_node;
    backup(&mut t, na, 100);
    backup(&mut t, nb, 200);
    // On device: host copies are not evictable.
    assert_eq!(t.evict_host(10).freed_pages, 0);
    t.evict(10, &mut NoHost);
    ok(&t);
    assert_eq!(t.device_pages(), 0);
    // Protected leaf is skipped; its parent is not a leaf.
    t.protect_host(nb).unwrap();
    assert_eq!(t.evict_host(10).freed_pages, 0);
    t.release_host(nb).unwrap();
    let out = t.evict_host(1);
    ok(&t);
    assert_eq!(out.host_slots, hs([200]));
    assert!(t.node_info(nb).is_err(), "deleted node ids are stale");
    assert!(matches!(t.lock(nb), Err(CoreError::StaleNode(_))));
    let out = t.evict_host(1);
    assert_eq!(out.host_slots, hs([100]));
    assert_eq!(t.stats().nodes, 0);
    ok(&t);
}

#[test]
fn load_back_is_all_or_nothing_with_threshold_and_quota() {
    let mut c = cfg(WritePolicy::WriteThrough);
    c.load_back_threshold_tokens = 3 * PS;
    let mut t = HiRadixTree::new(c).unwrap();
    let a = toks(1, 1);
    let b = cat(&a, &toks(2, 2));
    let d = cat(&b, &toks(3, 1));
    let na = ins(&mut t, &a, 0).last_node;
    let nb = ins(&mut t, &b, 10).last_node;
    let nd = ins(&mut t, &d, 20).last_node;
    for (n, h) in [(na, 100), (nb, 200), (nd, 300)] {
        backup(&mut t, n, h);
    }
    // Evict b and d (leaves first), keep a.
    t.lock(na).unwrap();
    t.evict(10, &mut NoHost);
    t.unlock(na).unwrap();
    ok(&t);
    // On-device node: nothing to load.
    assert!(t.plan_load_back(na, None).unwrap().is_none());
    // b alone is 2 pages < threshold 3.
    assert!(t.plan_load_back(nb, None).unwrap().is_none());
    // d's chain is b+d = 3 pages; quota 3 minus a's 1 newly protected page is too small.
    assert!(t.plan_load_back(nd, Some(3)).unwrap().is_none());
    ok(&t);
    let plan = t.plan_load_back(nd, Some(4)).unwrap().unwrap();
    ok(&t);
    assert_eq!(plan.pages(), 3);
    assert_eq!(plan.host_slots(), &hs([200, 201, 300]));
    assert_eq!(plan.nodes(), &[nb, nd]);
    assert_eq!(plan.ancestor(), na);
    assert_eq!(t.node_info(na).unwrap().lock_ref, 1);
    // Pinned chain survives host eviction.
    assert_eq!(t.evict_host(10).freed_pages, 0);
    t.abort_load_back(plan).unwrap();
    ok(&t);
    let plan = t.plan_load_back(nd, None).unwrap().unwrap();
    assert!(t.commit_load_back(plan, &ds([1, 2])).is_err());
    ok(&t);
    let plan = t.plan_load_back(nd, None).unwrap().unwrap();
    let load = t.commit_load_back(plan, &ds([40, 41, 42])).unwrap();
    ok(&t);
    assert_eq!(
        t.match_prefix(T, &d).unwrap().device_slots,
        ds([0, 40, 41, 42])
    );
    assert_eq!(t.node_info(nd).unwrap().lock_ref, 1);
    assert_eq!(t.finish_load_back(load).unwrap(), nd);
    ok(&t);
    assert_eq!(t.protected_pages(), 0);
}

#[test]
fn write_back_eviction_stages_copies_or_drops_under_host_pressure() {
    struct Pool(Vec<HostSlot>, Vec<HostSlot>);
    impl HostAllocator for Pool {
        fn alloc(&mut self, pages: usize) -> Option<Vec<HostSlot>> {
            (self.0.len() >= pages).then(|| self.0.drain(..pages).collect())
        }
        fn free(&mut self, s: &[HostSlot]) {
            self.1.extend_from_slice(s);
            self.0.extend_from_slice(s);
        }
    }
    let mut t = tree(WritePolicy::WriteBack);
    let a = toks(1, 2);
    let b = cat(&a, &toks(2, 1));
    let na = ins(&mut t, &a, 0).last_node;
    let nb = ins(&mut t, &b, 10).last_node;
    let mut pool = Pool(hs([500, 501]), vec![]);
    let out = t.evict(1, &mut pool);
    ok(&t);
    assert_eq!(out.freed_pages, 1);
    assert_eq!(out.write_back.len(), 1);
    let s = &out.write_back[0];
    assert_eq!(
        (s.node, s.device_slots.clone(), s.host_slots.clone()),
        (nb, ds([12]), hs([500]))
    );
    assert!(t.node_info(nb).unwrap().host_ref == 1 && t.node_info(nb).unwrap().write_pending);
    // Host full for `a` (2 pages, 1 free): b's subtree is protected by the pending write, so
    // `a` cannot be dropped either; nothing is freed.
    let out2 = t.evict(1, &mut pool);
    ok(&t);
    assert_eq!(out2.freed_pages, 0);
    // Finish the staged copy: b is an ordinary host-only node now.
    let f = t.finish_backup(s.write_id).unwrap();
    assert_eq!(f.host_slots(), hs([500]));
    ok(&t);
    // Now `a` cannot be staged (1 host page free, but b is evicted to make room: 2 free).
    let out3 = t.evict(1, &mut pool);
    ok(&t);
    assert_eq!(out3.write_back.len(), 1);
    assert_eq!(pool.1, hs([500]));
    assert_eq!(out3.write_back[0].node, na);
    t.finish_backup(out3.write_back[0].write_id).unwrap();
    ok(&t);
    // With no host at all, a fresh leaf is dropped with its subtree.
    let mut t = tree(WritePolicy::WriteBack);
    ins(&mut t, &a, 0);
    let out = t.evict(1, &mut NoHost);
    ok(&t);
    assert_eq!(out.dropped_pages, 2);
    assert_eq!(out.device_slots, ds([0, 1]));
    assert_eq!(t.stats().nodes, 0);
}

#[test]
fn host_inserts_dedupe_adopt_and_create_host_only_nodes() {
    let mut t = tree(WritePolicy::WriteThroughSelective);
    let a = toks(1, 2);
    let b = cat(&a, &toks(2, 2));
    let root = t.tenant_root(T).unwrap();
    // `a` on device, not backed up: the fetched copy is adopted, the rest becomes host-only.
    let na = ins(&mut t, &a, 0).last_node;
    let r = t
        .insert_host_only(T, root, &b, &hs([70, 71, 72, 73]), None)
        .unwrap();
    ok(&t);
    assert_eq!(r.present_pages, 2);
    assert_eq!(r.adopted_pages, 2);
    assert_eq!(r.new_pages, 2);
    assert!(r.duplicate_slots.is_empty());
    assert_eq!(t.host_slots(na).unwrap(), hs([70, 71]));
    let m = t.match_prefix(T, &b).unwrap();
    assert_eq!(m.host_hit_pages, 2);
    assert_eq!(m.last_host_node, r.last_node);
    // Same pages again: all duplicates; a partial key splits the host-only node.
    let r2 = t
        .insert_host_only(T, root, &b[..12], &hs([80, 81, 82]), None)
        .unwrap();
    ok(&t);
    assert_eq!(r2.duplicate_slots, hs([80, 81, 82]));
    assert_eq!(r2.new_pages, 0);
    // Anchored below: only the suffix is given.
    let c = toks(3, 1);
    let r3 = t
        .insert_host_only(T, r.last_node, &c, &hs([90]), None)
        .unwrap();
    ok(&t);
    assert_eq!(r3.new_pages, 1);
    let m = t.match_prefix(T, &cat(&b, &c)).unwrap();
    assert_eq!(m.host_hit_pages, 3);
    // Anchor not backed up: refused.
    let e = ins(&mut t, &toks(5, 1), 40).last_node;
    assert!(t.insert_host_only(T, e, &c, &hs([1]), None).is_err());
    assert!(t.insert_host_only(T, root, &c, &hs([1, 2]), None).is_err());
    ok(&t);
}

#[test]
fn page_hashes_chain_through_splits_and_events_report_tiers() {
    let hasher = PageHasher::sglang(PS).unwrap();
    let mut c = cfg(WritePolicy::WriteThrough);
    c.hasher = Some(hasher.clone());
    c.events = true;
    let mut t = HiRadixTree::new(c).unwrap();
    let a = toks(1, 3);
    let na = ins(&mut t, &a, 0).last_node;
    let want = hasher.hash_pages(None, &a);
    assert_eq!(t.page_hashes(na).unwrap(), &want[..]);
    let b = cat(&a[..4], &toks(2, 1));
    let nb = ins(&mut t, &b, 10).last_node;
    assert_eq!(t.prefix_hashes(nb).unwrap(), hasher.hash_pages(None, &b));
    assert_eq!(t.last_page_hash(na).unwrap(), Some(want[2]));
    assert_eq!(t.last_page_hash(t.tenant_root(T).unwrap()).unwrap(), None);
    let events = t.drain_events();
    assert_eq!(events.len(), 2);
    assert!(
        matches!(&events[0], KvEvent::BlockStored { medium: Medium::Gpu, block_hashes, .. } if block_hashes.len() == 3)
    );
    match &events[1] {
        KvEvent::BlockStored {
            parent_block_hash,
            block_hashes,
            ..
        } => {
            assert_eq!(*parent_block_hash, Some(want[0]));
            assert_eq!(block_hashes.len(), 1);
        }
        e => panic!("{e:?}"),
    }
    let upper = t.node_info(na).unwrap().parent.unwrap();
    let f = backup(&mut t, upper, 100);
    assert_eq!(f.hashes(), vec![want[0]]);
    assert_eq!(f.prior_hash, None);
    // One fragment: its own vectors, by value.
    let (nodes, slots, hashes) = f.clone().into_parts();
    assert_eq!(
        (nodes, slots, hashes),
        (vec![upper], f.host_slots(), vec![want[0]])
    );
    let f = backup(&mut t, na, 200);
    assert_eq!(f.prior_hash, Some(want[0]));
    let ev = t.drain_events();
    assert!(ev.iter().all(|e| e.medium() == Some(Medium::CpuPinned)));
    t.evict(10, &mut NoHost);
    assert!(t.drain_events().iter().any(|e| matches!(
        e,
        KvEvent::BlockRemoved {
            medium: Medium::Gpu,
            ..
        }
    )));
    t.reset();
    assert_eq!(t.drain_events(), vec![KvEvent::AllBlocksCleared]);
    ok(&t);
}

#[test]
fn namespaced_tenants_seed_their_chains() {
    use crate::hash::{HashMode, Namespace};
    use crate::layout::{DType, KvKind, LayoutKind};
    let ns = Namespace::single_rank(
        "m",
        DType::Bf16,
        LayoutKind::PageFirst,
        KvKind::Mla { kv_dim: 576 },
        4,
        PS,
    );
    let hasher = PageHasher::new(HashMode::Namespaced, &ns).unwrap();
    let mut c = cfg(WritePolicy::WriteThrough);
    c.hasher = Some(hasher.clone());
    let mut t = HiRadixTree::new(c).unwrap();
    let x = t.tenant(Some("x"), None).unwrap();
    let a = toks(1, 1);
    let n0 = ins(&mut t, &a, 0).last_node;
    let n1 = t
        .insert(x, &a, &ds([1]), InsertOptions::default())
        .unwrap()
        .last_node;
    assert_ne!(t.page_hashes(n0).unwrap(), t.page_hashes(n1).unwrap());
    let start = t.chain_start(x).unwrap().unwrap();
    assert_eq!(
        t.page_hashes(n1).unwrap(),
        &hasher.hash_pages(start.prior, &a)[..]
    );
    ok(&t);
}

#[test]
fn insert_with_hashes_reuses_known_hashes_only_where_the_chain_continues() {
    use crate::hash::{HashMode, Namespace};
    use crate::key::PageHash;
    use crate::layout::{DType, KvKind, LayoutKind};
    let ns = Namespace::single_rank(
        "m",
        DType::Bf16,
        LayoutKind::PageFirst,
        KvKind::Mha {
            heads: 1,
            head_dim: 8,
        },
        2,
        PS,
    );
    let hasher = PageHasher::new(HashMode::Namespaced, &ns).unwrap();
    let mut c = cfg(WritePolicy::WriteThrough);
    c.hasher = Some(hasher.clone());
    let mut t = HiRadixTree::new(c).unwrap();
    let seed = t.chain_start(T).unwrap().unwrap().prior;
    let a = toks(1, 2);
    ins(&mut t, &a, 0);
    let key = cat(&a, &toks(2, 3));
    let real = hasher.hash_pages(seed, &key);
    // Marked hashes show which pages were taken from `known`: the tree cannot tell them from
    // real ones once the prior and tokens check out (the caller's guarantee).
    let fake: Vec<PageHash> = (0..5u8).map(|k| PageHash([k + 1; 32])).collect();
    let insert = |t: &mut HiRadixTree, known: KnownHashes<'_>, from: u32| {
        let r = t
            .insert_with_hashes(
                T,
                &key,
                &slots(from, 5),
                InsertOptions::default(),
                Some(known),
            )
            .unwrap();
        let hashes = t.page_hashes(r.last_node).unwrap().to_vec();
        t.reset();
        ins(t, &a, 0);
        hashes
    };
    // Known from page 0 (prior: the seed): the leaf (pages 2..5) continues from page 1's
    // hash, which is real[1] in the tree but fake[1] in `known`: nothing reused.
    let k = KnownHashes {
        first_page: 0,
        prior: seed,
        tokens: &key,
        hashes: &fake,
    };
    assert_eq!(insert(&mut t, k, 10), real[2..]);
    // Known from page 2, prior the tree's page-1 hash: every leaf page reused.
    let k = KnownHashes {
        first_page: 2,
        prior: Some(real[1]),
        tokens: &key[2 * PS as usize..],
        hashes: &fake[..3],
    };
    assert_eq!(insert(&mut t, k, 10), fake[..3]);
    // A wrong prior: hashed.
    let k = KnownHashes {
        prior: Some(real[0]),
        ..k
    };
    assert_eq!(insert(&mut t, k, 10), real[2..]);
    // Known tokens differ from page 3 on: page 2 reused, the rest hashed from it.
    let mut other = key[2 * PS as usize..].to_vec();
    other[PS as usize] += 1;
    let k = KnownHashes {
        first_page: 2,
        prior: Some(real[1]),
        tokens: &other,
        hashes: &fake[..3],
    };
    let want = [
        vec![fake[0]],
        hasher.hash_pages(Some(fake[0]), &key[3 * PS as usize..]),
    ]
    .concat();
    assert_eq!(insert(&mut t, k, 10), want);
    // Known covers only page 2: reused, pages 3..5 hashed from it.
    let k = KnownHashes {
        first_page: 2,
        prior: Some(real[1]),
        tokens: &key[2 * PS as usize..3 * PS as usize],
        hashes: &real[2..3],
    };
    assert_eq!(insert(&mut t, k, 10), real[2..]);
    // Known starts after the leaf's first page: hashed.
    let k = KnownHashes {
        first_page: 3,
        prior: Some(real[2]),
        tokens: &key[3 * PS as usize..],
        hashes: &fake[..2],
    };
    assert_eq!(insert(&mut t, k, 10), real[2..]);
    // Real known hashes keep every invariant (the check rehashes every page).
    let k = KnownHashes {
        first_page: 0,
        prior: seed,
        tokens: &key,
        hashes: &real,
    };
    t.insert_with_hashes(T, &key, &slots(10, 5), InsertOptions::default(), Some(k))
        .unwrap();
    ok(&t);
    let last = t.match_prefix(T, &key).unwrap().last_node;
    assert_eq!(t.prefix_hashes(last).unwrap(), real);
}

#[test]
fn reset_returns_every_slot_and_stales_old_ids() {
    let mut t = tree(WritePolicy::WriteThrough);
    let a = toks(1, 2);
    let n = ins(&mut t, &a, 0).last_node;
    backup(&mut t, n, 100);
    let old_root = t.tenant_root(T).unwrap();
    let (mut d, h) = t.reset();
    d.sort();
    assert_eq!(d, ds([0, 1]));
    assert_eq!(h, hs([100, 101]));
    ok(&t);
    assert!(t.node_info(n).is_err());
    assert!(t.node_info(old_root).is_err());
    assert!(t.match_prefix(T, &a).unwrap().device_slots.is_empty());
    ins(&mut t, &a, 0);
}

#[test]
fn every_strategy_evicts_consistently() {
    for kind in StrategyKind::ALL {
        let mut c = cfg(WritePolicy::WriteThrough);
        c.eviction = kind;
        let mut t = HiRadixTree::new(c).unwrap();
        let mut leaves = Vec::new();
        for i in 0..8 {
            let key = cat(&toks(100, 1), &toks(i, 1 + i as usize % 3));
            let r = ins(&mut t, &key, i * 10);
            if i % 2 == 0 {
                for n in r.write_through {
                    if let Some(p) = t.begin_backup(n).unwrap() {
                        let w = t
                            .commit_backup(n, &slots(1000 + i * 10, p.pages()))
                            .unwrap();
                        t.finish_backup(w).unwrap();
                    }
                }
            }
            leaves.push(key);
        }
        for key in &leaves[..4] {
            t.match_prefix(T, key).unwrap();
        }
        let mut freed = 0;
        while t.evictable_pages() > 0 {
            let out = t.evict(2, &mut NoHost);
            assert!(out.freed_pages > 0, "{kind}");
            freed += out.freed_pages;
            ok(&t);
        }
        assert_eq!(
            freed,
            1 + (0..8).map(|i| 1 + i % 3).sum::<usize>(),
            "{kind}"
        );
        while t.stats().host_candidates > 0 {
            assert!(t.evict_host(1).freed_pages > 0);
            ok(&t);
        }
        assert_eq!(t.host_pages(), 0, "{kind}");
    }
}

#[test]
fn lru_eviction_order_is_by_last_access() {
    let mut t = tree(WritePolicy::WriteThroughSelective);
    let keys: Vec<Vec<u32>> = (0..4).map(|i| toks(i, 1)).collect();
    for (i, k) in keys.iter().enumerate() {
        ins(&mut t, k, i as u32);
    }
    t.match_prefix(T, &keys[0]).unwrap();
    t.match_prefix(T, &keys[2]).unwrap();
    let order: Vec<DeviceSlot> = (0..4)
        .map(|_| t.evict(1, &mut NoHost).device_slots[0])
        .collect();
    assert_eq!(order, ds([1, 3, 0, 2]));
}

#[test]
fn metadata_accounting_is_reported() {
    let mut t = tree(WritePolicy::WriteThroughSelective);
    ins(&mut t, &toks(1, 8), 0);
    let (meta, tokens) = t.memory_bytes();
    assert_eq!(tokens, 8 * PS as usize * 4);
    assert!(meta > 8 * 8);
}

#[test]
fn load_back_plan_survives_a_split_of_its_chain() {
    let mut t = tree(WritePolicy::WriteThrough);
    let a = toks(1, 1);
    let b = cat(&a, &toks(2, 3));
    let na = ins(&mut t, &a, 0).last_node;
    let nb = ins(&mut t, &b, 10).last_node;
    backup(&mut t, na, 100);
    backup(&mut t, nb, 200);
    t.lock(na).unwrap();
    t.evict(10, &mut NoHost);
    t.unlock(na).unwrap();
    let plan = t.plan_load_back(nb, None).unwrap().unwrap();
    // A lookup ending inside the planned chain splits it.
    let m = t.match_prefix(T, &b[..8]).unwrap();
    assert_ne!(m.last_node, nb);
    ok(&t);
    let load = t.commit_load_back(plan, &ds([50, 51, 52])).unwrap();
    ok(&t);
    assert_eq!(
        t.match_prefix(T, &b).unwrap().device_slots,
        ds([0, 50, 51, 52])
    );
    t.finish_load_back(load).unwrap();
    ok(&t);
}

#[test]
fn priorities_are_maxed_along_the_path_and_drive_the_priority_strategy() {
    let mut c = cfg(WritePolicy::WriteThroughSelective);
    c.eviction = StrategyKind::Priority;
    let mut t = HiRadixTree::new(c).unwrap();
    let low = toks(1, 1);
    let high = toks(2, 1);
    let opts = |priority| InsertOptions {
        chunked: false,
        priority,
    };
    let nl = t.insert(T, &low, &ds([0]), opts(1)).unwrap().last_node;
    let nh = t.insert(T, &high, &ds([1]), opts(5)).unwrap().last_node;
    // A later, more recent hit on `low` at priority 0 keeps its priority 1.
    t.insert(T, &low, &ds([2]), opts(0)).unwrap();
    assert_eq!(t.node_info(nl).unwrap().priority, 1);
    assert_eq!(t.node_info(nh).unwrap().priority, 5);
    assert_eq!(t.evict(1, &mut NoHost).device_slots, ds([0]));
    ok(&t);
}

#[test]
fn host_inserts_and_subtree_drops_emit_events() {
    let mut c = cfg(WritePolicy::WriteBack);
    c.hasher = Some(PageHasher::sglang(PS).unwrap());
    c.events = true;
    let mut t = HiRadixTree::new(c).unwrap();
    let root = t.tenant_root(T).unwrap();
    let a = toks(1, 1);
    let b = cat(&a, &toks(2, 1));
    ins(&mut t, &a, 0);
    t.drain_events();
    let r = t.insert_host_only(T, root, &b, &hs([7, 8]), None).unwrap();
    ok(&t);
    assert_eq!((r.adopted_pages, r.new_pages), (1, 1));
    let ev = t.drain_events();
    assert_eq!(ev.len(), 2);
    assert!(ev.iter().all(|e| e.medium() == Some(Medium::CpuPinned)));
    // The adopted node is now backed up; its host-only child is dropped only with host eviction.
    let out = t.evict_host(1);
    assert_eq!(out.host_slots, hs([8]));
    let out = t.evict(1, &mut NoHost);
    assert_eq!(out.demoted_pages, 1);
    ok(&t);
    let kinds: Vec<_> = t.drain_events().iter().map(KvEvent::medium).collect();
    assert_eq!(kinds, vec![Some(Medium::CpuPinned), Some(Medium::Gpu)]);
}

#[test]
fn stale_ids_are_errors_for_every_operation() {
    let mut t = tree(WritePolicy::WriteThrough);
    let n = ins(&mut t, &toks(1, 1), 0).last_node;
    t.evict(1, &mut NoHost);
    let stale = |e: Result<(), CoreError>| assert!(matches!(e, Err(CoreError::StaleNode(_))));
    stale(t.lock(n));
    stale(t.unlock(n));
    stale(t.protect_host(n));
    stale(t.release_host(n));
    stale(t.begin_backup(n).map(|_| ()));
    stale(t.commit_backup(n, &hs([1])).map(|_| ()));
    stale(t.plan_load_back(n, None).map(|_| ()));
    stale(t.split(n, 1).map(|_| ()));
    stale(
        t.insert_host_only(T, n, &toks(2, 1), &hs([1]), None)
            .map(|_| ()),
    );
    stale(t.tokens(n).map(|_| ()));
    stale(t.children(n).map(|_| ()));
    stale(t.last_page_hash(n).map(|_| ()));
    ok(&t);
}

#[test]
fn page_size_one_works_token_by_token() {
    let mut t = HiRadixTree::new(TreeConfig {
        hasher: Some(PageHasher::sglang(1).unwrap()),
        events: true,
        ..TreeConfig::new(1)
    })
    .unwrap();
    let a = [1, 2, 3, 4];
    let b = [1, 2, 9];
    let r = t
        .insert(T, &a, &ds([10, 11, 12, 13]), InsertOptions::default())
        .unwrap();
    ok(&t);
    let m = t.match_prefix(T, &b).unwrap();
    ok(&t);
    assert_eq!(m.device_slots, ds([10, 11]));
    let r2 = t
        .insert(T, &b, &ds([20, 21, 22]), InsertOptions::default())
        .unwrap();
    ok(&t);
    assert_eq!(r2.prefix_pages, 2);
    assert_eq!(
        t.prefix_hashes(r2.last_node).unwrap(),
        PageHasher::sglang(1).unwrap().hash_pages(None, &b)
    );
    // The oldest leaf is the split-off tail [3, 4]: the whole node goes.
    assert_eq!(t.node_info(r.last_node).unwrap().pages, 2);
    assert_eq!(t.evict(1, &mut NoHost).device_slots, ds([12, 13]));
    ok(&t);
    assert!(t.node_info(r.last_node).is_err());
}

#[test]
fn the_tree_can_move_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<HiRadixTree>();
}

// ----- tiering: transient host copies (buffer_only) and exclusive L3 writes -----------------

fn hashed_tree(policy: WritePolicy) -> HiRadixTree {
    let ns = crate::hash::Namespace::single_rank(
        "m",
        crate::layout::DType::Bf16,
        crate::layout::LayoutKind::PageFirst,
        crate::layout::KvKind::Mha {
            heads: 1,
            head_dim: 8,
        },
        1,
        PS,
    );
    HiRadixTree::new(TreeConfig {
        hasher: Some(PageHasher::new(crate::hash::HashMode::Namespaced, &ns).unwrap()),
        ..cfg(policy)
    })
    .unwrap()
}

#[test]
fn transient_host_copies_drop_parent_first_and_back_up_children_alone() {
    let mut t = tree(WritePolicy::WriteThrough);
    t.set_transient_host(true).unwrap();
    let a = toks(1, 2);
    let r = ins(&mut t, &a, 100);
    let parent = r.last_node;
    backup(&mut t, parent, 0);
    // The parent's host copy goes; the tree still holds it on device, not backed up.
    assert_eq!(t.drop_host_copy(parent).unwrap(), Some(hs([0, 1])));
    ok(&t);
    assert_eq!(t.host_pages(), 0);
    let info = t.node_info(parent).unwrap();
    assert!(info.on_device && !info.backed_up);
    // A child may be backed up below a parent without a host copy.
    let r = ins(&mut t, &cat(&a, &toks(2, 1)), 100);
    backup(&mut t, r.last_node, 5);
    ok(&t);
    // A match continues after its last node: L3 prefetches start there.
    let m = t.match_prefix(T, &cat(&a, &toks(2, 1))).unwrap();
    assert_eq!(m.last_host_node, r.last_node);
    // Pages from L3 below a device node without a host copy: the anchor may be that node,
    // and present device pages never take the fetched copies.
    t.drop_host_copy(r.last_node).unwrap().unwrap();
    t.protect_host(parent).unwrap();
    let out = t
        .insert_host_only(T, parent, &cat(&toks(2, 1), &toks(3, 1)), &hs([7, 8]), None)
        .unwrap();
    assert_eq!(out.duplicate_slots, hs([7]));
    assert_eq!((out.adopted_pages, out.new_pages), (0, 1));
    ok(&t);
    // The pinned anchor is not evicted from device while its pin lasts.
    t.evict(100, &mut NoHost);
    ok(&t);
    assert!(t.node_info(parent).unwrap().on_device);
    t.release_host(parent).unwrap();
    ok(&t);
    // Turning the mode off is refused once nodes exist.
    assert!(t.set_transient_host(false).is_err());
}

#[test]
fn drop_host_copy_keeps_prefix_closed_host_residency_in_cache_mode() {
    let mut t = tree(WritePolicy::WriteThrough);
    let a = toks(1, 1);
    let pa = ins(&mut t, &a, 100).last_node;
    backup(&mut t, pa, 0);
    let child = ins(&mut t, &cat(&a, &toks(2, 1)), 100).last_node;
    backup(&mut t, child, 1);
    // The parent keeps its copy while a child has one (write-through, cache mode).
    assert_eq!(t.drop_host_copy(pa).unwrap(), None);
    // Pinned or write-pending nodes keep theirs.
    t.protect_host(child).unwrap();
    assert_eq!(t.drop_host_copy(child).unwrap(), None);
    t.release_host(child).unwrap();
    assert_eq!(t.drop_host_copy(child).unwrap(), Some(hs([1])));
    assert_eq!(t.drop_host_copy(pa).unwrap(), Some(hs([0])));
    ok(&t);
    // A host-only leaf is deleted with its copy.
    backup(&mut t, pa, 3);
    t.evict(100, &mut NoHost);
    ok(&t);
    assert!(!t.node_info(pa).unwrap().on_device);
    assert_eq!(t.drop_host_copy(pa).unwrap(), Some(hs([3])));
    assert!(matches!(t.node_info(pa), Err(CoreError::StaleNode(_))));
    ok(&t);
}

#[test]
fn coldest_host_leaves_change_nothing_and_evict_host_while_stops_at_a_refused_leaf() {
    let mut t = hashed_tree(WritePolicy::WriteThrough);
    let mut nodes = Vec::new();
    for i in 0..4 {
        let n = ins(&mut t, &toks(10 + i, 2), 100 + 2 * i).last_node;
        backup(&mut t, n, 2 * i);
        nodes.push(n);
    }
    t.evict(100, &mut NoHost);
    ok(&t);
    // LRU: the first inserted is the coldest.
    let cold = t.coldest_host_leaves(3);
    assert_eq!(cold, nodes[..2].to_vec());
    ok(&t);
    assert_eq!(
        t.coldest_host_leaves(3),
        cold,
        "asking again changes nothing"
    );
    // The first (coldest) may go, the second may not: eviction stops there, and the hotter
    // third and fourth stay although they may go.
    let keep = t.page_hashes(nodes[1]).unwrap().to_vec();
    let out = t.evict_host_while(100, &mut |h| h != keep.as_slice());
    assert_eq!(out.freed_pages, 2);
    assert_eq!(out.host_slots, hs([0, 1]));
    ok(&t);
    assert!(t.node_info(nodes[0]).is_err());
    for n in &nodes[1..] {
        assert!(t.node_info(*n).is_ok());
    }
    let none = t.evict_host_while(100, &mut |_| false);
    assert_eq!(none.freed_pages, 0);
    ok(&t);
    assert_eq!(t.host_pages(), 6);
    assert_eq!(t.coldest_host_leaves(1), vec![nodes[1]]);
}
