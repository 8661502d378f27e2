//! The slab files: one per size class, preallocated in growth steps, opened with O_DIRECT and
//! registered with the ring as fixed files; [`Disk`] gives the index their disk operations.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use crate::common::caused;
use crate::io::ring::{self, FileRef};
use crate::io::sys;
use crate::slab::engine::Engine;
use hicache_storage::{Result, StorageError};

use crate::slab::format::slab_file_name;
use crate::slab::index::SlabDisk;
use crate::slab::{NAME, Slabs, backend_err};

pub(crate) struct Slab {
    pub(crate) slot_bytes: u64,
    pub(crate) file: File,
    pub(crate) fixed: Option<u32>,
}

impl Slab {
    pub(crate) fn file_ref(&self) -> FileRef {
        FileRef {
            fd: self.file.as_raw_fd(),
            fixed: self.fixed,
        }
    }
}

/// Free space a slab never grows into: the index log's appends and compactions need room on
/// a file system the slabs have filled. 1/1024 of the file system, at least 4 MiB and at most
/// 64 MiB: half a million 128-byte log records, more than a compaction of any cache this
/// backend's capacity check admits on such a disk needs. (The bound matters on large, nearly
/// full shared disks: a fixed fraction alone would keep a gigabyte free on a 256 GiB disk and
/// refuse every write with hundreds of megabytes still free.)
const MIN_FS_HEADROOM: u64 = 4 << 20;
/// See [`MIN_FS_HEADROOM`].
const MAX_FS_HEADROOM: u64 = 64 << 20;

/// The free space a slab leaves on a file system of `total` bytes.
fn fs_headroom(total: u64) -> u64 {
    (total / 1024).clamp(MIN_FS_HEADROOM, MAX_FS_HEADROOM)
}

/// The disk operations of the index, on the slabs.
pub(crate) struct Disk<'a>(pub(crate) &'a [Arc<Slab>]);

impl SlabDisk for Disk<'_> {
    /// Grows by the whole step when the file system has room, else by at most half of the
    /// free space above the headroom (then halving the step while `fallocate` fails); a failed `fallocate` is undone by cutting the file back,
    /// so a partial allocation never leaves the file system full.
    fn grow(&self, class: u16, from: u32, to: u32) -> io::Result<u32> {
        let s = &self.0[class as usize];
        let start = from as u64 * s.slot_bytes;
        // Leave room for the index log (its appends and a compaction's copy) and others.
        let (avail, total) = sys::fs_space(&s.file)?;
        let usable = avail.saturating_sub(fs_headroom(total));
        if usable < s.slot_bytes {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        // One growth takes at most half of what is free (but at least one slot), so however
        // large `grow_bytes` is, the cache never takes the last of a shared disk in one step;
        // it reaches its capacity by several smaller steps instead.
        let room = (usable / 2).max(s.slot_bytes) / s.slot_bytes;
        let mut to = to.min(from.saturating_add(u32::try_from(room).unwrap_or(u32::MAX)));
        loop {
            let len = (to - from) as u64 * s.slot_bytes;
            match sys::allocate(&s.file, start, len) {
                Ok(()) => return Ok(to),
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    if s.file.metadata()?.len() > start {
                        s.file.set_len(start)?;
                    }
                    if to - from == 1 {
                        return Err(e);
                    }
                    to = from + (to - from) / 2;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn punch(&self, class: u16, slot: u32) {
        let s = &self.0[class as usize];
        sys::punch_hole(&s.file, slot as u64 * s.slot_bytes, s.slot_bytes);
    }
}

/// Opens (creating) a slab file for O_DIRECT I/O; read-only (never created) when `read_only`.
pub(crate) fn open_slab(path: &Path, read_only: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(!read_only)
        .create(!read_only)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

impl Slabs {
    /// Opens (creating) the slab of `slot_bytes` as class `class`, registering it with the
    /// ring (if io_uring carries the I/O); returns it and its length. `read_only`: an existing slab, opened for reading.
    pub(crate) fn make_slab(
        engine: &Engine,
        dir: &Path,
        slot_bytes: u64,
        class: usize,
        read_only: bool,
    ) -> Result<(Slab, u64)> {
        let path = dir.join(slab_file_name(slot_bytes));
        let file = open_slab(&path, read_only).map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                caused(
                    NAME,
                    format!(
                        "{}: the file system refuses O_DIRECT; use the `file` backend here",
                        path.display()
                    ),
                    e,
                )
            } else {
                StorageError::io("open slab", &path)(e)
            }
        })?;
        let len = file
            .metadata()
            .map_err(StorageError::io("stat", &path))?
            .len();
        let fixed = engine.ring().and_then(|ring| {
            (ring.fixed_files() && (class as u32) < ring::MAX_FIXED_FILES)
                .then_some(class as u32)
                .filter(|&slot| ring.register_file(slot, file.as_raw_fd()).is_ok())
        });
        Ok((
            Slab {
                slot_bytes,
                file,
                fixed,
            },
            len,
        ))
    }

    /// The class of `slot_bytes`, creating its slab if needed.
    pub(crate) fn class_of(&self, slot_bytes: u64) -> Result<u16> {
        let find = |v: &[Arc<Slab>]| v.iter().position(|s| s.slot_bytes == slot_bytes);
        if let Some(c) = find(&self.slabs.read()) {
            return Ok(c as u16);
        }
        let _g = self.new_slab.lock();
        if let Some(c) = find(&self.slabs.read()) {
            return Ok(c as u16);
        }
        let n = self.slabs.read().len();
        if n >= u16::MAX as usize {
            return Err(backend_err("too many page size classes"));
        }
        let (slab, len) = Self::make_slab(&self.engine, &self.opts.dir, slot_bytes, n, false)?;
        let mut ix = self.core.index.lock();
        let id = ix.add_class(
            slot_bytes,
            u32::try_from(len.div_ceil(slot_bytes)).unwrap_or(u32::MAX),
        );
        self.slabs.write().push(Arc::new(slab));
        debug_assert_eq!(id as usize, n);
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_headroom_is_a_small_bounded_share_of_the_file_system() {
        assert_eq!(fs_headroom(96 << 20), MIN_FS_HEADROOM);
        assert_eq!(fs_headroom(16 << 30), 16 << 20);
        // A 256 GiB disk keeps 64 MiB free, not a gigabyte.
        assert_eq!(fs_headroom(256 << 30), MAX_FS_HEADROOM);
        assert_eq!(fs_headroom(u64::MAX), MAX_FS_HEADROOM);
    }
}
