//! One page file's I/O (see [`format`](crate::pages::format)), independent of how it is issued.
//!
//! [`WriteIo`] prepares a page's file bytes (header, data, padding) as one iovec list and
//! [`ReadIo`] the destination of a page file's bytes (header buffer, then the caller's page),
//! so that a page is written with one vectored write and read with one vectored read, through
//! either driver of the `io` engine. [`ReadIo::finish`] verifies what a read brought in.
//!
//! With O_DIRECT, a page whose parts are sector-aligned in address and length (the pinned
//! host pool's pages are) moves straight from and into the caller's memory; an unaligned page
//! is written through a pooled aligned staging copy and read buffered. A page of more parts
//! than one vectored call takes is staged through one buffer.

use std::fs::File;
use std::io;
use std::marker::PhantomData;
use std::path::Path;

use hicache_core::PageKey;
use hicache_storage::checksum::{checksum_page, checksum_page_mut};
use hicache_storage::{PageBuf, PageBufMut, PageMeta};

use crate::io::sys::{self, IOV_MAX};
use crate::io::{AlignedBuf, BufPool};
use crate::pages::format::{HEADER_LEN, Header, SECTOR, pad};

/// How page files are accessed.
#[derive(Copy, Clone, Debug)]
pub struct IoCtx<'a> {
    /// O_DIRECT is available and wanted.
    pub direct: bool,
    /// Aligned buffers for staging.
    pub bufs: &'a BufPool,
    /// Now, Unix nanoseconds: the write time a new page's header records.
    pub now: u64,
}

/// A header buffer aligned for O_DIRECT (a small boxed allocation: no page faults, no pool
/// lock per page).
#[repr(C, align(4096))]
struct HeaderBuf([u8; HEADER_LEN]);

impl HeaderBuf {
    fn new() -> Box<Self> {
        Box::new(Self([0u8; HEADER_LEN]))
    }
}

/// Zeros for the padding of buffered writes (only ever read from).
static ZEROS: [u8; SECTOR] = [0u8; SECTOR];

fn iovec(ptr: *const u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: ptr.cast_mut().cast(),
        iov_len: len,
    }
}

fn parts_aligned(mut parts: impl Iterator<Item = (*const u8, usize)>, count: usize) -> bool {
    count < IOV_MAX && parts.all(|(p, l)| sys::is_aligned(p, l, SECTOR))
}

/// One page's file bytes, prepared for a single vectored write at offset 0.
///
/// The iovecs point into the header buffer and staging copy this value owns and into the
/// caller's page it borrows for `'a`, so they stay valid for as long as it lives.
pub struct WriteIo<'a> {
    _header: Box<HeaderBuf>,
    staged: Option<AlignedBuf>,
    iov: Vec<libc::iovec>,
    /// Open the file with O_DIRECT.
    pub direct: bool,
    /// The file's length: header, data, padding (what to preallocate).
    pub file_len: u64,
    _page: PhantomData<&'a [u8]>,
}

// SAFETY: the only non-`Send` parts are the raw pointers of `iov`, and they point only into
// memory this value owns (the header box, the staging buffer, the static zero padding) or
// borrows shared for `'a` (the caller's page, `&[u8]`, which is `Sync`). Nothing writes
// through them, so moving the value to another thread is as safe as sending those borrows.
unsafe impl Send for WriteIo<'_> {}

impl<'a> WriteIo<'a> {
    /// Prepares the file bytes of `page` under `key`.
    pub fn new(ctx: IoCtx<'_>, key: &PageKey, page: &PageBuf<'a>) -> io::Result<Self> {
        let meta = page.meta();
        let mut header = HeaderBuf::new();
        Header {
            key: *key,
            meta,
            checksum: checksum_page(page),
            written: ctx.now,
        }
        .encode(&mut header.0);
        let padded = pad(meta.len);
        let parts = page.parts();
        let in_place = if ctx.direct {
            parts_aligned(parts.iter().map(|p| (p.as_ptr(), p.len())), parts.len())
        } else {
            parts.len() + 2 <= IOV_MAX
        };
        let mut iov = Vec::with_capacity(parts.len() + 2);
        iov.push(iovec(header.0.as_ptr(), HEADER_LEN));
        let staged = if in_place {
            iov.extend(parts.iter().map(|p| iovec(p.as_ptr(), p.len())));
            if padded > meta.len {
                iov.push(iovec(ZEROS.as_ptr(), padded - meta.len));
            }
            None
        } else {
            let mut buf = ctx.bufs.get(padded);
            let mut off = 0;
            for p in parts {
                buf[off..off + p.len()].copy_from_slice(p);
                off += p.len();
            }
            buf[off..padded].fill(0);
            iov.push(iovec(buf.as_ptr(), padded));
            Some(buf)
        };
        Ok(Self {
            _header: header,
            staged,
            iov,
            direct: ctx.direct,
            file_len: (HEADER_LEN + padded) as u64,
            _page: PhantomData,
        })
    }

    /// The file's bytes, in order; valid while `self` lives. At most [`IOV_MAX`] entries.
    pub fn iovecs(&self) -> &[libc::iovec] {
        &self.iov
    }

    /// Returns the staging buffer, if any, to the pool.
    pub fn release(self, bufs: &BufPool) {
        if let Some(b) = self.staged {
            bufs.put(b);
        }
    }
}

/// What reading a page file found.
#[derive(Debug)]
pub enum ReadResult {
    /// The destination holds the page, verified.
    Hit,
    /// No file.
    Missing,
    /// A valid page with other metadata (the destination may have been written).
    Mismatch(PageMeta),
    /// The file failed verification; the reason.
    Corrupt(String),
    /// The read itself failed.
    Io(io::Error),
}

/// A page file's destination, prepared for a single vectored read at offset 0: the header
/// buffer, then the caller's page (or a staging buffer standing in for it).
///
/// The iovecs point into the header buffer and staging buffer this value owns and into the
/// page it borrows exclusively for `'d`, so they stay valid, and nothing else touches that
/// memory, for as long as it lives.
pub struct ReadIo<'d, 'b> {
    dst: &'d mut PageBufMut<'b>,
    header: Box<HeaderBuf>,
    staged: Option<AlignedBuf>,
    iov: Vec<libc::iovec>,
    /// Open the file with O_DIRECT.
    pub direct: bool,
}

// SAFETY: the only non-`Send` parts are the raw pointers of `iov`, and they point only into
// memory this value owns (the header box, the staging buffer) or borrows exclusively for `'d`
// (the destination page, itself `Send`). No other handle to that memory exists while the value
// lives, so moving it to another thread moves that exclusive access with it.
unsafe impl Send for ReadIo<'_, '_> {}

impl<'d, 'b> ReadIo<'d, 'b> {
    /// Prepares a read of a page file into `dst`.
    pub fn new(ctx: IoCtx<'_>, dst: &'d mut PageBufMut<'b>) -> io::Result<Self> {
        let count = dst.parts().len();
        let direct =
            ctx.direct && parts_aligned(dst.parts().iter().map(|p| (p.as_ptr(), p.len())), count);
        let mut header = HeaderBuf::new();
        let mut iov = Vec::with_capacity(count + 1);
        iov.push(iovec(header.0.as_mut_ptr(), HEADER_LEN));
        let staged = if direct || count < IOV_MAX {
            iov.extend(
                dst.parts_mut()
                    .iter_mut()
                    .map(|p| iovec(p.as_mut_ptr(), p.len())),
            );
            None
        } else {
            let mut buf = ctx.bufs.get(dst.len());
            iov.push(iovec(buf.as_mut_ptr(), dst.len()));
            Some(buf)
        };
        Ok(Self {
            dst,
            header,
            staged,
            iov,
            direct,
        })
    }

    /// Where the file's bytes go, in order; valid while `self` lives. At most [`IOV_MAX`]
    /// entries.
    pub fn iovecs(&self) -> &[libc::iovec] {
        &self.iov
    }

    /// Bytes the iovecs take: the header and the page.
    pub fn total(&self) -> usize {
        HEADER_LEN + self.dst.len()
    }

    /// Verifies header, key, metadata, length and checksum after a read that returned `n`
    /// (bytes read from offset 0, or the error), and returns the staging buffer to `bufs`.
    /// After anything but `Hit` the destination's contents are unspecified.
    pub fn finish(mut self, n: io::Result<usize>, key: &PageKey, bufs: &BufPool) -> ReadResult {
        let r = self.verify(n, key);
        if let Some(b) = self.staged.take() {
            bufs.put(b);
        }
        r
    }

    fn verify(&mut self, n: io::Result<usize>, key: &PageKey) -> ReadResult {
        let n = match n {
            Ok(n) => n,
            Err(e) => return ReadResult::Io(e),
        };
        let header = match Header::decode(&self.header.0) {
            Ok(h) => h,
            Err(e) => return ReadResult::Corrupt(format!("header: {e}")),
        };
        if header.key != *key {
            return ReadResult::Corrupt(format!("header names key {}", header.key));
        }
        if header.meta != self.dst.meta() {
            return ReadResult::Mismatch(header.meta);
        }
        if n < self.total() {
            return ReadResult::Corrupt(format!("truncated: {} of {} bytes", n, self.total()));
        }
        if let Some(b) = &self.staged {
            self.dst.copy_from(&b[..self.dst.len()]);
        }
        if checksum_page_mut(self.dst) != header.checksum {
            return ReadResult::Corrupt("data checksum mismatch".into());
        }
        ReadResult::Hit
    }
}

/// Reads and verifies only the header of the file at `path`, and that the file's size fits
/// it. With `verify_data`, also reads the data and checks its checksum.
pub fn check_page_file(path: &Path, verify_data: bool) -> Result<Header, String> {
    use std::os::unix::fs::FileExt;
    let file = File::open(path).map_err(|e| format!("open: {e}"))?;
    let size = file.metadata().map_err(|e| format!("stat: {e}"))?.len();
    let mut h = vec![0u8; HEADER_LEN];
    file.read_exact_at(&mut h, 0)
        .map_err(|e| format!("header: {e}"))?;
    let header = Header::decode(&h).map_err(|e| format!("header: {e}"))?;
    let expect = crate::pages::format::file_bytes(header.meta.len);
    if size != expect {
        return Err(format!("size {size}, header says {expect}"));
    }
    if verify_data {
        let mut data = vec![0u8; header.meta.len];
        file.read_exact_at(&mut data, HEADER_LEN as u64)
            .map_err(|e| format!("data: {e}"))?;
        if hicache_storage::checksum::checksum(&data) != header.checksum {
            return Err("data checksum mismatch".into());
        }
    }
    Ok(header)
}
