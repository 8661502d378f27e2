//! Recovery at open: every page file is listed and checked (header, key, size; with
//! `verify_on_open` the data checksum too), invalid ones and stale temp files are deleted
//! and counted, and the valid ones indexed oldest first, then fitted to the capacity.

use std::collections::HashMap;
use std::fs;
use std::time::SystemTime;

use crate::io::par;
use crate::io::sys;
use hicache_storage::{PageKey, PageMeta, Result, StorageError};
use parking_lot::Mutex;

use crate::pages::format::{self, Layout, file_bytes};
use crate::pages::index::Index;
use crate::pages::open::{owned_temp_instance, remove_file};
use crate::pages::{FileOptions, OpenReport, Pages, pageio};

impl Pages {
    /// Scans the page directory and builds the index; returns it, the capacity, the report
    /// (pages, discarded, evicted) and the bytes evicted to fit the capacity.
    #[tracing::instrument(name = "file.recover", skip_all, fields(pages))]
    pub(crate) fn recover(
        paths: &Layout,
        opts: &FileOptions,
    ) -> Result<(Index, u64, OpenReport, u64)> {
        let root = &paths.root;
        let (found, discarded_pages, stale_temp_files) = Self::scan(
            paths,
            opts.io_threads,
            opts.verify_on_open,
            opts.shared,
            opts.read_only,
        );
        let used: u64 = found.iter().map(|(_, m, _, _)| file_bytes(m.len)).sum();
        let capacity = match opts.capacity_bytes {
            Some(c) => c,
            None => {
                let free = sys::free_bytes(root).map_err(StorageError::io("statvfs", root))?;
                (free + used) / 10 * 9
            }
        };
        let mut index = Index::new(capacity, opts.eviction);
        let mut found = found;
        found.sort_by_key(|(_, _, t, _)| *t);
        for (k, m, _, written) in &found {
            index.insert(*k, *m, *written);
        }
        let mut victims = Vec::new();
        index.reserve(0, &mut victims);
        // A read-only open only counts what it would evict.
        if !opts.read_only {
            for (k, _) in &victims {
                let _ = remove_file(&paths.page_path(k));
            }
        }
        let report = OpenReport {
            pages: index.len() as u64,
            discarded_pages,
            discarded_temp: stale_temp_files,
            evicted: victims.len() as u64,
            direct: false,
            uring: false,
        };
        tracing::Span::current().record("pages", report.pages);
        let evicted_bytes = victims.iter().map(|(_, e)| e.meta.len as u64).sum();
        Ok((index, capacity, report, evicted_bytes))
    }

    /// Lists and checks every page file; returns the valid ones (key, meta, mtime, write
    /// time), the
    /// number of invalid files deleted and the number of stale temp files deleted (every temp
    /// file in exclusive mode; those of dead instances in shared mode). With `dry` (a
    /// read-only open) nothing is deleted: the counts are what would be.
    #[allow(clippy::type_complexity)]
    fn scan(
        paths: &Layout,
        threads: usize,
        verify: bool,
        shared: bool,
        dry: bool,
    ) -> (Vec<(PageKey, PageMeta, SystemTime, u64)>, u64, u64) {
        let alive: Mutex<HashMap<String, bool>> = Mutex::new(HashMap::new());
        let tmp = paths.tmp();
        let is_live = |inst: &str| {
            shared
                && *alive
                    .lock()
                    .entry(inst.to_string())
                    .or_insert_with(|| Self::instance_alive(&tmp, inst))
        };
        let entries: Vec<fs::DirEntry> = match fs::read_dir(paths.pages()) {
            Ok(rd) => rd.flatten().collect(),
            Err(_) => Vec::new(),
        };
        let chunks: Vec<Vec<fs::DirEntry>> = {
            let mut it = entries.into_iter().peekable();
            let mut v = Vec::new();
            while it.peek().is_some() {
                v.push(it.by_ref().take(256).collect());
            }
            v
        };
        let per_chunk = par::par_map(threads, chunks, |chunk| {
            let mut ok = Vec::new();
            let mut bad = 0u64;
            let mut temp = 0u64;
            for e in chunk {
                let p = e.path();
                let name = e.file_name();
                // Only regular files with names this backend writes are touched: anything
                // else (foreign files, directories, symlinks) is left alone.
                if !e.file_type().is_ok_and(|t| t.is_file()) {
                    continue;
                }
                let Some(name) = name.to_str() else { continue };
                if let Some(inst) = owned_temp_instance(name) {
                    if !is_live(inst) && (dry || remove_file(&p).unwrap_or(false)) {
                        temp += 1;
                    }
                    continue;
                }
                let checked = match format::key_from_file_name(name) {
                    None => continue,
                    Some(k) => pageio::check_page_file(&p, verify).and_then(|h| {
                        if h.key == k {
                            Ok(h)
                        } else {
                            Err(format!("header names key {}", h.key))
                        }
                    }),
                };
                match checked {
                    Ok(h) => {
                        let mtime = e
                            .metadata()
                            .and_then(|m| m.modified())
                            .unwrap_or(SystemTime::UNIX_EPOCH);
                        ok.push((h.key, h.meta, mtime, h.written));
                    }
                    Err(why) => {
                        tracing::warn!(path = %p.display(), %why, "file backend: discarding invalid page file");
                        if dry || remove_file(&p).unwrap_or(false) {
                            bad += 1;
                        }
                    }
                }
            }
            (ok, bad, temp)
        });
        let mut all = Vec::new();
        let mut bad = 0;
        let mut temp = 0;
        for (ok, b, t) in per_chunk {
            all.extend(ok);
            bad += b;
            temp += t;
        }
        (all, bad, temp)
    }
}
