//! Housekeeping, the reclaim stage: adopting pages other processes committed (shared mode),
//! deleting evicted page files, the shared-mode janitor that bounds the directory's total by
//! deleting the least recently used files, and `clear` of one namespace.
//!
//! Crash safety of every removal here: a page is one file, removed by one `unlink` of its
//! committed name, so a crash (or power loss) in the middle of a clear or an eviction run
//! leaves each page either whole (its file still there, verified on read) or gone, never torn.

use std::fs::{self, File};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use crate::io::FsyncPolicy;
use crate::io::sys;
use hicache_storage::backend::bump;
use hicache_storage::{Clock, Lifecycle, StatsCounters};
use hicache_storage::{NamespaceId, PageKey, PageMeta};
use parking_lot::Mutex;

use crate::pages::format::{self, HEADER_LEN, Layout, file_bytes};
use crate::pages::index::{Entry, Index};
use crate::pages::open::remove_file;
use crate::pages::{Pages, pageio};

impl Pages {
    /// Shared mode: if `key` is already committed on disk with `meta` (by another process),
    /// adopts it.
    pub(crate) fn adopt_from_disk(
        &self,
        key: &PageKey,
        meta: Option<PageMeta>,
    ) -> Option<PageMeta> {
        let h = pageio::check_page_file(&self.paths.page_path(key), false).ok()?;
        if h.key != *key
            || meta.is_some_and(|m| m != h.meta)
            || self.clock.expired(h.written, self.opts.lifecycle.ttl)
        {
            return None;
        }
        let mut ix = self.core.index.lock();
        if !ix.contains(key) {
            let mut victims = Vec::new();
            if ix.reserve(file_bytes(h.meta.len), &mut victims) {
                ix.insert(*key, h.meta, h.written);
                ix.release(file_bytes(h.meta.len));
            }
            drop(ix);
            self.drop_victims(&victims);
        }
        Some(h.meta)
    }

    pub(crate) fn drop_victims(&self, victims: &[(PageKey, Entry)]) {
        for (k, e) in victims {
            if let Err(err) = remove_file(&self.paths.page_path(k)) {
                tracing::warn!(key = %k, %err, "file backend: could not delete an evicted page");
            }
            bump(&self.core.counters.evicted_pages, 1);
            bump(&self.core.counters.evicted_bytes, e.meta.len as u64);
        }
    }

    /// Shared mode: if no other process is doing it, rescans the directory and deletes the
    /// least recently used page files (by modification time, which readers refresh) until the
    /// directory's total is within the capacity.
    pub(crate) fn janitor(&self) {
        let lock_path = self.paths.root.join("janitor.lock");
        let Ok(lock) = File::create(&lock_path) else {
            return;
        };
        if !sys::try_flock(&lock, true).unwrap_or(false) {
            return;
        }
        let mut files: Vec<(SystemTime, u64, PageKey, PathBuf)> = Vec::new();
        if let Ok(rd) = fs::read_dir(self.paths.pages()) {
            for e in rd.flatten() {
                let Some(k) = e.file_name().to_str().and_then(format::key_from_file_name) else {
                    continue;
                };
                let Ok(m) = e.metadata() else { continue };
                if !m.file_type().is_file() {
                    continue;
                }
                files.push((
                    m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    m.len(),
                    k,
                    e.path(),
                ));
            }
        }
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        if total > self.core.capacity {
            files.sort_by_key(|f| f.0);
            for (_, len, k, p) in files {
                if total <= self.core.capacity {
                    break;
                }
                if remove_file(&p).unwrap_or(false) {
                    total -= len;
                    let e = self.core.index.lock().remove(&k);
                    bump(&self.core.counters.evicted_pages, 1);
                    bump(
                        &self.core.counters.evicted_bytes,
                        e.map_or(len.saturating_sub(HEADER_LEN as u64), |e| e.meta.len as u64),
                    );
                }
            }
        }
        sys::unflock(&lock);
    }
}

impl Pages {
    /// `clear` on the calling (blocking) thread: removes every committed page file of
    /// `namespace` in `pages/` (this process's and, in shared mode, any other's), forgets them
    /// in the index, then (unless `fsync: none`) syncs the directory so the clear survives a
    /// power loss. Only names of the form `<key>.page` whose key carries `namespace` are
    /// touched; temp files of writes in flight are left to their writers.
    pub(crate) fn clear_blocking(&self, namespace: NamespaceId) -> std::io::Result<u64> {
        let pages = self.paths.pages();
        let mut removed = 0u64;
        for e in fs::read_dir(&pages)?.flatten() {
            let Some(k) = e.file_name().to_str().and_then(format::key_from_file_name) else {
                continue;
            };
            if k.namespace != namespace || !e.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let known = self.core.index.lock().remove(&k).is_some();
            match remove_file(&e.path()) {
                Ok(existed) => removed += u64::from(existed || known),
                Err(err) => {
                    tracing::warn!(key = %k, %err, "file backend: clear could not delete a page");
                    return Err(err);
                }
            }
        }
        // Pages the index knew but the listing missed (deleted behind our back): forget them.
        let stale: Vec<PageKey> = {
            let ix = self.core.index.lock();
            ix.keys()
                .filter(|k| k.namespace == namespace)
                .copied()
                .collect()
        };
        for k in stale {
            self.core.index.lock().remove(&k);
            if remove_file(&self.paths.page_path(&k))? {
                removed += 1;
            }
        }
        if self.opts.fsync != FsyncPolicy::None {
            sys::sync_dir(&pages)?;
        }
        Ok(removed)
    }
}

/// Called by the reclaim thread after each chunk of a pass with the pages it removed so far
/// in that pass (for observability and for tests that hold a pass midway to show batches
/// proceed meanwhile).
pub type ReclaimHook = Arc<dyn Fn(u64) + Send + Sync>;

/// Pages removed per index-lock hold by the reclaim thread: batches wait for the lock at
/// most one chunk's bookkeeping (no I/O is done under it).
pub(crate) const RECLAIM_CHUNK: usize = 64;

/// What the background reclaim pass works on: clones of the backend's shared state.
pub(crate) struct Reclaim {
    pub index: Arc<Mutex<Index>>,
    pub counters: Arc<StatsCounters>,
    pub paths: Layout,
    pub capacity: u64,
    pub lifecycle: Lifecycle,
    pub clock: Clock,
    pub hook: Arc<Mutex<Option<ReclaimHook>>>,
}

impl Reclaim {
    /// One pass, on the reclaim thread: drops expired pages (`ttl_s`), then evicts in the
    /// index's eviction order until committed bytes are at most the low watermark. Each
    /// chunk is taken out of the index under its lock, and its files are deleted after the
    /// lock is released, so batches keep going during a pass. A page is one file removed by
    /// one unlink: a crash mid-pass leaves every page whole or gone.
    pub fn pass(&self) {
        let mut removed = 0u64;
        if let Some(ttl) = self.lifecycle.ttl {
            let expired = |w: u64| self.clock.expired(w, Some(ttl));
            // One scan of the index per pass; each chunk re-checks its keys under the lock
            // (a key written again meanwhile is fresh and stays).
            let candidates = self.index.lock().expired_keys(usize::MAX, expired);
            for keys in candidates.chunks(RECLAIM_CHUNK) {
                let chunk: Vec<(PageKey, Entry)> = {
                    let mut ix = self.index.lock();
                    let mut out = Vec::new();
                    for k in keys {
                        if ix.get(k).is_some_and(|e| expired(e.written))
                            && let Some(e) = ix.remove(k)
                        {
                            out.push((*k, e));
                        }
                    }
                    out
                };
                for (k, _) in &chunk {
                    if let Err(err) = remove_file(&self.paths.page_path(k)) {
                        tracing::warn!(key = %k, %err, "file backend: could not delete an expired page");
                    }
                }
                bump(&self.counters.expired_pages, chunk.len() as u64);
                removed += chunk.len() as u64;
                if !chunk.is_empty() {
                    self.call_hook(removed);
                }
            }
        }
        if let Some(w) = self.lifecycle.watermarks {
            let (_, low) = w.bytes(self.capacity);
            loop {
                let mut victims = Vec::new();
                let reached = self
                    .index
                    .lock()
                    .evict_down_to(low, RECLAIM_CHUNK, &mut victims);
                for (k, e) in &victims {
                    if let Err(err) = remove_file(&self.paths.page_path(k)) {
                        tracing::warn!(key = %k, %err, "file backend: could not delete an evicted page");
                    }
                    bump(&self.counters.evicted_pages, 1);
                    bump(&self.counters.evicted_bytes, e.meta.len as u64);
                }
                removed += victims.len() as u64;
                if !victims.is_empty() {
                    self.call_hook(removed);
                }
                if reached {
                    break;
                }
            }
        }
    }

    fn call_hook(&self, removed: u64) {
        let hook = self.hook.lock().clone();
        if let Some(h) = hook {
            h(removed);
        }
    }
}
