//! Shared mode's housekeeping: adopting pages other processes committed, deleting evicted
//! page files, and the janitor that bounds the directory's total by deleting the least
//! recently used files.

use std::fs::{self, File};
use std::path::PathBuf;
use std::time::SystemTime;

use hicache_localio::sys;
use hicache_storage::backend::bump;
use hicache_storage::{PageKey, PageMeta};

use crate::format::{self, HEADER_LEN, file_bytes};
use crate::index::Entry;
use crate::open::remove_file;
use crate::{FileBackend, pageio};

impl FileBackend {
    /// Shared mode: if `key` is already committed on disk with `meta` (by another process),
    /// adopts it.
    pub(crate) fn adopt_from_disk(
        &self,
        key: &PageKey,
        meta: Option<PageMeta>,
    ) -> Option<PageMeta> {
        let h = pageio::check_page_file(&self.paths.page_path(key), false).ok()?;
        if h.key != *key || meta.is_some_and(|m| m != h.meta) {
            return None;
        }
        let mut ix = self.index.lock();
        if !ix.contains(key) {
            let mut victims = Vec::new();
            if ix.reserve(file_bytes(h.meta.len), &mut victims) {
                ix.insert(*key, h.meta);
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
            bump(&self.counters.evicted_pages, 1);
            bump(&self.counters.evicted_bytes, e.meta.len as u64);
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
        if total > self.capacity {
            files.sort_by_key(|f| f.0);
            for (_, len, k, p) in files {
                if total <= self.capacity {
                    break;
                }
                if remove_file(&p).unwrap_or(false) {
                    total -= len;
                    let e = self.index.lock().remove(&k);
                    bump(&self.counters.evicted_pages, 1);
                    bump(
                        &self.counters.evicted_bytes,
                        e.map_or(len.saturating_sub(HEADER_LEN as u64), |e| e.meta.len as u64),
                    );
                }
            }
        }
        sys::unflock(&lock);
    }
}
