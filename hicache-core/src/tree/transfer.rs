//! Transfers between tiers, in steps the controller drives:
//!
//! - **backup** (device → host, SGLang's `write_backup`): [`HiRadixTree::begin_backup`] says
//!   whether a node may be written and which device slots to read; [`HiRadixTree::commit_backup`]
//!   records the host slots the controller allocated (immediately, as SGLang does), locks the
//!   node until the copy is done and returns a [`WriteId`]; [`HiRadixTree::finish_backup`] is
//!   the ack: it unpins the node and returns every fragment (the node may have been split
//!   meanwhile) with its host slots and page hashes, ready for an L3 backup.
//! - **load-back** (host → device, SGLang's `load_back`): [`HiRadixTree::plan_load_back`]
//!   picks the whole evicted chain above a node (or nothing), pins it while the controller allocates
//!   device pages, [`HiRadixTree::commit_load_back`] assigns them and locks the node until
//!   [`HiRadixTree::finish_load_back`].
//! - **L3 arrivals** (a finished prefetch's pages inserted as host-only nodes):
//!   [`HiRadixTree::insert_host_only`].

use crate::error::{CoreError, Result};
use crate::event::Medium;
use crate::key::PageHash;

use super::node::{HOST, WRITE_PENDING};
use super::{
    DeviceSlot, HiRadixTree, HostSlot, LoadId, NodeId, PendingWrite, TenantId, WriteId, WriteKind,
};

/// A node that may be backed up now: read `device_slots`, allocate as many host pages, then
/// [`HiRadixTree::commit_backup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupPlan {
    /// The node.
    pub node: NodeId,
    /// Its device slots, one per page.
    pub device_slots: Vec<DeviceSlot>,
}

impl BackupPlan {
    /// Pages to write.
    pub fn pages(&self) -> usize {
        self.device_slots.len()
    }
}

/// One node of a finished write (a write covers several nodes when its node was split).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupFragment {
    /// The node.
    pub node: NodeId,
    /// Its host slots.
    pub host_slots: Vec<HostSlot>,
    /// Its page hashes (empty without a hasher).
    pub hashes: Vec<PageHash>,
}

/// A finished write, root-first fragments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinishedBackup {
    /// The write.
    pub write_id: WriteId,
    /// The node the write was committed for (the deepest fragment).
    pub node: NodeId,
    /// The tenant of the pages.
    pub tenant: TenantId,
    /// The fragments, root-first; their pages are the pages written.
    pub fragments: Vec<BackupFragment>,
    /// The hash of the page before the first fragment (the chain prior for L3).
    pub prior_hash: Option<PageHash>,
}

impl FinishedBackup {
    /// Pages written (the fragments' host slots together).
    pub fn pages(&self) -> usize {
        self.fragments.iter().map(|f| f.host_slots.len()).sum()
    }

    /// The fragments' nodes, and all host slots and all page hashes of the write, in page
    /// order: the one fragment's vectors themselves when the write covers one node (the
    /// common case; nothing is copied), concatenated otherwise.
    pub fn into_parts(self) -> (Vec<NodeId>, Vec<HostSlot>, Vec<PageHash>) {
        let nodes = self.fragments.iter().map(|f| f.node).collect();
        let mut fragments = self.fragments.into_iter();
        let (mut slots, mut hashes) = match fragments.next() {
            Some(f) => (f.host_slots, f.hashes),
            None => (Vec::new(), Vec::new()),
        };
        for f in fragments {
            slots.extend_from_slice(&f.host_slots);
            hashes.extend_from_slice(&f.hashes);
        }
        (nodes, slots, hashes)
    }

    /// All host slots of the write, in page order.
    pub fn host_slots(&self) -> Vec<HostSlot> {
        self.fragments
            .iter()
            .flat_map(|f| f.host_slots.iter().copied())
            .collect()
    }

    /// All page hashes of the write, in page order.
    pub fn hashes(&self) -> Vec<PageHash> {
        self.fragments
            .iter()
            .flat_map(|f| f.hashes.iter().copied())
            .collect()
    }
}

/// A planned load-back: the evicted chain ending at `node`, pinned until it is committed or
/// aborted. Allocate [`LoadBackPlan::pages`] device pages, then
/// [`HiRadixTree::commit_load_back`]; or [`HiRadixTree::abort_load_back`].
#[must_use = "a load-back plan pins nodes until it is committed or aborted"]
#[derive(Debug, PartialEq, Eq)]
pub struct LoadBackPlan {
    node: NodeId,
    ancestor: NodeId,
    nodes: Vec<NodeId>,
    host_slots: Vec<HostSlot>,
}

impl LoadBackPlan {
    /// The deepest node to load.
    pub fn node(&self) -> NodeId {
        self.node
    }
    /// The deepest ancestor already on device (locked while the plan lives).
    pub fn ancestor(&self) -> NodeId {
        self.ancestor
    }
    /// The nodes to load, root-first (host-protected while the plan lives).
    pub fn nodes(&self) -> &[NodeId] {
        &self.nodes
    }
    /// The host slots to copy from, in page order.
    pub fn host_slots(&self) -> &[HostSlot] {
        &self.host_slots
    }
    /// Pages to load.
    pub fn pages(&self) -> usize {
        self.host_slots.len()
    }
}

/// What [`HiRadixTree::insert_host_only`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostInsertResult {
    /// Pages of the key that were already in the tree.
    pub present_pages: usize,
    /// Of those, pages on device without a host copy that took the caller's host slots.
    pub adopted_pages: usize,
    /// Pages inserted as a new host-only node.
    pub new_pages: usize,
    /// The caller's host slots the tree did not take (duplicates): free them.
    pub duplicate_slots: Vec<HostSlot>,
    /// The node holding the key's last page (the anchor for an empty key).
    pub last_node: NodeId,
}

impl HiRadixTree {
    fn backup_refusal(&self, i: u32) -> Result<Option<&'static str>> {
        let n = self.node(i);
        if n.is_root() {
            return Err(self.invalid(i, "a tenant root has no pages to back up"));
        }
        if !n.on_device() {
            return Err(self.invalid(i, "an evicted node has no device pages to back up"));
        }
        if n.backed() {
            return Ok(Some("already backed up"));
        }
        if self.host_prefix_closed() && !self.node(n.parent).backed() {
            return Ok(Some(
                "its parent is not backed up (host residency must stay prefix-closed)",
            ));
        }
        Ok(None)
    }

    /// Whether `node` may be backed up now, and what to copy (SGLang's `write_backup` checks).
    /// `None` when it is already backed up or, under write-through, its parent is not.
    pub fn begin_backup(&self, node: NodeId) -> Result<Option<BackupPlan>> {
        let i = self.get(node)?;
        if self.backup_refusal(i)?.is_some() {
            return Ok(None);
        }
        Ok(Some(BackupPlan {
            node,
            device_slots: self.node(i).device(self.ps).collect(),
        }))
    }

    /// Records the host slots of a device→host copy the controller has launched: the node is
    /// backed up from now on, and locked until [`HiRadixTree::finish_backup`]. Call it before
    /// beginning a child's backup (the child's check needs its parent backed up).
    pub fn commit_backup(&mut self, node: NodeId, host_slots: &[HostSlot]) -> Result<WriteId> {
        let i = self.get(node)?;
        if let Some(why) = self.backup_refusal(i)? {
            return Err(self.invalid(i, format!("cannot back up: {why}")));
        }
        let p = self.node(i).pages as usize;
        Self::check_len(
            "commit_backup: host slots vs node pages",
            host_slots.len(),
            p,
        )?;
        let ps = self.ps;
        {
            let n = self.node_mut(i);
            n.set_host_slots(ps, host_slots);
            n.set(HOST, true);
            n.set(WRITE_PENDING, true);
        }
        self.host_pages += p;
        self.lock_idx(i);
        let write_id = WriteId(self.next_transfer_id());
        self.writes.insert(
            write_id,
            PendingWrite {
                node,
                pages: p as u32,
                kind: WriteKind::Through,
            },
        );
        Ok(write_id)
    }

    /// The ack of a write (SGLang's `mark_backed_up` / `_finish_write_through_ack`): unpins
    /// the node, emits `BlockStored(CPU_PINNED)` per fragment and returns the fragments for an
    /// L3 backup.
    pub fn finish_backup(&mut self, write_id: WriteId) -> Result<FinishedBackup> {
        let rec = *self
            .writes
            .get(&write_id)
            .ok_or(CoreError::UnknownTransfer {
                kind: "write",
                id: write_id.0,
            })?;
        let i = self.get(rec.node)?;
        self.writes.remove(&write_id);
        let ps = self.ps;
        // The write's nodes, deepest first: the node and, when it was split since the
        // commit, the upper parts above it, until the pages written are covered.
        let mut fragments = Vec::with_capacity(1);
        let mut covered = 0u32;
        let mut n = i;
        while covered < rec.pages && !self.node(n).is_root() {
            let node = self.node(n);
            fragments.push(BackupFragment {
                node: self.id(n),
                host_slots: node.host(ps).collect(),
                hashes: node.hashes.to_vec(),
            });
            covered += node.pages;
            n = node.parent;
        }
        fragments.reverse();
        // `n` is the parent of the top fragment.
        let prior_hash = self.prior_of(n);
        for f in &fragments {
            // Made from live indices just above, with nothing deleted since.
            let c = f.node.index();
            self.node_mut(c).set(WRITE_PENDING, false);
            self.emit_stored(c, Medium::CpuPinned);
        }
        match rec.kind {
            WriteKind::Through => self.unlock_idx(i),
            WriteKind::Back => {
                self.node_mut(i).host_ref -= 1;
                self.refresh_host(i);
            }
        }
        Ok(FinishedBackup {
            write_id,
            node: rec.node,
            tenant: TenantId(u32::from(self.node(i).tenant)),
            fragments,
            prior_hash,
        })
    }

    /// The writes pending, oldest first.
    pub fn pending_writes(&self) -> Vec<WriteId> {
        self.writes.keys().copied().collect()
    }

    /// Plans loading the evicted chain that ends at `node` back to device (SGLang's
    /// `load_back`): all of it or nothing. `None` when `node` is on device, when the chain is
    /// shorter than the load-back threshold, or when `quota_pages` is given and the chain
    /// exceeds it less the pages that pinning the ancestors makes unevictable. Otherwise the
    /// first ancestor on device is locked and the chain host-protected until the plan is
    /// committed or aborted.
    pub fn plan_load_back(
        &mut self,
        node: NodeId,
        quota_pages: Option<usize>,
    ) -> Result<Option<LoadBackPlan>> {
        let i = self.get(node)?;
        let mut chain = Vec::new();
        let mut n = i;
        while !self.node(n).on_device() {
            chain.push(n);
            n = self.node(n).parent;
        }
        if chain.is_empty() {
            return Ok(None);
        }
        let ancestor = n;
        chain.reverse();
        let pages: usize = chain.iter().map(|&c| self.node(c).pages as usize).sum();
        if pages * self.ps < self.cfg.load_back_threshold_tokens as usize {
            return Ok(None);
        }
        if let Some(quota) = quota_pages {
            // SGLang: `len > mem_quota + delta`, delta = -(pages newly protected by the lock).
            let mut newly_protected = 0usize;
            let mut a = ancestor;
            while !self.node(a).is_root() {
                if self.node(a).lock_ref == 0 {
                    newly_protected += self.node(a).pages as usize;
                }
                a = self.node(a).parent;
            }
            if pages as i64 > quota as i64 - newly_protected as i64 {
                return Ok(None);
            }
        }
        if !self.node(ancestor).is_root() {
            self.lock_idx(ancestor);
        }
        let ps = self.ps;
        let mut host_slots = Vec::with_capacity(pages);
        for &c in &chain {
            self.node_mut(c).host_ref += 1;
            self.refresh_host(c);
            host_slots.extend(self.node(c).host(ps));
        }
        Ok(Some(LoadBackPlan {
            node,
            ancestor: self.id(ancestor),
            nodes: chain.iter().map(|&c| self.id(c)).collect(),
            host_slots,
        }))
    }

    /// Releases the pins of a plan that will not be committed.
    pub fn abort_load_back(&mut self, plan: LoadBackPlan) -> Result<()> {
        self.release_plan(&plan)
    }

    fn release_plan(&mut self, plan: &LoadBackPlan) -> Result<()> {
        let a = self.get(plan.ancestor)?;
        if !self.node(a).is_root() {
            self.unlock_idx(a);
        }
        for &id in &plan.nodes {
            let c = self.get(id)?;
            self.node_mut(c).host_ref -= 1;
            self.refresh_host(c);
        }
        Ok(())
    }

    /// Assigns the device slots the controller allocated (one per page, in page order) to the
    /// planned chain, emits `BlockStored(GPU)`, and locks the node until
    /// [`HiRadixTree::finish_load_back`]. On error the plan is aborted.
    pub fn commit_load_back(
        &mut self,
        plan: LoadBackPlan,
        device_slots: &[DeviceSlot],
    ) -> Result<LoadId> {
        if let Err(e) = Self::check_len(
            "commit_load_back: device slots vs plan pages",
            device_slots.len(),
            plan.pages(),
        ) {
            self.release_plan(&plan)?;
            return Err(e);
        }
        let i = self.get(plan.node)?;
        // The chain may have been split since the plan (never shortened: it is pinned).
        let mut chain = Vec::new();
        let mut n = i;
        while !self.node(n).on_device() {
            chain.push(n);
            n = self.node(n).parent;
        }
        let pages: usize = chain.iter().map(|&c| self.node(c).pages as usize).sum();
        if self.id(n) != plan.ancestor || pages != plan.pages() {
            self.release_plan(&plan)?;
            return Err(self.invalid(i, "the planned chain changed before the commit"));
        }
        self.release_plan(&plan)?;
        chain.reverse();
        let mut off = 0;
        for &c in &chain {
            let p = self.node(c).pages as usize;
            self.set_device(c, &device_slots[off..off + p]);
            off += p;
        }
        self.lock_idx(i);
        let id = LoadId(self.next_transfer_id());
        self.loads.insert(id, plan.node);
        Ok(id)
    }

    /// The loads pending, oldest first.
    pub fn pending_loads(&self) -> Vec<LoadId> {
        self.loads.keys().copied().collect()
    }

    /// The ack of a load: unlocks its node. Returns the node.
    pub fn finish_load_back(&mut self, load_id: LoadId) -> Result<NodeId> {
        let node = *self.loads.get(&load_id).ok_or(CoreError::UnknownTransfer {
            kind: "load",
            id: load_id.0,
        })?;
        let i = self.get(node)?;
        self.loads.remove(&load_id);
        self.unlock_idx(i);
        Ok(node)
    }

    /// Inserts pages fetched from L3 (`tokens`, one host slot per page, optional page hashes)
    /// below `anchor`, a backed-up node (or root) of `tenant` (SGLang's
    /// `_insert_helper_host`). Existing nodes are walked (split where the key ends inside one)
    /// and the rest becomes one new host-only node. Where an existing node already has a host
    /// copy, the caller's slots for it are duplicates to free; where it is on device without
    /// one, it adopts them. Without `hashes` the tree computes them (when hashing is on). The
    /// tree is unchanged when an error is returned.
    pub fn insert_host_only(
        &mut self,
        tenant: TenantId,
        anchor: NodeId,
        tokens: &[u32],
        host_slots: &[HostSlot],
        hashes: Option<&[PageHash]>,
    ) -> Result<HostInsertResult> {
        self.tenant_ref(tenant)?;
        let a = self.get(anchor)?;
        let anchor_tenant = u32::from(self.node(a).tenant);
        if anchor_tenant != tenant.0 {
            return Err(CoreError::WrongTenant {
                node: anchor.to_string(),
                node_tenant: anchor_tenant,
                tenant: tenant.0,
            });
        }
        let pages = self.check_aligned("host insert key", tokens.len())?;
        Self::check_len(
            "insert_host_only: host slots vs key pages",
            host_slots.len(),
            pages,
        )?;
        if let Some(h) = hashes {
            Self::check_len("insert_host_only: hashes vs key pages", h.len(), pages)?;
        }
        if !(self.node(a).backed() || self.transient_host && self.node(a).on_device()) {
            return Err(self.invalid(
                a,
                "the anchor of a host insert must be backed up (or a tenant root)",
            ));
        }
        self.clock += 1;
        let now = self.clock;
        if !self.node(a).is_root() {
            self.touch(a, now);
        }
        let ps = self.ps;
        let mut out = HostInsertResult {
            present_pages: 0,
            adopted_pages: 0,
            new_pages: 0,
            duplicate_slots: Vec::new(),
            last_node: anchor,
        };
        let mut node = a;
        let mut off = 0usize;
        while off < pages {
            let rest = &tokens[off * ps..];
            let Some(c) = self.arena.find_child(node, &rest[..ps]) else {
                break;
            };
            self.touch(c, now);
            let common = self.arena.common_pages(c, rest);
            let target = if common < self.node(c).pages as usize {
                self.split_idx(c, common as u32, now)
            } else {
                c
            };
            let mine = &host_slots[off..off + common];
            if self.node(target).backed() || self.transient_host {
                // Transient host copies: a device node keeps no copy of pages it holds.
                out.duplicate_slots.extend_from_slice(mine);
            } else {
                // On device (evicted nodes are always backed up) without a host copy.
                let n = self.node_mut(target);
                n.set_host_slots(ps, mine);
                n.set(HOST, true);
                self.host_pages += common;
                self.refresh(target);
                self.emit_stored(target, Medium::CpuPinned);
                out.adopted_pages += common;
            }
            out.present_pages += common;
            off += common;
            node = target;
        }
        if off < pages {
            let priority = self.node(node).stats.priority;
            let leaf = self.new_leaf(
                node,
                &tokens[off * ps..],
                None,
                Some(&host_slots[off..]),
                hashes.map(|h| h[off..].into()),
                now,
                priority,
            );
            out.new_pages = pages - off;
            node = leaf;
        }
        out.last_node = self.id(node);
        Ok(out)
    }
}
