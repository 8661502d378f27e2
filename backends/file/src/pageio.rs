//! Writing and reading one page file (see [`format`](crate::format)), with O_DIRECT straight
//! from and into the caller's buffers when they are sector-aligned, through a pooled aligned
//! staging buffer when writing unaligned pages with O_DIRECT, and buffered otherwise.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::path::Path;

use hicache_core::PageKey;
use hicache_storage::checksum::{checksum_page, checksum_page_mut};
use hicache_storage::{PageBuf, PageBufMut, PageMeta};

use crate::format::{HEADER_LEN, Header, SECTOR, pad};
use crate::sys::{self, BufPool, IOV_MAX};

/// How page files are accessed.
#[derive(Copy, Clone, Debug)]
pub struct IoCtx<'a> {
    /// O_DIRECT is available and wanted.
    pub direct: bool,
    /// Aligned buffers for headers and staging.
    pub bufs: &'a BufPool,
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

fn parts_aligned(mut parts: impl Iterator<Item = (*const u8, usize)>, count: usize) -> bool {
    count < IOV_MAX && parts.all(|(p, l)| sys::is_aligned(p, l, SECTOR))
}

/// Writes a complete page file at `path`, which must not exist (a fresh temp name). With
/// `sync`, its data is flushed to stable storage before returning. Returns the open file, for
/// a later sync.
pub fn write_page_file(
    ctx: IoCtx<'_>,
    path: &Path,
    key: &PageKey,
    page: &PageBuf<'_>,
    sync: bool,
) -> io::Result<File> {
    let meta = page.meta();
    let header = Header {
        key: *key,
        meta,
        checksum: checksum_page(page),
    };
    let padded = pad(meta.len);
    let direct_in_place = ctx.direct
        && parts_aligned(
            page.parts().iter().map(|p| (p.as_ptr(), p.len())),
            page.parts().len(),
        );
    let file = sys::create_new(path, ctx.direct)?;
    sys::preallocate(&file, (HEADER_LEN + padded) as u64)?;
    let result = if direct_in_place {
        let mut hbuf = HeaderBuf::new();
        header.encode(&mut hbuf.0);
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(page.parts().len() + 1);
        iov.push(IoSlice::new(&hbuf.0));
        iov.extend(page.parts().iter().map(|p| IoSlice::new(p)));
        sys::pwritev_all(&file, &mut iov, 0)
    } else if ctx.direct {
        let total = HEADER_LEN + padded;
        let mut buf = ctx.bufs.take(total)?;
        header.encode(&mut buf);
        let mut off = HEADER_LEN;
        for p in page.parts() {
            buf[off..off + p.len()].copy_from_slice(p);
            off += p.len();
        }
        buf[off..total].fill(0);
        let r = sys::pwritev_all(&file, &mut [IoSlice::new(&buf[..total])], 0);
        ctx.bufs.give(buf);
        r
    } else {
        let mut hbuf = [0u8; HEADER_LEN];
        header.encode(&mut hbuf);
        let zeros = [0u8; SECTOR];
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(page.parts().len() + 2);
        iov.push(IoSlice::new(&hbuf));
        iov.extend(page.parts().iter().map(|p| IoSlice::new(p)));
        iov.push(IoSlice::new(&zeros[..padded - meta.len]));
        sys::pwritev_all(&file, &mut iov, 0)
    };
    result?;
    if sync {
        file.sync_data()?;
    }
    Ok(file)
}

/// What reading a page file found.
#[derive(Debug)]
pub enum ReadResult {
    /// The destination holds the page, verified.
    Hit(File),
    /// No file.
    Missing,
    /// A valid page with other metadata (the destination may have been written).
    Mismatch(PageMeta),
    /// The file failed verification; the reason.
    Corrupt(String),
    /// The read itself failed.
    Io(io::Error),
}

/// Reads the page file at `path` into `dst`, verifying header, key, metadata and checksum.
/// After anything but `Hit` the destination's contents are unspecified.
pub fn read_page_file(
    ctx: IoCtx<'_>,
    path: &Path,
    key: &PageKey,
    dst: &mut PageBufMut<'_>,
) -> ReadResult {
    let direct = ctx.direct
        && parts_aligned(
            dst.parts().iter().map(|p| (p.as_ptr(), p.len())),
            dst.parts().len(),
        );
    let file = match sys::open_read(path, direct) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return ReadResult::Missing,
        Err(e) => return ReadResult::Io(e),
    };
    let mut hbuf = HeaderBuf::new();
    let want = dst.len();
    let n = {
        let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(dst.parts().len() + 1);
        iov.push(IoSliceMut::new(&mut hbuf.0));
        iov.extend(dst.parts_mut().iter_mut().map(|p| IoSliceMut::new(p)));
        sys::preadv_all(&file, &mut iov, 0)
    };
    let header = Header::decode(&hbuf.0);
    let n = match n {
        Ok(n) => n,
        Err(e) => return ReadResult::Io(e),
    };
    let header = match header {
        Ok(h) => h,
        Err(e) => return ReadResult::Corrupt(format!("header: {e}")),
    };
    if header.key != *key {
        return ReadResult::Corrupt(format!("header names key {}", header.key));
    }
    if header.meta != dst.meta() {
        return ReadResult::Mismatch(header.meta);
    }
    if n < HEADER_LEN + want {
        return ReadResult::Corrupt(format!("truncated: {} of {} bytes", n, HEADER_LEN + want));
    }
    if checksum_page_mut(dst) != header.checksum {
        return ReadResult::Corrupt("data checksum mismatch".into());
    }
    ReadResult::Hit(file)
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
    let expect = crate::format::file_bytes(header.meta.len);
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
