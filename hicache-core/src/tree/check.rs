//! The invariant checker: recomputes everything the tree maintains incrementally and compares.

use std::collections::BTreeSet;

use crate::hash::PageHasher;

use super::node::{DEVICE, HOST, LIVE, NIL, SKIPPED, WRITE_PENDING};
use super::{HiRadixTree, WriteKind};

impl HiRadixTree {
    /// Checks every invariant of the module documentation by full
    /// recomputation: O(nodes + pages), plus one SHA-256 per page when hashing is on. Returns
    /// the first violation found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let ps = self.ps;
        let nodes = &self.arena.nodes;
        let mut live = 0usize;
        let (mut device, mut host, mut evictable, mut protected) = (0, 0, 0, 0);
        let mut want_dev = BTreeSet::new();
        let mut want_host = BTreeSet::new();
        for (idx, n) in nodes.iter().enumerate() {
            let i = idx as u32;
            if !n.has(LIVE) {
                continue;
            }
            let id = self.id(i);
            let fail = |what: &str| Err(format!("node {id}: {what}"));
            if n.has(SKIPPED) {
                return fail("SKIPPED flag left set");
            }
            if n.is_root() {
                if n.parent != NIL || n.pages != 0 || n.flags & (DEVICE | HOST) != DEVICE | HOST {
                    return fail("malformed tenant root");
                }
                let t = &self.tenants[n.tenant as usize];
                if t.root != i {
                    return fail("tenant root not registered");
                }
            } else {
                live += 1;
                let p = n.pages as usize;
                if p == 0 {
                    return fail("empty node");
                }
                if n.buf.len() != p * (ps + 2) {
                    return fail("buffer length does not match pages");
                }
                if n.first_token != n.buf[0] {
                    return fail("cached first token is stale");
                }
                let hashing = self.cfg.hasher.is_some();
                if n.hashes.len() != if hashing { p } else { 0 } {
                    return fail("wrong number of page hashes");
                }
                let Some(parent) = nodes.get(n.parent as usize).filter(|x| x.has(LIVE)) else {
                    return fail("parent is not live");
                };
                if parent.tenant != n.tenant {
                    return fail("child of another tenant's node");
                }
                if self.arena.find_child(n.parent, self.arena.first_page(i)) != Some(i) {
                    return fail("child table does not find the node under its parent");
                }
                // 1. device prefix-closed; 3. evicted => backed up.
                if n.on_device() && !parent.on_device() {
                    return fail("on device below a node that is not");
                }
                if !n.on_device() && !n.backed() {
                    return fail("neither on device nor backed up");
                }
                // 2. host prefix-closed under write-through.
                if self.host_prefix_closed() && n.backed() && !parent.backed() {
                    return fail("backed up below a node that is not (write-through)");
                }
                // 5. locks.
                if n.lock_ref > 0 && !n.on_device() {
                    return fail("locked but not on device");
                }
                if n.on_device() {
                    device += p;
                    if n.lock_ref > 0 {
                        protected += p;
                    } else {
                        evictable += p;
                    }
                }
                if n.backed() {
                    host += p;
                }
                if n.has(WRITE_PENDING) && !n.backed() {
                    return fail("write pending but not backed up");
                }
                if n.stats.last_access > self.clock || n.stats.creation > self.clock {
                    return fail("stamp from the future");
                }
                if self.cfg.hasher.is_some() {
                    let mut prior = self.prior_of(n.parent);
                    for (k, page) in n.tokens(ps).chunks_exact(ps).enumerate() {
                        let want = PageHasher::hash_page(prior.as_ref(), page);
                        if n.hashes[k] != want {
                            return fail(&format!("page hash {k} does not continue the chain"));
                        }
                        prior = Some(want);
                    }
                }
            }
            // Children: links, counts, lock sums, distinct first pages.
            let kids = self.arena.children_of(i);
            let mut dev_kids = 0;
            let mut lock_sum = 0u64;
            let mut prev = NIL;
            let mut firsts = BTreeSet::new();
            for &c in &kids {
                let k = &nodes[c as usize];
                if !k.has(LIVE) || k.parent != i || k.prev != prev {
                    return fail("broken sibling list");
                }
                if !firsts.insert(self.arena.first_page(c).to_vec()) {
                    return fail("two children share a first page");
                }
                prev = c;
                dev_kids += u32::from(k.on_device());
                lock_sum += u64::from(k.lock_ref);
            }
            if kids.len() != n.n_children as usize {
                return fail("child count is wrong");
            }
            if dev_kids != n.dev_children {
                return fail("device-children count is wrong");
            }
            if !n.is_root() && u64::from(n.lock_ref) < lock_sum {
                return fail("lock_ref below the sum of the children's");
            }
            // 6. candidate sets.
            if Self::is_device_candidate(n) {
                want_dev.insert(i);
            }
            if Self::is_host_candidate(n) {
                want_host.insert(i);
            }
        }
        if live != self.node_count {
            return Err(format!("node count {} != {live}", self.node_count));
        }
        if self.arena.children.len() != live {
            return Err(format!(
                "child table has {} entries for {live} nodes",
                self.arena.children.len()
            ));
        }
        let counters = [
            ("device_pages", self.device_pages, device),
            ("host_pages", self.host_pages, host),
            ("evictable_pages", self.evictable, evictable),
            ("protected_pages", self.protected, protected),
        ];
        for (name, have, want) in counters {
            if have != want {
                return Err(format!("{name} is {have}, the nodes sum to {want}"));
            }
        }
        let have_dev: BTreeSet<u32> = self.dev.candidates().into_iter().collect();
        if have_dev != want_dev || self.dev.len() != want_dev.len() {
            return Err(format!(
                "device candidates {have_dev:?} != evictable device leaves {want_dev:?}"
            ));
        }
        let have_host: BTreeSet<u32> = self.host.candidates().into_iter().collect();
        if have_host != want_host || self.host.len() != want_host.len() {
            return Err(format!(
                "host candidates {have_host:?} != evictable host leaves {want_host:?}"
            ));
        }
        // 7. pending writes pin their node.
        for (w, rec) in &self.writes {
            let Ok(i) = self.get(rec.node) else {
                return Err(format!("write {w:?} refers to a stale node"));
            };
            let n = &nodes[i as usize];
            if !n.has(WRITE_PENDING) {
                return Err(format!("write {w:?}: node not marked pending"));
            }
            let pinned = match rec.kind {
                WriteKind::Through => n.lock_ref > 0,
                WriteKind::Back => n.host_ref > 0,
            };
            if !pinned {
                return Err(format!("write {w:?}: node not pinned"));
            }
        }
        for (l, node) in &self.loads {
            let Ok(i) = self.get(*node) else {
                return Err(format!("load {l:?} refers to a stale node"));
            };
            if nodes[i as usize].lock_ref == 0 {
                return Err(format!("load {l:?}: node not locked"));
            }
        }
        Ok(())
    }

    /// Panics with the violation when an invariant does not hold (debug builds only; a no-op
    /// in release builds).
    pub fn debug_assert_invariants(&self) {
        if cfg!(debug_assertions)
            && let Err(e) = self.check_invariants()
        {
            panic!("HiRadixTree invariant violated: {e}");
        }
    }
}
