//! The write stage. A batch is classified, capacity reserved, then its pages are written,
//! each as a [`NewFile`]: a fresh file created without a name in its final name's directory
//! (`O_TMPFILE` relative to `pages/` held open, a [`DirFd`]; where the file system lacks it,
//! under a temp name beside the final one), preallocated, written whole in one vectored
//! write, synced (`fdatasync`, where the policy syncs per page) and linked by descriptor (or
//! renamed) to its final name, as blocking calls on at most
//! [`CREATE_THREADS`] threads per batch, whichever engine carries the reads. Then, before any page is acknowledged:
//! - `fsync: batch`, `batch_sync: syncfs` (default): the pages were not synced one by one;
//!   one `syncfs` of the file system makes the batch's data, block maps and renames durable
//!   at once, merged with concurrent batches' ([`GroupCommit`]). A crash before it may leave
//!   a final name over torn bytes: its header or data checksum fails and it is a miss, never
//!   a wrong page, and no such page was acknowledged.
//! - `fsync: batch`, `batch_sync: per_page`: each page's data was synced before its rename;
//!   one sync per directory the batch touched, merged across batches, makes the renames
//!   durable.
//! - `fsync: always`: each page's data synced before its rename, its directory after it.
//!
//! Then the pages are published to the index.
//!
//! [`GroupCommit`]: crate::io::GroupCommit
//! [`DirFd`]: crate::io::DirFd

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use crate::io::newfile::{self, Step};
use crate::io::{FsyncPolicy, NewFile, NewFileError, par, sys};
use hicache_storage::{PageBuf, PageError, PageKey, PageOutcome, SetBatch};

use crate::pages::Pages;
use crate::pages::format::{HEADER_LEN, file_bytes};
use crate::pages::options::BatchSync;
use crate::pages::pageio::WriteIo;

/// Threads writing one batch's pages, each preparing a page (header, checksum) and then
/// making its file, so checksums overlap other pages' I/O. A create and a rename each take
/// the directory's lock, so page files of one directory are made one at a time there; more
/// makers only spin on that lock. Measured here (2 cores, ext4, 256 KiB pages, 4 batches in
/// flight, same-run raw O_DIRECT reference): 8 threads a batch 0.79-0.91 when every checksum
/// came first, 0.74-0.87 (1.77-1.90 GB/s vs 1.51-1.57) with each thread checksumming its own
/// page; 4 threads 0.72-0.82, 32 threads 0.39; io_uring chains of linked requests (create →
/// preallocate → write → rename run in the kernel's workers) 0.66-0.88 at 16 in flight,
/// 0.60-0.71 at 128. (Those with one batch in flight: the bench ran its batches one at a
/// time until 2026-12-04.) With 4 batches really in flight (2026-12-04, load 2-6): 16 threads
/// 0.65-0.94 against 0.75-0.97 for 8; io_uring for the data writes (one submission of the
/// batch after its creates, or each page's write as soon as its file is made) 0.42-0.99
/// against 0.64-1.00 (docs/benchmarks.md, "file").
pub(crate) const CREATE_THREADS: usize = 8;

/// Directories whose renames a batch needs durable; `None` when all synced, else why not.
pub(crate) type DirSyncs = BTreeSet<PathBuf>;
/// A commit group's answer to one batch: `Some(error)` if a directory sync failed.
pub(crate) type DirSyncResult = Option<String>;

impl Pages {
    /// `batch_set` on the calling (blocking) thread.
    pub(crate) fn set_blocking(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Vec<PageOutcome> {
        let mut victims = Vec::new();
        let mut reserved = 0u64;
        let mut batch = {
            let mut ix = self.core.index.lock();
            let mut b = SetBatch::classify(
                keys,
                src,
                |len| {
                    (file_bytes(len) > self.core.capacity)
                        .then(|| (self.core.capacity as usize).saturating_sub(HEADER_LEN))
                },
                |k, meta| {
                    // An expired page is rewritten (a fresh write time), not kept.
                    let same = ix.get(k).is_some_and(|e| {
                        e.meta == meta && !self.clock.expired(e.written, self.opts.lifecycle.ttl)
                    });
                    if same {
                        ix.touch(k);
                    }
                    same
                },
            );
            let todo = std::mem::take(&mut b.todo);
            for i in todo {
                let need = file_bytes(src[i].len());
                if ix.reserve(need, &mut victims) {
                    reserved += need;
                    b.todo.push(i);
                } else {
                    b.outcomes.set(i, PageOutcome::Failed(PageError::NoSpace));
                }
            }
            b
        };
        self.drop_victims(&victims);
        let now = self.clock.now();
        let results = self.write_batch(keys, src, &batch.todo);
        let mut stored_bytes = 0u64;
        {
            let mut ix = self.core.index.lock();
            for (i, r) in results {
                batch.outcomes.set(
                    i,
                    match r {
                        Ok(true) => {
                            ix.insert(keys[i], src[i].meta(), now);
                            stored_bytes += file_bytes(src[i].len());
                            PageOutcome::Stored
                        }
                        Ok(false) => PageOutcome::Present,
                        Err(e) => {
                            tracing::warn!(key = %keys[i], error = %e, "file backend: page write failed");
                            PageOutcome::Failed(e)
                        }
                    },
                );
            }
            ix.release(reserved);
        }
        self.after_write(stored_bytes);
        self.check_watermark();
        batch.finish()
    }

    /// Shared mode: runs the janitor once enough bytes were written since the last rescan.
    fn after_write(&self, stored_bytes: u64) {
        if !self.opts.shared || stored_bytes == 0 {
            return;
        }
        let w = self
            .written_since_rescan
            .fetch_add(stored_bytes, Ordering::Relaxed)
            + stored_bytes;
        if w >= self.rescan_bytes {
            self.written_since_rescan.store(0, Ordering::Relaxed);
            self.janitor();
        }
    }

    /// Writes and commits the pages `todo`; `Ok(true)` once committed (durably per the
    /// policy), `Ok(false)` when adopted from another process (shared mode).
    fn write_batch(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        todo: &[usize],
    ) -> Vec<(usize, Result<bool, PageError>)> {
        let mut results: Vec<(usize, Result<bool, PageError>)> = Vec::new();
        let todo: Vec<usize> = if self.opts.shared {
            // A page another process committed meanwhile is adopted, not rewritten.
            let adopted = par::par_map(self.opts.io_threads, todo.to_vec(), |i| {
                (
                    i,
                    self.adopt_from_disk(&keys[i], Some(src[i].meta()))
                        .is_some(),
                )
            });
            adopted
                .into_iter()
                .filter_map(|(i, a)| {
                    if a {
                        results.push((i, Ok(false)));
                        None
                    } else {
                        Some(i)
                    }
                })
                .collect()
        } else {
            todo.to_vec()
        };
        let written = self.write_files(keys, src, &todo);
        let dirs: DirSyncs = written
            .iter()
            .filter(|(_, r)| r.is_ok())
            .map(|(i, _)| self.paths.bucket(&keys[*i]))
            .collect();
        let synced = if self.opts.fsync == FsyncPolicy::Batch && !dirs.is_empty() {
            self.commit.run(dirs, |items| self.sync_dirs(items))
        } else {
            None
        };
        results.extend(written.into_iter().map(|(i, r)| {
            let r = match (r, &synced) {
                // The renames happened but may not survive a power loss: report, do not ack.
                (Ok(()), Some(why)) => Err(PageError::Io {
                    op: match self.opts.batch_sync {
                        BatchSync::Syncfs => "sync file system",
                        BatchSync::PerPage => "sync directory",
                    },
                    detail: why.clone(),
                }),
                (Ok(()), None) => Ok(true),
                (Err(e), _) => Err(e),
            };
            (i, r)
        }));
        results
    }

    /// Whether each page is `fdatasync`ed on its own, before its rename.
    fn sync_each_page(&self) -> bool {
        match self.opts.fsync {
            FsyncPolicy::None => false,
            FsyncPolicy::Batch => self.opts.batch_sync == BatchSync::PerPage,
            FsyncPolicy::Always => true,
        }
    }

    /// A commit group's work: one `syncfs` (`batch_sync: syncfs`), or one sync per directory
    /// any of its batches touched (`per_page`, whose data is already durable).
    #[tracing::instrument(name = "file.commit", skip_all, fields(batches = items.len(), dirs))]
    fn sync_dirs(&self, items: Vec<DirSyncs>) -> Vec<DirSyncResult> {
        if self.opts.batch_sync == BatchSync::Syncfs {
            let r = sys::sync_fs(&self.paths.root).map_err(|e| e.to_string());
            if let Err(e) = &r {
                tracing::warn!(%e, "file backend: file-system sync failed");
            }
            return items.iter().map(|_| r.clone().err()).collect();
        }
        let all: BTreeSet<PathBuf> = items.iter().flatten().cloned().collect();
        tracing::Span::current().record("dirs", all.len());
        let failed: Vec<(PathBuf, String)> = par::par_map(
            self.opts.io_threads,
            all.into_iter().collect(),
            |b: PathBuf| sys::sync_dir(&b).map_err(|e| (b, e.to_string())),
        )
        .into_iter()
        .filter_map(|r| r.err())
        .collect();
        for (b, e) in &failed {
            tracing::warn!(dir = %b.display(), %e, "file backend: directory sync failed");
        }
        items
            .iter()
            .map(|dirs| {
                failed
                    .iter()
                    .find(|(b, _)| dirs.contains(b))
                    .map(|(_, e)| e.clone())
            })
            .collect()
    }

    /// Writes each page of `todo` to a fresh temp file and renames it to its final name, as
    /// one [`NewFile`] per page (create → preallocate → write → `fdatasync` where the policy
    /// syncs each page → rename) on at most [`CREATE_THREADS`] threads; under `always`, then
    /// syncs each page's directory.
    fn write_files(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        todo: &[usize],
    ) -> Vec<(usize, Result<(), PageError>)> {
        let threads = self.opts.io_threads.min(CREATE_THREADS);
        let sync = self.sync_each_page();
        // Each thread prepares a page (header, checksum: CPU work) and then makes its file,
        // so one page's checksum overlaps other pages' I/O.
        par::par_map(threads, todo.to_vec(), |i| {
            let io = match WriteIo::new(self.io(), &keys[i], &src[i]) {
                Ok(io) => io,
                Err(e) => return (i, Err(PageError::io("write", &e))),
            };
            let file = NewFile {
                tmp: self.temp_path(&keys[i]),
                dest: self.paths.page_path(&keys[i]),
                iov: io.iovecs().to_vec(),
                direct: io.direct,
                prealloc: io.file_len,
                sync,
                unnamed: self.unnamed.clone(),
                tag: i,
            };
            let made = newfile::write_blocking(&file).map_err(|e| page_error(&e));
            io.release(&self.bufs);
            // Under `always` each page is durable on its own before it is acknowledged: its
            // rename too.
            let r = made.and_then(|()| {
                if self.opts.fsync == FsyncPolicy::Always {
                    sys::sync_dir(&self.paths.bucket(&keys[i]))
                        .map_err(|e| PageError::io("sync directory", &e))
                } else {
                    Ok(())
                }
            });
            (i, r)
        })
    }
}

/// The page error of a file that was not published: `rename` for its rename, `write` for
/// every step before it (create, preallocate, write, data sync), as the threads path always
/// reported them.
fn page_error(e: &NewFileError) -> PageError {
    let op = match e.step {
        Step::Rename => "rename",
        Step::Link => "link",
        _ => "write",
    };
    PageError::io(op, &e.error)
}
