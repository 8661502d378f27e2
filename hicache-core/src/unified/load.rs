//! Host tier, load-back (plan → commit → finish), following SGLang 0.5.23's
//! `UnifiedRadixCache.load_back`: a match's [`host_node`](super::UnifiedMatch::host_node)
//! is brought back to device per component — Full: the host-only nodes from the device
//! prefix down to it, ancestors first; SWA: the nodes within one window of it whose SWA is
//! on host only; Mamba: its state when on host only. The tree stays metadata only: the
//! caller allocates device slots for a [`UnifiedLoadPlan`], launches the host→device copy of
//! exactly the plan's host slots, and commits; from the commit the components are on device
//! and the node is locked (Full path, SWA window, Mamba) and host-locked (SGLang's host
//! anchor lock, see `host_lock`) until [`UnifiedTree::finish_load_back`].
//!
//! Invariant kept here: a plan's host slots are the node's own host slots (those its
//! write-through backup committed, see `host`), so a load-back restores the backed-up
//! bytes; a commit applies only the plan the tree would make now; nodes come back on
//! device parents first (a device node's parent is on device).

use super::host::{check_commit, list_pages, per_node};
use super::node::ROOT;
use super::{Component, UnifiedTree};
use super::{FULL, MAMBA, SWA};
use crate::error::{CoreError, Result};
use crate::tree::NodeId;

/// A committed load-back, finished with [`UnifiedTree::finish_load_back`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct UnifiedLoadId(u64);

/// What a load-back copies, per component (host slots, in the caller's host pools).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnifiedLoadPlan {
    /// The node loaded (a match's `host_node`).
    pub node: NodeId,
    /// Host-only nodes on the path to `node`, ancestors first, with their host Full pages.
    pub full: Vec<(NodeId, Vec<u32>)>,
    /// Nodes within one window of `node` whose SWA is on host only, ancestors first, with
    /// their host SWA pages.
    pub swa: Vec<(NodeId, Vec<u32>)>,
    /// The host Mamba state slot of `node`, when its state is on host only.
    pub mamba: Option<u32>,
}

impl UnifiedLoadPlan {
    /// Full pages to copy (the length of [`DeviceLoad::full`]).
    pub fn full_pages(&self) -> usize {
        list_pages(&self.full)
    }

    /// SWA pages to copy (the length of [`DeviceLoad::swa`]).
    pub fn swa_pages(&self) -> usize {
        list_pages(&self.swa)
    }
}

/// The device slots a load-back writes, in the order of its [`UnifiedLoadPlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLoad<'a> {
    /// One device slot per Full page of the plan, its nodes concatenated in order.
    pub full: &'a [u32],
    /// One device slot per SWA page of the plan, its nodes concatenated in order.
    pub swa: &'a [u32],
    /// The device state slot, exactly when the plan has a Mamba state.
    pub mamba: Option<u32>,
}

impl UnifiedTree {
    /// What loading `node` back to device copies now; `None` when every component it needs
    /// is on device already. Errors: a tree without device slots, or a component neither on
    /// device nor on host on the way (not a match's `host_node`).
    pub fn plan_load_back(&self, node: NodeId) -> Result<Option<UnifiedLoadPlan>> {
        let target = self.index(node)?;
        let refuse = |reason| CoreError::InvalidPolicy {
            field: "load_back",
            value: format!("{node:?}"),
            reason,
        };
        if !self.slots {
            return Err(refuse("the tree does not track device slots"));
        }
        let mut full = Vec::new();
        let mut i = target;
        while i != ROOT && !self.arena.nodes[i as usize].comp[FULL].present {
            full.push((self.id(i), self.arena.nodes[i as usize].host_full.clone()));
            i = self.arena.nodes[i as usize].parent;
        }
        full.reverse();
        let t = &self.arena.nodes[target as usize];
        let mamba = if self.has[MAMBA] && target != ROOT && !t.comp[MAMBA].present {
            Some(
                t.host_mamba
                    .ok_or(refuse("the Mamba state is neither on device nor host"))?,
            )
        } else {
            None
        };
        let plan = UnifiedLoadPlan {
            node,
            full,
            swa: self.host_swa_window(target),
            mamba,
        };
        let empty = plan.full.is_empty() && plan.swa.is_empty() && plan.mamba.is_none();
        Ok((!empty).then_some(plan))
    }

    /// The nodes within one window of `i` whose SWA is on host only, ancestors first,
    /// walking up until the window is covered or a node has SWA neither on device nor on
    /// host (also the match's SWA host hit, SGLang's `swa_host_hit`).
    pub(crate) fn host_swa_window(&self, mut i: u32) -> Vec<(NodeId, Vec<u32>)> {
        let Some(w) = self.cfg.swa_window else {
            return Vec::new();
        };
        let (mut covered, mut out) = (0usize, Vec::new());
        while i != ROOT && covered < w as usize {
            let n = &self.arena.nodes[i as usize];
            if !n.comp[SWA].present {
                if n.host_swa.is_empty() {
                    break;
                }
                out.push((self.id(i), n.host_swa.clone()));
            }
            covered += n.key.len();
            i = n.parent;
        }
        out.reverse();
        out
    }

    /// Records the device slots of a launched host→device copy of `plan` (which must still
    /// be what [`plan_load_back`](Self::plan_load_back) says): the components are on device
    /// from now on (matches reuse them) and the node is locked until
    /// [`finish_load_back`](Self::finish_load_back).
    pub fn commit_load_back(
        &mut self,
        plan: &UnifiedLoadPlan,
        dev: DeviceLoad<'_>,
    ) -> Result<UnifiedLoadId> {
        let state = dev.mamba.is_some() == plan.mamba.is_some();
        self.commit_load(plan, dev, state)
    }

    /// As [`commit_load_back`](Self::commit_load_back), for a copy that wrote the plan's
    /// Mamba state (if any) into a slot the tree does not own — a request's working state,
    /// loaded straight from host instead of into the tree and copied again — so `dev.mamba`
    /// is `None`: the Full and SWA pages are on device from now on, the node's state stays on
    /// host only (a device match ends above the node; the request locks the node itself,
    /// skipping Mamba). The node is locked and host-locked until
    /// [`finish_load_back`](Self::finish_load_back), as with the state.
    pub fn commit_load_back_detached(
        &mut self,
        plan: &UnifiedLoadPlan,
        dev: DeviceLoad<'_>,
    ) -> Result<UnifiedLoadId> {
        let state = dev.mamba.is_none();
        self.commit_load(plan, dev, state)
    }

    /// Commits `plan` into `dev` (`state`: whether `dev` has the state slot the caller's
    /// variant requires).
    fn commit_load(
        &mut self,
        plan: &UnifiedLoadPlan,
        dev: DeviceLoad<'_>,
        state: bool,
    ) -> Result<UnifiedLoadId> {
        let fresh = self.plan_load_back(plan.node)?.as_ref() == Some(plan);
        let fits =
            dev.full.len() == plan.full_pages() && dev.swa.len() == plan.swa_pages() && state;
        check_commit("load_back", plan.node, fresh, fits)?;
        for (node, mine) in per_node(&plan.full, dev.full) {
            let i = self.index(node)?;
            self.arena.nodes[i as usize].full_pages = mine.to_vec();
            self.unevict(i);
        }
        for (node, mine) in per_node(&plan.swa, dev.swa) {
            let i = self.index(node)?;
            self.arena.nodes[i as usize].swa_pages = mine.to_vec();
            self.set_present(i, Component::Swa);
        }
        let i = self.index(plan.node)?;
        if let Some(slot) = dev.mamba {
            self.arena.nodes[i as usize].mamba_slot = slot;
            self.set_present(i, Component::Mamba);
        }
        let host = self.lock_host(plan.node)?;
        let id = self.start_transfer(plan.node, true)?;
        self.load_host_locks.insert(id, host);
        Ok(UnifiedLoadId(id))
    }

    /// The copy of a committed load-back has landed: releases the node's lock and host lock.
    pub fn finish_load_back(&mut self, id: UnifiedLoadId) -> Result<()> {
        self.end_transfer(true, id.0)?;
        match self.load_host_locks.remove(&id.0) {
            Some(host) => self.unlock_host(&host),
            None => Ok(()),
        }
    }

    /// Load-backs committed and not finished.
    pub fn pending_load_backs(&self) -> usize {
        self.loads.len()
    }
}
