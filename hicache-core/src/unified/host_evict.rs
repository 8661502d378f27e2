//! Host eviction per component, as SGLang 0.5.23's `drive_host_eviction` (one order per
//! component, the host twin of the device tier's):
//!
//! - **Full**: whole *host leaves* (host-only, childless, unlocked on device and host), least
//!   recently used first. They sit in an indexed heap keyed by the node's time (the dense
//!   tree's [`LruStrategy`]), kept up to date on every change, so each step is O(log n)
//!   (SGLang heapifies every host leaf on each call; the scan it replaced visited every node).
//! - **SWA**, **Mamba**: their *host LRU* (an intrusive list, oldest at the tail) of nodes
//!   whose component is on host only and not host-locked, joined when the device copy goes
//!   (a tombstone or a demotion, most recent first) or the last host lock is released. From
//!   the tail: a host leaf goes whole; any other node loses that component's host copy (SWA
//!   takes the node's host Mamba with it, by cascade priority; Mamba takes nothing).
//!
//! Invariants kept here (checked by `check_host_order`): a node is in the host-leaf heap iff
//! it is a host leaf; a node is in component `c`'s host LRU iff `c` is on host, not on
//! device and not host-locked there. Host-locked components are never freed: they are off
//! the LRU, and a node with any host lock is no host leaf.

use super::node::ROOT;
use super::{Component, Evicted, UnifiedTree};
use super::{FULL, MAMBA, SWA};
use crate::eviction::{EvictionStrategy, NodeStats};

/// The host-leaf heap's key for a node last used at `time`.
fn stats(time: u64) -> NodeStats {
    NodeStats {
        last_access: time,
        ..NodeStats::default()
    }
}

impl UnifiedTree {
    /// Frees at least `full_tokens` of host Full: whole host leaves, least recently used
    /// first (a parent that becomes a host leaf joins), with their host SWA and Mamba.
    /// The freed host slots are in the `host_*` lists of the result; device counts stay 0.
    pub fn evict_host(&mut self, full_tokens: u64) -> Evicted {
        self.evict_host_of(Component::Full, full_tokens)
    }

    /// Frees at least `n` of component `c`'s host copies (tokens for Full and SWA, states
    /// for Mamba) where the tree can, in `c`'s host order (module documentation).
    pub fn evict_host_of(&mut self, c: Component, n: u64) -> Evicted {
        let mut out = Evicted::default();
        if self.has[c as usize] {
            match c {
                Component::Full => self.evict_host_full(n, &mut out),
                _ => self.evict_host_aux(c, n, &mut out),
            }
        }
        out
    }

    /// Host copies of `c` freed so far in `out` (tokens, or states for Mamba).
    fn host_freed(&self, c: Component, out: &Evicted) -> u64 {
        let ps = self.ps() as u64;
        match c {
            Component::Full => out.host_full_pages.len() as u64 * ps,
            Component::Swa => out.host_swa_pages.len() as u64 * ps,
            Component::Mamba => out.host_mamba_slots.len() as u64,
        }
    }

    fn evict_host_full(&mut self, want: u64, out: &mut Evicted) {
        while self.host_freed(Component::Full, out) < want {
            let Some(i) = self.host_leaves.peek() else {
                break;
            };
            debug_assert!(self.is_host_leaf(i));
            self.delete_leaf(i, out);
        }
    }

    fn evict_host_aux(&mut self, c: Component, want: u64, out: &mut Evicted) {
        let l = c.lru();
        let unlocked = |t: &Self, x: u32| t.arena.nodes[x as usize].host_lock[c as usize] == 0;
        let mut x = self.host_lrus[l].prev_unlocked(None, |x| unlocked(self, x));
        while let Some(i) = x {
            if self.host_freed(c, out) >= want {
                break;
            }
            let next = self.host_lrus[l].prev_unlocked(Some(i), |x| unlocked(self, x));
            if self.is_host_leaf(i) {
                self.delete_leaf(i, out);
            } else {
                self.drop_host_comp(i, c, out);
                let lower = Component::Mamba;
                let unlocked = self.arena.nodes[i as usize].host_lock[MAMBA] == 0;
                if c == Component::Swa && self.has[MAMBA] && unlocked {
                    self.drop_host_comp(i, lower, out);
                }
                self.update_leaf(i);
            }
            x = next.filter(|&n| self.host_lrus[l].contains(n));
            if x.is_none() && next.is_some() {
                x = self.host_lrus[l].prev_unlocked(None, |x| unlocked(self, x));
            }
        }
    }

    /// Frees `c`'s host copy on `i` (SWA or Mamba; Full goes only with the node).
    fn drop_host_comp(&mut self, i: u32, c: Component, out: &mut Evicted) {
        let n = &mut self.arena.nodes[i as usize];
        match c {
            Component::Swa => out.host_swa_pages.append(&mut n.host_swa),
            Component::Mamba => out.host_mamba_slots.extend(n.host_mamba.take()),
            Component::Full => unreachable!("Full's host copy goes with its node"),
        }
        self.sync_host_lru(i, c);
    }

    /// A host leaf (SGLang's `_is_host_leaf`): live, not the root, Full on host only, no
    /// children, no lock on device or host.
    pub(crate) fn is_host_leaf(&self, i: u32) -> bool {
        let n = &self.arena.nodes[i as usize];
        i != ROOT
            && n.live
            && !n.comp[FULL].present
            && !n.host_full.is_empty()
            && n.children.is_empty()
            && n.comp.iter().all(|c| c.lock == 0)
            && n.host_lock == [0; 3]
    }

    /// Re-derives `i`'s membership of the host-leaf heap.
    pub(crate) fn update_host_leaf(&mut self, i: u32) {
        let want = self.is_host_leaf(i);
        if want != self.host_leaves.contains(i) {
            let s = stats(self.arena.nodes[i as usize].time);
            if want {
                self.host_leaves.insert(i, &s);
            } else {
                self.host_leaves.remove(i, &s);
            }
        }
    }

    /// Whether `c` on `i` belongs in its host LRU: on host, not on device, not host-locked.
    fn wants_host_lru(&self, i: u32, c: Component) -> bool {
        let n = &self.arena.nodes[i as usize];
        let d = n.comp[c as usize];
        n.live && n.on_host(c) && !d.present && n.host_lock[c as usize] == 0
    }

    /// Puts `c` of `i` on or off its host LRU as [`wants_host_lru`] says (joining at the
    /// most recent end).
    pub(crate) fn sync_host_lru(&mut self, i: u32, c: Component) {
        if c == Component::Full || !self.has[c as usize] {
            return;
        }
        let want = self.wants_host_lru(i, c);
        let lru = &mut self.host_lrus[c.lru()];
        if want && !lru.contains(i) {
            lru.insert_mru(i);
        } else if !want {
            lru.remove(i);
        }
    }

    /// Takes `i` (about to be deleted) off every host order.
    pub(crate) fn forget_host(&mut self, i: u32) {
        self.host_leaves.remove(i, &stats(0));
        for lru in &mut self.host_lrus {
            lru.remove(i);
        }
    }

    /// Sets `i`'s time (SGLang's `last_access_time`), re-keying it in the host-leaf heap.
    pub(crate) fn stamp(&mut self, i: u32, time: u64) {
        self.arena.nodes[i as usize].time = time;
        if self.host_seen && self.host_leaves.contains(i) {
            self.host_leaves.update(i, &stats(time));
        }
    }

    /// After a split of `child` into `new` (prefix) and `child`: the prefix's host SWA joins
    /// the host LRU just older than the child (SGLang's `redistribute_on_node_split`).
    pub(crate) fn split_host_lru(&mut self, new: u32, child: u32) {
        if !self.has[SWA] || !self.wants_host_lru(new, Component::Swa) {
            return;
        }
        let lru = &mut self.host_lrus[Component::Swa.lru()];
        if lru.contains(child) {
            lru.insert_after(child, new);
        } else {
            lru.insert_mru(new);
        }
    }

    /// The host-order invariants of the module documentation.
    pub(crate) fn check_host_order(&self) -> Result<(), String> {
        let mut members = [0usize; 3];
        for i in 0..self.arena.nodes.len() as u32 {
            let live = self.arena.nodes[i as usize].live;
            if self.host_leaves.contains(i) != (live && self.is_host_leaf(i)) {
                return Err(format!("node {i}: host-leaf heap out of date"));
            }
            members[0] += usize::from(live && self.is_host_leaf(i));
            for c in [Component::Swa, Component::Mamba] {
                let want = self.has[c as usize] && live && self.wants_host_lru(i, c);
                if self.host_lrus[c.lru()].contains(i) != want {
                    return Err(format!("node {i}: {c:?} host LRU membership out of date"));
                }
                members[c as usize] += usize::from(want);
            }
        }
        let lens = [
            self.host_leaves.len(),
            self.host_lrus[0].len(),
            self.host_lrus[1].len(),
        ];
        if lens != members {
            return Err(format!("host orders hold {lens:?}, {members:?} belong"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::tree::NodeId;
    use crate::unified::{Component, HostInsert, UnifiedConfig, UnifiedTree};

    /// Host-only nodes: A (tokens 0..4) with child B (4..8), and C (100..104), inserted in
    /// the order A, C, B (so the host leaves are C older than B, and the SWA / Mamba host
    /// LRUs hold, least recent first, A, C, B).
    fn tree(window: u32) -> (UnifiedTree, [NodeId; 3]) {
        let mut t = UnifiedTree::with_device_slots(UnifiedConfig {
            page_size: 2,
            swa_window: Some(window),
            mamba_chunk: Some(2),
        })
        .unwrap();
        let root = t.root();
        let host = |f: [u32; 2], s: [u32; 2], m: u32| (f, s, m);
        let mut put = |parent, key: Vec<u32>, (f, s, m): ([u32; 2], [u32; 2], u32)| {
            let h = HostInsert {
                full: &f,
                swa: &s,
                mamba: Some(m),
            };
            t.insert_host_only(parent, &key, h).unwrap()
        };
        let a = put(root, (0..4).collect(), host([1, 2], [11, 12], 21));
        let c = put(root, (100..104).collect(), host([5, 6], [15, 16], 23));
        let b = put(a, (4..8).collect(), host([3, 4], [13, 14], 22));
        t.check_invariants().unwrap();
        (t, [a, b, c])
    }

    #[test]
    fn full_evicts_the_oldest_host_leaf_then_parents_that_become_leaves() {
        let (mut t, [a, b, c]) = tree(4);
        let e = t.evict_host(2);
        assert_eq!(
            (e.host_full_pages, e.host_swa_pages),
            (vec![5, 6], vec![15, 16])
        );
        assert_eq!(e.host_mamba_slots, [23]);
        assert!(t.backed_up(c, Component::Full).is_err(), "C is deleted");
        assert_eq!(t.evict_host(2).host_full_pages, [3, 4]);
        assert!(t.backed_up(b, Component::Full).is_err());
        assert_eq!(
            t.evict_host(2).host_full_pages,
            [1, 2],
            "A became a host leaf"
        );
        assert!(t.backed_up(a, Component::Full).is_err());
        assert_eq!(t.node_count(), 1);
        t.check_invariants().unwrap();
    }

    #[test]
    fn a_match_refreshes_a_host_leaf() {
        let (mut t, [_, b, _]) = tree(4);
        // Matching C's tokens stamps C (the match's host node): B is now the oldest leaf.
        let m = t.match_prefix(&(100..104).collect::<Vec<_>>()).unwrap();
        assert_ne!(m.host_node, t.root());
        let e = t.evict_host(2);
        assert_eq!(e.host_full_pages, [3, 4]);
        assert!(t.backed_up(b, Component::Full).is_err());
        t.check_invariants().unwrap();
    }

    #[test]
    fn host_locks_keep_what_they_cover() {
        let (mut t, [a, b, _]) = tree(6);
        // The SWA window of B (6 tokens) covers B and A; Full and Mamba lock B alone.
        let r = t.lock_host(b).unwrap();
        assert_eq!(t.host_lock_count(a, Component::Swa).unwrap(), 1);
        assert_eq!(t.host_lock_count(a, Component::Full).unwrap(), 0);
        assert_eq!(t.host_lock_count(b, Component::Mamba).unwrap(), 1);
        let e = t.evict_host_of(Component::Swa, 100);
        assert_eq!(e.host_swa_pages, [15, 16], "only C's window is free");
        let e = t.evict_host(100);
        assert!(e.host_full_pages.is_empty(), "B is locked, A has a child");
        let e = t.evict_host_of(Component::Mamba, 100);
        assert_eq!(e.host_mamba_slots, [21], "A's state is not locked");
        t.check_invariants().unwrap();
        t.unlock_host(&r).unwrap();
        assert!(t.unlock_host(&r).is_err(), "released twice");
        assert_eq!(t.evict_host(100).host_full_pages.len(), 4);
        assert_eq!(t.node_count(), 1);
        t.check_invariants().unwrap();
    }

    #[test]
    fn swa_drops_an_internal_host_copy_and_deletes_a_host_leaf() {
        let (mut t, [a, b, c]) = tree(4);
        // Tail of the SWA host LRU: A, internal: its host SWA goes with its host Mamba.
        let e = t.evict_host_of(Component::Swa, 2);
        assert_eq!(
            (e.host_swa_pages, e.host_mamba_slots),
            (vec![11, 12], vec![21])
        );
        assert!(e.host_full_pages.is_empty());
        assert!(t.backed_up(a, Component::Full).unwrap());
        assert!(!t.backed_up(a, Component::Swa).unwrap());
        // Then C, a host leaf: deleted whole.
        let e = t.evict_host_of(Component::Swa, 2);
        assert_eq!(e.host_full_pages, [5, 6]);
        assert!(t.backed_up(c, Component::Full).is_err());
        // Mamba: B is a leaf, deleted whole; A then has no state left to free.
        let e = t.evict_host_of(Component::Mamba, 5);
        assert_eq!(
            (e.host_full_pages, e.host_mamba_slots),
            (vec![3, 4], vec![22])
        );
        assert!(t.backed_up(b, Component::Full).is_err());
        t.check_invariants().unwrap();
    }
}
