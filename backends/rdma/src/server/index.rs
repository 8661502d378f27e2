//! The server's index: committed pages, reservations, leases and eviction, as a plain state
//! machine (no I/O; time is passed in), kept under one lock by the server.
//!
//! # Invariants
//!
//! 1. **Visibility.** A key is visible (`exists`, `read`, `lookup`) only through `pages`, and a
//!    page enters `pages` only by [`Index::commit`] of a reservation whose bytes the owner
//!    wrote. A reservation that is never committed (its client died, or its time ran out) is
//!    never visible; its extent goes back to the allocator.
//! 2. **Immutability.** A committed extent is never written again while it is allocated. An
//!    overwrite reserves a new extent and swaps the index entry at commit.
//! 3. **Leases.** Every read of an extent's bytes happens under a pin (`pins`). A pinned
//!    extent is never evicted and never freed: a page deleted, dropped or replaced while pinned
//!    leaves the index at once (invisible) but its extent moves to `retired` and is freed when
//!    the last pin goes. `LOOKUP` leases (remote readers) expire after their lease time so a
//!    dead client cannot pin memory forever; the leases of a closed connection go at once.
//!    A client releases only its own connection's leases ([`Index::release_for`]).
//! 4. **Reservations.** A reservation belongs to one connection; only it may write or commit
//!    it. It is freed by commit, abort, its connection closing, or expiry. Expiry skips a
//!    reservation whose bytes are being written right now (`writing`), so its extent is never
//!    handed to someone else mid-write.
//! 5. **Accounting.** `bytes` is the sum of committed pages' lengths, `reserved` the sum of
//!    reserved extents; allocated extents = committed + reserved + retired, within the pool.
//!    The evictor tracks exactly the keys of `pages` (when eviction is on). `usage` holds, per
//!    connection, the bytes of its reservations and of the pages its leases pin (entries at
//!    zero are removed), so per-tenant limits can be checked without a scan.

use std::collections::HashMap;
use std::time::Instant;

use hicache_core::PageKey;
use hicache_storage::{EvictionPolicy, Evictor};

use crate::protocol::{AllocStatus, LookupStatus, Occupancy, PageReq, ReadStatus};
use crate::server::pool::{Allocator, Extent};

/// A committed page.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Page {
    /// Where its bytes lie.
    pub extent: Extent,
    /// Byte length (≤ the extent's).
    pub len: u64,
    /// Layout tag.
    pub layout: u8,
    /// XXH3-64 given at commit.
    pub checksum: u64,
}

#[derive(Debug)]
struct Reservation {
    key: PageKey,
    len: u64,
    layout: u8,
    extent: Extent,
    conn: u64,
    deadline: Instant,
    writing: bool,
}

#[derive(Debug)]
struct Lease {
    start: (u32, u64),
    conn: u64,
    /// Bytes of the pinned page (counted in its connection's usage).
    len: u64,
    /// `None`: held by the server itself for the duration of a send (released explicitly).
    deadline: Option<Instant>,
}

/// A pinned hit of [`Index::read`]: what to send, and the lease to release afterwards.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Pinned {
    /// The lease id.
    pub lease: u64,
    /// Where the bytes lie.
    pub extent: Extent,
    /// How many bytes to send.
    pub len: u64,
}

/// What one connection holds in flight.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes of its uncommitted reservations.
    pub reserved_bytes: u64,
    /// Bytes of the pages its leases pin.
    pub leased_bytes: u64,
}

impl Usage {
    /// Reserved plus leased bytes.
    pub fn in_flight(&self) -> u64 {
        self.reserved_bytes + self.leased_bytes
    }
}

/// Counters the index keeps.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexCounters {
    /// Committed pages.
    pub pages: u64,
    /// Bytes of committed pages.
    pub bytes: u64,
    /// Bytes of reserved extents.
    pub reserved_bytes: u64,
    /// Pages evicted.
    pub evicted_pages: u64,
    /// Bytes evicted.
    pub evicted_bytes: u64,
    /// Reservations reclaimed (connection closed or expired).
    pub reclaimed_reservations: u64,
    /// Leases that expired.
    pub expired_leases: u64,
}

/// The index. See the [module documentation](self).
pub struct Index {
    alloc: Allocator,
    max_page: u64,
    pages: HashMap<PageKey, Page>,
    evictor: Option<Box<dyn Evictor<PageKey>>>,
    reservations: HashMap<u64, Reservation>,
    pins: HashMap<(u32, u64), u32>,
    retired: HashMap<(u32, u64), Extent>,
    leases: HashMap<u64, Lease>,
    usage: HashMap<u64, Usage>,
    next_id: u64,
    c: IndexCounters,
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("pages", &self.pages.len())
            .field("reservations", &self.reservations.len())
            .field("leases", &self.leases.len())
            .field("counters", &self.c)
            .finish()
    }
}

impl Index {
    /// An empty index over `alloc`. Pages above `max_page` bytes are refused; `eviction`
    /// `None` refuses allocations when full instead of evicting.
    pub fn new(alloc: Allocator, max_page: u64, eviction: Option<EvictionPolicy>) -> Self {
        Self {
            alloc,
            max_page,
            pages: HashMap::new(),
            evictor: eviction.map(|p| p.build()),
            reservations: HashMap::new(),
            pins: HashMap::new(),
            retired: HashMap::new(),
            leases: HashMap::new(),
            usage: HashMap::new(),
            next_id: 1,
            c: IndexCounters::default(),
        }
    }

    /// The counters.
    pub fn counters(&self) -> IndexCounters {
        self.c
    }

    /// Occupancy with sequence number `seq`.
    pub fn occupancy(&self, seq: u64) -> Occupancy {
        Occupancy {
            seq,
            pages: self.c.pages,
            bytes: self.c.bytes,
            evicted_pages: self.c.evicted_pages,
            evicted_bytes: self.c.evicted_bytes,
        }
    }

    /// Live reservations.
    pub fn reservations(&self) -> usize {
        self.reservations.len()
    }

    /// Live leases.
    pub fn leases(&self) -> usize {
        self.leases.len()
    }

    /// Bytes free in the pool.
    pub fn free_bytes(&self) -> u64 {
        self.alloc.free_bytes()
    }

    /// The committed page of `key`.
    pub fn page(&self, key: &PageKey) -> Option<Page> {
        self.pages.get(key).copied()
    }

    /// Whether the extent of `key`'s page is pinned by a lease.
    pub fn is_pinned(&self, key: &PageKey) -> bool {
        self.pages
            .get(key)
            .is_some_and(|p| self.pins.contains_key(&p.extent.start()))
    }

    fn id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// The number of leading `keys` that are committed.
    pub fn exists(&self, keys: &[PageKey]) -> usize {
        keys.iter()
            .take_while(|k| self.pages.contains_key(k))
            .count()
    }

    /// What connection `conn` holds in flight.
    pub fn usage(&self, conn: u64) -> Usage {
        self.usage.get(&conn).copied().unwrap_or_default()
    }

    /// Adds (or, with `add` false, removes) bytes to `conn`'s usage.
    fn account(&mut self, conn: u64, reserved: u64, leased: u64, add: bool) {
        let u = self.usage.entry(conn).or_default();
        if add {
            u.reserved_bytes += reserved;
            u.leased_bytes += leased;
        } else {
            u.reserved_bytes -= reserved;
            u.leased_bytes -= leased;
        }
        if *u == Usage::default() {
            self.usage.remove(&conn);
        }
    }

    fn pin(&mut self, start: (u32, u64), conn: u64, len: u64, deadline: Option<Instant>) -> u64 {
        *self.pins.entry(start).or_insert(0) += 1;
        self.account(conn, 0, len, true);
        let id = self.id();
        self.leases.insert(
            id,
            Lease {
                start,
                conn,
                len,
                deadline,
            },
        );
        id
    }

    fn unpin(&mut self, lease: Lease) {
        self.account(lease.conn, 0, lease.len, false);
        let n = self
            .pins
            .get_mut(&lease.start)
            .expect("invariant 3: a lease pins its extent");
        *n -= 1;
        if *n == 0 {
            self.pins.remove(&lease.start);
            if let Some(e) = self.retired.remove(&lease.start) {
                self.alloc.free(e);
            }
        }
    }

    fn lookup_one(&mut self, p: &PageReq) -> Option<Result<Page, ()>> {
        let page = *self.pages.get(&p.key)?;
        if page.len != p.len || page.layout != p.layout {
            return Some(Err(()));
        }
        if let Some(ev) = self.evictor.as_mut() {
            ev.touch(&p.key);
        }
        Some(Ok(page))
    }

    /// `READ`: per page, its status and, for hits, a pin the caller releases with
    /// [`release`](Self::release) once the bytes are sent.
    pub fn read(&mut self, conn: u64, pages: &[PageReq]) -> Vec<(ReadStatus, Option<Pinned>)> {
        pages
            .iter()
            .map(|p| match self.lookup_one(p) {
                None => (ReadStatus::Miss, None),
                Some(Err(())) => (ReadStatus::Mismatch, None),
                Some(Ok(page)) => {
                    let lease = self.pin(page.extent.start(), conn, page.len, None);
                    (
                        ReadStatus::Hit {
                            checksum: page.checksum,
                        },
                        Some(Pinned {
                            lease,
                            extent: page.extent,
                            len: page.len,
                        }),
                    )
                }
            })
            .collect()
    }

    /// `LOOKUP`: per page, its location under a lease that expires at `deadline`.
    pub fn lookup(&mut self, conn: u64, pages: &[PageReq], deadline: Instant) -> Vec<LookupStatus> {
        pages
            .iter()
            .map(|p| match self.lookup_one(p) {
                None => LookupStatus::Miss,
                Some(Err(())) => LookupStatus::Mismatch,
                Some(Ok(page)) => LookupStatus::Hit {
                    region: page.extent.region,
                    offset: page.extent.offset,
                    checksum: page.checksum,
                    lease: self.pin(page.extent.start(), conn, page.len, Some(deadline)),
                },
            })
            .collect()
    }

    /// `RELEASE`: releases the leases of `conn` among `leases`; returns how many were live.
    /// Another connection's lease ids are ignored (a client cannot unpin what another client
    /// is reading).
    pub fn release_for(&mut self, conn: u64, leases: &[u64]) -> usize {
        let own: Vec<u64> = leases
            .iter()
            .copied()
            .filter(|id| self.leases.get(id).is_some_and(|l| l.conn == conn))
            .collect();
        self.release(&own)
    }

    /// Releases leases, whoever holds them; returns how many were live.
    pub fn release(&mut self, leases: &[u64]) -> usize {
        let mut n = 0;
        for id in leases {
            if let Some(l) = self.leases.remove(id) {
                self.unpin(l);
                n += 1;
            }
        }
        n
    }

    /// Takes `key`'s page out of the index (and the evictor); its extent is freed, or retired
    /// while pinned.
    fn remove_page(&mut self, key: &PageKey) -> Option<Page> {
        let page = self.pages.remove(key)?;
        if let Some(ev) = self.evictor.as_mut() {
            ev.remove(key);
        }
        self.c.pages -= 1;
        self.c.bytes -= page.len;
        if self.pins.contains_key(&page.extent.start()) {
            self.retired.insert(page.extent.start(), page.extent);
        } else {
            self.alloc.free(page.extent);
        }
        Some(page)
    }

    /// Evicts unpinned pages in policy order until an extent of `len` bytes is allocated.
    fn alloc_evicting(&mut self, len: u64) -> Option<Extent> {
        if let Some(e) = self.alloc.alloc(len) {
            return Some(e);
        }
        let mut skipped = Vec::new();
        let mut got = None;
        while let Some(victim) = self.evictor.as_mut().and_then(|ev| ev.pop_victim()) {
            if self.is_pinned(&victim) {
                skipped.push(victim);
                continue;
            }
            // The evictor already forgot the victim; remove_page's evictor.remove is a no-op.
            if let Some(p) = self.remove_page(&victim) {
                self.c.evicted_pages += 1;
                self.c.evicted_bytes += p.len;
            }
            if let Some(e) = self.alloc.alloc(len) {
                got = Some(e);
                break;
            }
        }
        if let Some(ev) = self.evictor.as_mut() {
            for k in skipped {
                ev.insert(k);
            }
        }
        got
    }

    /// `ALLOCATE`: per page, a reservation owned by `conn` until `deadline`, or why not.
    pub fn allocate(
        &mut self,
        conn: u64,
        pages: &[PageReq],
        deadline: Instant,
    ) -> Vec<AllocStatus> {
        let max = self.max_page.min(self.alloc.total_bytes());
        pages
            .iter()
            .map(|p| {
                if p.len == 0 {
                    return AllocStatus::Empty;
                }
                if p.len > max {
                    return AllocStatus::TooLarge { max };
                }
                if let Some(page) = self.pages.get(&p.key)
                    && page.len == p.len
                    && page.layout == p.layout
                {
                    if let Some(ev) = self.evictor.as_mut() {
                        ev.touch(&p.key);
                    }
                    return AllocStatus::Present;
                }
                let Some(extent) = self.alloc_evicting(p.len) else {
                    return AllocStatus::NoSpace;
                };
                let id = self.id();
                self.c.reserved_bytes += extent.len;
                self.account(conn, extent.len, 0, true);
                self.reservations.insert(
                    id,
                    Reservation {
                        key: p.key,
                        len: p.len,
                        layout: p.layout,
                        extent,
                        conn,
                        deadline,
                        writing: false,
                    },
                );
                AllocStatus::Slot {
                    id,
                    region: extent.region,
                    offset: extent.offset,
                }
            })
            .collect()
    }

    /// Starts writing `len` bytes into reservation `id` of `conn`: returns its extent and
    /// marks it as being written (so it cannot expire), or `None` if it is gone, not `conn`'s,
    /// or of another length.
    pub fn begin_write(&mut self, conn: u64, id: u64, len: u64) -> Option<Extent> {
        let r = self.reservations.get_mut(&id)?;
        if r.conn != conn || r.len != len || r.writing {
            return None;
        }
        r.writing = true;
        Some(r.extent)
    }

    /// Ends a write begun by [`begin_write`](Self::begin_write).
    pub fn end_write(&mut self, id: u64) {
        if let Some(r) = self.reservations.get_mut(&id) {
            r.writing = false;
        }
    }

    /// `COMMIT`: makes reservation `id` of `conn` visible under its key with `checksum`,
    /// replacing any older page of the key. `false` if the reservation is gone or not `conn`'s.
    pub fn commit(&mut self, conn: u64, id: u64, checksum: u64) -> bool {
        match self.reservations.get(&id) {
            Some(r) if r.conn == conn && !r.writing => {}
            _ => return false,
        }
        let r = self.reservations.remove(&id).expect("checked above");
        self.c.reserved_bytes -= r.extent.len;
        self.account(r.conn, r.extent.len, 0, false);
        self.remove_page(&r.key);
        self.pages.insert(
            r.key,
            Page {
                extent: r.extent,
                len: r.len,
                layout: r.layout,
                checksum,
            },
        );
        self.c.pages += 1;
        self.c.bytes += r.len;
        if let Some(ev) = self.evictor.as_mut() {
            ev.insert(r.key);
        }
        true
    }

    fn free_reservation(&mut self, id: u64) {
        if let Some(r) = self.reservations.remove(&id) {
            self.c.reserved_bytes -= r.extent.len;
            self.account(r.conn, r.extent.len, 0, false);
            self.alloc.free(r.extent);
        }
    }

    /// `ABORT`: gives back reservations of `conn`; returns how many were live.
    pub fn abort(&mut self, conn: u64, ids: &[u64]) -> usize {
        let mut n = 0;
        for id in ids {
            if self
                .reservations
                .get(id)
                .is_some_and(|r| r.conn == conn && !r.writing)
            {
                self.free_reservation(*id);
                n += 1;
            }
        }
        n
    }

    /// `DROP`: removes the pages whose stored checksum is the one given.
    pub fn drop_if(&mut self, pages: &[(PageKey, u64)]) -> usize {
        let mut n = 0;
        for (k, sum) in pages {
            if self.pages.get(k).is_some_and(|p| p.checksum == *sum) {
                self.remove_page(k);
                n += 1;
            }
        }
        n
    }

    /// `DELETE`: removes pages; returns how many were present.
    pub fn delete(&mut self, keys: &[PageKey]) -> usize {
        keys.iter()
            .filter(|k| self.remove_page(k).is_some())
            .count()
    }

    /// A connection closed: its reservations and leases go.
    pub fn connection_closed(&mut self, conn: u64) {
        let n = self.reclaim_where(|r| r.conn == conn);
        self.c.reclaimed_reservations += n;
        let leases: Vec<u64> = ids_where(&self.leases, |l| l.conn == conn);
        self.release(&leases);
    }

    /// Expires reservations and leases whose time ran out at `now`.
    pub fn sweep(&mut self, now: Instant) {
        let n = self.reclaim_where(|r| !r.writing && r.deadline <= now);
        self.c.reclaimed_reservations += n;
        let leases: Vec<u64> = ids_where(&self.leases, |l| l.deadline.is_some_and(|d| d <= now));
        self.c.expired_leases += leases.len() as u64;
        self.release(&leases);
    }

    /// Frees the reservations that match `f`; returns how many.
    fn reclaim_where(&mut self, f: impl Fn(&Reservation) -> bool) -> u64 {
        let ids = ids_where(&self.reservations, f);
        for &id in &ids {
            self.free_reservation(id);
        }
        ids.len() as u64
    }
}

/// The ids of the entries of `map` that match `f`.
fn ids_where<T>(map: &HashMap<u64, T>, f: impl Fn(&T) -> bool) -> Vec<u64> {
    map.iter()
        .filter(|(_, v)| f(v))
        .map(|(id, _)| *id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_core::{NamespaceId, PageHash};
    use proptest::prelude::*;
    use std::time::Duration;

    fn key(i: u64) -> PageKey {
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&i.to_le_bytes());
        PageKey::new(NamespaceId([1; 16]), PageHash(h))
    }

    fn req(i: u64, len: u64) -> PageReq {
        PageReq {
            key: key(i),
            len,
            layout: 2,
        }
    }

    fn index(slots: u64) -> Index {
        Index::new(
            Allocator::new(4096, &[slots * 4096]),
            1 << 30,
            Some(EvictionPolicy::Lru),
        )
    }

    fn put(ix: &mut Index, i: u64, now: Instant) {
        let out = ix.allocate(1, &[req(i, 4096)], now + Duration::from_secs(10));
        let AllocStatus::Slot { id, .. } = out[0] else {
            panic!("{out:?}")
        };
        assert!(ix.commit(1, id, i));
    }

    #[test]
    fn uncommitted_pages_are_invisible_and_reclaimed() {
        let now = Instant::now();
        let mut ix = index(4);
        let out = ix.allocate(7, &[req(1, 4096), req(2, 4096)], now);
        assert!(matches!(out[0], AllocStatus::Slot { .. }));
        assert_eq!(ix.exists(&[key(1)]), 0);
        assert_eq!(ix.free_bytes(), 2 * 4096);
        assert_eq!(ix.usage(7).reserved_bytes, 2 * 4096);
        ix.connection_closed(7);
        assert_eq!(ix.free_bytes(), 4 * 4096);
        assert_eq!(ix.usage(7), Usage::default());
        assert_eq!(ix.counters().reclaimed_reservations, 2);
        // Expiry reclaims too, but not while being written.
        let out = ix.allocate(8, &[req(3, 4096), req(4, 4096)], now);
        let ids: Vec<u64> = out
            .iter()
            .map(|s| match s {
                AllocStatus::Slot { id, .. } => *id,
                _ => panic!(),
            })
            .collect();
        assert!(ix.begin_write(8, ids[0], 4096).is_some());
        assert!(ix.begin_write(9, ids[1], 4096).is_none(), "not conn 9's");
        ix.sweep(now + Duration::from_secs(1));
        assert_eq!(ix.reservations(), 1, "the one being written survives");
        ix.end_write(ids[0]);
        assert!(!ix.commit(8, ids[1], 0), "expired");
        assert!(ix.commit(8, ids[0], 0));
        assert_eq!(ix.exists(&[key(3)]), 1);
    }

    #[test]
    fn leases_block_eviction_and_delay_frees() {
        let now = Instant::now();
        let mut ix = index(2);
        put(&mut ix, 1, now);
        put(&mut ix, 2, now);
        // Lease page 1 (the LRU victim), then ask for room: page 2 goes instead.
        let st = ix.lookup(3, &[req(1, 4096)], now + Duration::from_secs(5));
        let LookupStatus::Hit { lease, .. } = st[0] else {
            panic!()
        };
        put(&mut ix, 3, now);
        assert_eq!(ix.exists(&[key(1)]), 1, "leased page survives");
        assert_eq!(ix.exists(&[key(2)]), 0, "unleased page evicted");
        // Both slots are now pinned or fresh; page 3 is evictable, page 1 is not.
        put(&mut ix, 4, now);
        assert_eq!(ix.exists(&[key(1)]), 1);
        // Deleting a leased page hides it but keeps its extent until release.
        assert_eq!(ix.delete(&[key(1)]), 1);
        assert_eq!(ix.exists(&[key(1)]), 0);
        assert_eq!(ix.free_bytes(), 0);
        assert_eq!(ix.release_for(4, &[lease]), 0, "not connection 4's lease");
        assert_eq!(ix.release_for(3, &[lease]), 1);
        assert_eq!(ix.free_bytes(), 4096);
        // Lease expiry.
        let st = ix.lookup(3, &[req(4, 4096)], now + Duration::from_secs(5));
        assert!(matches!(st[0], LookupStatus::Hit { .. }));
        ix.sweep(now + Duration::from_secs(6));
        assert_eq!(ix.leases(), 0);
        assert_eq!(ix.counters().expired_leases, 1);
    }

    #[test]
    fn all_pinned_means_no_space() {
        let now = Instant::now();
        let mut ix = index(1);
        put(&mut ix, 1, now);
        let pins = ix.read(1, &[req(1, 4096)]);
        let out = ix.allocate(1, &[req(2, 4096)], now);
        assert_eq!(out[0], AllocStatus::NoSpace);
        ix.release(&[pins[0].1.unwrap().lease]);
        assert!(matches!(
            ix.allocate(1, &[req(2, 4096)], now)[0],
            AllocStatus::Slot { .. }
        ));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u64, u64),
        Delete(u64),
        Read(u64),
        ReleaseAll,
        Close,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..12, 1u64..3).prop_map(|(k, n)| Op::Put(k, n * 3000)),
            1 => (0u64..12).prop_map(Op::Delete),
            2 => (0u64..12).prop_map(Op::Read),
            1 => Just(Op::ReleaseAll),
            1 => Just(Op::Close),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// Against a naive model: a committed key reads back with its latest checksum or is
        /// gone (evicted/deleted); pinned pages are never evicted; accounting adds up.
        #[test]
        fn model(ops in proptest::collection::vec(op(), 1..120)) {
            let now = Instant::now();
            let far = now + Duration::from_secs(100);
            let mut ix = index(6);
            let mut model: HashMap<u64, (u64, u64)> = HashMap::new(); // key → (len, checksum)
            let mut held: Vec<(u64, u64)> = Vec::new(); // (lease, key)
            let mut version = 0u64;
            for o in ops {
                match o {
                    Op::Put(k, len) => {
                        version += 1;
                        let st = ix.allocate(1, &[req(k, len)], far);
                        match st[0] {
                            AllocStatus::Slot { id, .. } => {
                                prop_assert!(ix.commit(1, id, version));
                                model.insert(k, (len, version));
                            }
                            AllocStatus::Present => prop_assert_eq!(model.get(&k).map(|m| m.0), Some(len)),
                            AllocStatus::NoSpace => {}
                            other => prop_assert!(false, "unexpected {:?}", other),
                        }
                    }
                    Op::Delete(k) => {
                        let n = ix.delete(&[key(k)]);
                        prop_assert_eq!(n == 1, model.remove(&k).is_some());
                    }
                    Op::Read(k) => {
                        if let Some(&(len, sum)) = model.get(&k) {
                            let st = ix.lookup(2, &[req(k, len)], far);
                            if let LookupStatus::Hit { checksum, lease, .. } = st[0] {
                                prop_assert_eq!(checksum, sum);
                                held.push((lease, k));
                            } else {
                                prop_assert_eq!(st[0], LookupStatus::Miss);
                            }
                        }
                    }
                    Op::ReleaseAll => {
                        let ls: Vec<u64> = held.drain(..).map(|h| h.0).collect();
                        ix.release(&ls);
                    }
                    Op::Close => {
                        ix.connection_closed(2);
                        held.clear();
                    }
                }
                // Drop model entries the index evicted; leased (and still current) ones must stay.
                model.retain(|k, _| ix.exists(&[key(*k)]) == 1);
                let c = ix.counters();
                prop_assert_eq!(c.pages as usize, model.len());
                prop_assert_eq!(c.bytes, model.values().map(|m| m.0).sum::<u64>());
                for (k, (len, sum)) in &model {
                    let p = ix.page(&key(*k)).unwrap();
                    prop_assert_eq!((p.len, p.checksum), (*len, *sum));
                }
                prop_assert!(ix.free_bytes() <= 6 * 4096);
            }
            ix.connection_closed(2);
            let ks: Vec<PageKey> = (0..12).map(key).collect();
            ix.delete(&ks);
            prop_assert_eq!(ix.free_bytes(), 6 * 4096, "everything freed at the end");
            prop_assert!(ix.usage.is_empty(), "no usage left: {:?}", ix.usage);
        }
    }
}
