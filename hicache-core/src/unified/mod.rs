//! The unified radix tree: one radix tree whose nodes carry per-component data — Full KV,
//! sliding-window (SWA) KV, Mamba state — with SGLang 0.5.23's `UnifiedRadixCache` semantics
//! (device tier).
//!
//! [`HiRadixTree`](crate::HiRadixTree) stays the dense (Full-only) tree with host tiering; this
//! tree is where components live, so the dense path pays nothing for them. It is metadata
//! only: it never frees memory; evictions report what the caller must free.
//!
//! # Rules (SGLang's `unified_cache/components/README.md`)
//!
//! - **Full** is on every live node. Its lock is a *path lock* (node to root). It is evicted
//!   only as whole device leaves, oldest `last_access_time` first.
//! - **SWA** (window `W` tokens) may be a *tombstone* on a node (data gone, node kept). A
//!   match is valid at a node only once the SWA data on the path since the last tombstone
//!   covers `W` tokens (a path without tombstones is always valid). Its lock is a *window
//!   lock*: from the node up until `W` tokens of key are covered (tombstones counted), the
//!   last node stamped with a boundary uuid. Its LRU refreshes only the window ancestors
//!   (`W + page_size` tokens). An insert recovers a tombstone inside the request's window
//!   and caps a fresh leaf's SWA at one window by splitting it.
//! - **Mamba** state sits at some nodes only; a match ends at the deepest node with state
//!   (the *branching length* says how far Full KV went past it). Its lock is the node alone;
//!   a hit copies the state (copy-on-write, done by the caller with [`UnifiedMatch::mamba_slot`]).
//! - **Eviction**: each component frees from its own order (Full: leaf heap by time; SWA and
//!   Mamba: their LRU from the tail). A leaf goes whole; on an internal node evicting a
//!   component cascades to components of lower or equal priority (Full 2 > SWA 1 > Mamba 0).
//!   A locked component is never evicted.
//! - **Clock**: SGLang stamps nodes from one global counter; after a match the matched path
//!   gets `t, t − ε, t − 2ε …` upwards. Here `t` is the counter shifted left by 20 bits and
//!   `ε` is 1, which orders identically.
//!
//! # Invariants (checked by [`UnifiedTree::check_invariants`])
//!
//! 1. Full is on device on every live non-root node except *host-only* (demoted) nodes,
//!    which hold Full on host and no device component; a device node's parent is the root
//!    or on device. Keys are whole pages, non-empty.
//! 2. A node is in a component's LRU iff the component is present (on device) on it.
//! 3. `evictable[c] + protected[c]` = Σ of component `c`'s device sizes (tokens; states
//!    for Mamba) over the tree, protected counting nodes with `lock > 0`.
//! 4. The evictable-leaf set (device leaves) is exact: on device, unlocked in every
//!    component, no child with Full on device.
//! 5. A Full lock is at least the sum of its children's Full locks (path locks nest).
//! 6. Device slots (a tree made with [`UnifiedTree::with_device_slots`]): one Full slot per
//!    page where Full is on device, one SWA slot per page where SWA is present, none twice;
//!    a tree without tracking holds none (see `slots`).
//! 7. Host copies (write-through backup, see `host`): one host slot per page or none; a
//!    backed-up node's parent is the root or backed up; host SWA / Mamba only where host
//!    Full is; no host slot twice.
//!
//! # Host tier (trees with device slots)
//!
//! A backed-up device leaf is demoted on device eviction (`evict`); a match reports how far
//! the host copies reach ([`UnifiedMatch::host_node`] and the host hits) but its device
//! node is never host-only; [`UnifiedTree::plan_load_back`] brings a host hit back
//! (`load`), an insert over a host-only node puts it back with the request's KV, and
//! [`UnifiedTree::evict_host`] frees host-only leaves. A tree without host copies behaves
//! exactly as before (the replay against SGLang's device tier).

use crate::error::{CoreError, Result};
use crate::tree::NodeId;

mod admit;
mod components;
mod evict;
mod host;
mod host_evict;
mod host_insert;
mod host_lock;
mod insert;
mod lengths;
mod load;
mod lock;
mod lru;
mod matching;
mod node;
mod slots;

#[cfg(test)]
mod tests;

pub use admit::{AdmissionAsk, DeviceFree};
pub use evict::{EvictRequest, Evicted};
pub use host::{BackupId, HostBackup, UnifiedBackupPlan};
pub use host_insert::HostInsert;
pub use host_lock::HostLockReceipt;
pub use insert::{InsertParams, UnifiedInsert};
pub use load::{DeviceLoad, UnifiedLoadId, UnifiedLoadPlan};
pub use lock::LockReceipt;
pub use matching::UnifiedMatch;
pub use slots::InsertSlots;

use lru::Lru;
use node::{Arena, NIL, ROOT};

/// A component of the tree, in SGLang's order (also the index of its data on a node).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// Full-attention KV (always configured).
    Full = 0,
    /// Sliding-window KV.
    Swa = 1,
    /// Mamba / linear-attention state.
    Mamba = 2,
}

/// Index of Full's data in a node's per-component arrays (`comp`, `has`, sizes).
const FULL: usize = Component::Full as usize;
/// Index of SWA's data in a node's per-component arrays.
const SWA: usize = Component::Swa as usize;
/// Index of Mamba's data in a node's per-component arrays.
const MAMBA: usize = Component::Mamba as usize;
/// SWA's LRU in `UnifiedTree::lrus`.
const SWA_LRU: usize = SWA - 1;
/// Mamba's LRU in `UnifiedTree::lrus`.
const MAMBA_LRU: usize = MAMBA - 1;

impl Component {
    /// Cascade priority on an internal node (higher is evicted later); all are 0 on a leaf.
    pub fn internal_priority(self) -> u8 {
        match self {
            Component::Full => 2,
            Component::Swa => 1,
            Component::Mamba => 0,
        }
    }

    fn lru(self) -> usize {
        self as usize - 1
    }
}

/// Configuration of a [`UnifiedTree`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnifiedConfig {
    /// Tokens per page (1..=65536).
    pub page_size: u32,
    /// SWA window in tokens (SGLang's `swa_retain_window`); `None`: no SWA component.
    pub swa_window: Option<u32>,
    /// Mamba checkpoint chunk in tokens (`mamba_cache_chunk_size`); `None`: no Mamba
    /// component. The branching grid is `lcm(chunk, page_size)`.
    pub mamba_chunk: Option<u32>,
}

impl UnifiedConfig {
    /// Full only.
    pub fn full(page_size: u32) -> Self {
        Self {
            page_size,
            swa_window: None,
            mamba_chunk: None,
        }
    }

    /// The Mamba checkpoint grid, `lcm(max(chunk, page_size), page_size)` tokens (SGLang's
    /// `mamba_checkpoint_grid`); `None` without Mamba.
    pub fn mamba_grid(&self) -> Option<usize> {
        let chunk = self.mamba_chunk?.max(self.page_size) as usize;
        let ps = self.page_size as usize;
        let (mut x, mut y) = (chunk, ps);
        while y != 0 {
            (x, y) = (y, x % y);
        }
        Some(chunk / x * ps)
    }

    /// The configured components, in order.
    pub fn components(&self) -> Vec<Component> {
        let mut v = vec![Component::Full];
        if self.swa_window.is_some() {
            v.push(Component::Swa);
        }
        if self.mamba_chunk.is_some() {
            v.push(Component::Mamba);
        }
        v
    }

    fn validate(&self) -> Result<()> {
        if self.page_size == 0 || self.page_size > 65536 {
            return Err(CoreError::BadPageSize(self.page_size));
        }
        let bad = |field, value: u32| CoreError::InvalidPolicy {
            field,
            value: value.to_string(),
            reason: "must be > 0",
        };
        match (self.swa_window, self.mamba_chunk) {
            (Some(0), _) => Err(bad("swa_window", 0)),
            (_, Some(0)) => Err(bad("mamba_chunk", 0)),
            _ => Ok(()),
        }
    }
}

/// The unified radix tree (see the module documentation).
#[derive(Clone, Debug)]
pub struct UnifiedTree {
    cfg: UnifiedConfig,
    has: [bool; 3],
    arena: Arena,
    /// LRU lists of SWA (0) and Mamba (1).
    lrus: [Lru; 2],
    /// Host LRU lists of SWA (0) and Mamba (1): nodes whose component is on host only and
    /// not host-locked (see `host_evict`).
    host_lrus: [Lru; 2],
    /// The host leaves, least recently used first (see `host_evict`).
    host_leaves: crate::eviction::lru::LruStrategy,
    /// The evictable device leaves, and each node's position in it (`NIL`: absent).
    leaves: Vec<u32>,
    leaf_pos: Vec<u32>,
    evictable: [u64; 3],
    protected: [u64; 3],
    clock: u64,
    uuid: u64,
    /// Whether nodes carry device page slots (see [`UnifiedTree::with_device_slots`]).
    slots: bool,
    /// Backups committed and not finished: the lock each holds.
    backups: std::collections::HashMap<u64, LockReceipt>,
    /// Load-backs committed and not finished: the lock each holds.
    loads: std::collections::HashMap<u64, LockReceipt>,
    /// Load-backs committed and not finished: the host lock each holds on its node.
    load_host_locks: std::collections::HashMap<u64, HostLockReceipt>,
    /// The last backup or load-back id handed out.
    next_transfer: u64,
    /// Whether a backup was ever committed since the last reset: until then no node has
    /// host data, and matches skip the host validators (the device-tier cost is unchanged).
    host_seen: bool,
}

const CLOCK_SHIFT: u32 = 20;

impl UnifiedTree {
    /// An empty tree.
    pub fn new(cfg: UnifiedConfig) -> Result<Self> {
        cfg.validate()?;
        let has = [true, cfg.swa_window.is_some(), cfg.mamba_chunk.is_some()];
        let mut t = Self {
            cfg,
            has,
            arena: Arena::with_root(0),
            lrus: [Lru::default(), Lru::default()],
            host_lrus: [Lru::default(), Lru::default()],
            host_leaves: Default::default(),
            leaves: Vec::new(),
            leaf_pos: Vec::new(),
            evictable: [0; 3],
            protected: [0; 3],
            clock: 0,
            uuid: 0,
            slots: false,
            backups: std::collections::HashMap::new(),
            loads: std::collections::HashMap::new(),
            load_host_locks: std::collections::HashMap::new(),
            next_transfer: 0,
            host_seen: false,
        };
        t.reset();
        Ok(t)
    }

    /// Drops every node (SGLang's `reset`): the tree is empty, the clock keeps counting.
    pub fn reset(&mut self) {
        let time = self.tick();
        self.arena = Arena::with_root(time);
        for c in &mut self.arena.nodes[ROOT as usize].comp {
            c.lock = 1;
        }
        self.arena.nodes[ROOT as usize].comp[FULL].present = true;
        self.lrus = [Lru::default(), Lru::default()];
        self.host_lrus = [Lru::default(), Lru::default()];
        crate::eviction::EvictionStrategy::clear(&mut self.host_leaves);
        self.leaves.clear();
        self.leaf_pos.clear();
        self.evictable = [0; 3];
        self.protected = [0; 3];
        self.backups.clear();
        self.loads.clear();
        self.load_host_locks.clear();
        self.host_seen = false;
    }

    /// The configuration.
    pub fn config(&self) -> &UnifiedConfig {
        &self.cfg
    }

    /// Whether `c` is configured.
    pub fn has(&self, c: Component) -> bool {
        self.has[c as usize]
    }

    /// The root's handle.
    pub fn root(&self) -> NodeId {
        self.id(ROOT)
    }

    /// Tokens (Full, SWA) or states (Mamba) of component `c` held by the tree.
    pub fn size(&self, c: Component) -> u64 {
        self.evictable[c as usize] + self.protected[c as usize]
    }

    /// The unlocked part of [`size`](Self::size).
    pub fn evictable_size(&self, c: Component) -> u64 {
        self.evictable[c as usize]
    }

    /// The locked part of [`size`](Self::size).
    pub fn protected_size(&self, c: Component) -> u64 {
        self.protected[c as usize]
    }

    /// Live nodes, root included.
    pub fn node_count(&self) -> usize {
        self.arena.live()
    }

    /// The path length in tokens from the root to `node` (its end position).
    pub fn depth_tokens(&self, node: NodeId) -> Result<usize> {
        let mut i = self.index(node)?;
        let mut n = 0;
        while i != ROOT {
            n += self.arena.nodes[i as usize].key.len();
            i = self.arena.nodes[i as usize].parent;
        }
        Ok(n)
    }

    /// Whether component `c` is present (not a tombstone) on `node`.
    pub fn present(&self, node: NodeId, c: Component) -> Result<bool> {
        let i = self.index(node)?;
        Ok(self.arena.nodes[i as usize].comp[c as usize].present)
    }

    /// Component `c`'s lock count on `node`.
    pub fn lock_count(&self, node: NodeId, c: Component) -> Result<u32> {
        let i = self.index(node)?;
        Ok(self.arena.nodes[i as usize].comp[c as usize].lock)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock << CLOCK_SHIFT
    }

    fn id(&self, i: u32) -> NodeId {
        NodeId::from_parts(i, self.arena.nodes[i as usize].generation)
    }

    fn index(&self, id: NodeId) -> Result<u32> {
        let (i, g) = id.parts();
        match self.arena.nodes.get(i as usize) {
            Some(n) if n.live && n.generation == g => Ok(i),
            _ => Err(CoreError::StaleNode(format!("{id:?}"))),
        }
    }

    fn ps(&self) -> usize {
        self.cfg.page_size as usize
    }

    /// Size of component `c` on node `i` when present (tokens, or 1 state).
    fn comp_len(&self, i: u32, c: Component) -> u64 {
        match c {
            Component::Mamba => 1,
            _ => self.arena.nodes[i as usize].key.len() as u64,
        }
    }

    /// Makes `c` present on `i` (SGLang's `set_component_device_value`): LRU, then the
    /// ledger by its lock.
    fn set_present(&mut self, i: u32, c: Component) {
        self.arena.nodes[i as usize].comp[c as usize].present = true;
        if c != Component::Full {
            self.lrus[c.lru()].insert_mru(i);
            if self.host_seen {
                self.sync_host_lru(i, c);
            }
        }
        self.credit(i, c);
    }

    /// Adds `c`'s size on `i` to the ledger its lock says.
    fn credit(&mut self, i: u32, c: Component) {
        let n = self.comp_len(i, c);
        if self.arena.nodes[i as usize].comp[c as usize].lock > 0 {
            self.protected[c as usize] += n;
        } else {
            self.evictable[c as usize] += n;
        }
    }

    /// Moves `n` from evictable to protected (`lock = true`) or back.
    fn shift(&mut self, c: Component, n: u64, lock: bool) {
        let (from, to) = if lock {
            (&mut self.evictable, &mut self.protected)
        } else {
            (&mut self.protected, &mut self.evictable)
        };
        from[c as usize] -= n;
        to[c as usize] += n;
    }

    fn is_leaf_candidate(&self, i: u32) -> bool {
        let n = &self.arena.nodes[i as usize];
        i != ROOT
            && n.comp[FULL].present
            && n.comp.iter().all(|c| c.lock == 0)
            && !n
                .children
                .iter()
                .any(|&ch| self.arena.nodes[ch as usize].comp[FULL].present)
    }

    /// Whether `i` is in the evictable-leaf set.
    fn in_leaves(&self, i: u32) -> bool {
        self.leaf_pos.get(i as usize).is_some_and(|&p| p != NIL)
    }

    /// Re-derives `i`'s membership of the evictable-leaf set and, once the tree has host
    /// copies, of the host-leaf heap (SGLang's `_update_evictable_leaf_sets`).
    fn update_leaf(&mut self, i: u32) {
        if self.host_seen {
            self.update_host_leaf(i);
        }
        self.update_device_leaf(i);
    }

    fn update_device_leaf(&mut self, i: u32) {
        let want = self.is_leaf_candidate(i);
        if want == self.in_leaves(i) {
            return;
        }
        if !want {
            self.remove_from_leaves(i);
            return;
        }
        if self.leaf_pos.len() <= i as usize {
            self.leaf_pos.resize(i as usize + 1, NIL);
        }
        self.leaf_pos[i as usize] = self.leaves.len() as u32;
        self.leaves.push(i);
    }

    fn remove_from_leaves(&mut self, i: u32) {
        if self.in_leaves(i) {
            let p = self.leaf_pos[i as usize] as usize;
            self.leaves.swap_remove(p);
            if let Some(&moved) = self.leaves.get(p) {
                self.leaf_pos[moved as usize] = p as u32;
            }
            self.leaf_pos[i as usize] = NIL;
        }
    }

    /// The child of `i` whose key starts with the page at `key[..ps]`.
    fn child(&self, i: u32, key: &[u32]) -> Option<u32> {
        let ps = self.ps();
        let first = &key[..ps];
        self.arena.nodes[i as usize]
            .children
            .iter()
            .copied()
            .find(|&c| &self.arena.nodes[c as usize].key[..ps] == first)
    }

    /// Length of the common prefix of node `i`'s key and `key`, in whole pages.
    fn match_len(&self, i: u32, key: &[u32]) -> usize {
        let nk = &self.arena.nodes[i as usize].key;
        let n = nk.iter().zip(key).take_while(|(a, b)| a == b).count();
        n / self.ps() * self.ps()
    }

    /// Splits node `child` after `len` tokens; returns the new parent (the prefix). Each
    /// component redistributes: Full and SWA are sliced (both halves keep the lock count;
    /// the SWA boundary uuid moves to the prefix, the older edge); Mamba stays on the child.
    fn split(&mut self, child: u32, len: usize) -> u32 {
        let time = self.tick();
        let parent = self.arena.nodes[child as usize].parent;
        let suffix = self.arena.nodes[child as usize].key.split_off(len);
        let prefix = std::mem::replace(&mut self.arena.nodes[child as usize].key, suffix);
        let new = self.arena.alloc(parent, prefix, time);
        let c = self.arena.nodes[child as usize].comp;
        let pages = len / self.ps();
        let [full, swa, host_full, host_swa] = {
            let ch = &mut self.arena.nodes[child as usize];
            [
                &mut ch.full_pages,
                &mut ch.swa_pages,
                &mut ch.host_full,
                &mut ch.host_swa,
            ]
            .map(|v| slots::take_prefix(v, pages))
        };
        {
            let n = &mut self.arena.nodes[new as usize];
            n.full_pages = full;
            n.swa_pages = swa;
            n.host_full = host_full;
            n.host_swa = host_swa;
            n.children.push(child);
            // Lock counts are copied; the boundary stamps (device and host) move to the
            // prefix, the older edge of both segments.
            n.comp[FULL] = node::Comp { uuid: 0, ..c[FULL] };
            n.comp[SWA] = c[SWA];
        }
        let ch = &mut self.arena.nodes[child as usize];
        let (host_lock, host_uuid) = (ch.host_lock, std::mem::take(&mut ch.host_uuid));
        ch.comp[SWA].uuid = 0;
        let n = &mut self.arena.nodes[new as usize];
        n.host_lock = [host_lock[FULL], host_lock[SWA], 0];
        n.host_uuid = host_uuid;
        self.arena.nodes[child as usize].parent = new;
        let siblings = &mut self.arena.nodes[parent as usize].children;
        let pos = siblings
            .iter()
            .position(|&x| x == child)
            .expect("child of its parent");
        siblings[pos] = new;
        if self.has[SWA] && c[SWA].present {
            self.lrus[SWA_LRU].insert_after(child, new);
        }
        if self.host_seen {
            self.split_host_lru(new, child);
        }
        let time = self.tick();
        self.stamp(child, time);
        self.update_leaf(new);
        self.update_leaf(child);
        new
    }

    /// Checks the invariants listed in the module documentation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        components::check(self)?;
        self.check_host_order()
    }
}
