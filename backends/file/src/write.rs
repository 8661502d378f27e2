//! The write stage. A batch is classified, capacity reserved, then its pages are written,
//! each as a [`NewFile`]: a fresh temp file beside its final name, created, preallocated,
//! written whole in one vectored write, synced (`fdatasync`, unless `fsync: none`) and
//! renamed to its final name. Through the io_uring driver each page's steps are one chain
//! of linked requests run inside the kernel, many pages at once; through the threads driver
//! the same steps are blocking calls on `io_threads` threads. Under `always` each page's
//! directory is then synced; under `batch` the renames are made durable by one sync per
//! directory the batch touched, merged with those of concurrent batches ([`GroupCommit`]),
//! before any page is acknowledged; then the pages are published to the index.
//!
//! [`GroupCommit`]: hicache_localio::GroupCommit

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use hicache_localio::newfile::Step;
use hicache_localio::{FsyncPolicy, NewFile, NewFileError, NewFileResult, par, sys};
use hicache_storage::{PageBuf, PageError, PageKey, PageOutcome, SetBatch};

use crate::FileBackend;
use crate::format::{HEADER_LEN, file_bytes};
use crate::pageio::WriteIo;

/// Directories whose renames a batch needs durable; `None` when all synced, else why not.
pub(crate) type DirSyncs = BTreeSet<PathBuf>;
/// A commit group's answer to one batch: `Some(error)` if a directory sync failed.
pub(crate) type DirSyncResult = Option<String>;

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

    /// Writes each page of `todo` to a fresh temp file and renames it to its final name, as
    /// one [`NewFile`] per page through the driver (in the ring: one chain of linked
    /// requests per page, create → preallocate → write → `fdatasync` unless `fsync: none` →
    /// rename, many pages at once); under `always`, then syncs each page's directory.
    fn write_files(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        todo: &[usize],
    ) -> Vec<(usize, Result<(), PageError>)> {
        let mut out = Vec::with_capacity(todo.len());
        // Headers and checksums (CPU work) on `io_threads` threads.
        let prepared = par::par_map(self.opts.io_threads, todo.to_vec(), |i| {
            (i, WriteIo::new(self.io(), &keys[i], &src[i]))
        });
        let mut pages: Vec<(usize, WriteIo<'_>)> = Vec::with_capacity(todo.len());
        for (i, r) in prepared {
            match r {
                Ok(io) => pages.push((i, io)),
                Err(e) => out.push((i, Err(PageError::io("write", &e)))),
            }
        }
        let files: Vec<NewFile> = pages
            .iter()
            .enumerate()
            .map(|(x, (i, io))| NewFile {
                tmp: self.temp_path(&keys[*i]),
                dest: self.paths.page_path(&keys[*i]),
                iov: io.iovecs().to_vec(),
                direct: io.direct,
                prealloc: io.file_len,
                sync: self.opts.fsync.durable(),
                tag: x,
            })
            .collect();
        let mut results: Vec<Option<NewFileResult>> = (0..pages.len()).map(|_| None).collect();
        self.driver
            .write_new_files(files, &mut |x, r| results[x] = Some(r));
        let published: Vec<(usize, Result<(), PageError>)> = pages
            .into_iter()
            .zip(results)
            .map(|((i, io), r)| {
                io.release(&self.bufs);
                let r = match r {
                    Some(Ok(())) => Ok(()),
                    Some(Err(e)) => Err(page_error(&e)),
                    None => Err(PageError::Backend("internal: no result".into())),
                };
                (i, r)
            })
            .collect();
        if self.opts.fsync == FsyncPolicy::Always {
            // Each page durable on its own before it is acknowledged: its rename too.
            out.extend(par::par_map(self.opts.io_threads, published, |(i, r)| {
                let r = r.and_then(|()| {
                    sys::sync_dir(&self.paths.bucket(&keys[i]))
                        .map_err(|e| PageError::io("sync directory", &e))
                });
                (i, r)
            }));
        } else {
            out.extend(published);
        }
        out
    }
}

/// The page error of a file that was not published: `rename` for its rename, `write` for
/// every step before it (create, preallocate, write, data sync), as the threads path always
/// reported them.
fn page_error(e: &NewFileError) -> PageError {
    let op = match e.step {
        Step::Rename => "rename",
        _ => "write",
    };
    PageError::io(op, &e.error)
}
