//! Node storage: a generational arena of compact nodes and the child table.
//!
//! A node's per-page data lives in one allocation, `buf = [tokens | device slots | host slots]`
//! (`pages·P + 2·pages` words), so a node costs one allocation besides its optional page
//! hashes. The slot halves are meaningful only while the matching flag is set. Children are
//! found through one tree-wide hash table keyed by `(parent, first page)`: the table stores
//! only the child's arena index and verifies the full first page on every probe, so a hash
//! collision can never return a wrong child. Siblings are also linked intrusively
//! (`first_child`, `next`, `prev`) for walks that enumerate children.

use hashbrown::HashTable;

use crate::eviction::{NodeStats, StatsTable};
use crate::key::PageHash;
use crate::slot::{DeviceSlot, HostSlot};

/// Tokens of a first page that enter its child-table hash.
pub(crate) const HASHED_TOKENS: usize = 16;

/// Parents with at most this many children are searched by scanning their sibling list.
const SCAN_CHILDREN: u32 = 2;

/// "No node" in the intrusive links.
pub(crate) const NIL: u32 = u32::MAX;

pub(crate) const LIVE: u8 = 1;
pub(crate) const ROOT: u8 = 1 << 1;
pub(crate) const DEVICE: u8 = 1 << 2;
pub(crate) const HOST: u8 = 1 << 3;
pub(crate) const WRITE_PENDING: u8 = 1 << 4;
/// Set on a device leaf that one `evict` call could not free, so that it is not popped again
/// in the same call; cleared before the call returns.
pub(crate) const SKIPPED: u8 = 1 << 5;

/// One node of the radix tree: two cache lines. The first holds everything a lookup reads
/// on its way down (buffer, first token, links, counts, flags); the second the page hashes
/// and the eviction stats.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct Node {
    pub buf: Box<[u32]>,
    /// `buf[0]` (the first token), kept in the node so that a sibling scan touches only nodes.
    pub first_token: u32,
    pub pages: u32,
    pub n_children: u32,
    pub first_child: u32,
    pub next: u32,
    pub parent: u32,
    pub generation: u32,
    pub lock_ref: u32,
    pub dev_children: u32,
    pub host_ref: u32,
    pub prev: u32,
    pub tenant: u16,
    pub flags: u8,
    pub hashes: Box<[PageHash]>,
    pub stats: NodeStats,
}

impl Node {
    pub fn vacant(generation: u32) -> Self {
        Self {
            buf: Box::default(),
            hashes: Box::default(),
            stats: NodeStats::default(),
            parent: NIL,
            first_child: NIL,
            next: NIL,
            prev: NIL,
            pages: 0,
            generation,
            lock_ref: 0,
            host_ref: 0,
            dev_children: 0,
            n_children: 0,
            first_token: 0,
            tenant: 0,
            flags: 0,
        }
    }

    /// Installs a new `[tokens | device | host]` buffer.
    pub fn set_buf(&mut self, buf: Box<[u32]>) {
        self.first_token = buf.first().copied().unwrap_or(0);
        self.buf = buf;
    }

    #[inline]
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
    #[inline]
    pub fn set(&mut self, flag: u8, on: bool) {
        if on {
            self.flags |= flag;
        } else {
            self.flags &= !flag;
        }
    }
    #[inline]
    pub fn is_root(&self) -> bool {
        self.has(ROOT)
    }
    #[inline]
    pub fn on_device(&self) -> bool {
        self.has(DEVICE)
    }
    #[inline]
    pub fn backed(&self) -> bool {
        self.has(HOST)
    }
    #[inline]
    pub fn tokens(&self, ps: usize) -> &[u32] {
        &self.buf[..self.pages as usize * ps]
    }
    /// The device-slot half of `buf` (raw page indices).
    #[inline]
    pub fn device_raw(&self, ps: usize) -> &[u32] {
        let t = self.pages as usize * ps;
        &self.buf[t..t + self.pages as usize]
    }
    /// The host-slot half of `buf` (raw page indices).
    #[inline]
    pub fn host_raw(&self, ps: usize) -> &[u32] {
        let t = self.pages as usize * ps + self.pages as usize;
        &self.buf[t..t + self.pages as usize]
    }
    /// The node's device slots (meaningful while `DEVICE` is set).
    #[inline]
    pub fn device(&self, ps: usize) -> impl ExactSizeIterator<Item = DeviceSlot> + '_ {
        self.device_raw(ps).iter().map(|&s| DeviceSlot(s))
    }
    /// The node's host slots (meaningful while `HOST` is set).
    #[inline]
    pub fn host(&self, ps: usize) -> impl ExactSizeIterator<Item = HostSlot> + '_ {
        self.host_raw(ps).iter().map(|&s| HostSlot(s))
    }
    /// Stores the node's device slots (one per page).
    #[inline]
    pub fn set_device_slots(&mut self, ps: usize, slots: &[DeviceSlot]) {
        let t = self.pages as usize * ps;
        let p = self.pages as usize;
        for (d, s) in self.buf[t..t + p].iter_mut().zip(slots) {
            *d = s.0;
        }
    }
    /// Stores the node's host slots (one per page).
    #[inline]
    pub fn set_host_slots(&mut self, ps: usize, slots: &[HostSlot]) {
        let p = self.pages as usize;
        let t = p * ps + p;
        for (d, s) in self.buf[t..t + p].iter_mut().zip(slots) {
            *d = s.0;
        }
    }
}

/// Builds `[tokens | device | host]` for a node of `tokens.len() / ps` pages.
pub(crate) fn make_buf(
    tokens: &[u32],
    device: Option<&[DeviceSlot]>,
    host: Option<&[HostSlot]>,
) -> Box<[u32]> {
    let pages = device.map(<[_]>::len).or(host.map(<[_]>::len));
    let pages = pages.unwrap_or(0);
    let mut v = Vec::with_capacity(tokens.len() + 2 * pages);
    v.extend_from_slice(tokens);
    match device {
        Some(d) => v.extend(d.iter().map(|s| s.0)),
        None => v.resize(v.len() + pages, 0),
    }
    match host {
        Some(h) => v.extend(h.iter().map(|s| s.0)),
        None => v.resize(v.len() + pages, 0),
    }
    v.into_boxed_slice()
}

/// Builds a node's `buf` from raw halves of equal length (a split of an existing node).
pub(crate) fn make_buf_raw(tokens: &[u32], device: &[u32], host: &[u32]) -> Box<[u32]> {
    debug_assert_eq!(device.len(), host.len());
    let mut v = Vec::with_capacity(tokens.len() + device.len() + host.len());
    v.extend_from_slice(tokens);
    v.extend_from_slice(device);
    v.extend_from_slice(host);
    v.into_boxed_slice()
}

/// Hash of a child's table key: its parent's index and its first page (at most its first
/// [`HASHED_TOKENS`] tokens: siblings almost always differ early, and the table verifies the
/// whole page anyway, so a longer hash would only cost time). Four independent multiply-xor
/// lanes over 64-bit words keep the dependency chain short.
#[inline]
pub(crate) fn child_hash(parent: u32, page: &[u32]) -> u64 {
    let page = &page[..page.len().min(HASHED_TOKENS)];
    const K: [u64; 4] = [
        0x9E37_79B9_7F4A_7C15,
        0xC2B2_AE3D_27D4_EB4F,
        0x1656_67B1_9E37_79F9,
        0x27D4_EB2F_1656_67C5,
    ];
    #[inline(always)]
    fn mix(a: u64, b: u64) -> u64 {
        let m = u128::from(a) * u128::from(b);
        (m as u64) ^ ((m >> 64) as u64)
    }
    let mut lanes = [
        K[0] ^ u64::from(parent),
        K[1],
        K[2],
        K[3] ^ page.len() as u64,
    ];
    let mut chunks = page.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..4 {
            let w = u64::from(c[2 * l]) | (u64::from(c[2 * l + 1]) << 32);
            lanes[l] = mix(lanes[l] ^ w, K[l] | 1);
        }
    }
    for (i, &t) in chunks.remainder().iter().enumerate() {
        lanes[i & 3] = mix(lanes[i & 3] ^ u64::from(t), K[i & 3] | 1);
    }
    mix(
        lanes[0] ^ lanes[2].rotate_left(29),
        lanes[1] ^ lanes[3].rotate_left(17) ^ K[0],
    )
}

/// The node arena plus the child table.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    pub nodes: Vec<Node>,
    pub free: Vec<u32>,
    pub children: HashTable<u32>,
    pub ps: usize,
}

impl Arena {
    pub fn new(ps: usize) -> Self {
        Self {
            ps,
            ..Self::default()
        }
    }

    /// A vacant slot (its generation preserved).
    pub fn alloc(&mut self) -> u32 {
        match self.free.pop() {
            Some(i) => i,
            None => {
                self.nodes.push(Node::vacant(0));
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Returns a slot to the free list; its generation moves on so old ids go stale.
    pub fn release(&mut self, i: u32) {
        let generation = self.nodes[i as usize].generation.wrapping_add(1);
        self.nodes[i as usize] = Node::vacant(generation);
        self.free.push(i);
    }

    #[inline]
    pub fn first_page(&self, i: u32) -> &[u32] {
        &self.nodes[i as usize].buf[..self.ps]
    }

    /// The child of `parent` whose first page is `page`. A parent with few children is
    /// scanned through its sibling list (no hashing, no table probe: the common chain case);
    /// others go through the child table.
    #[inline]
    pub fn find_child(&self, parent: u32, page: &[u32]) -> Option<u32> {
        let p = &self.nodes[parent as usize];
        if p.n_children <= SCAN_CHILDREN {
            let mut c = p.first_child;
            while c != NIL {
                let n = &self.nodes[c as usize];
                if n.first_token == page[0] && n.buf[..self.ps] == *page {
                    return Some(c);
                }
                c = n.next;
            }
            return None;
        }
        let h = child_hash(parent, page);
        let nodes = &self.nodes;
        let ps = self.ps;
        self.children
            .find(h, |&c| {
                let n = &nodes[c as usize];
                n.parent == parent && n.first_token == page[0] && &n.buf[..ps] == page
            })
            .copied()
    }

    fn rehash(nodes: &[Node], ps: usize) -> impl Fn(&u32) -> u64 + '_ {
        move |&c| {
            let n = &nodes[c as usize];
            child_hash(n.parent, &n.buf[..ps])
        }
    }

    /// Adds `child` (whose `parent` and tokens are set) to the child table.
    pub fn table_insert(&mut self, child: u32) {
        let n = &self.nodes[child as usize];
        let h = child_hash(n.parent, &n.buf[..self.ps]);
        self.children
            .insert_unique(h, child, Self::rehash(&self.nodes, self.ps));
    }

    /// Removes `child` from the child table (its `parent` and tokens must be unchanged since
    /// it was inserted).
    pub fn table_remove(&mut self, child: u32) {
        let n = &self.nodes[child as usize];
        let h = child_hash(n.parent, &n.buf[..self.ps]);
        if let Ok(e) = self.children.find_entry(h, |&c| c == child) {
            e.remove();
        }
    }

    /// Points the table entry of `old` at `new` (same parent and first page).
    pub fn table_replace(&mut self, old: u32, new: u32) {
        let n = &self.nodes[old as usize];
        let h = child_hash(n.parent, &n.buf[..self.ps]);
        if let Some(slot) = self.children.find_mut(h, |&c| c == old) {
            *slot = new;
        }
    }

    /// Links `child` as the first child of `parent`.
    pub fn link(&mut self, parent: u32, child: u32) {
        let head = self.nodes[parent as usize].first_child;
        {
            let c = &mut self.nodes[child as usize];
            c.parent = parent;
            c.prev = NIL;
            c.next = head;
        }
        if head != NIL {
            self.nodes[head as usize].prev = child;
        }
        let p = &mut self.nodes[parent as usize];
        p.first_child = child;
        p.n_children += 1;
    }

    /// Unlinks `child` from its parent's sibling list (parent pointer kept).
    pub fn unlink(&mut self, child: u32) {
        let (parent, prev, next) = {
            let c = &self.nodes[child as usize];
            (c.parent, c.prev, c.next)
        };
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else if parent != NIL {
            self.nodes[parent as usize].first_child = next;
        }
        if parent != NIL {
            self.nodes[parent as usize].n_children -= 1;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        }
        let c = &mut self.nodes[child as usize];
        c.prev = NIL;
        c.next = NIL;
    }

    /// Puts `new` in `old`'s place in the sibling list of their parent.
    pub fn replace_in_siblings(&mut self, old: u32, new: u32) {
        let (parent, prev, next) = {
            let o = &self.nodes[old as usize];
            (o.parent, o.prev, o.next)
        };
        {
            let n = &mut self.nodes[new as usize];
            n.parent = parent;
            n.prev = prev;
            n.next = next;
        }
        if prev != NIL {
            self.nodes[prev as usize].next = new;
        } else {
            self.nodes[parent as usize].first_child = new;
        }
        if next != NIL {
            self.nodes[next as usize].prev = new;
        }
        let o = &mut self.nodes[old as usize];
        o.prev = NIL;
        o.next = NIL;
    }

    /// The children of `i`, in link order.
    pub fn children_of(&self, i: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut c = self.nodes[i as usize].first_child;
        while c != NIL {
            out.push(c);
            c = self.nodes[c as usize].next;
        }
        out
    }

    /// Number of pages in which `tokens` (page-aligned) agrees with node `i` from its start,
    /// given that the first page is already known to agree (it was verified by
    /// [`Arena::find_child`]).
    #[inline]
    pub fn common_pages(&self, i: u32, tokens: &[u32]) -> usize {
        let ps = self.ps;
        let own = self.nodes[i as usize].tokens(ps);
        let n = own.len().min(tokens.len());
        debug_assert!(n >= ps && own[..ps] == tokens[..ps]);
        if own[ps..n] == tokens[ps..n] {
            return n / ps;
        }
        1 + own[ps..n]
            .chunks_exact(ps)
            .zip(tokens[ps..n].chunks_exact(ps))
            .position(|(a, b)| a != b)
            .unwrap_or(n / ps - 1)
    }
}

impl StatsTable for Arena {
    fn stats(&self, node: u32) -> &NodeStats {
        &self.nodes[node as usize].stats
    }
    fn stats_mut(&mut self, node: u32) -> &mut NodeStats {
        &mut self.nodes[node as usize].stats
    }
    fn pages(&self, node: u32) -> u32 {
        self.nodes[node as usize].pages
    }
    fn fingerprint(&self, node: u32) -> u64 {
        let n = &self.nodes[node as usize];
        child_hash(n.parent, &n.buf[..self.ps])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_hash_depends_on_parent_and_every_token() {
        let page: Vec<u32> = (0..64).collect();
        let h = child_hash(3, &page);
        assert_ne!(h, child_hash(4, &page));
        for i in 0..HASHED_TOKENS {
            let mut p = page.clone();
            p[i] ^= 1;
            assert_ne!(h, child_hash(3, &p), "token {i}");
        }
        assert_ne!(child_hash(0, &[1]), child_hash(0, &[2]));
        assert_ne!(child_hash(0, &[1, 2, 3]), child_hash(0, &[1, 2, 4]));
    }

    #[test]
    fn nodes_are_two_cache_lines() {
        assert_eq!(std::mem::size_of::<Node>(), 128);
        assert_eq!(std::mem::align_of::<Node>(), 64);
    }

    #[test]
    fn buf_layout_and_slices() {
        let mut n = Node::vacant(0);
        n.pages = 2;
        n.buf = make_buf(&[1, 2, 3, 4], Some(&[DeviceSlot(10), DeviceSlot(11)]), None);
        assert_eq!(n.tokens(2), &[1, 2, 3, 4]);
        assert_eq!(n.device_raw(2), &[10, 11]);
        assert_eq!(n.host_raw(2), &[0, 0]);
        n.set_host_slots(2, &[HostSlot(7), HostSlot(8)]);
        assert_eq!(n.host(2).collect::<Vec<_>>(), [HostSlot(7), HostSlot(8)]);
        assert_eq!(&n.buf[..], &[1, 2, 3, 4, 10, 11, 7, 8]);
    }
}
