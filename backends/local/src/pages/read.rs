//! The read stage: each wanted page file is opened (O_DIRECT when the destination allows),
//! read whole (header and page) through the driver in one vectored read, then verified
//! (header, key, metadata, length, checksum) on up to `io_threads` threads: verification is
//! CPU work, and doing it on the one thread that reaps completions would make one core the
//! limit. A damaged page is zeroed, deleted and reported `Corrupt`.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use crate::io::ring::{Dir, Req};
use crate::io::{par, sys};
use hicache_storage::backend::bump;
use hicache_storage::{Outcomes, PageBufMut, PageError, PageKey, PageOutcome};

use crate::pages::Pages;
use crate::pages::format::file_bytes;
use crate::pages::open::remove_file;
use crate::pages::pageio::{ReadIo, ReadResult};

/// One page file being read.
struct PageRead<'d, 'b> {
    idx: usize,
    io: ReadIo<'d, 'b>,
    file: File,
}

impl Pages {
    /// `batch_exists`: the leading run of `keys` listed in the index
    /// and not expired (in shared mode: whose files exist, and adopting files another
    /// process wrote).
    pub(crate) fn leading_run(&self, keys: &[PageKey]) -> usize {
        let mut hits = {
            let ix = self.core.index.lock();
            keys.iter()
                .take_while(|k| ix.get(k).is_some_and(|e| !self.expired(e.written)))
                .count()
        };
        if hits < keys.len() && self.core.index.lock().contains(&keys[hits]) {
            // Present but expired: a miss, and the reclaim thread removes it.
            self.wake_reclaimer();
        }
        if self.opts.shared && hits > 0 {
            // Another process sharing the directory may have deleted (cleared, evicted) pages
            // this index still lists: a listed page counts only while its file exists, and one
            // that is gone is forgotten here, so `batch_exists` never reports a page the next
            // get would miss. One `stat` per listed page, in shared mode only.
            let listed = hits;
            hits = par::blocking(|| {
                keys[..listed]
                    .iter()
                    .take_while(|k| {
                        let on_disk = std::fs::symlink_metadata(self.paths.page_path(k)).is_ok();
                        if !on_disk {
                            self.core.index.lock().remove(k);
                        }
                        on_disk
                    })
                    .count()
            });
        }
        if self.opts.shared && hits < keys.len() {
            hits += par::blocking(|| {
                keys[hits..]
                    .iter()
                    .take_while(|k| self.adopt_from_disk(k, None).is_some())
                    .count()
            });
        }
        hits
    }

    /// `batch_get` on the calling (blocking) thread: looks the pages up, then reads and
    /// verifies their files.
    pub(crate) fn read_pages(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
        out: &mut Outcomes,
    ) {
        let n = keys.len();
        let mut want = vec![false; n];
        let mut expired = false;
        {
            let mut ix = self.core.index.lock();
            for (i, (k, d)) in keys.iter().zip(dst.iter()).enumerate() {
                match ix.get(k) {
                    Some(e) if e.meta != d.meta() => {
                        bump(&self.core.counters.meta_mismatches, 1);
                        out.set(i, PageOutcome::Miss);
                    }
                    Some(e) if self.expired(e.written) => {
                        // Expired (`ttl_s`): a miss; the reclaim thread deletes it.
                        out.set(i, PageOutcome::Miss);
                        expired = true;
                    }
                    Some(_) => {
                        ix.touch(k);
                        want[i] = true;
                    }
                    None if self.opts.shared && !d.is_empty() => want[i] = true,
                    None => out.set(i, PageOutcome::Miss),
                }
            }
        }
        if expired {
            self.wake_reclaimer();
        }
        let jobs: Vec<(usize, &mut PageBufMut<'_>)> = dst
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| want[*i])
            .collect();
        let results = self.read_files(keys, jobs);
        for (i, r) in results {
            let o = self.read_outcome(&keys[i], &mut dst[i], r);
            out.set(i, o);
        }
    }

    /// The outcome of one page file's read, with its side effects: a damaged page is zeroed
    /// and deleted, a hit refreshes shared-mode recency and adopts the page.
    fn read_outcome(&self, key: &PageKey, d: &mut PageBufMut<'_>, r: ReadResult) -> PageOutcome {
        let meta = d.meta();
        match r {
            ReadResult::Hit => {
                if self.opts.shared {
                    let _ = sys::touch_mtime(&self.paths.page_path(key));
                    let mut ix = self.core.index.lock();
                    if !ix.contains(key) {
                        let mut v = Vec::new();
                        if ix.reserve(file_bytes(meta.len), &mut v) {
                            ix.insert(*key, meta, self.clock.now());
                            ix.release(file_bytes(meta.len));
                        }
                        drop(ix);
                        self.drop_victims(&v);
                    }
                }
                PageOutcome::Hit
            }
            ReadResult::Missing => {
                self.core.index.lock().remove(key);
                PageOutcome::Miss
            }
            ReadResult::Mismatch(stored) => {
                tracing::debug!(key = %key, ?stored, wanted = ?meta, "file backend: metadata mismatch");
                bump(&self.core.counters.meta_mismatches, 1);
                PageOutcome::Miss
            }
            ReadResult::Corrupt(why) => {
                d.zero();
                tracing::warn!(key = %key, %why, "file backend: corrupt page dropped");
                self.core.index.lock().remove(key);
                // A read-only instance deletes nothing (it only stops serving the page).
                if !self.opts.read_only {
                    let _ = remove_file(&self.paths.page_path(key));
                }
                PageOutcome::Corrupt
            }
            ReadResult::Io(e) => PageOutcome::Failed(PageError::io("read", &e)),
        }
    }

    /// Reads and verifies the page files of `jobs` (index into `keys`, destination).
    fn read_files(
        &self,
        keys: &[PageKey],
        jobs: Vec<(usize, &mut PageBufMut<'_>)>,
    ) -> Vec<(usize, ReadResult)> {
        let ctx = self.io();
        let mut out = Vec::with_capacity(jobs.len());
        let mut pages: Vec<PageRead<'_, '_>> = Vec::with_capacity(jobs.len());
        for (i, d) in jobs {
            let io = match ReadIo::new(ctx, d) {
                Ok(io) => io,
                Err(e) => {
                    out.push((i, ReadResult::Io(e)));
                    continue;
                }
            };
            match sys::open_read(&self.paths.page_path(&keys[i]), io.direct) {
                Ok(file) => pages.push(PageRead { idx: i, io, file }),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    out.push((i, ReadResult::Missing));
                }
                Err(e) => out.push((i, ReadResult::Io(e))),
            }
        }
        let reqs: Vec<Req> = pages
            .iter()
            .enumerate()
            .map(|(x, p)| Req {
                eof_ok: true,
                ..Req::new(Dir::Read, p.file.as_raw_fd(), 0, p.io.iovecs().to_vec(), x)
            })
            .collect();
        let mut read: Vec<Option<io::Result<usize>>> = (0..pages.len()).map(|_| None).collect();
        self.driver.run(reqs, &mut |x, r| read[x] = Some(r));
        let done: Vec<(PageRead<'_, '_>, io::Result<usize>)> = pages
            .into_iter()
            .zip(read)
            .map(|(p, r)| {
                (
                    p,
                    r.unwrap_or_else(|| Err(io::Error::other("internal: no result"))),
                )
            })
            .collect();
        out.extend(par::par_map(self.opts.io_threads, done, |(p, n)| {
            drop(p.file);
            (p.idx, p.io.finish(n, &keys[p.idx], &self.bufs))
        }));
        out
    }
}
