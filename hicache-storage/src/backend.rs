//! The [`Storage`] trait every L3 backend implements, its self-description ([`BackendInfo`]) and
//! its counters ([`StorageStats`]).
//!
//! # The contract
//!
//! Rules every backend obeys; the `conformance` suite (feature `testing`) checks each of them:
//!
//! 1. **Atomic visibility.** A page becomes visible (to `batch_exists` and `batch_get`, in this
//!    process and any other sharing the storage) only after its whole write completed. A torn
//!    or failed write is never returned.
//! 2. **Verified reads.** Every page carries a checksum verified on read. A mismatch is
//!    [`PageOutcome::Corrupt`] (a miss for the caller), counted in
//!    [`StorageStats::get_corrupt`], and the bad copy is dropped; bad bytes are never a `Hit`.
//! 3. **Metadata.** The page's layout and byte length are stored with it and compared with the
//!    destination on read (mismatch: a `Miss`, counted in [`StorageStats::meta_mismatches`]).
//!    The namespace is part of the key, so two namespaces never see each other's pages.
//! 4. **Leading run.** `batch_exists` returns the number of leading keys that are present
//!    (the index of the first absent key).
//! 5. **Batches.** A call with more than [`BackendInfo::max_batch`] keys fails whole with
//!    [`StorageError::BatchTooLarge`]; it is never silently truncated. Key and buffer lists of
//!    different lengths fail with [`StorageError::LengthMismatch`]. Everything else is reported
//!    per page in the returned outcomes, in key order.
//! 6. **Idempotent set.** Setting a key that is present with the same metadata may skip the
//!    write ([`PageOutcome::Present`]) or rewrite it ([`PageOutcome::Stored`]); a later read
//!    returns one complete written version, never a mix. A set with different metadata
//!    replaces the stored page.
//! 7. **Capacity.** Stored bytes stay within the configured capacity; room is made by evicting
//!    pages (policy per backend, LRU by default). A page larger than the capacity fails with
//!    [`PageError::TooLarge`](crate::PageError::TooLarge).
//! 8. **Concurrency.** All methods may be called concurrently from many tasks.
//! 9. **Batch context.** `batch_exists_with`, `batch_get_with` and `batch_set_with` carry a
//!    [`BatchContext`]: the keys of the pages before the batch in the same request (SGLang's
//!    `prefix_keys`, passed when `hicache_storage_pass_prefix_keys` is on) and optional extra
//!    info. A backend may use it for placement or read-ahead, never for what it answers: a call
//!    with a context returns exactly what the same call without one returns (outcomes, bytes).
//!    The defaults drop the context and call the plain methods, so a backend that has no use
//!    for it implements nothing; one that uses it overrides the three and sets
//!    [`BackendInfo::batch_context`]. A wrapper around another backend forwards all six (and `clear`, rule 10).
//! 10. **Clear.** A backend that reports [`BackendInfo::clear`] removes with
//!     [`Storage::clear`] every page of one namespace it holds (never a page of another
//!     namespace, never a file or key that is not its own), counts them, and afterwards serves
//!     them as misses and accepts them again. A local persistent backend clears crash-safely: a
//!     crash during the clear leaves each page of the namespace either intact or absent. Pages
//!     whose writes overlap the clear may survive it. A backend without the capability answers
//!     [`StorageError::Unsupported`] and changes nothing.

use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use hicache_core::{MemoryRegion, NamespaceId, PageKey};
use serde::Serialize;

use crate::context::BatchContext;
use crate::error::{Result, StorageError};
use crate::page::{PageBuf, PageBufMut, PageOutcome};

/// SGLang's batch size for L3 calls (`STORAGE_BATCH_SIZE`): the controller never sends more
/// pages in one call, and every backend accepts at least this many.
pub const STORAGE_BATCH_SIZE: usize = 128;

/// What a backend is and what it can do. Construct with [`BackendInfo::new`] and set fields.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BackendInfo {
    /// The registry name (`memory`, `file`, …).
    pub name: String,
    /// Whether pages move directly between caller buffers and the medium (no staging copy
    /// inside the backend).
    pub zero_copy: bool,
    /// Whether pages survive a restart of the process.
    pub persistent: bool,
    /// Whether several processes may use the same storage at once.
    pub shared: bool,
    /// Largest number of pages in one call.
    pub max_batch: usize,
    /// Largest page in bytes.
    pub max_page_bytes: usize,
    /// Capacity in bytes, when bounded.
    pub capacity_bytes: Option<u64>,
    /// Whether [`Storage::clear`] is supported (rule 10); `false` means it answers
    /// [`StorageError::Unsupported`].
    pub clear: bool,
    /// Whether the backend reads the [`BatchContext`] of the `*_with` calls (rule 9).
    /// Informational: callers pass the context either way, and a backend without this flag
    /// ignores it.
    pub batch_context: bool,
}

impl BackendInfo {
    /// A non-persistent, non-shared, copying backend with the given batch limit and no page or
    /// capacity limit.
    pub fn new(name: impl Into<String>, max_batch: usize) -> Self {
        Self {
            name: name.into(),
            zero_copy: false,
            persistent: false,
            shared: false,
            max_batch,
            max_page_bytes: usize::MAX,
            capacity_bytes: None,
            clear: false,
            batch_context: false,
        }
    }
}

/// A snapshot of a backend's counters. Construct with `StorageStats::default()` and set fields.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StorageStats {
    /// Pages currently stored (as far as this process knows).
    pub pages: u64,
    /// Bytes currently stored (page bytes, not counting headers).
    pub bytes: u64,
    /// Capacity in bytes, when bounded.
    pub capacity_bytes: Option<u64>,
    /// `batch_exists` calls.
    pub exists_calls: u64,
    /// Keys asked about by `batch_exists` (up to and including the first miss).
    pub exists_keys: u64,
    /// Pages reported present by `batch_exists`.
    pub exists_hits: u64,
    /// Pages asked for by `batch_get`.
    pub get_pages: u64,
    /// `Hit` outcomes.
    pub get_hits: u64,
    /// `Miss` outcomes (absent pages and metadata mismatches).
    pub get_misses: u64,
    /// Reads whose stored layout or length differed from the destination's.
    pub meta_mismatches: u64,
    /// `Corrupt` outcomes: stored copies that failed verification and were dropped.
    pub get_corrupt: u64,
    /// `Failed` outcomes of `batch_get`.
    pub get_errors: u64,
    /// Bytes returned by hits.
    pub get_bytes: u64,
    /// Pages offered to `batch_set`.
    pub set_pages: u64,
    /// `Stored` outcomes.
    pub set_stored: u64,
    /// `Present` outcomes (skipped, already stored).
    pub set_present: u64,
    /// `Failed` outcomes of `batch_set`.
    pub set_errors: u64,
    /// Bytes written by `Stored` outcomes.
    pub set_bytes: u64,
    /// Pages evicted to make room.
    pub evicted_pages: u64,
    /// Bytes evicted to make room.
    pub evicted_bytes: u64,
    /// Pages removed by `delete`.
    pub deleted_pages: u64,
    /// Pages removed by `clear`.
    pub cleared_pages: u64,
    /// Pages found expired (older than the backend's `ttl_s`) and dropped.
    pub expired_pages: u64,
    /// Stored pages found invalid and discarded when the storage was opened (torn, truncated,
    /// bad header), plus leftover temporary files removed.
    pub discarded_on_open: u64,
}

/// Lock-free counters a backend bumps on its I/O paths and snapshots into [`StorageStats`].
#[derive(Debug, Default)]
#[allow(missing_docs)] // one field per StorageStats counter of the same name
pub struct StatsCounters {
    pub exists_calls: AtomicU64,
    pub exists_keys: AtomicU64,
    pub exists_hits: AtomicU64,
    pub get_pages: AtomicU64,
    pub get_hits: AtomicU64,
    pub get_misses: AtomicU64,
    pub meta_mismatches: AtomicU64,
    pub get_corrupt: AtomicU64,
    pub get_errors: AtomicU64,
    pub get_bytes: AtomicU64,
    pub set_pages: AtomicU64,
    pub set_stored: AtomicU64,
    pub set_present: AtomicU64,
    pub set_errors: AtomicU64,
    pub set_bytes: AtomicU64,
    pub evicted_pages: AtomicU64,
    pub evicted_bytes: AtomicU64,
    pub deleted_pages: AtomicU64,
    pub cleared_pages: AtomicU64,
    pub expired_pages: AtomicU64,
    pub discarded_on_open: AtomicU64,
}

/// Adds `n` to a counter (relaxed: counters are statistics, not synchronisation).
pub fn bump(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl StatsCounters {
    /// Counts the outcomes of one `batch_get`.
    pub fn record_get(&self, outcomes: &[PageOutcome], lens: impl Iterator<Item = usize>) {
        bump(&self.get_pages, outcomes.len() as u64);
        for (o, len) in outcomes.iter().zip(lens) {
            match o {
                PageOutcome::Hit => {
                    bump(&self.get_hits, 1);
                    bump(&self.get_bytes, len as u64);
                }
                PageOutcome::Miss => bump(&self.get_misses, 1),
                PageOutcome::Corrupt => bump(&self.get_corrupt, 1),
                _ => bump(&self.get_errors, 1),
            }
        }
    }

    /// Counts the outcomes of one `batch_set`.
    pub fn record_set(&self, outcomes: &[PageOutcome], lens: impl Iterator<Item = usize>) {
        bump(&self.set_pages, outcomes.len() as u64);
        for (o, len) in outcomes.iter().zip(lens) {
            match o {
                PageOutcome::Stored => {
                    bump(&self.set_stored, 1);
                    bump(&self.set_bytes, len as u64);
                }
                PageOutcome::Present => bump(&self.set_present, 1),
                _ => bump(&self.set_errors, 1),
            }
        }
    }

    /// Counts one `batch_exists` call that looked at `looked` keys and found `hits`.
    pub fn record_exists(&self, looked: usize, hits: usize) {
        bump(&self.exists_calls, 1);
        bump(&self.exists_keys, looked as u64);
        bump(&self.exists_hits, hits as u64);
    }

    /// A snapshot, with the occupancy figures the backend supplies.
    pub fn snapshot(&self, pages: u64, bytes: u64, capacity_bytes: Option<u64>) -> StorageStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StorageStats {
            pages,
            bytes,
            capacity_bytes,
            exists_calls: g(&self.exists_calls),
            exists_keys: g(&self.exists_keys),
            exists_hits: g(&self.exists_hits),
            get_pages: g(&self.get_pages),
            get_hits: g(&self.get_hits),
            get_misses: g(&self.get_misses),
            meta_mismatches: g(&self.meta_mismatches),
            get_corrupt: g(&self.get_corrupt),
            get_errors: g(&self.get_errors),
            get_bytes: g(&self.get_bytes),
            set_pages: g(&self.set_pages),
            set_stored: g(&self.set_stored),
            set_present: g(&self.set_present),
            set_errors: g(&self.set_errors),
            set_bytes: g(&self.set_bytes),
            evicted_pages: g(&self.evicted_pages),
            evicted_bytes: g(&self.evicted_bytes),
            deleted_pages: g(&self.deleted_pages),
            cleared_pages: g(&self.cleared_pages),
            expired_pages: g(&self.expired_pages),
            discarded_on_open: g(&self.discarded_on_open),
        }
    }
}

/// Checks the batch-level rules (5) of the contract: at most `max_batch` keys and one buffer
/// per key. Backends call it first in `batch_get` / `batch_set` (with `buffers = keys` for
/// `batch_exists` and `delete`).
pub fn check_batch(op: &'static str, max_batch: usize, keys: usize, buffers: usize) -> Result<()> {
    if keys != buffers {
        return Err(StorageError::LengthMismatch { op, keys, buffers });
    }
    if keys > max_batch {
        return Err(StorageError::BatchTooLarge {
            len: keys,
            max: max_batch,
        });
    }
    Ok(())
}

/// An L3 storage backend. See the [module documentation](self) for the contract.
///
/// Buffers are borrowed from the caller for the duration of the call only; a backend must not
/// keep references to them after the returned future completes.
#[async_trait]
pub trait Storage: Send + Sync + 'static {
    /// What the backend is and what it can do.
    fn info(&self) -> BackendInfo;

    /// The number of leading `keys` that are present (the index of the first absent key).
    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize>;

    /// Reads `keys[i]` into `dst[i]`; one outcome per key, in order.
    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>>;

    /// Writes `src[i]` under `keys[i]`; one outcome per key, in order. A `Stored` outcome is
    /// returned only once the page is committed (visible, and durable per the backend's
    /// durability policy).
    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>>;

    /// [`batch_exists`](Self::batch_exists) with the batch's context (rule 9). The default
    /// ignores the context.
    async fn batch_exists_with(&self, keys: &[PageKey], ctx: BatchContext<'_>) -> Result<usize> {
        let _ = ctx;
        self.batch_exists(keys).await
    }

    /// [`batch_get`](Self::batch_get) with the batch's context (rule 9). The default ignores
    /// the context.
    async fn batch_get_with(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
        ctx: BatchContext<'_>,
    ) -> Result<Vec<PageOutcome>> {
        let _ = ctx;
        self.batch_get(keys, dst).await
    }

    /// [`batch_set`](Self::batch_set) with the batch's context (rule 9). The default ignores
    /// the context.
    async fn batch_set_with(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        ctx: BatchContext<'_>,
    ) -> Result<Vec<PageOutcome>> {
        let _ = ctx;
        self.batch_set(keys, src).await
    }

    /// Announces the long-lived memory region (the pinned host pool) that page buffers of later
    /// calls lie in, so the backend can register it once (io_uring fixed buffers, an RDMA
    /// memory region). Called at most once, before any I/O. The default ignores it.
    fn register_memory(&self, region: MemoryRegion) -> Result<()> {
        let _ = region;
        Ok(())
    }

    /// Removes the pages of `keys` that are present; returns how many were removed. Absent
    /// keys are not an error.
    async fn delete(&self, keys: &[PageKey]) -> Result<usize>;

    /// Removes every page of `namespace` this storage holds (rule 10); returns how many were
    /// removed. The default, for backends without the capability ([`BackendInfo::clear`]
    /// false), answers [`StorageError::Unsupported`] naming the backend.
    async fn clear(&self, namespace: NamespaceId) -> Result<u64> {
        let _ = namespace;
        Err(StorageError::Unsupported {
            backend: self.info().name,
            op: "clear",
        })
    }

    /// A snapshot of the backend's counters.
    fn stats(&self) -> StorageStats;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_checks_name_the_sizes() {
        assert!(check_batch("batch_get", 128, 128, 128).is_ok());
        let e = check_batch("batch_get", 128, 129, 129).unwrap_err();
        assert!(e.to_string().contains("129"), "{e}");
        let e = check_batch("batch_set", 128, 3, 2).unwrap_err();
        assert!(matches!(
            e,
            StorageError::LengthMismatch {
                keys: 3,
                buffers: 2,
                ..
            }
        ));
    }
}
