//! The HiRadixTree: which token pages live in device (L1) and host (L2) memory.
//!
//! Semantics follow SGLang's `HiRadixCache` (its radix tree with host copies); the differences are
//! listed at the end. The tree is metadata only: it never frees memory itself. Every operation that
//! drops pages returns the slots the caller must free, and every transfer is split into steps the
//! controller drives (plan → commit → finish), so the core stays pure and testable.
//!
//! # Model
//!
//! - Keys are `u32` token ids in whole pages of `page_size` tokens. Device and host slots are
//!   **page indices** ([`DeviceSlot`], [`HostSlot`]), one per page.
//! - Each tenant (extra key such as a LoRA id, cache salt) has its own root: tenants never
//!   share nodes. Its [`ChainStart`] seeds the page hashes of its root's children.
//! - A node holds a run of pages. It is *on device* when it has device slots, *backed up* when
//!   it has host slots, *evicted* (host-only) when it is backed up but not on device.
//! - `lock_ref` pins device pages (requests, pending writes and loads) and propagates to every
//!   ancestor; `host_ref` pins host pages (prefetch anchors, L3 backups) and does not.
//! - One logical clock ticks once per [`match_prefix`](HiRadixTree::match_prefix),
//!   [`insert`](HiRadixTree::insert) and [`insert_host_only`](HiRadixTree::insert_host_only);
//!   every node such an operation walks past, and every node it creates or splits, is stamped
//!   with it. No decision depends on wall-clock time or hash-map iteration order, so the same
//!   operations give the same tree on every TP rank.
//!
//! # Example
//!
//! ```
//! use hicache_core::{
//!     DeviceSlot, HiRadixTree, HostSlot, InsertOptions, NoHost, TenantId, TreeConfig, WritePolicy,
//! };
//!
//! let dev = |v: &[u32]| v.iter().copied().map(DeviceSlot).collect::<Vec<_>>();
//! let host = |v: &[u32]| v.iter().copied().map(HostSlot).collect::<Vec<_>>();
//! let mut tree = HiRadixTree::new(TreeConfig {
//!     write_policy: WritePolicy::WriteThrough,
//!     ..TreeConfig::new(4)
//! })?;
//! let t = TenantId::DEFAULT;
//! let prompt: Vec<u32> = (0..12).collect(); // 3 pages of 4 tokens
//!
//! // A request: match, pin, compute the missing pages, insert, unpin.
//! let m = tree.match_prefix(t, &prompt)?;
//! assert_eq!(m.device_pages(), 0);
//! tree.lock(m.last_device_node)?;
//! let r = tree.insert(t, &prompt, &dev(&[7, 8, 9]), InsertOptions::default())?;
//! tree.unlock(m.last_device_node)?;
//!
//! // Write-through: the new node is due for backup. The controller copies its device pages
//! // to host pages it allocated, and acks.
//! for node in r.write_through {
//!     let plan = tree.begin_backup(node)?.expect("parent is the root");
//!     let write = tree.commit_backup(node, &host(&[100, 101, 102]))?; // D2H copy launched
//!     assert_eq!(plan.device_slots, dev(&[7, 8, 9]));
//!     let done = tree.finish_backup(write)?; // D2H copy acknowledged
//!     assert_eq!(done.host_slots(), host(&[100, 101, 102]));
//! }
//!
//! // Device pressure: the node is demoted to host; the caller frees the device slots.
//! let out = tree.evict(3, &mut NoHost);
//! assert_eq!(out.device_slots, dev(&[7, 8, 9]));
//! let m = tree.match_prefix(t, &prompt)?;
//! assert_eq!((m.device_pages(), m.host_hit_pages), (0, 3));
//!
//! // Load it back: plan, allocate device pages, commit (H2D copy launched), finish on ack.
//! let plan = tree.plan_load_back(m.last_node, None)?.expect("3 pages >= threshold");
//! assert_eq!(plan.host_slots(), host(&[100, 101, 102]));
//! let load = tree.commit_load_back(plan, &dev(&[4, 5, 6]))?;
//! tree.finish_load_back(load)?;
//! assert_eq!(tree.match_prefix(t, &prompt)?.device_slots, dev(&[4, 5, 6]));
//! tree.check_invariants().unwrap();
//! # Ok::<(), hicache_core::CoreError>(())
//! ```
//!
//! # Invariants (checked by [`HiRadixTree::check_invariants`])
//!
//! 1. Device residency is prefix-closed: a node on device has every ancestor on device.
//! 2. Under write-through policies host residency is prefix-closed too (a node is backed up
//!    only after its parent); write-back may stage a child before its parent.
//! 3. Every evicted node is backed up; a node that is neither is deleted.
//! 4. All lengths are whole pages; siblings differ in their first page.
//! 5. `evictable_pages` = Σ pages of device nodes with `lock_ref == 0`; `protected_pages` =
//!    Σ pages of device nodes with `lock_ref > 0`. A locked node is on device, and its
//!    `lock_ref` is at least the sum of its children's.
//! 6. Device candidates = device nodes with `lock_ref == 0` and no device child; host
//!    candidates = evicted nodes with no child and `host_ref == 0`. Both are exact at all times
//!    (maintained incrementally, never rebuilt).
//! 7. A node with a pending write is backed up and pinned (locked for write-through, host
//!    protected for staged write-back) until the write finishes.
//!
//! # Differences from SGLang (deliberate)
//!
//! - Unaligned keys are an error ([`page_aligned`] truncates explicitly).
//! - [`insert_host_only`](HiRadixTree::insert_host_only) *adopts* the fetched host copy for
//!   existing nodes that are on device but not backed up, instead of freeing it and then
//!   hanging host-only children under a node that is not backed up (which would break
//!   invariant 2). The anchor must be backed up.
//! - Rematerialising an evicted node in `insert` emits a `BlockStored(GPU)` event.
//! - A staged write-back node stays host-protected until its write finishes, so a subtree
//!   drop in the same eviction call never frees the host pages a pending copy writes into.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};
use crate::event::{KvEvent, Medium};
use crate::eviction::{EvictionStrategy, StrategyKind};
use crate::hash::{ChainStart, PageHasher};
use crate::key::PageHash;
pub use crate::key::TenantId;
use crate::policy::{DEFAULT_LOAD_BACK_THRESHOLD_TOKENS, WritePolicy};

mod check;
mod evict;
mod node;
mod ops;
mod tiering;
mod transfer;

#[cfg(test)]
mod tests;

pub use evict::{EvictHostOutcome, EvictOutcome, HostAllocator, NoHost, StagedWriteBack};
pub use ops::{InsertOptions, InsertResult, KnownHashes, MatchResult};
pub use transfer::{BackupFragment, BackupPlan, FinishedBackup, HostInsertResult, LoadBackPlan};

use node::{Arena, DEVICE, HOST, LIVE, NIL, Node, ROOT, SKIPPED, WRITE_PENDING};

pub use crate::slot::{DeviceSlot, HostSlot};

/// A node handle: arena index plus generation. A handle to a deleted node is *stale*: every
/// operation given one returns [`CoreError::StaleNode`].
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId {
    index: u32,
    generation: u32,
}

impl NodeId {
    /// The arena index (reused after the node is deleted).
    pub fn index(self) -> u32 {
        self.index
    }

    /// A handle from its parts (for the other trees of this crate).
    pub(crate) fn from_parts(index: u32, generation: u32) -> Self {
        Self { index, generation }
    }

    /// The index and generation.
    pub(crate) fn parts(self) -> (u32, u32) {
        (self.index, self.generation)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}.{}", self.index, self.generation)
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Id of a pending device→host write, issued by the tree.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WriteId(pub u64);

/// Id of a pending host→device load, issued by the tree.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LoadId(pub u64);

/// Configuration of a [`HiRadixTree`].
#[derive(Clone, Debug)]
pub struct TreeConfig {
    /// Tokens per page (1..=65536).
    pub page_size: u32,
    /// When device pages are due for backup to host.
    pub write_policy: WritePolicy,
    /// Eviction order, used for both tiers.
    pub eviction: StrategyKind,
    /// A host hit shorter than this many tokens is not loaded back (SGLang: 10).
    pub load_back_threshold_tokens: u32,
    /// Computes per-page hashes on insert when set (needed for L3 and events).
    pub hasher: Option<PageHasher>,
    /// Collect [`KvEvent`]s (requires `hasher`).
    pub events: bool,
}

impl TreeConfig {
    /// SGLang's defaults for `page_size`: write-through-selective, LRU, load-back threshold 10
    /// tokens, no hashing, no events.
    pub fn new(page_size: u32) -> Self {
        Self {
            page_size,
            write_policy: WritePolicy::default(),
            eviction: StrategyKind::default(),
            load_back_threshold_tokens: DEFAULT_LOAD_BACK_THRESHOLD_TOKENS,
            hasher: None,
            events: false,
        }
    }

    /// Checks the page size, the hasher's page size and that events have hashes.
    pub fn validate(&self) -> Result<()> {
        if self.page_size == 0 || self.page_size > 65536 {
            return Err(CoreError::BadPageSize(self.page_size));
        }
        if let Some(h) = &self.hasher
            && h.page_size() != self.page_size
        {
            return Err(CoreError::InvalidPolicy {
                field: "hasher",
                value: format!("page size {}", h.page_size()),
                reason: "the hasher's page size differs from the tree's",
            });
        }
        if self.events && self.hasher.is_none() {
            return Err(CoreError::InvalidPolicy {
                field: "events",
                value: "true".into(),
                reason: "KV events carry page hashes: configure a hasher",
            });
        }
        Ok(())
    }
}

/// Truncates `tokens` to whole pages (SGLang's `page_aligned`).
pub fn page_aligned(tokens: &[u32], page_size: u32) -> &[u32] {
    let ps = page_size.max(1) as usize;
    &tokens[..tokens.len() / ps * ps]
}

/// A snapshot of one node, for callers and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node.
    pub id: NodeId,
    /// Its parent (`None` for a tenant root).
    pub parent: Option<NodeId>,
    /// Its tenant.
    pub tenant: TenantId,
    /// Whether it is a tenant root (no pages, never evicted).
    pub is_root: bool,
    /// Number of pages.
    pub pages: usize,
    /// Has device slots.
    pub on_device: bool,
    /// Has host slots.
    pub backed_up: bool,
    /// Device pin count (includes descendants' locks).
    pub lock_ref: u32,
    /// Host pin count.
    pub host_ref: u32,
    /// Insert-path hits.
    pub hit_count: u32,
    /// Request priority.
    pub priority: i32,
    /// Logical time of the last access.
    pub last_access: u64,
    /// Logical time of creation.
    pub creation: u64,
    /// A device→host write of this node is pending.
    pub write_pending: bool,
    /// Number of children.
    pub children: usize,
}

/// Sizes and counters of the tree.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TreeStats {
    /// Live nodes, tenant roots excluded.
    pub nodes: usize,
    /// Pages with device slots.
    pub device_pages: usize,
    /// Pages with host slots.
    pub host_pages: usize,
    /// Device pages that may be evicted (`lock_ref == 0`).
    pub evictable_pages: usize,
    /// Device pages pinned by locks.
    pub protected_pages: usize,
    /// Device eviction candidates.
    pub device_candidates: usize,
    /// Host eviction candidates.
    pub host_candidates: usize,
    /// Pending device→host writes.
    pub pending_writes: usize,
    /// Pending host→device loads.
    pub pending_loads: usize,
}

#[derive(Clone, Debug)]
struct Tenant {
    extra_key: Option<String>,
    cache_salt: Option<String>,
    root: u32,
    chain: Option<ChainStart>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum WriteKind {
    /// Write-through: the node is locked until the write finishes.
    Through,
    /// Staged write-back: the node is host-protected until the write finishes.
    Back,
}

#[derive(Copy, Clone, Debug)]
struct PendingWrite {
    node: NodeId,
    pages: u32,
    kind: WriteKind,
}

/// The hierarchical radix tree. See the module documentation.
#[derive(Debug)]
pub struct HiRadixTree {
    cfg: TreeConfig,
    ps: usize,
    arena: Arena,
    dev: Box<dyn EvictionStrategy>,
    host: Box<dyn EvictionStrategy>,
    tenants: Vec<Tenant>,
    tenant_ids: BTreeMap<(Option<String>, Option<String>), TenantId>,
    clock: u64,
    next_transfer: u64,
    writes: BTreeMap<WriteId, PendingWrite>,
    loads: BTreeMap<LoadId, NodeId>,
    events: Vec<KvEvent>,
    node_count: usize,
    device_pages: usize,
    host_pages: usize,
    evictable: usize,
    protected: usize,
    /// Host copies are transient (`buffer_only`, see [`HiRadixTree::set_transient_host`]).
    transient_host: bool,
}

impl HiRadixTree {
    /// An empty tree with the default tenant.
    pub fn new(cfg: TreeConfig) -> Result<Self> {
        cfg.validate()?;
        let ps = cfg.page_size as usize;
        let mut t = Self {
            ps,
            arena: Arena::new(ps),
            dev: cfg.eviction.build(),
            host: cfg.eviction.build(),
            tenants: Vec::new(),
            tenant_ids: BTreeMap::new(),
            clock: 0,
            next_transfer: 0,
            writes: BTreeMap::new(),
            loads: BTreeMap::new(),
            events: Vec::new(),
            node_count: 0,
            device_pages: 0,
            host_pages: 0,
            evictable: 0,
            protected: 0,
            transient_host: false,
            cfg,
        };
        t.tenant(None, None)?;
        Ok(t)
    }

    /// The configuration.
    pub fn config(&self) -> &TreeConfig {
        &self.cfg
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.cfg.page_size
    }

    /// The current value of the logical clock.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    // ----- tenants -------------------------------------------------------------------------

    /// Interns a tenant, creating its root on first use. Ids are issued in order of first use,
    /// so ranks that see the same tenants in the same order agree on them.
    pub fn tenant(
        &mut self,
        extra_key: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<TenantId> {
        let key = (extra_key.map(str::to_owned), cache_salt.map(str::to_owned));
        if let Some(&id) = self.tenant_ids.get(&key) {
            return Ok(id);
        }
        if self.tenants.len() > u16::MAX as usize {
            return Err(CoreError::InvalidPolicy {
                field: "tenant",
                value: format!("{extra_key:?}/{cache_salt:?}"),
                reason: "too many tenants (at most 65536)",
            });
        }
        let id = TenantId(self.tenants.len() as u32);
        let chain = self
            .cfg
            .hasher
            .as_ref()
            .map(|h| h.chain_start(extra_key, cache_salt));
        let root = self.new_root(id);
        self.tenants.push(Tenant {
            extra_key: key.0.clone(),
            cache_salt: key.1.clone(),
            root,
            chain,
        });
        self.tenant_ids.insert(key, id);
        Ok(id)
    }

    fn new_root(&mut self, id: TenantId) -> u32 {
        let i = self.arena.alloc();
        let n = &mut self.arena.nodes[i as usize];
        n.flags = LIVE | ROOT | DEVICE | HOST;
        n.tenant = id.0 as u16;
        // SGLang's root has priority -maxsize; host-only children inherit it.
        n.stats.priority = i32::MIN;
        i
    }

    /// The extra key and cache salt of a tenant.
    pub fn tenant_info(&self, tenant: TenantId) -> Result<(Option<&str>, Option<&str>)> {
        let t = self.tenant_ref(tenant)?;
        Ok((t.extra_key.as_deref(), t.cache_salt.as_deref()))
    }

    /// Where a tenant's page-hash chains start (`None` without a hasher).
    pub fn chain_start(&self, tenant: TenantId) -> Result<Option<ChainStart>> {
        Ok(self.tenant_ref(tenant)?.chain)
    }

    /// The root node of a tenant.
    pub fn tenant_root(&self, tenant: TenantId) -> Result<NodeId> {
        let r = self.tenant_ref(tenant)?.root;
        Ok(self.id(r))
    }

    fn tenant_ref(&self, tenant: TenantId) -> Result<&Tenant> {
        self.tenants
            .get(tenant.0 as usize)
            .ok_or(CoreError::UnknownTenant(tenant.0))
    }

    // ----- handles -------------------------------------------------------------------------

    #[inline]
    fn id(&self, i: u32) -> NodeId {
        NodeId {
            index: i,
            generation: self.arena.nodes[i as usize].generation,
        }
    }

    #[inline]
    fn get(&self, id: NodeId) -> Result<u32> {
        match self.arena.nodes.get(id.index as usize) {
            Some(n) if n.generation == id.generation && n.has(LIVE) => Ok(id.index),
            _ => Err(CoreError::StaleNode(id.to_string())),
        }
    }

    #[inline]
    fn node(&self, i: u32) -> &Node {
        &self.arena.nodes[i as usize]
    }

    #[inline]
    fn node_mut(&mut self, i: u32) -> &mut Node {
        &mut self.arena.nodes[i as usize]
    }

    fn invalid(&self, i: u32, reason: impl Into<String>) -> CoreError {
        CoreError::InvalidState {
            node: self.id(i).to_string(),
            reason: reason.into(),
        }
    }

    fn check_aligned(&self, what: &'static str, len: usize) -> Result<usize> {
        if !len.is_multiple_of(self.ps) {
            return Err(CoreError::Unaligned {
                what,
                len,
                page_size: self.cfg.page_size,
            });
        }
        Ok(len / self.ps)
    }

    fn check_len(what: &'static str, left: usize, right: usize) -> Result<()> {
        if left != right {
            return Err(CoreError::LengthMismatch { what, left, right });
        }
        Ok(())
    }

    // ----- queries -------------------------------------------------------------------------

    /// A snapshot of a node.
    pub fn node_info(&self, id: NodeId) -> Result<NodeInfo> {
        let i = self.get(id)?;
        let n = self.node(i);
        Ok(NodeInfo {
            id,
            parent: (n.parent != NIL).then(|| self.id(n.parent)),
            tenant: TenantId(u32::from(n.tenant)),
            is_root: n.is_root(),
            pages: n.pages as usize,
            on_device: n.on_device(),
            backed_up: n.backed(),
            lock_ref: n.lock_ref,
            host_ref: n.host_ref,
            hit_count: n.stats.hit_count,
            priority: n.stats.priority,
            last_access: n.stats.last_access,
            creation: n.stats.creation,
            write_pending: n.has(WRITE_PENDING),
            // The kept count (checked against the sibling list by `check`): O(1), where the
            // list walk cost O(children) — thousands under a shared system prompt.
            children: n.n_children as usize,
        })
    }

    /// The tokens of a node.
    pub fn tokens(&self, id: NodeId) -> Result<&[u32]> {
        let i = self.get(id)?;
        Ok(self.node(i).tokens(self.ps))
    }

    /// The device slots of a node (empty when evicted or a root).
    pub fn device_slots(&self, id: NodeId) -> Result<Vec<DeviceSlot>> {
        let i = self.get(id)?;
        let n = self.node(i);
        Ok(if n.on_device() {
            n.device(self.ps).collect()
        } else {
            Vec::new()
        })
    }

    /// The host slots of a node (empty when not backed up or a root).
    pub fn host_slots(&self, id: NodeId) -> Result<Vec<HostSlot>> {
        let i = self.get(id)?;
        let n = self.node(i);
        Ok(if n.backed() {
            n.host(self.ps).collect()
        } else {
            Vec::new()
        })
    }

    /// The children of a node, most recently linked first.
    pub fn children(&self, id: NodeId) -> Result<Vec<NodeId>> {
        let i = self.get(id)?;
        Ok(self
            .arena
            .children_of(i)
            .into_iter()
            .map(|c| self.id(c))
            .collect())
    }

    /// The per-page hashes of a node (empty without a hasher, and for roots).
    pub fn page_hashes(&self, id: NodeId) -> Result<&[PageHash]> {
        let i = self.get(id)?;
        Ok(&self.node(i).hashes)
    }

    /// The hash a chain continuing after this node starts from: the node's last page hash, or
    /// the tenant's chain start for a root. `None` without a hasher (or in SGLang mode at a
    /// root). Prefetches anchored at this node chain from it.
    pub fn last_page_hash(&self, id: NodeId) -> Result<Option<PageHash>> {
        let i = self.get(id)?;
        Ok(self.prior_of(i))
    }

    fn prior_of(&self, i: u32) -> Option<PageHash> {
        let n = self.node(i);
        if n.is_root() {
            self.tenants[n.tenant as usize].chain.and_then(|c| c.prior)
        } else {
            n.hashes.last().copied()
        }
    }

    /// Every page hash from the tenant root down to and including `id`.
    pub fn prefix_hashes(&self, id: NodeId) -> Result<Vec<PageHash>> {
        let i = self.get(id)?;
        let mut chain = Vec::new();
        let mut n = i;
        while !self.node(n).is_root() {
            chain.push(n);
            n = self.node(n).parent;
        }
        let mut out = Vec::new();
        for &c in chain.iter().rev() {
            out.extend_from_slice(&self.node(c).hashes);
        }
        Ok(out)
    }

    /// Counters of the tree.
    pub fn stats(&self) -> TreeStats {
        TreeStats {
            nodes: self.node_count,
            device_pages: self.device_pages,
            host_pages: self.host_pages,
            evictable_pages: self.evictable,
            protected_pages: self.protected,
            device_candidates: self.dev.len(),
            host_candidates: self.host.len(),
            pending_writes: self.writes.len(),
            pending_loads: self.loads.len(),
        }
    }

    /// Device pages that eviction may free (SGLang's `evictable_size`).
    pub fn evictable_pages(&self) -> usize {
        self.evictable
    }

    /// Device pages pinned by locks (SGLang's `protected_size`).
    pub fn protected_pages(&self) -> usize {
        self.protected
    }

    /// Pages with device slots.
    pub fn device_pages(&self) -> usize {
        self.device_pages
    }

    /// Pages with host slots.
    pub fn host_pages(&self) -> usize {
        self.host_pages
    }

    /// Bytes of tree metadata (nodes, slots, hashes, child table, candidate sets, and an
    /// estimated 16 bytes of allocator overhead per heap block), excluding the token ids, and
    /// bytes of token ids, as `(metadata, tokens)`.
    pub fn memory_bytes(&self) -> (usize, usize) {
        const MALLOC_OVERHEAD: usize = 16;
        let mut meta = self.arena.nodes.capacity() * std::mem::size_of::<Node>()
            + self.arena.free.capacity() * 4
            + self.arena.children.capacity() * (std::mem::size_of::<u32>() + 1)
            + self.dev.memory_bytes()
            + self.host.memory_bytes();
        let mut tokens = 0;
        for n in &self.arena.nodes {
            if n.has(LIVE) && !n.is_root() {
                let t = n.pages as usize * self.ps;
                tokens += t * 4;
                meta += (n.buf.len() - t) * 4 + MALLOC_OVERHEAD;
                if !n.hashes.is_empty() {
                    meta += n.hashes.len() * std::mem::size_of::<PageHash>() + MALLOC_OVERHEAD;
                }
            }
        }
        (meta, tokens)
    }

    /// Takes the collected KV events (empty unless events are enabled).
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    // ----- pins ----------------------------------------------------------------------------

    /// Pins a node's device pages and those of its ancestors (`inc_lock_ref`). Locking a
    /// tenant root does nothing. Locking an evicted node is an error.
    pub fn lock(&mut self, id: NodeId) -> Result<()> {
        let i = self.get(id)?;
        if self.node(i).is_root() {
            return Ok(());
        }
        if !self.node(i).on_device() {
            return Err(self.invalid(i, "cannot lock a node whose pages are not on device"));
        }
        self.lock_idx(i);
        Ok(())
    }

    /// Releases one lock of a node and of its ancestors (`dec_lock_ref`). Unlocking a node
    /// that is not locked is an error (and changes nothing).
    pub fn unlock(&mut self, id: NodeId) -> Result<()> {
        let i = self.get(id)?;
        if self.node(i).is_root() {
            return Ok(());
        }
        if self.node(i).lock_ref == 0 {
            return Err(self.invalid(i, "unlock of a node that is not locked"));
        }
        self.unlock_idx(i);
        Ok(())
    }

    fn lock_idx(&mut self, i: u32) {
        let mut n = i;
        while !self.node(n).is_root() {
            let node = self.node_mut(n);
            node.lock_ref += 1;
            if node.lock_ref == 1 {
                let p = node.pages as usize;
                self.evictable -= p;
                self.protected += p;
                self.refresh_device(n);
            }
            n = self.node(n).parent;
        }
    }

    fn unlock_idx(&mut self, i: u32) {
        let mut n = i;
        while !self.node(n).is_root() {
            let node = self.node_mut(n);
            node.lock_ref -= 1;
            if node.lock_ref == 0 {
                let p = node.pages as usize;
                self.evictable += p;
                self.protected -= p;
                self.refresh_device(n);
            }
            n = self.node(n).parent;
        }
    }

    /// Pins a node's host pages (`protect_host`): it will not be host-evicted or dropped.
    /// The node must be backed up (or, with transient host copies, on device: the pin then
    /// also keeps it from device eviction); protecting a tenant root does nothing.
    pub fn protect_host(&mut self, id: NodeId) -> Result<()> {
        let i = self.get(id)?;
        if self.node(i).is_root() {
            return Ok(());
        }
        let n = self.node(i);
        if !(n.backed() || self.transient_host && n.on_device()) {
            return Err(self.invalid(i, "cannot protect host pages of a node not backed up"));
        }
        self.node_mut(i).host_ref += 1;
        self.refresh(i);
        Ok(())
    }

    /// Releases one host pin (`release_host`); releasing an unpinned node is an error.
    pub fn release_host(&mut self, id: NodeId) -> Result<()> {
        let i = self.get(id)?;
        if self.node(i).is_root() {
            return Ok(());
        }
        if self.node(i).host_ref == 0 {
            return Err(self.invalid(
                i,
                "release_host of a node whose host pages are not protected",
            ));
        }
        self.node_mut(i).host_ref -= 1;
        self.refresh(i);
        Ok(())
    }

    // ----- candidate sets and tiers --------------------------------------------------------

    fn is_device_candidate(n: &Node) -> bool {
        n.flags & (LIVE | ROOT | DEVICE | SKIPPED) == (LIVE | DEVICE)
            && n.lock_ref == 0
            && n.dev_children == 0
            && !Self::pinned_device_anchor(n.flags, n.host_ref)
    }

    fn is_host_candidate(n: &Node) -> bool {
        n.flags & (LIVE | ROOT | DEVICE | HOST) == (LIVE | HOST)
            && n.first_child == NIL
            && n.host_ref == 0
    }

    #[inline]
    fn refresh_device(&mut self, i: u32) {
        let n = &self.arena.nodes[i as usize];
        let want = Self::is_device_candidate(n);
        if want != self.dev.contains(i) {
            if want {
                self.dev.insert(i, &n.stats);
            } else {
                self.dev.remove(i, &n.stats);
            }
        }
    }

    #[inline]
    fn refresh_host(&mut self, i: u32) {
        let n = &self.arena.nodes[i as usize];
        let want = Self::is_host_candidate(n);
        if want != self.host.contains(i) {
            if want {
                self.host.insert(i, &n.stats);
            } else {
                self.host.remove(i, &n.stats);
            }
        }
    }

    fn refresh(&mut self, i: u32) {
        self.refresh_device(i);
        self.refresh_host(i);
    }

    /// Stamps an access on a node and re-keys it where it is a candidate.
    #[inline]
    fn touch(&mut self, i: u32, now: u64) {
        let n = &mut self.arena.nodes[i as usize];
        n.stats.last_access = now;
        if n.on_device() {
            self.dev.touch(&mut n.stats);
            if self.dev.contains(i) {
                self.dev.update(i, &n.stats);
            }
        } else {
            self.host.touch(&mut n.stats);
            if self.host.contains(i) {
                self.host.update(i, &n.stats);
            }
        }
    }

    /// Re-keys a node after a stats change.
    fn rekey(&mut self, i: u32) {
        let n = &self.arena.nodes[i as usize];
        if self.dev.contains(i) {
            self.dev.update(i, &n.stats);
        } else if self.host.contains(i) {
            self.host.update(i, &n.stats);
        }
    }

    /// Gives a node device slots (rematerialisation, load-back).
    fn set_device(&mut self, i: u32, slots: &[DeviceSlot]) {
        let ps = self.ps;
        let fp = self.arena_fingerprint(i);
        let n = &mut self.arena.nodes[i as usize];
        debug_assert!(!n.on_device());
        let p = n.pages;
        n.set_device_slots(ps, slots);
        n.set(DEVICE, true);
        let parent = n.parent;
        // It leaves the host-only tier.
        if self.host.contains(i) {
            self.host.remove(i, &n.stats);
        }
        self.host.departed(&n.stats, p);
        self.dev.admitted(&mut n.stats, p, fp);
        let locked = n.lock_ref > 0;
        self.device_pages += p as usize;
        if locked {
            self.protected += p as usize;
        } else {
            self.evictable += p as usize;
        }
        self.node_mut(parent).dev_children += 1;
        self.refresh(i);
        self.refresh(parent);
        self.emit_stored(i, Medium::Gpu);
    }

    /// Takes a node's device slots away (demotion to host-only, or before deletion).
    fn clear_device(&mut self, i: u32) -> Vec<DeviceSlot> {
        let mut slots = Vec::new();
        self.clear_device_into(i, &mut slots);
        slots
    }

    /// [`HiRadixTree::clear_device`], appending the slots to `slots` (an eviction gathers
    /// every node's slots in one vector).
    fn clear_device_into(&mut self, i: u32, slots: &mut Vec<DeviceSlot>) {
        let ps = self.ps;
        self.emit_removed(i, Medium::Gpu);
        let fp = self.arena_fingerprint(i);
        let n = &mut self.arena.nodes[i as usize];
        debug_assert!(n.on_device() && n.lock_ref == 0);
        slots.extend(n.device(ps));
        let p = n.pages;
        n.set(DEVICE, false);
        let parent = n.parent;
        if self.dev.contains(i) {
            self.dev.remove(i, &n.stats);
        }
        self.dev.departed(&n.stats, p);
        if n.backed() {
            self.host.admitted(&mut n.stats, p, fp);
        }
        self.device_pages -= p as usize;
        self.evictable -= p as usize;
        self.node_mut(parent).dev_children -= 1;
        self.refresh(i);
        self.refresh(parent);
    }

    fn arena_fingerprint(&self, i: u32) -> u64 {
        use crate::eviction::StatsTable;
        self.arena.fingerprint(i)
    }

    /// Deletes a childless, unpinned node. Its slots must have been taken by the caller.
    fn remove_node(&mut self, i: u32) {
        let n = &self.arena.nodes[i as usize];
        debug_assert!(n.first_child == NIL && n.lock_ref == 0 && !n.is_root());
        let p = n.pages as usize;
        let parent = n.parent;
        if self.dev.contains(i) {
            self.dev.remove(i, &n.stats);
        }
        if self.host.contains(i) {
            self.host.remove(i, &n.stats);
        }
        if n.on_device() {
            self.dev.departed(&n.stats, n.pages);
            self.device_pages -= p;
            self.evictable -= p;
            self.node_mut(parent).dev_children -= 1;
        } else {
            self.host.departed(&n.stats, n.pages);
        }
        if self.node(i).backed() {
            self.host_pages -= p;
        }
        self.arena.table_remove(i);
        self.arena.unlink(i);
        self.arena.release(i);
        self.node_count -= 1;
        self.refresh(parent);
    }

    // ----- events --------------------------------------------------------------------------

    fn emit_stored(&mut self, i: u32, medium: Medium) {
        if !self.cfg.events {
            return;
        }
        let e = self.stored_event_at(i, medium);
        self.events.push(e);
    }

    fn stored_event_at(&self, i: u32, medium: Medium) -> KvEvent {
        let n = self.node(i);
        let parent_block_hash = if self.node(n.parent).is_root() {
            None
        } else {
            self.node(n.parent).hashes.last().copied()
        };
        KvEvent::BlockStored {
            tenant: TenantId(u32::from(n.tenant)),
            block_hashes: n.hashes.to_vec(),
            parent_block_hash,
            token_ids: n.tokens(self.ps).to_vec(),
            block_size: self.cfg.page_size,
            medium,
        }
    }

    /// A `BlockStored` event for the pages `id` holds now, in `medium`: for tiers the tree does
    /// not track itself (L3, whose copies the controller makes). `None` when events are off or
    /// `id` is the root.
    pub fn stored_event(&self, id: NodeId, medium: Medium) -> Result<Option<KvEvent>> {
        let i = self.get(id)?;
        if !self.cfg.events || self.node(i).is_root() {
            return Ok(None);
        }
        Ok(Some(self.stored_event_at(i, medium)))
    }

    fn emit_removed(&mut self, i: u32, medium: Medium) {
        if !self.cfg.events {
            return;
        }
        let n = self.node(i);
        let e = KvEvent::BlockRemoved {
            tenant: TenantId(u32::from(n.tenant)),
            block_hashes: n.hashes.to_vec(),
            medium,
        };
        self.events.push(e);
    }

    // ----- reset ---------------------------------------------------------------------------

    /// Drops every node of every tenant (tenants stay interned, their roots get new ids) and
    /// forgets every pending write and load. Returns every device and host slot the tree held,
    /// for callers that free slots one by one (most clear their pools wholesale instead).
    pub fn reset(&mut self) -> (Vec<DeviceSlot>, Vec<HostSlot>) {
        let mut dev = Vec::new();
        let mut host = Vec::new();
        let ps = self.ps;
        for i in 0..self.arena.nodes.len() as u32 {
            let n = &self.arena.nodes[i as usize];
            if !n.has(LIVE) {
                continue;
            }
            if !n.is_root() {
                if n.on_device() {
                    dev.extend(n.device(ps));
                }
                if n.backed() {
                    host.extend(n.host(ps));
                }
            }
        }
        let len = self.arena.nodes.len();
        let mut arena = Arena::new(ps);
        arena.nodes = std::mem::take(&mut self.arena.nodes);
        for n in arena.nodes.iter_mut() {
            let generation = if n.has(LIVE) {
                n.generation.wrapping_add(1)
            } else {
                n.generation
            };
            *n = Node::vacant(generation);
        }
        arena.free = (0..len as u32).rev().collect();
        self.arena = arena;
        self.dev.clear();
        self.host.clear();
        self.writes.clear();
        self.loads.clear();
        self.node_count = 0;
        self.device_pages = 0;
        self.host_pages = 0;
        self.evictable = 0;
        self.protected = 0;
        for t in 0..self.tenants.len() {
            let root = self.new_root(TenantId(t as u32));
            self.tenants[t].root = root;
        }
        if self.cfg.events {
            self.events.push(KvEvent::AllBlocksCleared);
        }
        (dev, host)
    }

    fn next_transfer_id(&mut self) -> u64 {
        self.next_transfer += 1;
        self.next_transfer
    }
}
