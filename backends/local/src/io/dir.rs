//! [`DirFd`]: a directory held open, in which files are created without a name and then
//! named, by descriptor rather than by path.
//!
//! A page file is made with two directory operations, `O_TMPFILE` and `linkat`. By path,
//! each walks every component of the directory's path, and the link also walks
//! `/proc/self/fd/N` to find the unnamed file (a procfs lookup, about a third of `linkat`'s
//! time for 256 KiB pages on ext4). Relative to a held descriptor neither walks the
//! directory's path, and where the process may link a descriptor itself
//! (`linkat(fd, "", …, AT_EMPTY_PATH)`: `CAP_DAC_READ_SEARCH`, or newer kernels for a file it
//! created) the procfs lookup goes too; otherwise the link goes through `/proc/self/fd` as
//! before. Which of the two works is probed once ([`DirFd::probe_unnamed`]).
//!
//! # Invariants
//! 1. **The directory the path named at open.** Every file is created and linked in the
//!    directory [`DirFd::open`] opened (a symlink there is refused, never followed), so a
//!    sync of that directory ([`DirFd::sync`]) or of its file system covers every link made
//!    through it.
//! 2. **Recorded as by path.** With the journal on, creates, links and syncs are recorded
//!    under the directory's path joined with the name, exactly as the path-based calls record
//!    them, so the power-loss suite models them the same way.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::io::journal;

/// How an unnamed file is given a name.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LinkVia {
    /// `linkat(fd, "", dir, name, AT_EMPTY_PATH)`: no path walked.
    EmptyPath,
    /// `linkat(AT_FDCWD, "/proc/self/fd/N", dir, name, AT_SYMLINK_FOLLOW)`.
    ProcFd,
}

/// A directory held open for creating and linking files in it. See the [module docs](self).
#[derive(Debug)]
pub struct DirFd {
    fd: OwnedFd,
    path: PathBuf,
    via: LinkVia,
}

/// `name` as a C string.
fn cname(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name has a NUL byte"))
}

impl DirFd {
    /// Opens the directory `path` (not following a symlink there). Links go through
    /// `/proc/self/fd` until [`probe_unnamed`](Self::probe_unnamed) finds the direct way.
    pub fn open(path: &Path) -> io::Result<Self> {
        let c = crate::io::sys::cpath(path)?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: open with a NUL-terminated path that lives for the call; no other memory.
        let fd = unsafe { libc::open(c.as_ptr(), flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            // SAFETY: `fd` was just returned by open, is valid, and is owned by nothing else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: path.to_path_buf(),
            via: LinkVia::ProcFd,
        })
    }

    /// The directory's path (what the journal records names under).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How [`link`](Self::link) names files.
    pub fn link_via(&self) -> LinkVia {
        self.via
    }

    /// Opens a new file without a name in this directory for writing (`O_TMPFILE`, mode
    /// 0666 less the umask, as `std` creates files), with O_DIRECT if `direct`. It gets a
    /// name only from [`link`](Self::link); until then no directory entry exists (nothing for
    /// a crash to leave behind). File systems without `O_TMPFILE` fail (`EOPNOTSUPP`,
    /// `EISDIR` or `EINVAL`).
    pub fn create_unnamed(&self, direct: bool) -> io::Result<File> {
        let mut flags = libc::O_TMPFILE | libc::O_WRONLY | libc::O_CLOEXEC;
        if direct {
            flags |= libc::O_DIRECT;
        }
        // SAFETY: openat on a descriptor this value holds open, with a static NUL-terminated
        // path; the mode is passed as the variadic argument O_TMPFILE requires.
        let fd = unsafe { libc::openat(self.fd.as_raw_fd(), c".".as_ptr(), flags, 0o666) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by openat, is valid, and is owned by nothing else.
        let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        journal::create_unnamed(&f);
        Ok(f)
    }

    /// Gives the unnamed file `file` (from [`create_unnamed`](Self::create_unnamed)) the
    /// name `name` in this directory. Fails with `AlreadyExists` if the name exists: a link
    /// never replaces.
    pub fn link(&self, file: &File, name: &OsStr) -> io::Result<()> {
        self.link_via_mode(file, name, self.via)?;
        journal::link_at(file, &self.path, name);
        Ok(())
    }

    fn link_via_mode(&self, file: &File, name: &OsStr, via: LinkVia) -> io::Result<()> {
        let to = cname(name)?;
        let r = match via {
            // SAFETY: linkat from a descriptor the caller holds open (empty path) into a
            // descriptor this value holds open, with a NUL-terminated name that lives for
            // the call; no other memory.
            LinkVia::EmptyPath => unsafe {
                libc::linkat(
                    file.as_raw_fd(),
                    c"".as_ptr(),
                    self.fd.as_raw_fd(),
                    to.as_ptr(),
                    libc::AT_EMPTY_PATH,
                )
            },
            LinkVia::ProcFd => {
                let from = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "fd path"))?;
                // SAFETY: linkat with two NUL-terminated paths that live for the call, the
                // second relative to a descriptor this value holds open; no other memory.
                unsafe {
                    libc::linkat(
                        libc::AT_FDCWD,
                        from.as_ptr(),
                        self.fd.as_raw_fd(),
                        to.as_ptr(),
                        libc::AT_SYMLINK_FOLLOW,
                    )
                }
            }
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether files can be created without a name ([`create_unnamed`](Self::create_unnamed),
    /// with O_DIRECT if `direct`) and linked ([`link`](Self::link)) on this directory's file
    /// system: tried in `scratch` (a directory of the same file system that this process
    /// alone writes, so no other process meets the probe's name `unnamed-probe.tmp`; removed
    /// after). Also picks the way links are made: by descriptor where the kernel lets this
    /// process, else through `/proc/self/fd`.
    pub fn probe_unnamed(&mut self, direct: bool, scratch: &Path) -> bool {
        let Ok(mut s) = DirFd::open(scratch) else {
            return false;
        };
        let ok = s.probe_here(direct);
        self.via = s.via;
        ok
    }

    fn probe_here(&mut self, direct: bool) -> bool {
        let name = OsStr::new("unnamed-probe.tmp");
        let probe = self.path.join(name);
        let _ = std::fs::remove_file(&probe);
        let Ok(f) = self.create_unnamed(direct) else {
            return false;
        };
        for via in [LinkVia::EmptyPath, LinkVia::ProcFd] {
            if self.link_via_mode(&f, name, via).is_ok() {
                let _ = std::fs::remove_file(&probe);
                self.via = via;
                return true;
            }
        }
        false
    }

    /// Flushes the directory's entries (links and renames into it) to stable storage.
    pub fn sync(&self) -> io::Result<()> {
        // SAFETY: fsync on a descriptor this value holds open; no memory is passed.
        if unsafe { libc::fsync(self.fd.as_raw_fd()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        journal::sync_dir(&self.path);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file created unnamed is invisible until linked, then holds what was written; a
    /// link over an existing name fails with `AlreadyExists`; either way of linking names the
    /// file; the probe leaves no name.
    #[test]
    fn unnamed_files_appear_only_when_linked() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = DirFd::open(dir.path()).unwrap();
        if !d.probe_unnamed(false, dir.path()) {
            eprintln!("skipped: no O_TMPFILE here");
            return;
        }
        let names = || -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        assert!(names().is_empty(), "the probe left {:?}", names());
        let f = d.create_unnamed(false).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"page", 0).unwrap();
        assert!(names().is_empty());
        d.link(&f, OsStr::new("a")).unwrap();
        assert_eq!(names(), ["a"]);
        assert_eq!(std::fs::read(dir.path().join("a")).unwrap(), b"page");
        let g = d.create_unnamed(false).unwrap();
        let e = d.link(&g, OsStr::new("a")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        // Both ways name a file the same; by descriptor only where the kernel allows it.
        d.link_via_mode(&g, OsStr::new("b"), LinkVia::ProcFd)
            .unwrap();
        let h = d.create_unnamed(false).unwrap();
        let mut want = vec!["a", "b"];
        if d.link_via_mode(&h, OsStr::new("c"), LinkVia::EmptyPath)
            .is_ok()
        {
            want.push("c");
        } else {
            assert_eq!(
                d.link_via(),
                LinkVia::ProcFd,
                "the probe chose a way that fails"
            );
        }
        assert_eq!(names(), want);
        d.sync().unwrap();
    }

    /// A symlink in place of the directory is refused, not followed.
    #[test]
    fn a_symlink_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("real")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("real"), dir.path().join("link")).unwrap();
        assert!(DirFd::open(&dir.path().join("link")).is_err());
        assert!(DirFd::open(&dir.path().join("real")).is_ok());
    }
}
