//! Host tier, first step: write-through backup of each component (plan → commit → finish),
//! following SGLang 0.5.23's `UnifiedRadixCache` write-through: Full backs up the node's
//! pages (ancestors first: a backed-up node's parent is backed up), SWA backs up every
//! device-only SWA node within one window of the node (walking up until `W` tokens are
//! covered, a node has SWA neither on device nor on host, or a node has a backup in
//! flight), Mamba backs up the node's state. The tree stays metadata only: the caller copies the device slots of a
//! [`UnifiedBackupPlan`] into host slots it allocated and commits them; the node is locked
//! from the commit until [`UnifiedTree::finish_backup`].
//!
//! Host data survives a device tombstone (an internal node's SWA or Mamba evicted from the
//! device keeps its host copy) and a demotion (a backed-up device leaf evicted from the
//! device stays host-only, see `evict`); [`UnifiedTree::evict_host`] deletes host-only
//! leaves and hands their host slots back in [`Evicted`](super::Evicted).
//!
//! Invariant kept here (checked by `check_invariants`): host Full and SWA slots are one per
//! page or none; a node with host Full has a parent that is the root or has host Full; host
//! SWA or Mamba only where host Full is; no host slot of a component appears twice; a host
//! Full host lock ([`UnifiedTree::lock_host`]) only where host Full is.

use super::{FULL, MAMBA, SWA};
use std::collections::HashSet;

use super::node::ROOT;
use super::{Component, UnifiedTree};
use crate::error::{CoreError, Result};
use crate::tree::NodeId;

/// A committed backup, finished with [`UnifiedTree::finish_backup`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct BackupId(u64);

/// What a node's backup copies, per component (device slots, in the caller's pools).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnifiedBackupPlan {
    /// The node backed up.
    pub node: NodeId,
    /// Device Full pages to copy (empty when Full is already on host).
    pub full: Vec<u32>,
    /// Device-only SWA nodes within one window of `node`, oldest first, with their device
    /// SWA pages.
    pub swa: Vec<(NodeId, Vec<u32>)>,
    /// The device Mamba state slot to copy, when the node has a state not yet on host.
    pub mamba: Option<u32>,
}

impl UnifiedBackupPlan {
    /// SWA pages to copy (the length of [`HostBackup::swa`]).
    pub fn swa_pages(&self) -> usize {
        list_pages(&self.swa)
    }
}

/// Pages in a per-node page list.
pub(crate) fn list_pages(list: &[(NodeId, Vec<u32>)]) -> usize {
    list.iter().map(|(_, p)| p.len()).sum()
}

/// Hands each node of `list` its run of `slots` (one per page, in order); `slots` holds
/// exactly [`list_pages`] entries.
pub(crate) fn per_node<'a>(
    list: &'a [(NodeId, Vec<u32>)],
    mut slots: &'a [u32],
) -> impl Iterator<Item = (NodeId, &'a [u32])> {
    list.iter().map(move |(node, pages)| {
        let (mine, tail) = slots.split_at(pages.len());
        slots = tail;
        (*node, mine)
    })
}

/// The refusal of a commit whose plan is stale (`fresh` false) or whose slots do not match
/// the plan one per page and state (`fits` false).
pub(crate) fn check_commit(
    field: &'static str,
    node: NodeId,
    fresh: bool,
    fits: bool,
) -> Result<()> {
    let reason = match (fresh, fits) {
        (false, _) => "the plan is out of date: plan again",
        (true, false) => "one slot per planned page and state",
        (true, true) => return Ok(()),
    };
    Err(CoreError::InvalidPolicy {
        field,
        value: format!("{node:?}"),
        reason,
    })
}

/// The host slots a backup wrote, in the order of its [`UnifiedBackupPlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostBackup<'a> {
    /// One host slot per page of [`UnifiedBackupPlan::full`].
    pub full: &'a [u32],
    /// One host slot per SWA page of the plan, its nodes concatenated in order.
    pub swa: &'a [u32],
    /// The host state slot, exactly when the plan has a Mamba state.
    pub mamba: Option<u32>,
}

impl UnifiedTree {
    /// Whether component `c` of `node` is on host.
    pub fn backed_up(&self, node: NodeId, c: Component) -> Result<bool> {
        Ok(self.arena.nodes[self.index(node)? as usize].on_host(c))
    }

    /// The nodes on the path to `node` whose Full is not on host, ancestors first: the
    /// order in which to back them up.
    pub fn unbacked_chain(&self, node: NodeId) -> Result<Vec<NodeId>> {
        let mut i = self.index(node)?;
        let mut out = Vec::new();
        while i != ROOT && self.arena.nodes[i as usize].host_full.is_empty() {
            out.push(self.id(i));
            i = self.arena.nodes[i as usize].parent;
        }
        out.reverse();
        Ok(out)
    }

    /// What backing up `node` copies now; `None` when every component is on host already.
    /// Errors: a tree without device slots, the root, a host-only node, or a parent not
    /// backed up.
    pub fn plan_backup(&self, node: NodeId) -> Result<Option<UnifiedBackupPlan>> {
        let i = self.index(node)?;
        let refuse = |reason| CoreError::InvalidPolicy {
            field: "backup",
            value: format!("{node:?}"),
            reason,
        };
        if !self.slots {
            return Err(refuse("the tree does not track device slots"));
        }
        if i == ROOT {
            return Err(refuse("the root holds no data"));
        }
        let n = &self.arena.nodes[i as usize];
        if !n.comp[FULL].present {
            return Err(refuse("the node is host-only"));
        }
        if n.parent != ROOT && self.arena.nodes[n.parent as usize].host_full.is_empty() {
            return Err(refuse("back up the ancestors first (unbacked_chain)"));
        }
        let plan = UnifiedBackupPlan {
            node,
            full: if n.host_full.is_empty() {
                n.full_pages.clone()
            } else {
                Vec::new()
            },
            swa: self.unbacked_swa(i),
            mamba: (self.has[MAMBA] && n.comp[MAMBA].present && n.host_mamba.is_none())
                .then_some(n.mamba_slot),
        };
        let empty = plan.full.is_empty() && plan.swa.is_empty() && plan.mamba.is_none();
        Ok((!empty).then_some(plan))
    }

    /// SGLang's `_collect_unbacked_swa_nodes_in_window`, oldest first.
    fn unbacked_swa(&self, mut i: u32) -> Vec<(NodeId, Vec<u32>)> {
        let Some(w) = self.cfg.swa_window else {
            return Vec::new();
        };
        let (mut covered, mut out) = (0usize, Vec::new());
        while i != ROOT && covered < w as usize {
            if self.backup_pending(i) {
                break;
            }
            let n = &self.arena.nodes[i as usize];
            if !n.comp[SWA].present && n.host_swa.is_empty() {
                break;
            }
            covered += n.key.len();
            if n.comp[SWA].present && n.host_swa.is_empty() {
                out.push((self.id(i), n.swa_pages.clone()));
            }
            i = n.parent;
        }
        out.reverse();
        out
    }

    /// Records the host slots of a launched device→host copy of `plan` (which must still
    /// be what [`plan_backup`](Self::plan_backup) says): the components are on host from
    /// now on and the node is locked until [`finish_backup`](Self::finish_backup).
    pub fn commit_backup(
        &mut self,
        plan: &UnifiedBackupPlan,
        host: HostBackup<'_>,
    ) -> Result<BackupId> {
        let fresh = self.plan_backup(plan.node)?.as_ref() == Some(plan);
        let fits = host.full.len() == plan.full.len()
            && host.swa.len() == plan.swa_pages()
            && host.mamba.is_some() == plan.mamba.is_some();
        check_commit("backup", plan.node, fresh, fits)?;
        self.host_seen = true;
        let i = self.index(plan.node)?;
        for (node, mine) in per_node(&plan.swa, host.swa) {
            let j = self.index(node)?;
            self.arena.nodes[j as usize].host_swa = mine.to_vec();
        }
        let n = &mut self.arena.nodes[i as usize];
        if !host.full.is_empty() {
            n.host_full = host.full.to_vec();
        }
        if host.mamba.is_some() {
            n.host_mamba = host.mamba;
        }
        self.start_transfer(plan.node, false).map(BackupId)
    }

    /// The copy of a committed backup has landed: releases the node's lock.
    pub fn finish_backup(&mut self, id: BackupId) -> Result<()> {
        self.end_transfer(false, id.0)
    }

    /// Locks `node` for a committed backup (`load` false) or load-back; returns its id.
    pub(crate) fn start_transfer(&mut self, node: NodeId, load: bool) -> Result<u64> {
        let receipt = self.lock(node, false)?;
        self.next_transfer += 1;
        let map = if load {
            &mut self.loads
        } else {
            &mut self.backups
        };
        map.insert(self.next_transfer, receipt);
        Ok(self.next_transfer)
    }

    /// Releases the lock of a committed backup (`load` false) or load-back.
    pub(crate) fn end_transfer(&mut self, load: bool, id: u64) -> Result<()> {
        let (map, kind) = if load {
            (&mut self.loads, "load")
        } else {
            (&mut self.backups, "write")
        };
        let receipt = map
            .remove(&id)
            .ok_or(CoreError::UnknownTransfer { kind, id })?;
        self.unlock(&receipt)
    }

    /// Backups committed and not finished.
    pub fn pending_backups(&self) -> usize {
        self.backups.len()
    }

    /// Whether node `i` has a committed, unfinished backup (SGLang's
    /// `write_through_pending_id`): the SWA window walk of a later plan stops there.
    fn backup_pending(&self, i: u32) -> bool {
        let id = self.id(i);
        self.backups.values().any(|r| r.node == id)
    }

    /// The host invariants of the module documentation.
    pub(crate) fn check_host(&self) -> std::result::Result<(), String> {
        let mut seen = [HashSet::new(), HashSet::new(), HashSet::new()];
        for (i, n) in self.arena.nodes.iter().enumerate() {
            if !n.live || i == ROOT as usize {
                continue;
            }
            let pages = n.key.len() / self.ps();
            let full = !n.host_full.is_empty();
            if ![0, pages].contains(&n.host_full.len()) || ![0, pages].contains(&n.host_swa.len()) {
                return Err(format!("node {i}: host slots are not one per page"));
            }
            let parent = n.parent as usize;
            if full && parent != ROOT as usize && self.arena.nodes[parent].host_full.is_empty() {
                return Err(format!("node {i}: on host, its parent is not"));
            }
            if !full && n.host_lock[FULL] > 0 {
                return Err(format!("node {i}: Full host-locked without a host copy"));
            }
            if !full && (!n.host_swa.is_empty() || n.host_mamba.is_some()) {
                return Err(format!("node {i}: host SWA or Mamba without host Full"));
            }
            let lists = [&n.host_full[..], &n.host_swa[..], n.host_mamba.as_slice()];
            for (c, list) in lists.into_iter().enumerate() {
                if let Some(x) = list.iter().find(|&&x| !seen[c].insert(x)) {
                    return Err(format!("node {i}: host slot {x} of {c} held twice"));
                }
            }
        }
        Ok(())
    }
}
