//! The few OS calls `std` lacks: `fallocate` (grow a slab, punch a freed slot), `statvfs`
//! (the default capacity, the room left for a slab to grow) and `eventfd` (waking the ring thread). Each `unsafe` block is one
//! libc call on a valid descriptor or a live, NUL-terminated path.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Allocates blocks for `[offset, offset + len)` of `file`, extending its size if needed.
pub fn allocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on an open descriptor; no memory is passed.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, offset as i64, len as i64) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // File systems without fallocate: a sparse extension (blocks come with the writes).
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
        tracing::debug!(error = %io::Error::last_os_error(), "uring backend: punch hole failed");
    }
}

/// Bytes available to unprivileged users on the file system of `path`.
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and alive; `s` is a valid, exclusive out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
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

/// A non-blocking eventfd.
pub fn eventfd() -> io::Result<File> {
    // SAFETY: eventfd takes no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}
