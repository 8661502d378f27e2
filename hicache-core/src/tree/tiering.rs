//! Operations for the two L2/L3 arrangements beside the default (host memory as a cache that
//! holds every page L3 receives):
//!
//! - **Transient host copies** (`buffer_only` host memory, [`HiRadixTree::set_transient_host`]):
//!   host pages only stage device↔L3 traffic, and the controller drops a node's host copy
//!   ([`HiRadixTree::drop_host_copy`]) once its pages are in L3 or back on device. Host
//!   residency is then no longer prefix-closed (a parent's copy may go before its child's),
//!   and a host-only node may sit below a device node that has no host copy.
//! - **Exclusive L3 writes** (cold-L2-first): the controller writes the coldest host-only
//!   leaves ([`HiRadixTree::coldest_host_leaves`]) to L3 before L2 evicts them, drops each
//!   once its copy is acknowledged, and lets pressure evict only leaves already in L3
//!   ([`HiRadixTree::evict_host_while`]).

use crate::key::PageHash;

use super::node::{DEVICE, HOST, NIL, WRITE_PENDING};
use super::{EvictHostOutcome, HiRadixTree, HostSlot, NodeId};
use crate::error::{CoreError, Result};
use crate::event::Medium;

impl HiRadixTree {
    /// Makes host copies transient (`buffer_only`): host residency need not be prefix-closed,
    /// a match's `last_host_node` is its last node (every node on the path is cached in some
    /// tier, so an L3 prefetch continues after it), pages arriving from L3 never attach to
    /// device nodes, and a prefetch anchor may be a device node without a host copy (its
    /// host pin then also keeps it from device eviction). Only on an empty tree.
    pub fn set_transient_host(&mut self, on: bool) -> Result<()> {
        if self.node_count != 0 {
            return Err(CoreError::InvalidPolicy {
                field: "transient_host",
                value: on.to_string(),
                reason: "can only be changed on an empty tree",
            });
        }
        self.transient_host = on;
        Ok(())
    }

    /// Whether host copies are transient (see [`HiRadixTree::set_transient_host`]).
    pub fn transient_host(&self) -> bool {
        self.transient_host
    }

    /// Whether host residency must stay prefix-closed: under write-through, unless host
    /// copies are transient.
    pub(super) fn host_prefix_closed(&self) -> bool {
        self.cfg.write_policy.host_prefix_closed() && !self.transient_host
    }

    /// Drops the host copy of `id` and returns its host slots for the caller to free:
    /// a node on device keeps its device pages (it is no longer backed up); a host-only leaf
    /// is deleted. `None` (nothing changed) when the node has no host copy, is host-pinned,
    /// has a write pending, is a host-only node with children, or — while host residency is
    /// prefix-closed — has a child with a host copy. Emits `BlockRemoved(CPU_PINNED)`.
    pub fn drop_host_copy(&mut self, id: NodeId) -> Result<Option<Vec<HostSlot>>> {
        let i = self.get(id)?;
        let n = self.node(i);
        if n.is_root() || !n.backed() || n.host_ref > 0 || n.has(WRITE_PENDING) {
            return Ok(None);
        }
        let ps = self.ps;
        if !n.on_device() {
            if n.first_child != NIL || n.lock_ref > 0 {
                return Ok(None);
            }
            self.emit_removed(i, Medium::CpuPinned);
            let slots: Vec<HostSlot> = self.node(i).host(ps).collect();
            self.remove_node(i);
            return Ok(Some(slots));
        }
        if self.host_prefix_closed()
            && self
                .arena
                .children_of(i)
                .iter()
                .any(|&c| self.node(c).backed())
        {
            return Ok(None);
        }
        self.emit_removed(i, Medium::CpuPinned);
        let slots: Vec<HostSlot> = self.node(i).host(ps).collect();
        let p = self.node(i).pages as usize;
        self.node_mut(i).set(HOST, false);
        self.host_pages -= p;
        self.refresh(i);
        Ok(Some(slots))
    }

    /// The coldest host-only leaves that are not pinned, in eviction order, until they hold
    /// at least `pages` pages (fewer when the tree has fewer). Nothing changes: they stay
    /// candidates for host eviction.
    pub fn coldest_host_leaves(&mut self, pages: usize) -> Vec<NodeId> {
        let mut popped = Vec::new();
        let mut have = 0usize;
        while have < pages {
            let Some(x) = self.host.pop(&mut self.arena) else {
                break;
            };
            have += self.node(x).pages as usize;
            popped.push(x);
        }
        for &x in &popped {
            self.refresh_host(x);
        }
        popped.into_iter().map(|x| self.id(x)).collect()
    }

    /// [`HiRadixTree::evict_host`] that stops at the first leaf, in eviction order, whose page
    /// hashes `may_drop` refuses (exclusive tiering: a page not yet in L3). Hotter leaves are
    /// never dropped in place of a colder one that must stay.
    pub fn evict_host_while(
        &mut self,
        pages: usize,
        may_drop: &mut dyn FnMut(&[PageHash]) -> bool,
    ) -> EvictHostOutcome {
        let mut out = EvictHostOutcome::default();
        let mut kept = Vec::new();
        let ps = self.ps;
        while out.freed_pages < pages {
            let Some(x) = self.host.pop(&mut self.arena) else {
                break;
            };
            if !may_drop(&self.node(x).hashes) {
                kept.push(x);
                break;
            }
            self.emit_removed(x, Medium::CpuPinned);
            let n = self.node(x);
            out.freed_pages += n.pages as usize;
            out.host_slots.extend(n.host(ps));
            self.remove_node(x);
        }
        for x in kept {
            self.refresh_host(x);
        }
        out
    }

    /// Whether a node is a device-only prefetch anchor under transient host copies (pinned by
    /// `host_ref`, so device eviction must leave it).
    pub(super) fn pinned_device_anchor(flags: u8, host_ref: u32) -> bool {
        host_ref > 0 && flags & (DEVICE | HOST) == DEVICE
    }
}
