//! Host locks (SGLang 0.5.23's `inc_host_lock_ref` / `dec_host_lock_ref`): what a reader or
//! writer of host copies pins while its I/O runs — a load-back (host → device), a backup to
//! L3 (host → L3) and a prefetch anchor (L3 → host, under the anchor). Per component:
//!
//! - **Full**: the anchor node alone, when its Full is on host (a one-node segment whose
//!   boundary stamp moves to the prefix when a split cuts it, so the segment grows with the
//!   split and the release walks up to the stamp).
//! - **SWA**: the window: from the anchor up until `W` tokens of key are covered, every node
//!   counted (tombstones too), the last stamped with a boundary.
//! - **Mamba**: the anchor node alone.
//!
//! A host-locked component is off its host LRU (`host_evict`) and a node with any host lock
//! is no host leaf, so host eviction never frees what a lock covers.
//!
//! Invariant kept here: a release decrements exactly the counts its acquire incremented
//! (checked before any is touched; an unbalanced release is an error, never a wrap).

use super::node::ROOT;
use super::{Component, UnifiedTree};
use super::{FULL, MAMBA};
use crate::error::{CoreError, Result};
use crate::tree::NodeId;

/// What a host lock took, handed back to [`UnifiedTree::unlock_host`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLockReceipt {
    /// The anchor node.
    pub node: NodeId,
    /// Full's boundary stamp; `None` when Full was not locked (not on host, or the root).
    full: Option<u64>,
    /// SWA's window: `None` when not locked, `Some(None)` when the walk reached the root.
    swa: Option<Option<u64>>,
    /// Whether Mamba was locked.
    mamba: bool,
}

impl UnifiedTree {
    /// Host-locks `node` for an in-flight host read or write (see the module documentation):
    /// until [`unlock_host`](Self::unlock_host), host eviction frees none of what it covers.
    pub fn lock_host(&mut self, node: NodeId) -> Result<HostLockReceipt> {
        let i = self.index(node)?;
        let mut r = HostLockReceipt {
            node,
            full: None,
            swa: None,
            mamba: false,
        };
        if i == ROOT {
            return Ok(r);
        }
        if !self.arena.nodes[i as usize].host_full.is_empty() {
            let n = &mut self.arena.nodes[i as usize];
            if n.host_uuid[FULL] == 0 {
                self.uuid += 1;
                n.host_uuid[FULL] = self.uuid;
            }
            n.host_lock[FULL] += 1;
            r.full = Some(n.host_uuid[FULL]);
        }
        if let Some(w) = self.cfg.swa_window {
            r.swa = Some(self.lock_host_window(i, w as usize));
        }
        if self.has[MAMBA] {
            self.bump_host(i, Component::Mamba, true);
            r.mamba = true;
        }
        self.update_leaf(i);
        Ok(r)
    }

    /// SWA's host window lock from `i`; returns the boundary stamp (`None`: reached the root).
    fn lock_host_window(&mut self, i: u32, w: usize) -> Option<u64> {
        let last = self.window_walk(i, w, |t, cur| t.bump_host(cur, Component::Swa, true))?;
        Some(self.boundary(last, true))
    }

    /// Releases what `receipt` host-locked. Errors: a count it would release is 0.
    pub fn unlock_host(&mut self, receipt: &HostLockReceipt) -> Result<()> {
        let i = self.index(receipt.node)?;
        let path = self.host_lock_path(i, receipt)?;
        for (node, c) in path {
            self.bump_host(node, c, false);
            self.update_leaf(node);
        }
        Ok(())
    }

    /// The (node, component) counts `receipt` holds, each checked positive.
    fn host_lock_path(&self, i: u32, r: &HostLockReceipt) -> Result<Vec<(u32, Component)>> {
        let mut out = Vec::new();
        let mut walk = |c: Component, boundary: Option<u64>, whole: bool| -> Result<()> {
            let mut cur = i;
            while cur != ROOT {
                let n = &self.arena.nodes[cur as usize];
                if n.host_lock[c as usize] == 0 {
                    return Err(CoreError::InvalidState {
                        node: format!("{:?}", self.id(cur)),
                        reason: format!("{c:?} host lock is 0: unlock_host without lock_host"),
                    });
                }
                out.push((cur, c));
                if !whole || boundary == n.host_uuid.get(c as usize).copied() {
                    break;
                }
                cur = self.arena.nodes[cur as usize].parent;
            }
            Ok(())
        };
        if let Some(b) = r.full {
            walk(Component::Full, Some(b), true)?;
        }
        if let Some(b) = r.swa {
            walk(Component::Swa, b, true)?;
        }
        if r.mamba {
            walk(Component::Mamba, None, false)?;
        }
        Ok(out)
    }

    /// One host lock up or down on `c` of `i`; at the 0 ↔ 1 edge the component leaves or
    /// rejoins its host LRU (SWA and Mamba).
    fn bump_host(&mut self, i: u32, c: Component, up: bool) {
        let l = &mut self.arena.nodes[i as usize].host_lock[c as usize];
        *l = if up { *l + 1 } else { *l - 1 };
        let edge = if up { *l == 1 } else { *l == 0 };
        if edge && c != Component::Full {
            self.sync_host_lru(i, c);
        }
    }

    /// Component `c`'s host locks on `node`.
    pub fn host_lock_count(&self, node: NodeId, c: Component) -> Result<u32> {
        Ok(self.arena.nodes[self.index(node)? as usize].host_lock[c as usize])
    }
}
