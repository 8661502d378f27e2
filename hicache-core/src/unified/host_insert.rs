//! Host-only inserts: pages arriving from L3 (a prefetch) become host-only nodes, as if a
//! backed-up node had been demoted — Full on host for every page, SWA on host for the
//! trailing pages the prefetch staged, the Mamba state on host at the last page. A later
//! match reports them as a host hit and [`UnifiedTree::plan_load_back`] brings them to
//! device like any demoted node.
//!
//! Invariant kept here (those of `host` and `components`): the new nodes have no device
//! component; their parent is the root or has host Full; when only the trailing pages have
//! host SWA the key is split so that each node holds one host SWA slot per page or none.

use super::node::ROOT;
use super::{Component, SWA, UnifiedTree};
use crate::error::{CoreError, Result};
use crate::tree::NodeId;

/// The host slots of a host-only insert (the caller's host pools).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostInsert<'a> {
    /// One host Full slot per page of the key.
    pub full: &'a [u32],
    /// Host SWA slots of the key's last `swa.len()` pages (empty without SWA data).
    pub swa: &'a [u32],
    /// The host Mamba state at the key's end.
    pub mamba: Option<u32>,
}

impl UnifiedTree {
    /// Adds `key` (whole pages) under `parent` as host-only nodes holding `host`; returns
    /// the deepest new node. Errors: a tree without device slots, a parent neither the root
    /// nor on host, a key whose first page is already a child of `parent`, or slots that do
    /// not fit the key and the configured components.
    pub fn insert_host_only(
        &mut self,
        parent: NodeId,
        key: &[u32],
        host: HostInsert<'_>,
    ) -> Result<NodeId> {
        let p = self.index(parent)?;
        let ps = self.ps();
        let pages = key.len() / ps;
        let refuse = |reason| CoreError::InvalidPolicy {
            field: "insert_host_only",
            value: format!("{parent:?}, {} tokens", key.len()),
            reason,
        };
        let reason = if !self.slots {
            Some("the tree does not track device slots")
        } else if pages == 0 || !key.len().is_multiple_of(ps) {
            Some("the key must be a non-empty whole number of pages")
        } else if p != ROOT && self.arena.nodes[p as usize].host_full.is_empty() {
            Some("the parent is not on host")
        } else if self.child(p, key).is_some() {
            Some("the parent already has a child for the key's first page")
        } else if host.full.len() != pages
            || host.swa.len() > pages
            || (!self.has[SWA] && !host.swa.is_empty())
            || (!self.has[super::MAMBA] && host.mamba.is_some())
        {
            Some("one Full slot per page, SWA slots for trailing pages, a state only with Mamba")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(refuse(reason));
        }
        self.host_seen = true;
        let split = if host.swa.is_empty() {
            pages
        } else {
            pages - host.swa.len()
        };
        let mut at = p;
        if split > 0 {
            at = self.host_node(at, &key[..split * ps], &host.full[..split]);
        }
        if split < pages {
            at = self.host_node(at, &key[split * ps..], &host.full[split..]);
            self.arena.nodes[at as usize].host_swa = host.swa.to_vec();
        }
        self.arena.nodes[at as usize].host_mamba = host.mamba;
        for c in [Component::Swa, Component::Mamba] {
            self.sync_host_lru(at, c);
        }
        self.update_leaf(at);
        Ok(self.id(at))
    }

    /// A new host-only child of `parent` with host Full `full`.
    fn host_node(&mut self, parent: u32, key: &[u32], full: &[u32]) -> u32 {
        let time = self.tick();
        let i = self.arena.alloc(parent, key.to_vec(), time);
        self.arena.nodes[parent as usize].children.push(i);
        self.arena.nodes[i as usize].host_full = full.to_vec();
        self.update_leaf(parent);
        self.update_leaf(i);
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unified::{Component, DeviceLoad, InsertParams, InsertSlots, UnifiedConfig};

    fn tree() -> UnifiedTree {
        UnifiedTree::with_device_slots(UnifiedConfig {
            page_size: 4,
            swa_window: Some(8),
            mamba_chunk: Some(8),
        })
        .unwrap()
    }

    /// A tree holding 16 tokens (4 pages) as one host-only node: its key and the node.
    fn host_only() -> (UnifiedTree, Vec<u32>, NodeId) {
        let mut t = tree();
        let key: Vec<u32> = (0..16).collect();
        let root = t.root();
        let host = HostInsert {
            full: &[10, 11, 12, 13],
            swa: &[20, 21],
            mamba: Some(30),
        };
        let node = t.insert_host_only(root, &key, host).unwrap();
        (t, key, node)
    }

    #[test]
    fn a_host_only_insert_is_a_host_hit_that_loads_back() {
        let (mut t, key, node) = host_only();
        t.check_invariants().unwrap();
        assert!(t.backed_up(node, Component::Mamba).unwrap());
        let m = t.match_prefix(&key).unwrap();
        assert_eq!((m.device_prefix_len, m.host_hit_len), (0, 16));
        assert_eq!(m.host_node, node);
        assert_eq!(m.swa_host_hit_len, 8);
        assert!(m.mamba_host_hit);
        let plan = t.plan_load_back(node).unwrap().unwrap();
        assert_eq!((plan.full_pages(), plan.swa_pages()), (4, 2));
        assert_eq!(plan.mamba, Some(30));
        let id = t
            .commit_load_back(
                &plan,
                DeviceLoad {
                    full: &[0, 1, 2, 3],
                    swa: &[4, 5],
                    mamba: Some(6),
                },
            )
            .unwrap();
        t.finish_load_back(id).unwrap();
        t.check_invariants().unwrap();
        assert_eq!(t.match_prefix(&key).unwrap().device_prefix_len, 16);
        // Host eviction frees them like demoted nodes.
        t.reset();
    }

    #[test]
    fn bad_host_inserts_are_refused() {
        let mut t = tree();
        let key: Vec<u32> = (0..8).collect();
        let root = t.root();
        let two = HostInsert {
            full: &[1, 2],
            swa: &[],
            mamba: None,
        };
        let short = HostInsert { full: &[1], ..two };
        assert!(t.insert_host_only(root, &key, short).is_err());
        assert!(t.insert_host_only(root, &key[..6], two).is_err());
        t.insert_host_only(root, &key, two).unwrap();
        let again = HostInsert {
            full: &[3, 4],
            ..two
        };
        assert!(t.insert_host_only(root, &key, again).is_err());
        t.check_invariants().unwrap();
    }

    #[test]
    fn a_detached_load_back_leaves_the_state_on_host() {
        let (mut t, key, node) = host_only();
        let plan = t.plan_load_back(node).unwrap().unwrap();
        let with_state = DeviceLoad {
            full: &[0, 1, 2, 3],
            swa: &[4, 5],
            mamba: Some(6),
        };
        assert!(t.commit_load_back_detached(&plan, with_state).is_err());
        let dev = DeviceLoad {
            mamba: None,
            ..with_state
        };
        assert!(t.commit_load_back(&plan, dev).is_err());
        let id = t.commit_load_back_detached(&plan, dev).unwrap();
        t.check_invariants().unwrap();
        // Full and SWA on device, the state on host only: the device match stops above.
        let m = t.match_prefix(&key).unwrap();
        assert_eq!((m.device_prefix_len, m.host_node), (0, node));
        assert!(m.mamba_host_hit);
        assert_eq!(t.prefix_pages(node, Component::Full).unwrap().len(), 4);
        let again = t.plan_load_back(node).unwrap().unwrap();
        assert!(again.full.is_empty() && again.swa.is_empty());
        assert_eq!(again.mamba, Some(30));
        // A request on the loaded pages locks the node without its state and inserts on.
        let lock = t.lock(node, true).unwrap();
        let long: Vec<u32> = (0..24).collect();
        t.insert_with_slots(
            &long,
            &InsertParams {
                prev_prefix_len: 16,
                swa_evicted_len: 8,
                mamba_slot: Some(7),
            },
            InsertSlots {
                full: &[0, 1, 2, 3, 8, 9],
                swa: &[u32::MAX, u32::MAX, 4, 5, 14, 15],
            },
        )
        .unwrap();
        t.unlock(&lock).unwrap();
        t.finish_load_back(id).unwrap();
        t.check_invariants().unwrap();
        assert_eq!(t.match_prefix(&long).unwrap().device_prefix_len, 24);
    }
}
