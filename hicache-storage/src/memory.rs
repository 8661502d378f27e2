//! [`MemoryBackend`]: the in-memory reference backend.
//!
//! Pages are owned copies in a hash map, bounded by a capacity in bytes with an eviction
//! policy (LRU by default), each with its XXH3-64 checksum verified before any byte is copied
//! to a caller. It is what the conformance suite's expectations are modelled on, what tests
//! use, and an embedded default where L3 need not persist.
//!
//! Extra-config (`backend memory`): `capacity` (common field; default 1 GiB), `eviction`
//! (`lru` | `fifo`, default `lru`), `max_batch` (pages per call, default 256),
//! `copy_threads` (threads that copy the pages of one large batch, default the machine's
//! cores up to 4; 1 copies on the caller's thread), `record_contexts` (default false: keep
//! and log at debug level every [`BatchContext`] that arrives, for tests and debugging; see
//! [`MemoryBackend::contexts`]).
//!
//! Invariants:
//! 1. `bytes` equals the sum of the stored pages' lengths; the evictor tracks exactly the keys
//!    of `pages`. The memory the store holds — stored pages, the buffers of writes in flight
//!    (`reserved`) and the free buffers kept for reuse (`Recycler`) — never exceeds
//!    `capacity` when the lock is released, unless the writes in flight alone hold more:
//!    room for a write is made (free buffers dropped, then pages evicted) before its bytes
//!    are copied. All of it changes under one lock.
//! 2. A stored page is immutable (`Arc`): readers copy outside the lock, and a replaced or
//!    evicted page stays valid for readers that already hold it.
//! 3. A page whose checksum fails is removed (if still the same copy) and reported `Corrupt`;
//!    the destination's contents are then unspecified (the contract's rule 2).
//! 4. Every page's bytes cross memory once per call: a write copies and checksums in one pass
//!    (`copy_in`), a read copies and verifies in one pass (`copy_out`), each chunk hashed
//!    while it is still in the CPU cache. A write reuses the buffer of a page that left the
//!    store (replaced, evicted, deleted, cleared) when one of its length is free
//!    (`Recycler`), so once the store has held its working set, writes go into memory that
//!    is already faulted in, as a memcpy into a preallocated segment does; free buffers count
//!    against the capacity, so keeping them costs no memory beyond it.
//! 5. A batch of at least [`PARALLEL_MIN_BYTES`] and two pages is copied by up to
//!    `copy_threads` scoped threads, each taking a contiguous run of its pages; outcomes keep
//!    the batch's order. Each page is still one `set_one` / `get_one`, so rules 1–3 and the
//!    invariants above hold per page whatever thread copies it.
//!
//! What the checksum guards here: the store's copy lives in this process's heap, so no
//! process, network or disk boundary lies between write and read. It catches a stray write
//! into the store's buffers by other code of the process (a native extension, an `unsafe`
//! bug) and a memory error that ECC did not correct, and turns either into a `Corrupt` miss
//! instead of wrong KV. The contract's rule 2 asks every backend for it; fused with the copy
//! (each 32 KiB chunk hashed while in cache) it costs CPU, not a second pass over memory.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use hicache_core::{NamespaceId, PageKey};
use parking_lot::Mutex;

use crate::backend::{BackendInfo, StatsCounters, Storage, StorageStats, bump, check_batch};
use crate::checksum::Checksummer;
use crate::config::{CommonConfig, ConfigFields};
use crate::context::{BatchContext, ContextLog};
use crate::error::Result;
use crate::evict::{EvictionPolicy, Evictor};
use crate::factory::{BackendContext, BackendFactory};
use crate::page::{PageBuf, PageBufMut, PageError, PageMeta, PageOutcome};

/// Default capacity of the memory backend: 1 GiB.
pub const DEFAULT_MEMORY_CAPACITY: u64 = 1 << 30;

/// Options of a [`MemoryBackend`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryOptions {
    /// Capacity in bytes of page data.
    pub capacity_bytes: u64,
    /// Which page to drop first when full.
    pub eviction: EvictionPolicy,
    /// Largest batch accepted.
    pub max_batch: usize,
    /// Record every batch context received ([`MemoryBackend::contexts`]).
    pub record_contexts: bool,
    /// Threads that copy the pages of one batch of at least [`PARALLEL_MIN_BYTES`]
    /// (invariant 5); 1 copies on the caller's thread.
    pub copy_threads: usize,
}

/// The default [`MemoryOptions::copy_threads`]: the machine's cores, at most 4 (memory
/// bandwidth, not cores, bounds a copy beyond that).
pub fn default_copy_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// Bytes a batch must hold before its copies are split among threads: below it a thread's
/// start costs more than the copy it would take over.
pub const PARALLEL_MIN_BYTES: usize = 4 << 20;

impl Default for MemoryOptions {
    fn default() -> Self {
        Self {
            capacity_bytes: DEFAULT_MEMORY_CAPACITY,
            eviction: EvictionPolicy::Lru,
            max_batch: 256,
            record_contexts: false,
            copy_threads: default_copy_threads(),
        }
    }
}

impl MemoryOptions {
    /// Reads the options from the common config and the backend's fields (strict).
    pub fn from_config(common: &CommonConfig, mut fields: ConfigFields) -> Result<Self> {
        let d = Self::default();
        let eviction = fields.choice("eviction", "lru", &EvictionPolicy::NAMES)?;
        let max_batch = fields.u64("max_batch", d.max_batch as u64, 128..=65_536)? as usize;
        let record_contexts = fields.bool("record_contexts", d.record_contexts)?;
        let copy_threads = fields.u64("copy_threads", d.copy_threads as u64, 1..=64)? as usize;
        let capacity_bytes = common.capacity_bytes.unwrap_or(d.capacity_bytes);
        // Pages are held in memory: a capacity above the machine's memory is a mistake.
        crate::machine::check_memory_size(fields.scope(), "capacity", capacity_bytes)?;
        fields.finish()?;
        Ok(Self {
            capacity_bytes,
            eviction: EvictionPolicy::parse(eviction).unwrap_or_default(),
            max_batch,
            record_contexts,
            copy_threads,
        })
    }
}

struct Stored {
    meta: PageMeta,
    checksum: u64,
    data: Box<[u8]>,
}

struct Inner {
    pages: HashMap<PageKey, Arc<Stored>>,
    evictor: Box<dyn Evictor<PageKey>>,
    /// Bytes of the stored pages.
    bytes: u64,
    /// Bytes of the buffers of writes in flight (taken or allocated, not yet stored).
    reserved: u64,
    recycler: Recycler,
}

impl Inner {
    /// Memory held: stored pages, writes in flight and free buffers (invariant 1).
    fn held(&self) -> u64 {
        self.bytes + self.reserved + self.recycler.bytes
    }

    /// Removes `key`'s page, its buffer going to the recycler. Returns its length.
    fn remove(&mut self, key: &PageKey) -> Option<u64> {
        let old = self.pages.remove(key)?;
        let len = old.meta.len as u64;
        self.bytes -= len;
        self.evictor.remove(key);
        self.recycler.keep(old);
        Some(len)
    }
}

/// Bytes copied and then hashed at a time: small enough that the hash reads them from the
/// CPU cache the copy just filled, large enough that the per-chunk calls cost nothing.
const CHUNK: usize = 32 << 10;

/// The page's bytes in a buffer of their own, and their checksum, in one pass over the bytes:
/// copied into `reuse` (a free buffer of the page's length) where given, else into a fresh
/// allocation that is never zeroed first.
fn copy_in(page: &PageBuf<'_>, reuse: Option<Box<[u8]>>) -> (Box<[u8]>, u64) {
    let mut h = Checksummer::default();
    let pieces = page.parts().iter().flat_map(|p| p.chunks(CHUNK));
    let data = match reuse {
        Some(mut buf) => {
            let mut off = 0;
            for piece in pieces {
                let to = &mut buf[off..off + piece.len()];
                to.copy_from_slice(piece);
                h.update(to);
                off += piece.len();
            }
            buf
        }
        None => {
            let mut v = Vec::with_capacity(page.len());
            for piece in pieces {
                let start = v.len();
                v.extend_from_slice(piece);
                h.update(&v[start..]);
            }
            v.into_boxed_slice()
        }
    };
    (data, h.finish())
}

/// Copies `src` into the destination's parts and returns the checksum of what was copied, in
/// one pass over the bytes.
fn copy_out(src: &[u8], dst: &mut PageBufMut<'_>) -> u64 {
    let mut h = Checksummer::default();
    let mut off = 0;
    for part in dst.parts_mut() {
        for to in part.chunks_mut(CHUNK) {
            let piece = &src[off..off + to.len()];
            to.copy_from_slice(piece);
            h.update(piece);
            off += to.len();
        }
    }
    h.finish()
}

/// The outcomes of the copy threads of one batch, in the batch's order. A copy thread runs
/// only `set_one` / `get_one`, which return an outcome for every page and do not panic on
/// any input; should one panic all the same, the panic is carried on to the caller.
fn join_in_order(
    runs: Vec<std::thread::ScopedJoinHandle<'_, Vec<PageOutcome>>>,
) -> Vec<PageOutcome> {
    let mut out = Vec::new();
    for run in runs {
        match run.join() {
            Ok(part) => out.extend(part),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    out
}

/// Runs `copy` on each part of a batch (its keys and its buffers) on a scoped thread of its
/// own, the outcomes in the batch's order.
fn copy_in_parallel<'k, B: Send>(
    parts: impl Iterator<Item = (&'k [PageKey], B)>,
    copy: impl Fn(&'k [PageKey], B) -> Vec<PageOutcome> + Sync,
) -> Vec<PageOutcome> {
    std::thread::scope(|scope| {
        let copy = &copy;
        let runs: Vec<_> = parts
            .map(|(ks, bufs)| scope.spawn(move || copy(ks, bufs)))
            .collect();
        join_in_order(runs)
    })
}

/// Buffers of pages that left the store (replaced, evicted, deleted, cleared) and no reader
/// holds, kept by length for the next write of that length. They count against the store's
/// capacity (invariant 1): [`Recycler::drop_one`] frees one when a write needs the room.
#[derive(Default)]
struct Recycler {
    free: HashMap<usize, Vec<Box<[u8]>>>,
    bytes: u64,
}

impl Recycler {
    /// Keeps the buffer of `page` if no reader holds it (a reader's copy is freed when the
    /// reader drops it).
    fn keep(&mut self, page: Arc<Stored>) {
        let Ok(stored) = Arc::try_unwrap(page) else {
            return;
        };
        self.bytes += stored.data.len() as u64;
        self.free
            .entry(stored.data.len())
            .or_default()
            .push(stored.data);
    }

    /// Frees one kept buffer, of a length other than `spare` when there is one. Returns
    /// whether one was freed.
    fn drop_one(&mut self, spare: usize) -> bool {
        let len = match self.free.keys().copied().find(|&l| l != spare) {
            Some(l) => l,
            None => match self.free.keys().next() {
                Some(&l) => l,
                None => return false,
            },
        };
        self.take(len).is_some()
    }

    /// A free buffer of exactly `len` bytes, if one is kept.
    fn take(&mut self, len: usize) -> Option<Box<[u8]>> {
        let list = self.free.get_mut(&len)?;
        let b = list.pop()?;
        if list.is_empty() {
            self.free.remove(&len);
        }
        self.bytes -= len as u64;
        Some(b)
    }
}

/// The in-memory reference backend. See the [module documentation](self).
pub struct MemoryBackend {
    options: MemoryOptions,
    inner: Mutex<Inner>,
    counters: StatsCounters,
    contexts: ContextLog,
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl MemoryBackend {
    /// An empty backend.
    pub fn new(options: MemoryOptions) -> Self {
        let contexts = ContextLog::default();
        contexts.enable(options.record_contexts);
        Self {
            inner: Mutex::new(Inner {
                pages: HashMap::new(),
                evictor: options.eviction.build(),
                bytes: 0,
                reserved: 0,
                recycler: Recycler::default(),
            }),
            options,
            counters: StatsCounters::default(),
            contexts,
        }
    }

    /// The record of the batch contexts received (on when `record_contexts` was set, or after
    /// `contexts().enable(true)`). The backend otherwise ignores contexts, as rule 9 allows.
    pub fn contexts(&self) -> &ContextLog {
        &self.contexts
    }

    /// An empty backend with default options and the given capacity.
    pub fn with_capacity(capacity_bytes: u64) -> Self {
        Self::new(MemoryOptions {
            capacity_bytes,
            ..MemoryOptions::default()
        })
    }

    /// Fault injection: flips one byte of the stored copy of `key` without updating its
    /// checksum, as a memory fault would. Returns whether the page was present. For tests of
    /// the verification path (the conformance suite uses it) and of alerting.
    pub fn corrupt_page(&self, key: &PageKey) -> bool {
        let mut inner = self.inner.lock();
        let Some(old) = inner.pages.get(key) else {
            return false;
        };
        let mut data = old.data.clone();
        let i = data.len() / 2;
        data[i] ^= 0x5a;
        let bad = Arc::new(Stored {
            meta: old.meta,
            checksum: old.checksum,
            data,
        });
        inner.pages.insert(*key, bad);
        true
    }

    fn set_one(&self, key: &PageKey, page: &PageBuf<'_>) -> PageOutcome {
        let len = page.len();
        if len == 0 {
            return PageOutcome::Failed(PageError::EmptyPage);
        }
        if len as u64 > self.options.capacity_bytes {
            return PageOutcome::Failed(PageError::TooLarge {
                len,
                max: self.options.capacity_bytes as usize,
            });
        }
        let reuse = {
            let mut inner = self.inner.lock();
            if let Some(s) = inner.pages.get(key) {
                if s.meta == page.meta() {
                    inner.evictor.touch(key);
                    return PageOutcome::Present;
                }
                // Replaced: its buffer may carry the new page.
                inner.remove(key);
            }
            let reuse = self.make_room(&mut inner, len);
            inner.reserved += len as u64;
            reuse
        };
        // Copy and checksum outside the lock, in one pass.
        let (data, sum) = copy_in(page, reuse);
        let stored = Arc::new(Stored {
            meta: page.meta(),
            checksum: sum,
            data,
        });
        let mut inner = self.inner.lock();
        inner.reserved -= len as u64;
        // A concurrent write of the same key stored first: this one replaces it.
        inner.remove(key);
        inner.bytes += len as u64;
        inner.pages.insert(*key, stored);
        inner.evictor.insert(*key);
        PageOutcome::Stored
    }

    /// Makes room for a write of `len` bytes (invariant 1) and returns a free buffer of that
    /// length when one is kept or a page evicted for the room leaves one: free buffers of
    /// other lengths are dropped first, then pages evicted in the policy's order.
    fn make_room(&self, inner: &mut Inner, len: usize) -> Option<Box<[u8]>> {
        if let Some(buf) = inner.recycler.take(len) {
            return Some(buf);
        }
        while inner.held() + len as u64 > self.options.capacity_bytes {
            if inner.recycler.drop_one(len) {
                continue;
            }
            let Some(victim) = inner.evictor.pop_victim() else {
                break;
            };
            if let Some(n) = inner.remove(&victim) {
                bump(&self.counters.evicted_pages, 1);
                bump(&self.counters.evicted_bytes, n);
                if let Some(buf) = inner.recycler.take(len) {
                    return Some(buf);
                }
            }
        }
        None
    }

    /// Threads to copy a batch of `pages` pages and `bytes` bytes with (invariant 5).
    fn copy_threads(&self, pages: usize, bytes: usize) -> usize {
        if bytes < PARALLEL_MIN_BYTES {
            return 1;
        }
        self.options.copy_threads.min(pages).max(1)
    }

    fn get_one(&self, key: &PageKey, dst: &mut PageBufMut<'_>) -> PageOutcome {
        let stored = {
            let mut inner = self.inner.lock();
            let Some(s) = inner.pages.get(key).cloned() else {
                return PageOutcome::Miss;
            };
            inner.evictor.touch(key);
            s
        };
        if stored.meta != dst.meta() {
            bump(&self.counters.meta_mismatches, 1);
            return PageOutcome::Miss;
        }
        if copy_out(&stored.data, dst) != stored.checksum {
            tracing::warn!(key = %key, "memory backend: checksum mismatch, page dropped");
            let mut inner = self.inner.lock();
            if inner
                .pages
                .get(key)
                .is_some_and(|s| Arc::ptr_eq(s, &stored))
            {
                inner.pages.remove(key);
                inner.evictor.remove(key);
                inner.bytes -= stored.meta.len as u64;
            }
            return PageOutcome::Corrupt;
        }
        PageOutcome::Hit
    }
}

#[async_trait]
impl Storage for MemoryBackend {
    fn info(&self) -> BackendInfo {
        let mut i = BackendInfo::new("memory", self.options.max_batch);
        i.capacity_bytes = Some(self.options.capacity_bytes);
        i.max_page_bytes = self.options.capacity_bytes as usize;
        i.clear = true;
        i.batch_context = self.contexts.is_enabled();
        i
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch(
            "batch_exists",
            self.options.max_batch,
            keys.len(),
            keys.len(),
        )?;
        let inner = self.inner.lock();
        let hits = keys
            .iter()
            .take_while(|k| inner.pages.contains_key(k))
            .count();
        drop(inner);
        self.counters
            .record_exists((hits + 1).min(keys.len()), hits);
        Ok(hits)
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>> {
        check_batch("batch_get", self.options.max_batch, keys.len(), dst.len())?;
        let bytes = dst.iter().map(|d| d.len()).sum();
        let threads = self.copy_threads(keys.len(), bytes);
        let get = |ks: &[PageKey], ds: &mut [PageBufMut<'_>]| -> Vec<PageOutcome> {
            ks.iter()
                .zip(ds.iter_mut())
                .map(|(k, d)| self.get_one(k, d))
                .collect()
        };
        let out = if threads > 1 {
            let per = keys.len().div_ceil(threads);
            copy_in_parallel(keys.chunks(per).zip(dst.chunks_mut(per)), get)
        } else {
            get(keys, dst)
        };
        self.counters.record_get(&out, dst.iter().map(|d| d.len()));
        Ok(out)
    }

    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", self.options.max_batch, keys.len(), src.len())?;
        let bytes = src.iter().map(|p| p.len()).sum();
        let threads = self.copy_threads(keys.len(), bytes);
        let set = |ks: &[PageKey], ps: &[PageBuf<'_>]| -> Vec<PageOutcome> {
            ks.iter().zip(ps).map(|(k, p)| self.set_one(k, p)).collect()
        };
        let out = if threads > 1 {
            let per = keys.len().div_ceil(threads);
            copy_in_parallel(keys.chunks(per).zip(src.chunks(per)), set)
        } else {
            set(keys, src)
        };
        self.counters.record_set(&out, src.iter().map(|p| p.len()));
        Ok(out)
    }

    async fn batch_exists_with(&self, keys: &[PageKey], ctx: BatchContext<'_>) -> Result<usize> {
        self.contexts.record("batch_exists", keys, ctx);
        self.batch_exists(keys).await
    }

    async fn batch_get_with(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
        ctx: BatchContext<'_>,
    ) -> Result<Vec<PageOutcome>> {
        self.contexts.record("batch_get", keys, ctx);
        self.batch_get(keys, dst).await
    }

    async fn batch_set_with(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        ctx: BatchContext<'_>,
    ) -> Result<Vec<PageOutcome>> {
        self.contexts.record("batch_set", keys, ctx);
        self.batch_set(keys, src).await
    }

    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        let mut inner = self.inner.lock();
        let mut n = 0;
        for k in keys {
            if let Some(s) = inner.pages.remove(k) {
                inner.bytes -= s.meta.len as u64;
                inner.evictor.remove(k);
                inner.recycler.keep(s);
                n += 1;
            }
        }
        bump(&self.counters.deleted_pages, n as u64);
        Ok(n)
    }

    async fn clear(&self, namespace: NamespaceId) -> Result<u64> {
        let mut inner = self.inner.lock();
        let doomed: Vec<PageKey> = inner
            .pages
            .keys()
            .filter(|k| k.namespace == namespace)
            .copied()
            .collect();
        for k in &doomed {
            if let Some(s) = inner.pages.remove(k) {
                inner.bytes -= s.meta.len as u64;
                inner.evictor.remove(k);
                inner.recycler.keep(s);
            }
        }
        bump(&self.counters.cleared_pages, doomed.len() as u64);
        Ok(doomed.len() as u64)
    }

    fn stats(&self) -> StorageStats {
        let (pages, bytes) = {
            let inner = self.inner.lock();
            (inner.pages.len() as u64, inner.bytes)
        };
        self.counters
            .snapshot(pages, bytes, Some(self.options.capacity_bytes))
    }
}

/// Registers [`MemoryBackend`] as `memory`.
#[derive(Copy, Clone, Debug, Default)]
pub struct MemoryFactory;

#[async_trait]
impl BackendFactory for MemoryFactory {
    fn name(&self) -> &str {
        "memory"
    }

    async fn open(
        &self,
        common: &CommonConfig,
        fields: ConfigFields,
        _ctx: &BackendContext,
    ) -> Result<Arc<dyn Storage>> {
        Ok(Arc::new(MemoryBackend::new(MemoryOptions::from_config(
            common, fields,
        )?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StorageConfig;
    use hicache_core::{LayoutKind, PageHash};

    fn k(i: u8) -> PageKey {
        PageKey::new(NamespaceId([3; 16]), PageHash([i; 32]))
    }

    fn bytes(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    async fn read(m: &MemoryBackend, key: PageKey, len: usize) -> (PageOutcome, Vec<u8>) {
        let mut out = vec![0u8; len];
        let o = {
            // Uneven parts: the copy's chunks and the destination's parts do not line up.
            let (a, b) = out.split_at_mut(len / 3 + 1);
            let mut dst = [PageBufMut::from_parts(LayoutKind::PageFirst, [a, b])];
            m.batch_get(&[key], &mut dst).await.unwrap().remove(0)
        };
        (o, out)
    }

    /// Pages written over buffers that other pages left (replaced, evicted, deleted) read back
    /// exactly, whatever their parts; the recycler keeps no more than its limit.
    #[tokio::test]
    async fn recycled_buffers_carry_the_new_page() {
        let len = 100_000;
        // Room for 16 pages, free buffers included.
        let cap = 16 * len as u64;
        let m = MemoryBackend::with_capacity(cap);
        for round in 0u8..4 {
            // 20 new pages a round: each round evicts the previous round's pages.
            let ids: Vec<u8> = (0..20).map(|i| round * 20 + i).collect();
            for &id in &ids {
                let data = bytes(id, len);
                let page = PageBuf::from_parts(LayoutKind::PageFirst, data.chunks(7_777));
                let out = m.batch_set(&[k(id)], &[page]).await.unwrap();
                assert_eq!(out[0], PageOutcome::Stored, "page {id}");
            }
            for &id in &ids[..4] {
                assert_eq!(read(&m, k(id), len).await.0, PageOutcome::Miss, "evicted");
            }
            for &id in &ids[4..] {
                let (o, got) = read(&m, k(id), len).await;
                assert_eq!(o, PageOutcome::Hit, "page {id}");
                assert!(got == bytes(id, len), "page {id}");
            }
            {
                let inner = m.inner.lock();
                assert!(inner.held() <= cap, "round {round}: over capacity");
                assert_eq!(inner.reserved, 0);
            }
            // Deleted pages' buffers are kept, within the capacity, and carry the next writes.
            assert_eq!(m.delete(&[k(ids[4]), k(ids[5])]).await.unwrap(), 2);
            assert_eq!(m.inner.lock().recycler.bytes, 2 * len as u64);
            for &id in &ids[4..6] {
                let data = bytes(id ^ 0x80, len);
                let page = PageBuf::from_parts(LayoutKind::PageFirst, [&data[..]]);
                assert_eq!(
                    m.batch_set(&[k(id)], &[page]).await.unwrap()[0],
                    PageOutcome::Stored
                );
                let (o, got) = read(&m, k(id), len).await;
                assert!(
                    o == PageOutcome::Hit && got == bytes(id ^ 0x80, len),
                    "page {id}"
                );
            }
            assert_eq!(
                m.inner.lock().recycler.bytes,
                0,
                "round {round}: buffers not reused"
            );
        }
        // A damaged copy is still found on the one-pass read.
        assert!(m.corrupt_page(&k(70)));
        assert_eq!(read(&m, k(70), len).await.0, PageOutcome::Corrupt);
    }

    /// Free buffers of another length are dropped, before any page is evicted, to make room:
    /// the memory held stays within the capacity.
    #[tokio::test]
    async fn free_buffers_of_other_lengths_make_room_first() {
        let m = MemoryBackend::with_capacity(10_000);
        let set = |id: u8, len: usize| {
            let data = bytes(id, len);
            let m = &m;
            async move {
                let page = PageBuf::from_parts(LayoutKind::PageFirst, [&data[..]]);
                m.batch_set(&[k(id)], &[page]).await.unwrap().remove(0)
            }
        };
        for id in 0..4 {
            assert_eq!(set(id, 2_000).await, PageOutcome::Stored);
        }
        assert_eq!(m.delete(&[k(0), k(1)]).await.unwrap(), 2);
        // 4 000 bytes of pages and 4 000 free: a 3 000-byte page needs one free buffer gone.
        assert_eq!(set(9, 3_000).await, PageOutcome::Stored);
        let inner = m.inner.lock();
        assert_eq!((inner.bytes, inner.recycler.bytes), (7_000, 2_000));
        assert_eq!(inner.pages.len(), 3, "no page was evicted");
    }

    /// Batches large enough to be split among copy threads come back in order, misses and
    /// hits where they were, every byte exact.
    #[tokio::test]
    async fn batches_copied_by_several_threads_keep_their_order() {
        let m = MemoryBackend::new(MemoryOptions {
            capacity_bytes: 64 << 20,
            copy_threads: 3,
            ..MemoryOptions::default()
        });
        let len = 1 << 20;
        let data: Vec<Vec<u8>> = (0..8).map(|i| bytes(i, len)).collect();
        let pages: Vec<PageBuf<'_>> = data
            .iter()
            .map(|d| PageBuf::from_parts(LayoutKind::PageFirst, d.chunks(300_000)))
            .collect();
        let keys: Vec<PageKey> = (0..8).map(k).collect();
        assert_eq!(m.copy_threads(8, 8 * len), 3);
        let out = m.batch_set(&keys, &pages).await.unwrap();
        assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
        assert_eq!(m.delete(&[k(2), k(5)]).await.unwrap(), 2);
        let mut back = vec![vec![0u8; len]; 8];
        let out = {
            let mut dst: Vec<PageBufMut<'_>> = back
                .iter_mut()
                .map(|b| PageBufMut::from_parts(LayoutKind::PageFirst, [&mut b[..]]))
                .collect();
            m.batch_get(&keys, &mut dst).await.unwrap()
        };
        for (i, o) in out.iter().enumerate() {
            if i == 2 || i == 5 {
                assert_eq!(*o, PageOutcome::Miss, "page {i}");
            } else {
                assert_eq!(*o, PageOutcome::Hit, "page {i}");
                assert!(back[i] == data[i], "page {i}");
            }
        }
        // Small batches stay on the caller's thread.
        assert_eq!(m.copy_threads(8, PARALLEL_MIN_BYTES - 1), 1);
    }

    #[test]
    fn options_are_strict() {
        let cfg = StorageConfig::parse(Some("memory"), Some(r#"{"eviction": "random"}"#)).unwrap();
        let e = MemoryOptions::from_config(&cfg.common, cfg.backend_fields)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("eviction") && e.contains("random") && e.contains("lru, fifo"),
            "{e}"
        );
        let cfg = StorageConfig::parse(
            Some("memory"),
            Some(
                r#"{"capacity": "2MiB", "eviction": "fifo", "max_batch": 512, "record_contexts": true, "copy_threads": 2}"#,
            ),
        )
        .unwrap();
        let o = MemoryOptions::from_config(&cfg.common, cfg.backend_fields).unwrap();
        assert_eq!(
            o,
            MemoryOptions {
                capacity_bytes: 2 << 20,
                eviction: EvictionPolicy::Fifo,
                max_batch: 512,
                record_contexts: true,
                copy_threads: 2,
            }
        );
        let cfg = StorageConfig::parse(Some("memory"), Some(r#"{"max_batch": 3}"#)).unwrap();
        assert!(MemoryOptions::from_config(&cfg.common, cfg.backend_fields).is_err());
        // A capacity no machine of this size can hold is refused, naming what it has.
        let cfg =
            StorageConfig::parse(Some("memory"), Some(r#"{"capacity": "100000tb"}"#)).unwrap();
        let e = MemoryOptions::from_config(&cfg.common, cfg.backend_fields)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`capacity`") && e.contains("physical memory"),
            "{e}"
        );
    }
}
