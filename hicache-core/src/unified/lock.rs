//! Locks: Full path locks, SWA window locks with a boundary stamp, Mamba single-node locks.
//!
//! Invariant kept here: a lock count is only decremented after checking it is positive (an
//! unbalanced release is an error, never a wrap), and the ledger moves a component's size
//! from evictable to protected exactly when its count leaves or returns to zero on a node
//! where it is present.

use super::node::ROOT;
use super::{Component, UnifiedTree};
use super::{FULL, MAMBA, SWA};
use crate::error::{CoreError, Result};
use crate::tree::NodeId;

/// What a lock took, to be handed back to [`UnifiedTree::unlock`] (SGLang's
/// `IncLockRefResult`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockReceipt {
    /// The anchor node.
    pub node: NodeId,
    /// SWA window boundary stamp; `None` when the window walk reached the root.
    swa_uuid: Option<u64>,
    /// Whether the Mamba lock was skipped.
    pub mamba_skipped: bool,
}

impl UnifiedTree {
    /// Locks `node` for a request: Full from the node to the root, SWA over the trailing
    /// window, Mamba on the node (unless `skip_mamba`).
    pub fn lock(&mut self, node: NodeId, skip_mamba: bool) -> Result<LockReceipt> {
        let i = self.index(node)?;
        let mut swa_uuid = None;
        self.lock_full(i);
        if let Some(w) = self.cfg.swa_window {
            swa_uuid = self.lock_swa(i, w as usize);
        }
        if self.has[MAMBA] && !skip_mamba && i != ROOT {
            self.bump(i, Component::Mamba, true);
        }
        self.update_leaf(i);
        Ok(LockReceipt {
            node,
            swa_uuid,
            mamba_skipped: skip_mamba,
        })
    }

    /// Releases what `receipt` locked (Mamba, then SWA up to its boundary, then Full).
    pub fn unlock(&mut self, receipt: &LockReceipt) -> Result<()> {
        let i = self.index(receipt.node)?;
        self.check_unlock(i, receipt)?;
        if self.has[MAMBA] && !receipt.mamba_skipped && i != ROOT {
            self.bump(i, Component::Mamba, false);
            self.update_leaf(i);
        }
        if self.has[SWA] && i != ROOT {
            let mut cur = i;
            while cur != ROOT {
                self.bump(cur, Component::Swa, false);
                self.update_leaf(cur);
                let stamp = self.arena.nodes[cur as usize].comp[SWA].uuid;
                if receipt.swa_uuid.is_some_and(|u| u == stamp) {
                    break;
                }
                cur = self.arena.nodes[cur as usize].parent;
            }
        }
        let mut cur = i;
        while cur != ROOT {
            self.bump(cur, Component::Full, false);
            self.update_leaf(cur);
            cur = self.arena.nodes[cur as usize].parent;
        }
        self.update_leaf(i);
        Ok(())
    }

    /// Verifies every count `receipt` would decrement is positive, before touching any.
    fn check_unlock(&self, i: u32, receipt: &LockReceipt) -> Result<()> {
        let bad = |c: Component, at: u32| CoreError::InvalidState {
            node: format!("{:?}", self.id(at)),
            reason: format!("{c:?} lock is 0: unlock without a matching lock"),
        };
        let mut cur = i;
        while cur != ROOT {
            if self.arena.nodes[cur as usize].comp[FULL].lock == 0 {
                return Err(bad(Component::Full, cur));
            }
            cur = self.arena.nodes[cur as usize].parent;
        }
        if self.has[MAMBA]
            && !receipt.mamba_skipped
            && i != ROOT
            && self.arena.nodes[i as usize].comp[MAMBA].lock == 0
        {
            return Err(bad(Component::Mamba, i));
        }
        let mut cur = i;
        while self.has[SWA] && cur != ROOT {
            let d = self.arena.nodes[cur as usize].comp[SWA];
            if d.lock == 0 {
                return Err(bad(Component::Swa, cur));
            }
            if receipt.swa_uuid == Some(d.uuid) {
                break;
            }
            cur = self.arena.nodes[cur as usize].parent;
        }
        Ok(())
    }

    fn lock_full(&mut self, i: u32) {
        let mut cur = i;
        while cur != ROOT {
            self.bump(cur, Component::Full, true);
            self.remove_from_leaves(cur);
            cur = self.arena.nodes[cur as usize].parent;
        }
    }

    /// Locks every node from `i` up until `w` tokens of key are covered; stamps the last.
    fn lock_swa(&mut self, i: u32, w: usize) -> Option<u64> {
        let last = self.window_walk(i, w, |t, cur| t.bump(cur, Component::Swa, true))?;
        Some(self.boundary(last, false))
    }

    /// Calls `f` on every node from `i` up until `w` tokens of key are covered (SGLang's
    /// window walk, tombstones counted); the node that completed the window, `None` when the
    /// walk reached the root first.
    pub(crate) fn window_walk(
        &mut self,
        i: u32,
        w: usize,
        mut f: impl FnMut(&mut Self, u32),
    ) -> Option<u32> {
        let (mut cur, mut covered) = (i, 0usize);
        while cur != ROOT && covered < w {
            f(self, cur);
            covered += self.arena.nodes[cur as usize].key.len();
            if covered >= w {
                return Some(cur);
            }
            cur = self.arena.nodes[cur as usize].parent;
        }
        None
    }

    /// The SWA boundary stamp of node `i` (the host lock's with `host`), stamped first if 0.
    pub(crate) fn boundary(&mut self, i: u32, host: bool) -> u64 {
        let n = &mut self.arena.nodes[i as usize];
        let stamp = if host {
            &mut n.host_uuid[SWA]
        } else {
            &mut n.comp[SWA].uuid
        };
        if *stamp == 0 {
            self.uuid += 1;
            *stamp = self.uuid;
        }
        *stamp
    }

    /// One lock up (`up`) or down on component `c` of node `i`, moving the ledger on the
    /// 0 ↔ 1 transition of a present component. Down on a zero count is a no-op (callers
    /// check first).
    fn bump(&mut self, i: u32, c: Component, up: bool) {
        let d = self.arena.nodes[i as usize].comp[c as usize];
        if !up && d.lock == 0 {
            debug_assert!(false, "lock underflow on {c:?}");
            return;
        }
        let edge = if up { d.lock == 0 } else { d.lock == 1 };
        if edge && d.present {
            let n = self.comp_len(i, c);
            self.shift(c, n, up);
        }
        let l = &mut self.arena.nodes[i as usize].comp[c as usize].lock;
        *l = if up { *l + 1 } else { *l - 1 };
    }
}
