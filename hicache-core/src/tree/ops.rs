//! Lookups and inserts: `match_prefix`, `insert`, `split`, with the semantics of SGLang's
//! `HiRadixCache` methods of the same names.

use crate::error::Result;
use crate::key::PageHash;

use super::node::{DEVICE, LIVE, NIL, make_buf, make_buf_raw};
use super::{DeviceSlot, HiRadixTree, HostSlot, NodeId, TenantId};

/// What [`HiRadixTree::match_prefix`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatchResult {
    /// Device slots of the matched prefix that is on device, one per page.
    pub device_slots: Vec<DeviceSlot>,
    /// The deepest matched node (SGLang's `best_match_node` before the host walk).
    pub last_node: NodeId,
    /// The deepest matched node on device (the tenant root if none).
    pub last_device_node: NodeId,
    /// The deepest matched node that is backed up (the tenant root if none).
    pub last_host_node: NodeId,
    /// Pages matched below `last_device_node` that are only on host (load-back candidates).
    pub host_hit_pages: usize,
}

impl MatchResult {
    /// Pages matched on device.
    pub fn device_pages(&self) -> usize {
        self.device_slots.len()
    }
}

/// Options of [`HiRadixTree::insert`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct InsertOptions {
    /// An intermediate insert of a chunked prefill: hit counts are not bumped.
    pub chunked: bool,
    /// Request priority; nodes keep the maximum over the requests that walked them.
    pub priority: i32,
}

/// Page hashes a caller computed earlier for part of an insert's key (the controller's L3
/// lookup at a request's arrival hashes the pages it looks up): given to
/// [`HiRadixTree::insert_with_hashes`], a new leaf takes its pages' hashes from here instead
/// of hashing them again, where the tree can check that they are the ones it would compute.
///
/// The caller guarantees that `hashes` is the chain the tree's own hasher computes from
/// `prior` over `tokens`: `hashes[i]` = chain step of (`hashes[i-1]`, or `prior` for `i = 0`)
/// and the tokens of page `i`. The tree checks the rest: a leaf starting at key page `p` uses
/// `hashes[p - first_page..]` only when the hash its chain continues from (its parent's last
/// page hash, or the tenant's chain start under the root) equals the known chain's hash
/// before page `p`, and only for the leading pages whose tokens equal `tokens`' pages; it
/// hashes every other page. Equal prior and equal tokens give equal digests, so the leaf's
/// hashes are byte-identical to those [`HiRadixTree::insert`] computes.
#[derive(Clone, Copy, Debug)]
pub struct KnownHashes<'a> {
    /// Index, in pages from the start of the insert's key, of the first page hashed.
    pub first_page: usize,
    /// The hash the chain continued from: the page before `first_page`'s hash, or the
    /// tenant's chain start prior (`None` in SGLang mode under the root).
    pub prior: Option<PageHash>,
    /// The tokens hashed, from page `first_page` on (at least `hashes.len()` whole pages).
    pub tokens: &'a [u32],
    /// One hash per page, from page `first_page` on.
    pub hashes: &'a [PageHash],
}

/// What [`HiRadixTree::insert`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InsertResult {
    /// Pages of the key that were already on device. The caller's slots for these pages are
    /// duplicates: it frees those it does not already share with the tree (`[protected,
    /// prefix_pages)` in SGLang's terms). Its slots for every later page now belong to the
    /// tree (new leaf or rematerialised nodes).
    pub prefix_pages: usize,
    /// The node holding the key's last page (the tenant root for an empty key).
    pub last_node: NodeId,
    /// Nodes whose hit count reached the write-through threshold and that are not backed up,
    /// root-first: the controller should back them up ([`HiRadixTree::begin_backup`]).
    pub write_through: Vec<NodeId>,
}

impl HiRadixTree {
    /// Finds the longest cached prefix of `tokens` for `tenant` (SGLang's `match_prefix`).
    ///
    /// `tokens` must be whole pages. A match that ends inside a node splits it there, so
    /// the result always ends on a node boundary. Every node walked is stamped with a new
    /// logical time. The tree is unchanged when an error is returned.
    pub fn match_prefix(&mut self, tenant: TenantId, tokens: &[u32]) -> Result<MatchResult> {
        let root = self.tenant_ref(tenant)?.root;
        self.check_aligned("match key", tokens.len())?;
        self.clock += 1;
        let now = self.clock;
        let ps = self.ps;
        let mut slots = Vec::with_capacity(tokens.len() / ps);
        let mut node = root;
        let mut rest = tokens;
        while !rest.is_empty() {
            let Some(c) = self.arena.find_child(node, &rest[..ps]) else {
                break;
            };
            self.touch(c, now);
            let common = self.arena.common_pages(c, rest);
            if common < self.node(c).pages as usize {
                let nn = self.split_idx(c, common as u32, now);
                let n = self.node(nn);
                if n.on_device() {
                    slots.extend(n.device(ps));
                }
                node = nn;
                break;
            }
            let n = self.node(c);
            if n.on_device() {
                slots.extend(n.device(ps));
            }
            node = c;
            rest = &rest[common * ps..];
        }
        let last_node = node;
        let mut host_hit_pages = 0;
        let mut dev = node;
        while !self.node(dev).on_device() {
            host_hit_pages += self.node(dev).pages as usize;
            dev = self.node(dev).parent;
        }
        let mut host = node;
        // Transient host copies: every node on the path is cached somewhere; L3 continues
        // after the last one.
        while !self.node(host).backed() && !self.transient_host {
            host = self.node(host).parent;
        }
        Ok(MatchResult {
            device_slots: slots,
            last_node: self.id(last_node),
            last_device_node: self.id(dev),
            last_host_node: self.id(host),
            host_hit_pages,
        })
    }

    /// Inserts `tokens` with the request's `device_slots` (one per page) for `tenant`
    /// (SGLang's `insert`).
    ///
    /// Nodes already on device count towards [`InsertResult::prefix_pages`] and get a hit
    /// (unless `chunked` or write-back); evicted nodes on the path are *rematerialised* with the
    /// request's slots; the remainder becomes a new leaf. The tree is unchanged when an error
    /// is returned.
    pub fn insert(
        &mut self,
        tenant: TenantId,
        tokens: &[u32],
        device_slots: &[DeviceSlot],
        opts: InsertOptions,
    ) -> Result<InsertResult> {
        self.insert_with_hashes(tenant, tokens, device_slots, opts, None)
    }

    /// [`HiRadixTree::insert`], taking the new leaf's page hashes from `known` where they
    /// provably continue the tree's chain (see [`KnownHashes`]) instead of hashing those
    /// pages again. The result, and the tree, are the same as with `insert`.
    pub fn insert_with_hashes(
        &mut self,
        tenant: TenantId,
        tokens: &[u32],
        device_slots: &[DeviceSlot],
        opts: InsertOptions,
        known: Option<KnownHashes<'_>>,
    ) -> Result<InsertResult> {
        let root = self.tenant_ref(tenant)?.root;
        let pages = self.check_aligned("insert key", tokens.len())?;
        Self::check_len(
            "insert: device slots vs key pages",
            device_slots.len(),
            pages,
        )?;
        self.clock += 1;
        let now = self.clock;
        let ps = self.ps;
        let mut node = root;
        let mut rest = tokens;
        let mut rest_slots = device_slots;
        let mut prefix = 0;
        let mut due = Vec::new();
        while !rest.is_empty() {
            let Some(c) = self.arena.find_child(node, &rest[..ps]) else {
                break;
            };
            self.touch(c, now);
            self.raise_priority(c, opts.priority);
            let common = self.arena.common_pages(c, rest);
            let target = if common < self.node(c).pages as usize {
                let nn = self.split_idx(c, common as u32, now);
                self.raise_priority(nn, opts.priority);
                nn
            } else {
                c
            };
            if self.node(target).on_device() {
                self.inc_hit(target, opts.chunked, &mut due);
                prefix += common;
            } else {
                self.set_device(target, &rest_slots[..common]);
            }
            node = target;
            rest = &rest[common * ps..];
            rest_slots = &rest_slots[common..];
        }
        if !rest.is_empty() {
            let first_page = (tokens.len() - rest.len()) / ps;
            let hashes = known.and_then(|k| self.known_leaf_hashes(node, first_page, rest, &k));
            let leaf = self.new_leaf(
                node,
                rest,
                Some(rest_slots),
                None,
                hashes.map(Vec::into_boxed_slice),
                now,
                opts.priority,
            );
            if self.cfg.write_policy.write_through_threshold().is_some() {
                self.inc_hit(leaf, opts.chunked, &mut due);
            }
            node = leaf;
        }
        Ok(super::InsertResult {
            prefix_pages: prefix,
            last_node: self.id(node),
            write_through: due,
        })
    }

    /// The hashes of a new leaf under `parent` holding `tokens` (whole pages), key pages from
    /// `first_page` on: `known`'s for the leading pages it provably covers (see
    /// [`KnownHashes`]), the rest hashed here. `None` (the leaf hashes every page) without a
    /// hasher or when `known` covers none of its pages.
    fn known_leaf_hashes(
        &self,
        parent: u32,
        first_page: usize,
        tokens: &[u32],
        known: &KnownHashes<'_>,
    ) -> Option<Vec<PageHash>> {
        let hasher = self.cfg.hasher.as_ref()?;
        let ps = self.ps;
        let off = first_page.checked_sub(known.first_page)?;
        let covered = known.hashes.len().min(known.tokens.len() / ps);
        if off >= covered {
            return None;
        }
        let before = match off {
            0 => known.prior,
            _ => Some(known.hashes[off - 1]),
        };
        if before != self.prior_of(parent) {
            return None;
        }
        let pages = tokens.len() / ps;
        let same = tokens
            .chunks_exact(ps)
            .zip(known.tokens[off * ps..covered * ps].chunks_exact(ps))
            .take_while(|(a, b)| a == b)
            .count();
        if same == 0 {
            return None;
        }
        let mut out = Vec::with_capacity(pages);
        out.extend_from_slice(&known.hashes[off..off + same]);
        let prior = out.last().copied();
        hasher.hash_pages_into(prior, &tokens[same * ps..], &mut out);
        Some(out)
    }

    fn raise_priority(&mut self, i: u32, priority: i32) {
        let n = self.node_mut(i);
        if priority > n.stats.priority {
            n.stats.priority = priority;
            self.rekey(i);
        }
    }

    /// `_inc_hit_count`: counts a hit and reports the node when it becomes due for
    /// write-through.
    fn inc_hit(&mut self, i: u32, chunked: bool, due: &mut Vec<NodeId>) {
        let Some(threshold) = self.cfg.write_policy.write_through_threshold() else {
            return;
        };
        if chunked {
            return;
        }
        let n = self.node_mut(i);
        n.stats.hit_count = n.stats.hit_count.saturating_add(1);
        let is_due = !n.backed() && n.stats.hit_count >= threshold;
        self.rekey(i);
        if is_due {
            due.push(self.id(i));
        }
    }

    /// Creates a leaf under `parent`. With `device` it is a device node; otherwise a host-only
    /// node with `host` slots. Hashes are taken from `hashes` or computed when hashing is on.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new_leaf(
        &mut self,
        parent: u32,
        tokens: &[u32],
        device: Option<&[DeviceSlot]>,
        host: Option<&[HostSlot]>,
        hashes: Option<Box<[PageHash]>>,
        now: u64,
        priority: i32,
    ) -> u32 {
        let pages = (tokens.len() / self.ps) as u32;
        let hashes: Box<[PageHash]> = match (&self.cfg.hasher, hashes) {
            (None, _) => Box::default(),
            (Some(_), Some(h)) => h,
            (Some(h), None) => h.hash_pages(self.prior_of(parent), tokens).into(),
        };
        let i = self.arena.alloc();
        let tenant = self.node(parent).tenant;
        {
            let n = self.node_mut(i);
            n.set_buf(make_buf(tokens, device, host));
            n.hashes = hashes;
            n.pages = pages;
            n.tenant = tenant;
            n.flags = LIVE;
            n.stats.last_access = now;
            n.stats.creation = now;
            n.stats.priority = priority;
        }
        self.arena.link(parent, i);
        self.arena.table_insert(i);
        self.node_count += 1;
        let fp = self.arena_fingerprint(i);
        let p = pages as usize;
        if device.is_some() {
            let n = &mut self.arena.nodes[i as usize];
            n.set(DEVICE, true);
            self.dev.admitted(&mut n.stats, pages, fp);
            self.device_pages += p;
            self.evictable += p;
            self.node_mut(parent).dev_children += 1;
        } else {
            let n = &mut self.arena.nodes[i as usize];
            n.set(super::HOST, true);
            self.host.admitted(&mut n.stats, pages, fp);
        }
        if host.is_some() {
            self.node_mut(i).set(super::HOST, true);
            self.host_pages += p;
        }
        self.refresh(i);
        self.refresh(parent);
        self.emit_stored(
            i,
            if device.is_some() {
                crate::event::Medium::Gpu
            } else {
                crate::event::Medium::CpuPinned
            },
        );
        i
    }

    /// Splits a node after its first `at_pages` pages (SGLang's `_split_node`): a new node
    /// takes the first part and becomes the parent of the rest, which keeps the id. Returns
    /// the new upper node. Splitting at 0 or at the node's length is an error.
    pub fn split(&mut self, id: NodeId, at_pages: usize) -> Result<NodeId> {
        let i = self.get(id)?;
        let n = self.node(i);
        if n.is_root() || at_pages == 0 || at_pages >= n.pages as usize {
            return Err(self.invalid(
                i,
                format!(
                    "cannot split a node of {} pages at page {at_pages}",
                    n.pages
                ),
            ));
        }
        let now = self.clock;
        let nn = self.split_idx(i, at_pages as u32, now);
        Ok(self.id(nn))
    }

    /// New node `nn` = first `k` pages of `c`; `c` keeps the rest and becomes `nn`'s only
    /// child. Locks, hit count, priority and residency are copied; host pins are not (`nn`
    /// has a backed-up child, so it is never a host candidate). Pending writes stay correct:
    /// a finishing write walks up from its node over as many pages as it wrote.
    pub(super) fn split_idx(&mut self, c: u32, k: u32, now: u64) -> u32 {
        let ps = self.ps;
        let kk = k as usize;
        let nn = self.arena.alloc();
        let (upper, lower, hu, hl, on_dev) = {
            let n = self.node(c);
            let t = n.tokens(ps);
            let d = n.device_raw(ps);
            let h = n.host_raw(ps);
            let upper = make_buf_raw(&t[..kk * ps], &d[..kk], &h[..kk]);
            let lower = make_buf_raw(&t[kk * ps..], &d[kk..], &h[kk..]);
            let (hu, hl): (Box<[_]>, Box<[_]>) = if n.hashes.is_empty() {
                (Box::default(), Box::default())
            } else {
                (n.hashes[..kk].into(), n.hashes[kk..].into())
            };
            (upper, lower, hu, hl, n.on_device())
        };
        // The table entry of `c` (parent, first page) now belongs to `nn`.
        self.arena.table_replace(c, nn);
        let (stats, lock_ref, tenant, flags) = {
            let n = self.node(c);
            (n.stats, n.lock_ref, n.tenant, n.flags)
        };
        {
            let m = self.node_mut(nn);
            m.set_buf(upper);
            m.hashes = hu;
            m.pages = k;
            m.stats = stats;
            m.stats.last_access = now;
            m.stats.creation = now;
            m.lock_ref = lock_ref;
            m.host_ref = 0;
            m.tenant = tenant;
            m.flags = flags & (LIVE | DEVICE | super::HOST | super::WRITE_PENDING);
            m.dev_children = u32::from(on_dev);
            m.first_child = NIL;
            m.n_children = 0;
        }
        self.arena.replace_in_siblings(c, nn);
        {
            let n = self.node_mut(c);
            n.set_buf(lower);
            n.hashes = hl;
            n.pages -= k;
        }
        self.arena.link(nn, c);
        self.arena.table_insert(c);
        self.node_count += 1;
        // `c` keeps its candidate status and key; `nn` is never a candidate (it has a child
        // that is on device, or a child that is backed up).
        self.refresh(nn);
        self.refresh(c);
        nn
    }
}
