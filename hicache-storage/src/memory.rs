//! [`MemoryBackend`]: the in-memory reference backend.
//!
//! Pages are owned copies in a hash map, bounded by a capacity in bytes with an eviction
//! policy (LRU by default), each with its XXH3-64 checksum verified before any byte is copied
//! to a caller. It is what the conformance suite's expectations are modelled on, what tests
//! use, and an embedded default where L3 need not persist.
//!
//! Extra-config (`backend memory`): `capacity` (common field; default 1 GiB), `eviction`
//! (`lru` | `fifo`, default `lru`), `max_batch` (pages per call, default 256),
//! `record_contexts` (default false: keep and log at debug level every [`BatchContext`] that
//! arrives, for tests and debugging; see [`MemoryBackend::contexts`]).
//!
//! Invariants:
//! 1. `bytes` equals the sum of the stored pages' lengths and never exceeds `capacity` after a
//!    call returns; the evictor tracks exactly the keys of `pages`. Both change under one lock.
//! 2. A stored page is immutable (`Arc`): readers copy outside the lock, and a replaced or
//!    evicted page stays valid for readers that already hold it.
//! 3. A page whose checksum fails is removed (if still the same copy) and reported `Corrupt`;
//!    the destination's contents are then unspecified (the contract's rule 2).
//! 4. Every page's bytes cross memory once per call: a write copies and checksums in one pass
//!    (`copy_in`), a read copies and verifies in one pass (`copy_out`), each chunk hashed
//!    while it is still in the CPU cache. A write reuses the buffer of a page it replaced or
//!    evicted when one of its length is free (`Recycler`), so a full store writes into memory
//!    that is already faulted in. The free buffers kept are bounded (1/8 of the capacity, at
//!    most 256 MiB) and are memory beyond the capacity's page bytes.

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
}

impl Default for MemoryOptions {
    fn default() -> Self {
        Self {
            capacity_bytes: DEFAULT_MEMORY_CAPACITY,
            eviction: EvictionPolicy::Lru,
            max_batch: 256,
            record_contexts: false,
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
        let capacity_bytes = common.capacity_bytes.unwrap_or(d.capacity_bytes);
        // Pages are held in memory: a capacity above the machine's memory is a mistake.
        crate::machine::check_memory_size(fields.scope(), "capacity", capacity_bytes)?;
        fields.finish()?;
        Ok(Self {
            capacity_bytes,
            eviction: EvictionPolicy::parse(eviction).unwrap_or_default(),
            max_batch,
            record_contexts,
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
    bytes: u64,
    recycler: Recycler,
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

/// Buffers of pages that left the store (replaced, evicted, deleted, cleared) and no reader
/// holds, kept by length for the next write of that length. Bounded: at most `limit` bytes
/// are kept; the rest are freed.
struct Recycler {
    free: HashMap<usize, Vec<Box<[u8]>>>,
    bytes: u64,
    limit: u64,
}

impl Recycler {
    /// A recycler that keeps at most 1/8 of `capacity` bytes, and never more than 256 MiB.
    fn new(capacity: u64) -> Self {
        Self {
            free: HashMap::new(),
            bytes: 0,
            limit: (capacity / 8).min(256 << 20),
        }
    }

    /// Keeps the buffer of `page` if no reader holds it and there is room.
    fn keep(&mut self, page: Arc<Stored>) {
        let Ok(stored) = Arc::try_unwrap(page) else {
            return;
        };
        let len = stored.data.len() as u64;
        if self.bytes + len <= self.limit {
            self.bytes += len;
            self.free
                .entry(stored.data.len())
                .or_default()
                .push(stored.data);
        }
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
                recycler: Recycler::new(options.capacity_bytes),
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
            if inner.pages.get(key).is_some_and(|s| s.meta == page.meta()) {
                inner.evictor.touch(key);
                return PageOutcome::Present;
            }
            inner.recycler.take(len)
        };
        // Copy and checksum outside the lock, in one pass.
        let (data, sum) = copy_in(page, reuse);
        let stored = Arc::new(Stored {
            meta: page.meta(),
            checksum: sum,
            data,
        });
        let mut inner = self.inner.lock();
        if let Some(old) = inner.pages.remove(key) {
            inner.bytes -= old.meta.len as u64;
            inner.evictor.remove(key);
            inner.recycler.keep(old);
        }
        while inner.bytes + len as u64 > self.options.capacity_bytes {
            let Some(victim) = inner.evictor.pop_victim() else {
                break;
            };
            if let Some(v) = inner.pages.remove(&victim) {
                inner.bytes -= v.meta.len as u64;
                bump(&self.counters.evicted_pages, 1);
                bump(&self.counters.evicted_bytes, v.meta.len as u64);
                inner.recycler.keep(v);
            }
        }
        inner.bytes += len as u64;
        inner.pages.insert(*key, stored);
        inner.evictor.insert(*key);
        PageOutcome::Stored
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
        let out: Vec<PageOutcome> = keys
            .iter()
            .zip(dst.iter_mut())
            .map(|(k, d)| self.get_one(k, d))
            .collect();
        self.counters.record_get(&out, dst.iter().map(|d| d.len()));
        Ok(out)
    }

    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", self.options.max_batch, keys.len(), src.len())?;
        let out: Vec<PageOutcome> = keys
            .iter()
            .zip(src)
            .map(|(k, p)| self.set_one(k, p))
            .collect();
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
        // Room for 16 pages; the recycler keeps up to 2 buffers (1/8 of that).
        let m = MemoryBackend::with_capacity(16 * len as u64);
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
            let inner = m.inner.lock();
            assert!(inner.recycler.bytes > 0, "round {round}: nothing recycled");
            assert!(inner.recycler.bytes <= inner.recycler.limit);
        }
        // A damaged copy is still found on the one-pass read.
        assert!(m.corrupt_page(&k(70)));
        assert_eq!(read(&m, k(70), len).await.0, PageOutcome::Corrupt);
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
                r#"{"capacity": "2MiB", "eviction": "fifo", "max_batch": 512, "record_contexts": true}"#,
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
