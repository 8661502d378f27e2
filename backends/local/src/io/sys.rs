//! The thin layer over the OS the local layouts need beyond `std`: O_DIRECT opens, positioned
//! vectored I/O, `flock`, `fallocate` (preallocation, slab growth, hole punching),
//! `utimensat`, `statvfs` (free-space checks), `eventfd`, directory syncs.
//!
//! Every `unsafe` block here is a single libc call on a valid file descriptor with pointers
//! derived from live Rust slices; each names its invariant.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The largest number of iovecs one `preadv`/`pwritev` takes on Linux.
pub const IOV_MAX: usize = 1024;

/// Opens `path` for writing, creating it exclusively, with O_DIRECT if `direct`.
pub fn create_new(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.write(true).create_new(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    let f = o.open(path)?;
    crate::io::journal::create(path, &f);
    Ok(f)
}

/// Renames `from` to `to` (replacing it).
pub fn rename(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::rename(from, to)?;
    crate::io::journal::rename(from, to);
    Ok(())
}

/// Removes a file, treating "already gone" as success; returns whether it existed.
pub fn remove_file(path: &Path) -> io::Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => {
            crate::io::journal::unlink(path);
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// `fdatasync`: the file's data (and the metadata needed to read it) made durable.
pub fn sync_data(file: &File) -> io::Result<()> {
    file.sync_data()?;
    crate::io::journal::sync(file.as_raw_fd(), None);
    Ok(())
}

/// Appends `buf` at the end of `file` (open for appending) in one `write_all`.
pub fn append(file: &mut File, buf: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let at = file.metadata()?.len();
    file.write_all(buf)?;
    crate::io::journal::write(file.as_raw_fd(), at, buf);
    Ok(())
}

/// Opens `path` read-only, with O_DIRECT if `direct`.
pub fn open_read(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Allocates `len` bytes for a new file up front and sets its size, so that the O_DIRECT
/// write that follows does not extend the file (ext4 serialises extending direct writes on
/// its orphan list) and running out of space fails here, before any data is written. File
/// systems without `fallocate` fall back to `ftruncate`.
pub fn preallocate(file: &File, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on an open fd has no memory effects.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
    if r == 0 {
        crate::io::journal::set_len(file.as_raw_fd(), len);
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => file.set_len(len),
        _ => Err(e),
    }
}

/// Drops the first `n` bytes from an iovec list (whole entries, then a prefix of the next).
fn advance(iov: &mut &mut [libc::iovec], mut n: usize) {
    let mut i = 0;
    while i < iov.len() && n >= iov[i].iov_len {
        n -= iov[i].iov_len;
        i += 1;
    }
    let rest = std::mem::take(iov);
    *iov = &mut rest[i..];
    if n > 0 {
        let v = &mut iov[0];
        v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
        v.iov_len -= n;
    }
}

/// Which positioned vectored call [`transfer_all`] loops over.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Xfer {
    Write,
    Read,
}

/// Moves bytes between the memory `iov` describes and the file from `offset`, one
/// `pwritev`/`preadv` at a time (at most [`IOV_MAX`] iovecs each), continuing after short
/// transfers and interruptions, until every byte moved or (a read) the file ended. Returns
/// the bytes moved; a write that moves nothing is an error.
///
/// # Safety
/// Every iovec must describe memory valid for the transfer (readable for a write; writable
/// and not otherwise accessed for a read) for the whole call.
unsafe fn transfer_all(
    file: &File,
    iov: &[libc::iovec],
    mut offset: u64,
    dir: Xfer,
) -> io::Result<usize> {
    let mut owned = iov.to_vec();
    let mut cur: &mut [libc::iovec] = &mut owned;
    advance(&mut cur, 0);
    let mut total = 0;
    while !cur.is_empty() {
        let (fd, n) = (file.as_raw_fd(), cur.len().min(IOV_MAX) as libc::c_int);
        // SAFETY: the caller guarantees the iovecs describe memory valid for this direction
        // (advancing keeps them inside it); the fd is open for it.
        let r = unsafe {
            match dir {
                Xfer::Write => libc::pwritev(fd, cur.as_ptr(), n, offset as libc::off_t),
                Xfer::Read => libc::preadv(fd, cur.as_ptr(), n, offset as libc::off_t),
            }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            if dir == Xfer::Read {
                break;
            }
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote nothing",
            ));
        }
        offset += r as u64;
        total += r as usize;
        advance(&mut cur, r as usize);
    }
    Ok(total)
}

/// Writes every byte `iov` describes at `offset`, retrying short writes.
///
/// # Safety
/// Every iovec must describe memory valid for reads for the whole call.
pub unsafe fn pwritev_raw(file: &File, iov: &[libc::iovec], offset: u64) -> io::Result<()> {
    // SAFETY: the caller's guarantee, passed on.
    unsafe { transfer_all(file, iov, offset, Xfer::Write) }.map(drop)
}

/// Reads into the memory `iov` describes from `offset` until it is full or the file ends;
/// returns the number of bytes read.
///
/// # Safety
/// Every iovec must describe memory valid for writes, not otherwise accessed, for the whole
/// call.
pub unsafe fn preadv_raw(file: &File, iov: &[libc::iovec], offset: u64) -> io::Result<usize> {
    // SAFETY: the caller's guarantee, passed on.
    unsafe { transfer_all(file, iov, offset, Xfer::Read) }
}

/// Writes every byte of `bufs` at `offset`, retrying short writes.
pub fn pwritev_all(file: &File, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
    // SAFETY: `IoSlice` is ABI-compatible with `iovec` on Unix, and each is a live shared
    // borrow for the duration of the call.
    unsafe {
        pwritev_raw(
            file,
            std::slice::from_raw_parts(bufs.as_ptr().cast::<libc::iovec>(), bufs.len()),
            offset,
        )
    }
}

/// Reads into `bufs` from `offset` until they are full or the file ends; returns the number of
/// bytes read.
pub fn preadv_all(
    file: &File,
    bufs: &mut [std::io::IoSliceMut<'_>],
    offset: u64,
) -> io::Result<usize> {
    // SAFETY: `IoSliceMut` is ABI-compatible with `iovec` on Unix, and each is a live
    // exclusive borrow for the duration of the call.
    unsafe {
        preadv_raw(
            file,
            std::slice::from_raw_parts(bufs.as_ptr().cast::<libc::iovec>(), bufs.len()),
            offset,
        )
    }
}

/// `flock` on a file: exclusive or shared, never blocking. Returns `Ok(false)` if another
/// open file description holds a conflicting lock.
pub fn try_flock(file: &File, exclusive: bool) -> io::Result<bool> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | libc::LOCK_NB;
    loop {
        // SAFETY: flock on an open fd has no memory effects.
        let r = unsafe { libc::flock(file.as_raw_fd(), op) };
        if r == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}

/// Whether the holder a lock file names (`"pid N ..."` or `"N"`) is this very process: a
/// store of ours that is still open, or closed while one of its calls was in flight (the call
/// keeps it alive until it returns). Lets a refused open say so instead of blaming "another
/// process".
pub fn holder_is_this_process(holder: &str) -> bool {
    let t = holder.trim();
    let t = t.strip_prefix("pid").unwrap_or(t).trim_start();
    let digits: String = t.chars().take_while(char::is_ascii_digit).collect();
    digits.parse::<u32>().ok() == Some(std::process::id())
}

/// The reason a refused open gives when the lock holder is this process
/// ([`holder_is_this_process`]): `"<dir> is held by a store of this same process (pid N) ..."`.
pub fn held_by_this_process(dir: &Path) -> String {
    format!(
        "{} is held by a store of this same process (pid {}) that is still open, or was closed \
         while one of its calls was in flight (it stays open until that call returns): close or \
         drop it, let its calls finish, then open again",
        dir.display(),
        std::process::id()
    )
}

/// An exclusive `flock`, waiting for it.
pub fn flock_wait(file: &File) -> io::Result<()> {
    loop {
        // SAFETY: flock on an open fd has no memory effects.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Releases a `flock`.
pub fn unflock(file: &File) {
    // SAFETY: flock on an open fd has no memory effects; failure only leaves the lock held
    // until the fd closes.
    unsafe {
        libc::flock(file.as_raw_fd(), libc::LOCK_UN);
    }
}

/// `path` as a C string (for system calls and io_uring requests).
pub fn cpath(path: &Path) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path has a NUL byte"))
}

/// Sets the modification time of the file at `path` to now (shared-mode recency for the
/// janitor).
pub fn touch_mtime(path: &Path) -> io::Result<()> {
    let c = cpath(path)?;
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
    ];
    // SAFETY: `c` is a NUL-terminated path and `times` a live array of two timespecs, as
    // utimensat requires.
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bytes available to unprivileged users on the file system holding `path`.
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    let c = cpath(path)?;
    // SAFETY: statvfs is plain data; zeroed is a valid initial value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a live statvfs to fill.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Whether a buffer may take part in O_DIRECT I/O: address and length multiples of `align`.
pub fn is_aligned(ptr: *const u8, len: usize, align: usize) -> bool {
    (ptr as usize).is_multiple_of(align) && len.is_multiple_of(align)
}

/// Raises the soft limit of open files to the hard limit (a batch keeps its page files open
/// until they are synced).
pub fn raise_nofile_limit() {
    // SAFETY: rlimit is plain data; getrlimit/setrlimit only read and write it.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Flushes a directory's entries (renames into it) to stable storage.
pub fn sync_dir(path: &Path) -> io::Result<()> {
    File::open(path)?.sync_all()?;
    crate::io::journal::sync_dir(path);
    Ok(())
}

/// Makes everything written to the file system holding `path` durable, every process's
/// writes included: file data, sizes and block maps, and directory entries (`syncfs(2)`).
///
/// Issued twice: Linux's `sync_filesystem` submits the metadata buffers of a file system
/// without a journal (ext4 `nojournal`, ext2) in its first pass, flushes the device's cache in
/// its second, and only then waits for those buffers: a write still in flight at the flush
/// may sit in the device's volatile cache when the call returns. The second call's flush
/// covers every write the first one waited for. On journaling file systems it costs one
/// more (empty) cache flush.
pub fn sync_fs(path: &Path) -> io::Result<()> {
    let dir = File::open(path)?;
    for _ in 0..2 {
        // SAFETY: syncfs on a descriptor this function holds open; no memory is passed.
        if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    crate::io::journal::sync_fs();
    Ok(())
}

/// Allocates blocks for `[offset, offset + len)` of `file`, extending its size if needed.
/// File systems without `fallocate` get a sparse extension (blocks come with the writes).
pub fn allocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on an open descriptor; no memory is passed.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, offset as i64, len as i64) };
    if r == 0 {
        crate::io::journal::set_len(file.as_raw_fd(), offset + len);
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) => {
            let end = offset + len;
            if file.metadata()?.len() < end {
                file.set_len(end)?;
            }
            Ok(())
        }
        _ => Err(e),
    }
}

/// Releases the blocks of `[offset, offset + len)` (the file keeps its size). Best effort:
/// a file system without hole punching keeps the blocks.
pub fn punch_hole(file: &File, offset: u64, len: u64) {
    // SAFETY: fallocate on an open descriptor; no memory is passed.
    let r = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as i64,
            len as i64,
        )
    };
    if r != 0 {
        tracing::debug!(error = %io::Error::last_os_error(), "localio: punch hole failed");
    }
}

/// Bytes available to unprivileged users, and the total size, of the file system holding
/// `file`.
pub fn fs_space(file: &File) -> io::Result<(u64, u64)> {
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: an open descriptor; `s` is a valid, exclusive out-pointer.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut s) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let unit = s.f_frsize as u64;
    Ok((s.f_bavail as u64 * unit, s.f_blocks as u64 * unit))
}

/// A non-blocking eventfd (wakes the ring's thread).
pub fn eventfd() -> io::Result<File> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: eventfd takes no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::IoSliceMut;

    #[test]
    fn the_holder_is_recognised_as_this_process() {
        let me = std::process::id();
        assert!(holder_is_this_process(&format!("{me}")));
        assert!(holder_is_this_process(&format!("pid {me} on host h\n")));
        assert!(!holder_is_this_process(&format!("pid {}1 on host h", me)));
        assert!(!holder_is_this_process(""));
        assert!(!holder_is_this_process("processes in shared mode"));
    }

    #[test]
    fn advance_skips_whole_and_partial_entries() {
        let a = [0u8; 10];
        let b = [0u8; 0];
        let c = [0u8; 5];
        let iov = |s: &[u8]| libc::iovec {
            iov_base: s.as_ptr().cast_mut().cast(),
            iov_len: s.len(),
        };
        let mut v = vec![iov(&a), iov(&b), iov(&c)];
        let mut cur: &mut [libc::iovec] = &mut v;
        advance(&mut cur, 4);
        assert_eq!((cur.len(), cur[0].iov_len), (3, 6));
        assert_eq!(cur[0].iov_base as usize, a.as_ptr() as usize + 4);
        advance(&mut cur, 6);
        assert_eq!(cur.len(), 1, "the empty entry goes with the finished one");
        assert_eq!(cur[0].iov_base as usize, c.as_ptr() as usize);
        advance(&mut cur, 5);
        assert!(cur.is_empty());
    }

    #[test]
    fn vectored_io_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = create_new(&p, false).unwrap();
        let a = vec![1u8; 3000];
        let b = vec![2u8; 5000];
        pwritev_all(&f, &[IoSlice::new(&a), IoSlice::new(&b)], 10).unwrap();
        drop(f);
        let f = open_read(&p, false).unwrap();
        let mut x = vec![0u8; 3010];
        let mut y = vec![0u8; 6000];
        let n = preadv_all(
            &f,
            &mut [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)],
            0,
        )
        .unwrap();
        assert_eq!(n, 8010);
        assert!(x[10..].iter().all(|&v| v == 1) && y[..5000].iter().all(|&v| v == 2));
        assert!(
            create_new(&p, false).is_err(),
            "create_new refuses an existing file"
        );
    }

    /// More iovecs than one call takes: the loop continues with the rest, both ways.
    #[test]
    fn vectored_io_beyond_iov_max_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = create_new(&p, false).unwrap();
        let parts: Vec<[u8; 3]> = (0..2 * IOV_MAX + 7).map(|i| [i as u8; 3]).collect();
        let slices: Vec<IoSlice<'_>> = parts.iter().map(|b| IoSlice::new(b)).collect();
        pwritev_all(&f, &slices, 0).unwrap();
        drop(f);
        let f = open_read(&p, false).unwrap();
        let mut back = vec![[0u8; 3]; parts.len()];
        let mut dst: Vec<IoSliceMut<'_>> = back.iter_mut().map(|b| IoSliceMut::new(b)).collect();
        assert_eq!(preadv_all(&f, &mut dst, 0).unwrap(), 3 * parts.len());
        assert_eq!(back, parts);
    }

    #[test]
    fn flock_conflicts_between_descriptions() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("l");
        let a = File::create(&p).unwrap();
        let b = File::open(&p).unwrap();
        assert!(try_flock(&a, true).unwrap());
        assert!(!try_flock(&b, false).unwrap());
        unflock(&a);
        assert!(try_flock(&b, false).unwrap());
        assert!(try_flock(&a, false).unwrap(), "shared locks coexist");
    }
}
