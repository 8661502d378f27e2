//! The write stage. A batch is classified, capacity reserved, then its pages are written:
//! each to a fresh temp file beside its final name (created and preallocated on `io_threads`
//! threads), its bytes through the driver in one vectored write, then synced (`fdatasync`,
//! unless `fsync: none`) and renamed to its final name (under `always`, its directory synced
//! too), again on `io_threads` threads. Under `batch` the renames are made durable by one sync per directory the
//! batch touched, merged with those of concurrent batches ([`GroupCommit`]), before any page
//! is acknowledged; then the pages are published to the index.
//!
//! [`GroupCommit`]: hicache_localio::GroupCommit

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use hicache_localio::ring::{Dir, Req};
use hicache_localio::{FsyncPolicy, par, sys};
use hicache_storage::{PageBuf, PageError, PageKey, PageOutcome, SetBatch};

use crate::FileBackend;
use crate::format::{HEADER_LEN, file_bytes};
use crate::open::remove_file;
use crate::pageio::WriteIo;

/// Directories whose renames a batch needs durable; `None` when all synced, else why not.
pub(crate) type DirSyncs = BTreeSet<PathBuf>;
/// A commit group's answer to one batch: `Some(error)` if a directory sync failed.
pub(crate) type DirSyncResult = Option<String>;

/// One page being written: its bytes, its open temp file and names.
struct PageWrite<'a> {
    idx: usize,
    io: WriteIo<'a>,
    file: File,
    tmp: PathBuf,
}

impl FileBackend {
    /// `batch_set` on the calling (blocking) thread.
    pub(crate) fn set_blocking(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Vec<PageOutcome> {
        let mut victims = Vec::new();
        let mut reserved = 0u64;
        let mut batch = {
            let mut ix = self.index.lock();
            let mut b = SetBatch::classify(
                keys,
                src,
                |len| {
                    (file_bytes(len) > self.capacity)
                        .then(|| (self.capacity as usize).saturating_sub(HEADER_LEN))
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
            let mut ix = self.index.lock();
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
                    op: "sync directory",
                    detail: why.clone(),
                }),
                (Ok(()), None) => Ok(true),
                (Err(e), _) => Err(e),
            };
            (i, r)
        }));
        results
    }

    /// A commit group's work: one sync per directory any of its batches touched.
    #[tracing::instrument(name = "file.commit", skip_all, fields(batches = items.len(), dirs))]
    fn sync_dirs(&self, items: Vec<DirSyncs>) -> Vec<DirSyncResult> {
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

    /// Writes each page of `todo` to a temp file through the driver and renames it to its
    /// final name when its write completed (syncing the directory under `always`).
    fn write_files(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        todo: &[usize],
    ) -> Vec<(usize, Result<(), PageError>)> {
        let mut out = Vec::with_capacity(todo.len());
        let mut pages: Vec<PageWrite<'_>> = Vec::with_capacity(todo.len());
        // Creates and preallocations on `io_threads` threads: each takes a journal handle on
        // ext4 and may wait for a commit, so one thread doing them all serialises the batch
        // behind the file system's journal.
        let prepared = par::par_map(self.opts.io_threads, todo.to_vec(), |i| {
            (i, self.prepare(&keys[i], &src[i]))
        });
        for (i, r) in prepared {
            match r {
                Ok((io, file, tmp)) => pages.push(PageWrite {
                    idx: i,
                    io,
                    file,
                    tmp,
                }),
                Err(e) => out.push((i, Err(PageError::io("write", &e)))),
            }
        }
        let reqs: Vec<Req> = pages
            .iter()
            .enumerate()
            .map(|(x, p)| Req::new(Dir::Write, p.file.as_raw_fd(), 0, p.io.iovecs().to_vec(), x))
            .collect();
        let mut written: Vec<Option<io::Result<usize>>> = (0..pages.len()).map(|_| None).collect();
        self.driver.run(reqs, &mut |x, r| written[x] = Some(r));
        // Renames (and, under `always`, directory syncs) on `io_threads` threads too.
        let done = par::par_map(
            self.opts.io_threads,
            pages.into_iter().zip(written).collect(),
            |(p, r)| {
                let r = match r {
                    Some(Ok(_)) => self.publish(&keys[p.idx], &p),
                    Some(Err(e)) => Err(PageError::io("write", &e)),
                    None => Err(PageError::Backend("internal: no result".into())),
                };
                if r.is_err() {
                    let _ = remove_file(&p.tmp);
                }
                drop(p.file);
                p.io.release(&self.bufs);
                (p.idx, r)
            },
        );
        out.extend(done);
        out
    }

    /// A page's bytes prepared, its temp file created (exclusively) and preallocated.
    fn prepare<'a>(
        &self,
        key: &PageKey,
        page: &PageBuf<'a>,
    ) -> io::Result<(WriteIo<'a>, File, PathBuf)> {
        let io = WriteIo::new(self.io(), key, page)?;
        let tmp = self.temp_path(key);
        let file = sys::create_new(&tmp, io.direct)
            .and_then(|f| sys::preallocate(&f, io.file_len).map(|()| f));
        match file {
            Ok(f) => Ok((io, f, tmp)),
            Err(e) => {
                let _ = remove_file(&tmp);
                io.release(&self.bufs);
                Err(e)
            }
        }
    }

    /// Syncs a written temp file's data (unless `fsync: none`) and renames it to its final
    /// name (under `always`, then syncs the directory): the page is now visible on disk.
    ///
    /// The data sync is an `fdatasync` here, on one of `io_threads` threads, not `RWF_DSYNC`
    /// on the write: ext4 completes direct writes on a one-at-a-time work queue, so `RWF_DSYNC`
    /// serialised every page's journal commit (256 KiB pages at 0.07–0.16 of the reference
    /// against 0.40 this way, same-run A/B); parallel `fdatasync`s share commits.
    fn publish(&self, key: &PageKey, p: &PageWrite<'_>) -> Result<(), PageError> {
        if self.opts.fsync.durable() {
            sys::sync_data(&p.file).map_err(|e| PageError::io("write", &e))?;
        }
        sys::rename(&p.tmp, &self.paths.page_path(key)).map_err(|e| PageError::io("rename", &e))?;
        if self.opts.fsync == FsyncPolicy::Always {
            sys::sync_dir(&self.paths.bucket(key))
                .map_err(|e| PageError::io("sync directory", &e))?;
        }
        Ok(())
    }
}
