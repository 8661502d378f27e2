//! Eviction: device (`evict`) and host (`evict_host`), with the semantics of SGLang's
//! `HiRadixCache` methods of the same names.

use crate::event::Medium;

use super::node::{DEVICE, HOST, NIL, SKIPPED, WRITE_PENDING};
use super::{DeviceSlot, HiRadixTree, HostSlot, NodeId, PendingWrite, WriteId, WriteKind};

/// The host pool as eviction sees it (used by write-back eviction only, which must find host
/// room for the pages it stages, and frees host pages of subtrees it drops).
pub trait HostAllocator {
    /// Allocates `pages` host pages, all or nothing.
    fn alloc(&mut self, pages: usize) -> Option<Vec<HostSlot>>;
    /// Returns host pages to the pool.
    fn free(&mut self, slots: &[HostSlot]);
}

/// A host pool with no room: write-back eviction then drops what it cannot stage.
#[derive(Copy, Clone, Debug, Default)]
pub struct NoHost;

impl HostAllocator for NoHost {
    fn alloc(&mut self, _pages: usize) -> Option<Vec<HostSlot>> {
        None
    }
    fn free(&mut self, _slots: &[HostSlot]) {}
}

/// A node staged by write-back eviction: the caller copies `device_slots` → `host_slots`
/// (device to host), then frees the device slots and calls
/// [`HiRadixTree::finish_backup`]`(write_id)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedWriteBack {
    /// The write to finish once the copy is done.
    pub write_id: WriteId,
    /// The node (now host-only and host-protected).
    pub node: NodeId,
    /// Where the pages are now (free them after the copy).
    pub device_slots: Vec<DeviceSlot>,
    /// Where they must be copied (already owned by the node).
    pub host_slots: Vec<HostSlot>,
}

/// What [`HiRadixTree::evict`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvictOutcome {
    /// Device pages freed or staged (may exceed the request: whole nodes go).
    pub freed_pages: usize,
    /// Device slots the caller frees now (demoted, deleted and dropped nodes).
    pub device_slots: Vec<DeviceSlot>,
    /// Pages demoted to host-only (they were backed up).
    pub demoted_pages: usize,
    /// Pages deleted (never backed up).
    pub deleted_pages: usize,
    /// Write-back: nodes staged for a device→host copy.
    pub write_back: Vec<StagedWriteBack>,
    /// Write-back under host pressure: pages (device and host) of the subtrees dropped
    /// because no host room could be found. Their host slots were freed through the
    /// [`HostAllocator`].
    pub dropped_pages: usize,
}

/// What [`HiRadixTree::evict_host`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvictHostOutcome {
    /// Host pages freed.
    pub freed_pages: usize,
    /// Host slots the caller frees.
    pub host_slots: Vec<HostSlot>,
}

impl HiRadixTree {
    /// Frees at least `pages` device pages if it can, whole nodes at a time, in the eviction
    /// strategy's order (SGLang's `evict`). A backed-up leaf is demoted to host-only, a leaf
    /// never backed up is deleted, and under write-back a leaf not backed up is staged for a
    /// device→host copy into host pages from `host` (host-only leaves are evicted to make
    /// room), or — when no room can be found — dropped with its host-only subtree. Each
    /// freed leaf's parent becomes a candidate once it has no device child and no lock.
    pub fn evict(&mut self, pages: usize, host: &mut dyn HostAllocator) -> EvictOutcome {
        let mut out = EvictOutcome::default();
        // Sized once for the pages asked for (whole nodes may free a few more); never more
        // than the tree holds (a caller may ask for everything with a huge count).
        out.device_slots.reserve(pages.min(self.device_pages));
        let mut skipped = Vec::new();
        let write_back = !self.cfg.write_policy.host_prefix_closed();
        while out.freed_pages < pages {
            let Some(x) = self.dev.pop(&mut self.arena) else {
                break;
            };
            let p = self.node(x).pages as usize;
            if self.node(x).backed() {
                self.clear_device_into(x, &mut out.device_slots);
                out.demoted_pages += p;
                out.freed_pages += p;
            } else if write_back {
                if let Some(staged) = self.stage_write_back(x, host) {
                    out.write_back.push(staged);
                    out.freed_pages += p;
                } else if let Some((slots, dropped)) = self.drop_subtree(x, host) {
                    out.device_slots.extend_from_slice(&slots);
                    out.dropped_pages += dropped;
                    out.freed_pages += p;
                } else {
                    self.node_mut(x).set(SKIPPED, true);
                    skipped.push(x);
                }
            } else if self.node(x).first_child == NIL {
                self.emit_removed(x, Medium::Gpu);
                out.device_slots.extend(self.node(x).device(self.ps));
                self.remove_node(x);
                out.deleted_pages += p;
                out.freed_pages += p;
            } else if let Some((slots, dropped)) = self.drop_subtree(x, host) {
                // Unreachable while invariant 2 holds (a leaf not backed up has no host-only
                // children under write-through); kept so that eviction never orphans nodes.
                out.device_slots.extend_from_slice(&slots);
                out.dropped_pages += dropped;
                out.freed_pages += p;
            } else {
                self.node_mut(x).set(SKIPPED, true);
                skipped.push(x);
            }
        }
        for x in skipped {
            self.node_mut(x).set(SKIPPED, false);
            self.refresh(x);
        }
        out
    }

    /// Write-back: gives `x` host pages, detaches its device pages for the caller to copy and
    /// free, and pins its host pages until the write finishes.
    fn stage_write_back(
        &mut self,
        x: u32,
        host: &mut dyn HostAllocator,
    ) -> Option<StagedWriteBack> {
        let p = self.node(x).pages as usize;
        let slots = match host.alloc(p) {
            Some(s) => s,
            None => {
                let freed = self.evict_host(p);
                host.free(&freed.host_slots);
                host.alloc(p)?
            }
        };
        if slots.len() != p {
            host.free(&slots);
            return None;
        }
        let ps = self.ps;
        {
            let n = self.node_mut(x);
            n.set_host_slots(ps, &slots);
            n.set(HOST, true);
            n.set(WRITE_PENDING, true);
            n.host_ref += 1;
        }
        self.host_pages += p;
        let device_slots = self.clear_device(x);
        let write_id = WriteId(self.next_transfer_id());
        let node = self.id(x);
        self.writes.insert(
            write_id,
            PendingWrite {
                node,
                pages: p as u32,
                kind: WriteKind::Back,
            },
        );
        Some(StagedWriteBack {
            write_id,
            node,
            device_slots,
            host_slots: slots,
        })
    }

    /// Drops `x` and its whole subtree unless a node in it is pinned (`_drop_subtree_no_host`).
    /// Returns the device slots to free and the number of pages dropped; host slots are freed
    /// through `host`.
    fn drop_subtree(
        &mut self,
        x: u32,
        host: &mut dyn HostAllocator,
    ) -> Option<(Vec<DeviceSlot>, usize)> {
        // Post-order list of the subtree.
        let mut order = Vec::new();
        let mut stack = vec![x];
        while let Some(n) = stack.pop() {
            let node = self.node(n);
            if node.host_ref > 0 || node.lock_ref > 0 || node.has(WRITE_PENDING) {
                return None;
            }
            order.push(n);
            stack.extend(self.arena.children_of(n));
        }
        let ps = self.ps;
        let mut dev = Vec::new();
        let mut dropped = 0;
        for &n in order.iter().rev() {
            let node = self.node(n);
            dropped += node.pages as usize;
            if node.flags & DEVICE != 0 {
                self.emit_removed(n, Medium::Gpu);
                dev.extend(self.node(n).device(ps));
            }
            if self.node(n).backed() {
                self.emit_removed(n, Medium::CpuPinned);
                host.free(&self.node(n).host(ps).collect::<Vec<_>>());
            }
            self.remove_node(n);
        }
        Some((dev, dropped))
    }

    /// Frees at least `pages` host pages if it can by deleting host-only leaves in the
    /// strategy's order (SGLang's `evict_host`); a parent that becomes a childless host-only
    /// node is a candidate in turn. Nodes still on device never lose their host copy here,
    /// and host-protected nodes are never chosen.
    pub fn evict_host(&mut self, pages: usize) -> EvictHostOutcome {
        let mut out = EvictHostOutcome::default();
        // Sized once for the pages asked for, never beyond what the tree holds on host.
        out.host_slots.reserve(pages.min(self.host_pages));
        let ps = self.ps;
        while out.freed_pages < pages {
            let Some(x) = self.host.pop(&mut self.arena) else {
                break;
            };
            self.emit_removed(x, Medium::CpuPinned);
            let n = self.node(x);
            out.freed_pages += n.pages as usize;
            out.host_slots.extend(n.host(ps));
            self.remove_node(x);
        }
        out
    }
}
