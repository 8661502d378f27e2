//! Nodes of the [`UnifiedTree`](super::UnifiedTree) and the arena that owns them.
//!
//! Invariant kept here: a live node's `key` is never empty (except the root's), and every
//! child of a node differs from its siblings in its first page.

/// Index of the root in the arena.
pub(crate) const ROOT: u32 = 0;
/// "No node".
pub(crate) const NIL: u32 = u32::MAX;

/// One component's data on one node (SGLang's `ComponentData`, device side).
///
/// `present` is false for a tombstone: the node stays, the component's data is gone.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Comp {
    /// The component holds data on this node.
    pub present: bool,
    /// Requests holding this component's data here (never negative: `u32`, and every
    /// decrement checks for zero first).
    pub lock: u32,
    /// Window-lock boundary stamp (SWA only; 0 = none).
    pub uuid: u64,
}

/// A node: a run of tokens and the per-component data on it.
#[derive(Clone, Debug)]
pub(crate) struct Node {
    /// Parent index (`NIL` for the root).
    pub parent: u32,
    /// Children indices; their keys differ in the first page.
    pub children: Vec<u32>,
    /// The tokens of this node (a whole number of pages).
    pub key: Vec<u32>,
    /// Logical access time (SGLang's `last_access_time`, scaled: see `super::clock`).
    pub time: u64,
    /// Full, SWA and Mamba data, indexed by [`super::Component`] as `usize`.
    pub comp: [Comp; 3],
    /// The Mamba state slot, meaningful while `comp[MAMBA].present`.
    pub mamba_slot: u32,
    /// Device Full page slots, one per page of `key` (empty when the tree does not track
    /// slots).
    pub full_pages: Vec<u32>,
    /// Device SWA page slots, one per page of `key` while SWA is present (empty otherwise or
    /// when the tree does not track slots).
    pub swa_pages: Vec<u32>,
    /// Host Full page slots, one per page of `key` once backed up (empty otherwise).
    pub host_full: Vec<u32>,
    /// Host SWA page slots, one per page of `key` once SWA is backed up (empty otherwise).
    pub host_swa: Vec<u32>,
    /// Host Mamba state slot once the state is backed up.
    pub host_mamba: Option<u32>,
    /// Host locks per component (SGLang's `host_lock_ref`): a load-back, an L3 backup or a
    /// prefetch reading or writing the host copy. Counted on tombstones too (SWA's window
    /// lock walks every node it covers), so a release mirrors its acquire. Kept beside
    /// `comp`, not in it, so the device tier's per-component data stays 16 bytes.
    pub host_lock: [u32; 3],
    /// Host-lock boundary stamps of Full and SWA (0 = none), as `Comp::uuid` for devices.
    pub host_uuid: [u64; 2],
    /// Bumped when the index is reused, so stale handles are detected.
    pub generation: u32,
    /// False once deleted (the index is on the free list).
    pub live: bool,
}

impl Node {
    /// Whether component `c` has a host copy on this node.
    pub(crate) fn on_host(&self, c: super::Component) -> bool {
        match c {
            super::Component::Full => !self.host_full.is_empty(),
            super::Component::Swa => !self.host_swa.is_empty(),
            super::Component::Mamba => self.host_mamba.is_some(),
        }
    }

    pub(crate) fn new(parent: u32, key: Vec<u32>, time: u64, generation: u32) -> Self {
        Self {
            parent,
            children: Vec::new(),
            key,
            time,
            comp: [Comp::default(); 3],
            mamba_slot: 0,
            full_pages: Vec::new(),
            swa_pages: Vec::new(),
            host_full: Vec::new(),
            host_swa: Vec::new(),
            host_mamba: None,
            host_lock: [0; 3],
            host_uuid: [0; 2],
            generation,
            live: true,
        }
    }
}

/// The node arena: indices are reused through a free list.
#[derive(Clone, Debug, Default)]
pub(crate) struct Arena {
    pub nodes: Vec<Node>,
    free: Vec<u32>,
}

impl Arena {
    /// A fresh arena holding only the root.
    pub(crate) fn with_root(time: u64) -> Self {
        Self {
            nodes: vec![Node::new(NIL, Vec::new(), time, 0)],
            free: Vec::new(),
        }
    }

    /// Allocates a node and returns its index.
    pub(crate) fn alloc(&mut self, parent: u32, key: Vec<u32>, time: u64) -> u32 {
        if let Some(i) = self.free.pop() {
            let generation = self.nodes[i as usize].generation.wrapping_add(1);
            self.nodes[i as usize] = Node::new(parent, key, time, generation);
            i
        } else {
            let i = self.nodes.len() as u32;
            self.nodes.push(Node::new(parent, key, time, 0));
            i
        }
    }

    /// Marks a node deleted and recycles its index.
    pub(crate) fn release(&mut self, i: u32) {
        let n = &mut self.nodes[i as usize];
        n.live = false;
        n.children = Vec::new();
        n.key = Vec::new();
        n.full_pages = Vec::new();
        n.swa_pages = Vec::new();
        n.host_full = Vec::new();
        n.host_swa = Vec::new();
        n.host_mamba = None;
        self.free.push(i);
    }

    /// Number of live nodes, root included.
    pub(crate) fn live(&self) -> usize {
        self.nodes.len() - self.free.len()
    }
}
