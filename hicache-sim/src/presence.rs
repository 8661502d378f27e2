//! [`PresenceStorage`]: the L3 of a run without payload ([`Payload::Counted`]): it records
//! which pages are stored (key, layout, length), never their bytes, and stands in for the
//! backend the run was configured with where that backend would answer the same.
//!
//! Where the stand-in answers exactly as the backend it replaces ([`stands_in_for`]): the
//! `file` backend in a fresh scratch directory (empty, so nothing is there before the run)
//! with its default capacity. That backend answers from its index of committed pages: a page
//! is present once its write returned `Stored`, read back as a hit when its layout and length
//! match, and gone once deleted or cleared. It evicts only to stay under its capacity; the
//! stand-in takes the capacity the real backend reports when opened (90 % of the scratch
//! directory's free space by default) and, rather than evict, fails a write that would exceed
//! it ([`PageError::NoSpace`], counted as an L3 write error), so a divergence cannot pass
//! unseen.
//!
//! Invariants: `bytes` is the sum of the lengths of the pages in `pages` and never exceeds
//! `capacity`; both change under one lock. A hit writes nothing to the caller's buffer (a
//! run without payload never reads one).
//!
//! [`Payload::Counted`]: crate::setup::Payload::Counted

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use hicache_storage::backend::bump;
use hicache_storage::{
    BackendContext, BackendFactory, BackendInfo, CommonConfig, ConfigFields, NamespaceId, PageBuf,
    PageBufMut, PageError, PageKey, PageMeta, PageOutcome, Registry, StatsCounters, Storage,
    StorageStats, async_trait, check_batch,
};

use crate::setup::StorageSetup;

/// The backend a [`PresenceStorage`] can stand in for (see the module docs).
pub const STANDS_IN_FOR: &str = "file";

/// Whether a run's L3 of `storage`, in the command's fresh scratch directory when
/// `fresh_dir`, answers as a [`PresenceStorage`] would: the `file` backend, in a fresh
/// directory, without a configured `capacity`.
pub fn stands_in_for(storage: &StorageSetup, fresh_dir: bool) -> bool {
    storage.backend == STANDS_IN_FOR && fresh_dir && !storage.extra_config.contains_key("capacity")
}

#[derive(Debug, Default)]
struct Held {
    pages: HashMap<PageKey, PageMeta>,
    bytes: u64,
}

/// An L3 that records which pages it holds and no bytes (see the module docs).
#[derive(Debug)]
pub struct PresenceStorage {
    info: BackendInfo,
    capacity: u64,
    held: Mutex<Held>,
    counters: StatsCounters,
}

fn lock(m: &Mutex<Held>) -> MutexGuard<'_, Held> {
    // A poisoned lock only means another thread panicked while holding it; the map and the
    // byte count change together under the lock, so they are consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PresenceStorage {
    /// A stand-in describing itself as `info` (the replaced backend's limits: batch size,
    /// page size, capacity; no capacity: unbounded).
    pub fn new(info: BackendInfo) -> Self {
        Self {
            capacity: info.capacity_bytes.unwrap_or(u64::MAX),
            info,
            held: Mutex::new(Held::default()),
            counters: StatsCounters::default(),
        }
    }
}

#[async_trait]
impl Storage for PresenceStorage {
    fn info(&self) -> BackendInfo {
        self.info.clone()
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> hicache_storage::Result<usize> {
        check_batch("batch_exists", self.info.max_batch, keys.len(), keys.len())?;
        let held = lock(&self.held);
        let hits = keys
            .iter()
            .take_while(|k| held.pages.contains_key(k))
            .count();
        self.counters
            .record_exists((hits + 1).min(keys.len()), hits);
        Ok(hits)
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        check_batch("batch_get", self.info.max_batch, keys.len(), dst.len())?;
        let held = lock(&self.held);
        let outcomes: Vec<PageOutcome> = keys
            .iter()
            .zip(dst.iter())
            .map(|(k, d)| match held.pages.get(k) {
                Some(meta) if *meta == d.meta() => PageOutcome::Hit,
                Some(_) => {
                    bump(&self.counters.meta_mismatches, 1);
                    PageOutcome::Miss
                }
                None => PageOutcome::Miss,
            })
            .collect();
        self.counters
            .record_get(&outcomes, dst.iter().map(|d| d.len()));
        Ok(outcomes)
    }

    async fn batch_set(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        check_batch("batch_set", self.info.max_batch, keys.len(), src.len())?;
        let mut held = lock(&self.held);
        let outcomes: Vec<PageOutcome> = keys
            .iter()
            .zip(src)
            .map(|(k, s)| {
                let meta = s.meta();
                if held.pages.get(k) == Some(&meta) {
                    return PageOutcome::Present;
                }
                let replaced = held.pages.get(k).map_or(0, |m| m.len as u64);
                let bytes = held.bytes - replaced + meta.len as u64;
                if bytes > self.capacity {
                    return PageOutcome::Failed(PageError::NoSpace);
                }
                held.bytes = bytes;
                held.pages.insert(*k, meta);
                PageOutcome::Stored
            })
            .collect();
        self.counters
            .record_set(&outcomes, src.iter().map(|s| s.len()));
        Ok(outcomes)
    }

    async fn delete(&self, keys: &[PageKey]) -> hicache_storage::Result<usize> {
        check_batch("delete", self.info.max_batch, keys.len(), keys.len())?;
        let mut held = lock(&self.held);
        let mut removed = 0;
        for k in keys {
            if let Some(meta) = held.pages.remove(k) {
                held.bytes -= meta.len as u64;
                removed += 1;
            }
        }
        bump(&self.counters.deleted_pages, removed as u64);
        Ok(removed)
    }

    async fn clear(&self, namespace: NamespaceId) -> hicache_storage::Result<u64> {
        let mut held = lock(&self.held);
        let before = held.pages.len();
        let mut freed = 0;
        held.pages.retain(|k, meta| {
            let keep = k.namespace != namespace;
            if !keep {
                freed += meta.len as u64;
            }
            keep
        });
        held.bytes -= freed;
        let cleared = (before - held.pages.len()) as u64;
        bump(&self.counters.cleared_pages, cleared);
        Ok(cleared)
    }

    fn stats(&self) -> StorageStats {
        let held = lock(&self.held);
        self.counters.snapshot(
            held.pages.len() as u64,
            held.bytes,
            self.info.capacity_bytes,
        )
    }
}

/// Opens the replaced backend (checking its extra-config and reading its limits), closes it
/// and answers with a [`PresenceStorage`] described as it.
struct PresenceFactory {
    inner: Arc<dyn BackendFactory>,
}

#[async_trait]
impl BackendFactory for PresenceFactory {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn open(
        &self,
        common: &CommonConfig,
        fields: ConfigFields,
        ctx: &BackendContext,
    ) -> hicache_storage::Result<Arc<dyn Storage>> {
        let info = self.inner.open(common, fields, ctx).await?.info();
        Ok(Arc::new(PresenceStorage::new(info)))
    }
}

/// `base`'s backends, with [`STANDS_IN_FOR`] opened as a [`PresenceStorage`].
pub fn presence_registry(base: &Registry) -> hicache_storage::Result<Registry> {
    let out = Registry::new();
    for name in base.names() {
        let factory = base.factory(&name)?;
        if name == STANDS_IN_FOR {
            out.register_arc(Arc::new(PresenceFactory { inner: factory }))?;
        } else {
            out.register_arc(factory)?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_storage::{LayoutKind, PageHash, StorageConfig};

    fn key(i: u8, ns: u8) -> PageKey {
        PageKey::new(NamespaceId([ns; 16]), PageHash([i; 32]))
    }

    fn storage(capacity: Option<u64>) -> PresenceStorage {
        let mut info = BackendInfo::new("file", 4);
        info.capacity_bytes = capacity;
        PresenceStorage::new(info)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn answers_presence_and_metadata_without_bytes() {
        let s = storage(None);
        let data: [&[u8]; 3] = [&[1; 8], &[2; 8], &[3; 4]];
        let src: Vec<PageBuf<'_>> = data
            .iter()
            .map(|d| PageBuf::from_parts(LayoutKind::PageFirst, vec![*d]))
            .collect();
        let keys = [key(0, 1), key(1, 1), key(2, 1)];
        let out = s.batch_set(&keys[..2], &src[..2]).await.unwrap();
        assert_eq!(out, [PageOutcome::Stored, PageOutcome::Stored]);
        let out = s.batch_set(&keys[..1], &src[..1]).await.unwrap();
        assert_eq!(out, [PageOutcome::Present], "same metadata: kept");
        assert_eq!(s.batch_exists(&keys).await.unwrap(), 2);
        assert_eq!(s.batch_exists(&[keys[2], keys[0]]).await.unwrap(), 0);
        // Reads: a hit writes nothing; another length is a miss.
        let mut bufs = [vec![9u8; 8], vec![9u8; 4], vec![9u8; 8]];
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::from_parts(LayoutKind::PageFirst, vec![&mut b[..]]))
            .collect();
        let out = s.batch_get(&keys, &mut dst).await.unwrap();
        assert_eq!(
            out,
            [PageOutcome::Hit, PageOutcome::Miss, PageOutcome::Miss]
        );
        drop(dst);
        assert_eq!(bufs[0], [9u8; 8], "no payload: the buffer is untouched");
        let st = s.stats();
        assert_eq!((st.pages, st.bytes, st.meta_mismatches), (2, 16, 1));
        assert_eq!((st.set_stored, st.set_present, st.get_hits), (2, 1, 1));
        // Batches over the limit fail whole.
        let five = [key(9, 1); 5];
        assert!(s.batch_exists(&five).await.is_err());
        // Delete and clear.
        assert_eq!(s.delete(&[keys[0], keys[2]]).await.unwrap(), 1);
        s.batch_set(&[key(7, 2)], &src[2..]).await.unwrap();
        assert_eq!(s.clear(NamespaceId([1; 16])).await.unwrap(), 1);
        assert_eq!(s.batch_exists(&keys[1..2]).await.unwrap(), 0);
        assert_eq!(s.batch_exists(&[key(7, 2)]).await.unwrap(), 1);
        assert_eq!((s.stats().pages, s.stats().bytes), (1, 4));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_write_over_the_capacity_fails_instead_of_evicting() {
        let s = storage(Some(12));
        let data = [[1u8; 8], [2u8; 8]];
        let src: Vec<PageBuf<'_>> = data
            .iter()
            .map(|d| PageBuf::from_parts(LayoutKind::PageFirst, vec![&d[..]]))
            .collect();
        let out = s.batch_set(&[key(0, 1), key(1, 1)], &src).await.unwrap();
        assert_eq!(
            out,
            [PageOutcome::Stored, PageOutcome::Failed(PageError::NoSpace)]
        );
        assert_eq!(s.batch_exists(&[key(0, 1), key(1, 1)]).await.unwrap(), 1);
        assert_eq!(s.stats().set_errors, 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_registry_opens_the_file_backend_for_its_checks_and_limits() {
        let dir = tempfile::tempdir().unwrap();
        let base = hicache::backends::builtin_registry().unwrap();
        let reg = presence_registry(&base).unwrap();
        assert_eq!(reg.names(), base.names());
        let extra = serde_json::json!({"dir": dir.path()});
        let cfg = StorageConfig::from_value(Some("file"), extra, "test").unwrap();
        let s = reg.open(&cfg, &BackendContext::default()).await.unwrap();
        let real = base.open(&cfg, &BackendContext::default()).await.unwrap();
        // The same description (the capacity, 90 % of the free disk, moves between opens).
        let (mut a, mut b) = (s.info(), real.info());
        assert!(a.capacity_bytes.is_some() && b.capacity_bytes.is_some());
        (a.capacity_bytes, b.capacity_bytes) = (None, None);
        (a.max_page_bytes, b.max_page_bytes) = (0, 0);
        assert_eq!(a, b);
        assert_eq!(s.stats().pages, 0);
        let bad = serde_json::json!({"dir": dir.path(), "no_such_field": 1});
        let cfg = StorageConfig::from_value(Some("file"), bad, "test").unwrap();
        assert!(reg.open(&cfg, &BackendContext::default()).await.is_err());
    }

    #[test]
    fn stands_in_only_for_a_fresh_file_backend_of_default_capacity() {
        let setup = |backend: &str, extra: serde_json::Value| StorageSetup {
            backend: backend.into(),
            extra_config: extra.as_object().unwrap().clone(),
        };
        let file = setup("file", serde_json::json!({"dir": "/tmp/x"}));
        assert!(stands_in_for(&file, true));
        assert!(!stands_in_for(&file, false), "a directory of the user's");
        let capped = setup("file", serde_json::json!({"capacity": "1gb"}));
        assert!(!stands_in_for(&capped, true));
        assert!(!stands_in_for(
            &setup("memory", serde_json::json!({})),
            true
        ));
    }
}
