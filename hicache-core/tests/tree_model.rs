//! Property tests: random sequences of tree operations checked against a naive model.
//!
//! The model knows nothing of nodes: it maps every cached page, identified by its tenant and
//! the tokens from the start of the sequence to the end of the page, to its device slot and
//! host slot. Each operation's result is predicted from the model where the semantics fix it
//! (match, insert, host insert, load-back) and applied to the model where the tree chooses
//! (eviction picks victims by strategy); after every step the tree's full content must equal
//! the model, its counters must equal the model's sums, and `check_invariants` must pass.

use std::collections::{BTreeMap, BTreeSet};

use hicache_core::{
    DeviceSlot, HiRadixTree, HostAllocator, HostSlot, InsertOptions, NodeId, StrategyKind,
    TenantId, TreeConfig, WriteId, WritePolicy,
};
use proptest::prelude::*;

const PS: u32 = 2;

#[derive(Clone, Debug)]
enum Op {
    Match(u8, Vec<u8>),
    Insert(u8, Vec<u8>, bool, u8),
    Lock(u8, Vec<u8>),
    Unlock(usize),
    Evict(usize),
    EvictHost(usize),
    LoadBack(u8, Vec<u8>, bool, Option<usize>),
    HostInsert(u8, Vec<u8>, bool),
    Protect(u8, Vec<u8>),
    Release(usize),
    Finish(usize),
    Split(u8, Vec<u8>, usize),
    Reset,
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..3, 1..6)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..2, key()).prop_map(|(t, k)| Op::Match(t, k)),
        6 => (0u8..2, key(), any::<bool>(), 0u8..3).prop_map(|(t, k, c, b)| Op::Insert(t, k, c, b)),
        2 => (0u8..2, key()).prop_map(|(t, k)| Op::Lock(t, k)),
        2 => any::<usize>().prop_map(Op::Unlock),
        3 => (1usize..6).prop_map(Op::Evict),
        2 => (1usize..6).prop_map(Op::EvictHost),
        4 => (0u8..2, key(), any::<bool>(), prop::option::of(0usize..8))
            .prop_map(|(t, k, f, q)| Op::LoadBack(t, k, f, q)),
        3 => (0u8..2, key(), any::<bool>()).prop_map(|(t, k, r)| Op::HostInsert(t, k, r)),
        1 => (0u8..2, key()).prop_map(|(t, k)| Op::Protect(t, k)),
        1 => any::<usize>().prop_map(Op::Release),
        2 => any::<usize>().prop_map(Op::Finish),
        1 => (0u8..2, key(), any::<usize>()).prop_map(|(t, k, at)| Op::Split(t, k, at)),
        1 => Just(Op::Reset),
    ]
}

/// Page `w` of a key: the same tokens wherever it appears, so keys share prefixes.
fn tokens_of(words: &[u8]) -> Vec<u32> {
    words
        .iter()
        .flat_map(|&w| (0..PS).map(move |j| u32::from(w) * 10 + j))
        .collect()
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Page {
    dev: Option<DeviceSlot>,
    host: Option<HostSlot>,
}

type PageKey = (u32, Vec<u32>);

#[derive(Default)]
struct Pool {
    next: u32,
    freed: Vec<HostSlot>,
    cap: usize,
    used: usize,
}

impl HostAllocator for Pool {
    fn alloc(&mut self, pages: usize) -> Option<Vec<HostSlot>> {
        if self.used + pages > self.cap {
            return None;
        }
        self.used += pages;
        let v = (self.next..self.next + pages as u32)
            .map(HostSlot)
            .collect();
        self.next += pages as u32;
        Some(v)
    }
    fn free(&mut self, slots: &[HostSlot]) {
        self.used -= slots.len();
        self.freed.extend_from_slice(slots);
    }
}

enum Pending {
    /// A write and, for write-through, the node it locks.
    Write(WriteId, Option<NodeId>),
    /// A load and the node it locks.
    Load(hicache_core::LoadId, NodeId),
}

struct Harness {
    t: HiRadixTree,
    model: BTreeMap<PageKey, Page>,
    tenants: [TenantId; 2],
    next_dev: u32,
    host: Pool,
    locks: Vec<NodeId>,
    protects: Vec<NodeId>,
    pending: Vec<Pending>,
    write_back: bool,
}

impl Harness {
    fn new(policy: WritePolicy, kind: StrategyKind) -> Self {
        let mut t = HiRadixTree::new(TreeConfig {
            write_policy: policy,
            eviction: kind,
            load_back_threshold_tokens: 3,
            ..TreeConfig::new(PS)
        })
        .unwrap();
        let tenants = [TenantId::DEFAULT, t.tenant(Some("lora"), None).unwrap()];
        Self {
            t,
            model: BTreeMap::new(),
            tenants,
            next_dev: 0,
            host: Pool {
                next: 1_000_000,
                cap: 12,
                ..Pool::default()
            },
            locks: Vec::new(),
            protects: Vec::new(),
            pending: Vec::new(),
            write_back: policy == WritePolicy::WriteBack,
        }
    }

    fn dev_slots(&mut self, n: usize) -> Vec<DeviceSlot> {
        let v = (self.next_dev..self.next_dev + n as u32)
            .map(DeviceSlot)
            .collect();
        self.next_dev += n as u32;
        v
    }

    fn page_key(&self, tenant: u8, tokens: &[u32], page: usize) -> PageKey {
        (
            self.tenants[tenant as usize].0,
            tokens[..(page + 1) * PS as usize].to_vec(),
        )
    }

    /// Full path tokens of a node (from its tenant root).
    fn path(&self, id: NodeId) -> Vec<u32> {
        let mut parts = Vec::new();
        let mut n = id;
        loop {
            let info = self.t.node_info(n).unwrap();
            if info.is_root {
                break;
            }
            parts.push(self.t.tokens(n).unwrap().to_vec());
            n = info.parent.unwrap();
        }
        parts.reverse();
        parts.concat()
    }

    fn tenant_of(&self, id: NodeId) -> u8 {
        let t = self.t.node_info(id).unwrap().tenant;
        self.tenants.iter().position(|&x| x == t).unwrap() as u8
    }

    /// The model's prediction for a match: device slots and host-hit pages.
    fn predict_match(&self, tenant: u8, tokens: &[u32]) -> (Vec<DeviceSlot>, usize) {
        let mut dev = Vec::new();
        let mut host = 0;
        for p in 0..tokens.len() / PS as usize {
            match self.model.get(&self.page_key(tenant, tokens, p)) {
                Some(pg) => match pg.dev {
                    Some(d) => dev.push(d),
                    None => host += 1,
                },
                None => break,
            }
        }
        (dev, host)
    }

    fn release_dev(&mut self, slots: &[DeviceSlot], demote_allowed: bool) {
        let set: BTreeSet<DeviceSlot> = slots.iter().copied().collect();
        let keys: Vec<PageKey> = self
            .model
            .iter()
            .filter(|(_, p)| p.dev.is_some_and(|d| set.contains(&d)))
            .map(|(k, _)| k.clone())
            .collect();
        assert_eq!(
            keys.len(),
            set.len(),
            "freed device slots the model does not hold"
        );
        for k in keys {
            let pg = self.model.get_mut(&k).unwrap();
            pg.dev = None;
            if pg.host.is_none() {
                self.model.remove(&k);
            } else {
                assert!(demote_allowed || pg.host.is_none());
            }
        }
    }

    fn release_host(&mut self, slots: &[HostSlot]) {
        let set: BTreeSet<HostSlot> = slots.iter().copied().collect();
        let keys: Vec<PageKey> = self
            .model
            .iter()
            .filter(|(_, p)| p.host.is_some_and(|h| set.contains(&h)))
            .map(|(k, _)| k.clone())
            .collect();
        assert_eq!(
            keys.len(),
            set.len(),
            "freed host slots the model does not hold"
        );
        for k in keys {
            let pg = self.model.get_mut(&k).unwrap();
            assert!(pg.dev.is_none(), "host copy of a device page freed");
            self.model.remove(&k);
        }
    }

    fn set_host(&mut self, id: NodeId, slots: &[HostSlot]) {
        let tenant = self.tenant_of(id);
        let path = self.path(id);
        let pages = self.t.node_info(id).unwrap().pages;
        let first = path.len() / PS as usize - pages;
        for (j, &h) in slots.iter().enumerate() {
            let k = self.page_key(tenant, &path, first + j);
            self.model.get_mut(&k).unwrap().host = Some(h);
        }
    }

    fn backup(&mut self, id: NodeId, finish_now: bool) {
        let Some(plan) = self.t.begin_backup(id).unwrap() else {
            return;
        };
        let Some(h) = self.host.alloc(plan.pages()) else {
            return;
        };
        let w = self.t.commit_backup(id, &h).unwrap();
        self.set_host(id, &h);
        if finish_now {
            self.t.finish_backup(w).unwrap();
        } else {
            self.pending.push(Pending::Write(w, Some(id)));
        }
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Match(tn, words) => {
                let toks = tokens_of(words);
                let (dev, host) = self.predict_match(*tn, &toks);
                let m = self
                    .t
                    .match_prefix(self.tenants[*tn as usize], &toks)
                    .unwrap();
                assert_eq!(m.device_slots, dev);
                assert_eq!(m.host_hit_pages, host);
                let matched = self.path(m.last_node).len() / PS as usize;
                assert_eq!(matched, dev.len() + host);
            }
            Op::Insert(tn, words, chunked, backup_mode) => {
                let toks = tokens_of(words);
                let n = words.len();
                let slots = self.dev_slots(n);
                let (dev, _) = self.predict_match(*tn, &toks);
                let r = self
                    .t
                    .insert(
                        self.tenants[*tn as usize],
                        &toks,
                        &slots,
                        InsertOptions {
                            chunked: *chunked,
                            priority: i32::from(*backup_mode),
                        },
                    )
                    .unwrap();
                assert_eq!(r.prefix_pages, dev.len());
                for (p, &slot) in slots.iter().enumerate() {
                    let k = self.page_key(*tn, &toks, p);
                    let e = self.model.entry(k).or_default();
                    if e.dev.is_none() {
                        e.dev = Some(slot);
                    }
                }
                assert_eq!(self.path(r.last_node), toks);
                if !self.write_back {
                    for id in r.write_through {
                        match backup_mode {
                            0 => {}
                            1 => self.backup(id, true),
                            _ => self.backup(id, false),
                        }
                    }
                } else {
                    assert!(r.write_through.is_empty());
                }
            }
            Op::Lock(tn, words) => {
                let toks = tokens_of(words);
                let m = self
                    .t
                    .match_prefix(self.tenants[*tn as usize], &toks)
                    .unwrap();
                self.t.lock(m.last_device_node).unwrap();
                self.locks.push(m.last_device_node);
            }
            Op::Unlock(i) => {
                if !self.locks.is_empty() {
                    let id = self.locks.swap_remove(i % self.locks.len());
                    self.t.unlock(id).unwrap();
                }
            }
            Op::Evict(n) => {
                let before = self.t.evictable_pages();
                let out = self.t.evict(*n, &mut self.host);
                if !self.write_back {
                    assert!(out.freed_pages >= (*n).min(before), "{out:?} {before}");
                    assert!(out.write_back.is_empty());
                }
                let freed_host = std::mem::take(&mut self.host.freed);
                self.release_host_any(&freed_host);
                self.release_dev(&out.device_slots, true);
                for s in &out.write_back {
                    // The copy is done at once; the write finishes later.
                    self.set_host_by_dev(&s.device_slots, &s.host_slots);
                    self.release_dev(&s.device_slots, true);
                    self.pending.push(Pending::Write(s.write_id, None));
                }
            }
            Op::EvictHost(n) => {
                let out = self.t.evict_host(*n);
                assert_eq!(out.freed_pages, out.host_slots.len());
                self.host.free(&out.host_slots);
                self.host.freed.clear();
                self.release_host(&out.host_slots);
            }
            Op::LoadBack(tn, words, finish, quota) => {
                let toks = tokens_of(words);
                let m = self
                    .t
                    .match_prefix(self.tenants[*tn as usize], &toks)
                    .unwrap();
                let plan = self.t.plan_load_back(m.last_node, *quota).unwrap();
                let Some(plan) = plan else {
                    let too_small = m.host_hit_pages * (PS as usize) < 3;
                    assert!(too_small || quota.is_some() || m.host_hit_pages == 0);
                    return;
                };
                assert_eq!(plan.pages(), m.host_hit_pages);
                let slots = self.dev_slots(plan.pages());
                let first = m.device_slots.len();
                let node = plan.node();
                let id = self.t.commit_load_back(plan, &slots).unwrap();
                for (j, &s) in slots.iter().enumerate() {
                    let k = self.page_key(*tn, &toks, first + j);
                    let pg = self.model.get_mut(&k).unwrap();
                    assert!(pg.dev.is_none() && pg.host.is_some());
                    pg.dev = Some(s);
                }
                if *finish {
                    self.t.finish_load_back(id).unwrap();
                } else {
                    self.pending.push(Pending::Load(id, node));
                }
            }
            Op::HostInsert(tn, words, at_root) => {
                let toks = tokens_of(words);
                let m = self
                    .t
                    .match_prefix(self.tenants[*tn as usize], &toks)
                    .unwrap();
                let anchor = if *at_root {
                    self.t.tenant_root(self.tenants[*tn as usize]).unwrap()
                } else {
                    m.last_host_node
                };
                let start = self.path(anchor).len();
                let suffix = &toks[start..];
                if suffix.is_empty() {
                    return;
                }
                let n = suffix.len() / PS as usize;
                let Some(h) = self.host.alloc(n) else {
                    return;
                };
                let r = self
                    .t
                    .insert_host_only(self.tenants[*tn as usize], anchor, suffix, &h, None)
                    .unwrap();
                let first = start / PS as usize;
                let mut dup = Vec::new();
                let (mut adopted, mut new) = (0, 0);
                for (j, &slot) in h.iter().enumerate() {
                    let k = self.page_key(*tn, &toks, first + j);
                    match self.model.get_mut(&k) {
                        Some(pg) if pg.host.is_some() => dup.push(slot),
                        Some(pg) => {
                            pg.host = Some(slot);
                            adopted += 1;
                        }
                        None => {
                            self.model.insert(
                                k,
                                Page {
                                    dev: None,
                                    host: Some(slot),
                                },
                            );
                            new += 1;
                        }
                    }
                }
                assert_eq!(r.duplicate_slots, dup);
                assert_eq!((r.adopted_pages, r.new_pages), (adopted, new));
                self.host.free(&r.duplicate_slots);
                self.host.freed.clear();
            }
            Op::Protect(tn, words) => {
                let toks = tokens_of(words);
                let m = self
                    .t
                    .match_prefix(self.tenants[*tn as usize], &toks)
                    .unwrap();
                self.t.protect_host(m.last_host_node).unwrap();
                self.protects.push(m.last_host_node);
            }
            Op::Release(i) => {
                if !self.protects.is_empty() {
                    let id = self.protects.swap_remove(i % self.protects.len());
                    self.t.release_host(id).unwrap();
                }
            }
            Op::Split(tn, words, at) => {
                let toks = tokens_of(words);
                let m = self
                    .t
                    .match_prefix(self.tenants[*tn as usize], &toks)
                    .unwrap();
                let info = self.t.node_info(m.last_node).unwrap();
                if info.pages > 1 {
                    let upper = self
                        .t
                        .split(m.last_node, 1 + at % (info.pages - 1))
                        .unwrap();
                    assert_eq!(self.t.node_info(m.last_node).unwrap().parent, Some(upper));
                } else {
                    assert!(self.t.split(m.last_node, 1).is_err());
                }
            }
            Op::Reset => {
                let (dev, host) = self.t.reset();
                let want_dev = self.model.values().filter(|p| p.dev.is_some()).count();
                let want_host = self.model.values().filter(|p| p.host.is_some()).count();
                assert_eq!((dev.len(), host.len()), (want_dev, want_host));
                self.host.used -= host.len();
                self.model.clear();
                self.locks.clear();
                self.protects.clear();
                self.pending.clear();
                for &t in &self.tenants {
                    assert!(
                        self.t
                            .match_prefix(t, &tokens_of(&[0]))
                            .unwrap()
                            .device_slots
                            .is_empty()
                    );
                }
            }
            Op::Finish(i) => {
                if !self.pending.is_empty() {
                    match self.pending.remove(i % self.pending.len()) {
                        Pending::Write(w, _) => {
                            self.t.finish_backup(w).unwrap();
                        }
                        Pending::Load(l, _) => {
                            self.t.finish_load_back(l).unwrap();
                        }
                    }
                }
            }
        }
    }

    fn set_host_by_dev(&mut self, dev: &[DeviceSlot], host: &[HostSlot]) {
        for (&d, &h) in dev.iter().zip(host) {
            let pg = self
                .model
                .values_mut()
                .find(|p| p.dev == Some(d))
                .expect("staged page in model");
            assert!(pg.host.is_none());
            pg.host = Some(h);
        }
    }

    /// Host slots freed through the allocator during `evict` (by host eviction to make room, or
    /// by subtree drops, which also free device slots reported separately).
    fn release_host_any(&mut self, slots: &[HostSlot]) {
        let set: BTreeSet<HostSlot> = slots.iter().copied().collect();
        let keys: Vec<PageKey> = self
            .model
            .iter()
            .filter(|(_, p)| p.host.is_some_and(|h| set.contains(&h)))
            .map(|(k, _)| k.clone())
            .collect();
        assert_eq!(keys.len(), set.len());
        for k in keys {
            let pg = self.model.get_mut(&k).unwrap();
            pg.host = None;
            if pg.dev.is_none() {
                self.model.remove(&k);
            }
        }
    }

    /// The tree's whole content as the model sees it.
    fn content(&self) -> BTreeMap<PageKey, Page> {
        let mut out = BTreeMap::new();
        for &tenant in &self.tenants {
            let root = self.t.tenant_root(tenant).unwrap();
            let mut stack = vec![(root, Vec::<u32>::new())];
            while let Some((id, prefix)) = stack.pop() {
                for c in self.t.children(id).unwrap() {
                    let toks = self.t.tokens(c).unwrap();
                    let dev = self.t.device_slots(c).unwrap();
                    let host = self.t.host_slots(c).unwrap();
                    let mut path = prefix.clone();
                    for (j, page) in toks.chunks(PS as usize).enumerate() {
                        path.extend_from_slice(page);
                        out.insert(
                            (tenant.0, path.clone()),
                            Page {
                                dev: dev.get(j).copied(),
                                host: host.get(j).copied(),
                            },
                        );
                    }
                    stack.push((c, path));
                }
            }
        }
        out
    }

    fn check(&self) {
        self.t.check_invariants().unwrap();
        assert_eq!(self.content(), self.model);
        let dev = self.model.values().filter(|p| p.dev.is_some()).count();
        let host = self.model.values().filter(|p| p.host.is_some()).count();
        assert_eq!(self.t.device_pages(), dev);
        assert_eq!(self.t.host_pages(), host);
        // Protected pages: the union of the paths of every lock holder (requests, pending
        // write-through writes and loads each lock a node and its ancestors).
        let mut holders: Vec<NodeId> = self.locks.clone();
        for p in &self.pending {
            match p {
                Pending::Write(_, Some(n)) | Pending::Load(_, n) => holders.push(*n),
                Pending::Write(_, None) => {}
            }
        }
        let mut protected: BTreeSet<PageKey> = BTreeSet::new();
        for &h in &holders {
            if self.t.node_info(h).unwrap().is_root {
                continue;
            }
            let path = self.path(h);
            let tenant = self.tenant_of(h);
            for p in 0..path.len() / PS as usize {
                protected.insert(self.page_key(tenant, &path, p));
            }
        }
        assert_eq!(self.t.protected_pages(), protected.len());
        assert_eq!(self.t.evictable_pages() + protected.len(), dev);
    }
}

fn run(policy: WritePolicy, kind: StrategyKind, ops: &[Op]) {
    let mut h = Harness::new(policy, kind);
    for op in ops {
        h.step(op);
        h.check();
    }
    // Determinism (TP ranks): the same operations give the same tree, node ids included.
    let mut twin = Harness::new(policy, kind);
    for op in ops {
        twin.step(op);
    }
    assert_eq!(twin.content(), h.content());
    assert_eq!(twin.t.stats(), h.t.stats());
    assert_eq!(twin.locks, h.locks);
    // Unwind every pin; then everything must be evictable down to nothing.
    while let Some(p) = h.pending.pop() {
        match p {
            Pending::Write(w, _) => {
                h.t.finish_backup(w).unwrap();
            }
            Pending::Load(l, _) => {
                h.t.finish_load_back(l).unwrap();
            }
        }
    }
    for id in std::mem::take(&mut h.locks) {
        h.t.unlock(id).unwrap();
    }
    for id in std::mem::take(&mut h.protects) {
        h.t.release_host(id).unwrap();
    }
    h.check();
    assert_eq!(h.t.protected_pages(), 0);
    if policy != WritePolicy::WriteBack {
        let out = h.t.evict(usize::MAX, &mut h.host);
        h.release_dev(&out.device_slots, true);
        assert_eq!(h.t.device_pages(), 0);
        let out = h.t.evict_host(usize::MAX);
        h.release_host(&out.host_slots);
        assert_eq!(h.t.stats().nodes, 0);
        h.check();
    }
}

fn policy() -> impl Strategy<Value = WritePolicy> {
    prop_oneof![
        Just(WritePolicy::WriteThrough),
        Just(WritePolicy::WriteThroughSelective),
        Just(WritePolicy::WriteBack),
    ]
}

fn strategy() -> impl Strategy<Value = StrategyKind> {
    prop::sample::select(StrategyKind::ALL.to_vec())
}

proptest! {
    // 256 cases by default; `PROPTEST_CASES=N` for a longer search.
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256)
    ))]

    #[test]
    fn tree_matches_the_naive_model(
        policy in policy(),
        kind in strategy(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(policy, kind, &ops);
    }
}
