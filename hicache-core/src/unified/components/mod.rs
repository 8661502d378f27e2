//! Component-specific rules that do not fit the generic walks: SWA's window (tombstone
//! recovery, leaf capping) in [`swa`], and the invariant checks of every component.

mod swa;

use super::node::{NIL, ROOT};
use super::{Component, UnifiedTree};
use crate::unified::FULL;

/// Checks the invariants of the module documentation of [`super`].
pub(super) fn check(t: &UnifiedTree) -> Result<(), String> {
    let mut sums = [[0u64; 2]; 3];
    let comps = [Component::Full, Component::Swa, Component::Mamba];
    for (i, n) in t.arena.nodes.iter().enumerate() {
        let i = i as u32;
        if !n.live || i == ROOT {
            continue;
        }
        if n.key.is_empty() || !n.key.len().is_multiple_of(t.ps()) {
            return Err(format!("node {i}: empty/unaligned key"));
        }
        // Host-only (demoted) nodes: Full on host, no device component, device parent or
        // host-only parent; a device node's parent is on device.
        if !n.comp[FULL].present {
            if n.host_full.is_empty() || n.comp.iter().any(|c| c.present) {
                return Err(format!("node {i}: Full neither on device nor host-only"));
            }
        } else if n.parent != ROOT && !t.arena.nodes[n.parent as usize].comp[FULL].present {
            return Err(format!("node {i}: on device under a host-only parent"));
        }
        if n.parent == NIL || !t.arena.nodes[n.parent as usize].children.contains(&i) {
            return Err(format!("node {i}: not a child of its parent"));
        }
        for c in comps {
            let d = n.comp[c as usize];
            if !t.has[c as usize] && (d.present || d.lock > 0) {
                return Err(format!("node {i}: data of unconfigured {c:?}"));
            }
            if d.present {
                sums[c as usize][usize::from(d.lock > 0)] += t.comp_len(i, c);
            }
            if c != Component::Full && t.has[c as usize] && t.lrus[c.lru()].contains(i) != d.present
            {
                return Err(format!("node {i}: {c:?} LRU membership != presence"));
            }
        }
        let child_locks: u32 = n
            .children
            .iter()
            .map(|&c| t.arena.nodes[c as usize].comp[FULL].lock)
            .sum();
        if n.comp[FULL].lock < child_locks {
            return Err(format!("node {i}: Full lock below its children's"));
        }
        if t.in_leaves(i) != t.is_leaf_candidate(i) {
            return Err(format!("node {i}: evictable-leaf set out of date"));
        }
    }
    for c in [Component::Swa, Component::Mamba] {
        let present = t
            .arena
            .nodes
            .iter()
            .filter(|n| n.live && n.comp[c as usize].present)
            .count();
        if t.lrus[c.lru()].len() != present {
            return Err(format!(
                "{c:?}: LRU holds {} nodes, {present} have data",
                t.lrus[c.lru()].len()
            ));
        }
    }
    for c in comps {
        let want = [t.evictable[c as usize], t.protected[c as usize]];
        if sums[c as usize] != want {
            return Err(format!(
                "{c:?}: sizes {:?} != ledger {want:?}",
                sums[c as usize]
            ));
        }
    }
    t.check_slots()?;
    t.check_host()
}
