//! [`NewFile`]: a file written whole and published under its final name, the unit of the
//! layouts that keep one file per page. Each goes through the same steps:
//!
//! ```text
//! create temp (O_CREAT|O_EXCL, O_DIRECT if asked) -> preallocate (if a length is given)
//!   -> write every byte at offset 0 -> fdatasync (if `sync`) -> rename temp -> final name
//! ```
//!
//! or, with [`NewFile::unnamed`], the file is created without a name (`O_TMPFILE`) in the
//! final name's directory, held open as a [`DirFd`], and, after the same preallocate, write
//! and sync steps, linked to its final name: one directory operation instead of two (each
//! takes the directory's lock, which every page file of a layout shares), neither walking the
//! directory's path. Where the final name exists already (a page replaced), the file is
//! linked to its temp name and renamed over it instead.
//!
//! [`write_blocking`] runs them with blocking calls on the calling thread; a layout runs
//! several files in parallel on a few threads (whichever driver carries its reads).
//!
//! # Invariants
//! 1. **Visible only when complete.** The rename runs only after every earlier step
//!    succeeded in full (a short write is a failure of the write step), so the final name
//!    never shows a partial file; under `sync`, never one whose data is not durable either.
//! 2. **A failure leaves nothing behind.** When a step fails, the file's outcome is that
//!    step's error and its temp file is removed before the outcome is reported (an unnamed
//!    file that was never linked is freed when it is closed).
//! 3. **Recorded.** With the journal on, every operation (create, size change, write, sync,
//!    rename, unlink) is recorded in the order the file system saw it, so the power-loss
//!    suite covers it.
//!
//! The directory holding the final name is not synced here: a layout makes the renames
//! durable itself (one directory sync per group of batches, or per page).

use std::fmt;
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use crate::io::{DirFd, sys};

/// One file to create, write whole and rename into place. See the [module docs](self).
#[derive(Debug)]
pub struct NewFile {
    /// The temp name (created exclusively: it must not exist). With `unnamed`, used only
    /// where `dest` exists already.
    pub tmp: PathBuf,
    /// The final name (replaced if it exists); in the same file system as `tmp`.
    pub dest: PathBuf,
    /// The file's bytes, in order, written at offset 0. With `direct`, sector-aligned.
    pub iov: Vec<libc::iovec>,
    /// Open with O_DIRECT.
    pub direct: bool,
    /// Preallocate this many bytes before writing (`0`: do not).
    pub prealloc: u64,
    /// `fdatasync` the file before the rename.
    pub sync: bool,
    /// Create the file without a name in this directory, which must be `dest`'s and `tmp`'s,
    /// and link it into place (the file system must support `O_TMPFILE`:
    /// [`DirFd::probe_unnamed`]).
    pub unnamed: Option<Arc<DirFd>>,
    /// The caller's tag, reported with the outcome.
    pub tag: usize,
}

// SAFETY: a `NewFile` carries raw pointers into memory its sender borrows for the call; the
// layout's batch returns only after every file's steps ended (scoped threads), so handing
// the pointers to another thread is no different from using them on the sender's.
unsafe impl Send for NewFile {}

impl NewFile {
    /// Bytes the iovecs take.
    pub fn bytes(&self) -> usize {
        self.iov.iter().map(|v| v.iov_len).sum()
    }
}

/// A step of a [`NewFile`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Creating the temp file.
    Create,
    /// Preallocating it.
    Preallocate,
    /// Writing its bytes.
    Write,
    /// `fdatasync`.
    Sync,
    /// Renaming it to its final name.
    Rename,
    /// Linking the unnamed file to its final (or temp) name.
    Link,
}

impl Step {
    /// A short name (`create`, `preallocate`, `write`, `sync`, `rename`, `link`).
    pub fn name(self) -> &'static str {
        match self {
            Step::Create => "create",
            Step::Preallocate => "preallocate",
            Step::Write => "write",
            Step::Sync => "sync",
            Step::Rename => "rename",
            Step::Link => "link",
        }
    }
}

/// Why a [`NewFile`] was not published: the step that failed and its error.
#[derive(Debug)]
pub struct NewFileError {
    /// The step.
    pub step: Step,
    /// Its error.
    pub error: io::Error,
}

impl fmt::Display for NewFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.step.name(), self.error)
    }
}

impl std::error::Error for NewFileError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The outcome of one [`NewFile`].
pub type NewFileResult = Result<(), NewFileError>;

fn at(step: Step) -> impl FnOnce(io::Error) -> NewFileError {
    move |error| NewFileError { step, error }
}

/// The steps of `f` with blocking calls on the calling thread. Each call records itself in
/// the journal.
pub fn write_blocking(f: &NewFile) -> NewFileResult {
    if let Some(dir) = &f.unnamed {
        return write_unnamed(f, dir);
    }
    let file = sys::create_new(&f.tmp, f.direct).map_err(at(Step::Create))?;
    let r = fill(f, &file).and_then(|()| {
        drop(file);
        sys::rename(&f.tmp, &f.dest).map_err(at(Step::Rename))
    });
    if r.is_err() {
        let _ = sys::remove_file(&f.tmp);
    }
    r
}

/// Preallocates, writes and (with `sync`) syncs the bytes of `f` into `file`.
fn fill(f: &NewFile, file: &File) -> NewFileResult {
    if f.prealloc > 0 {
        sys::preallocate(file, f.prealloc).map_err(at(Step::Preallocate))?;
    }
    // SAFETY: the iovecs describe memory the caller keeps readable for the call.
    unsafe {
        crate::io::journal::write_iov(std::os::fd::AsRawFd::as_raw_fd(file), 0, &f.iov);
        sys::pwritev_raw(file, &f.iov, 0).map_err(at(Step::Write))?;
    }
    if f.sync {
        sys::sync_data(file).map_err(at(Step::Sync))?;
    }
    Ok(())
}

/// The file name of `p`, which must be in `dir`.
fn name_in<'p>(dir: &DirFd, p: &'p std::path::Path) -> Result<&'p std::ffi::OsStr, NewFileError> {
    p.file_name()
        .filter(|_| p.parent() == Some(dir.path()))
        .ok_or_else(|| NewFileError {
            step: Step::Create,
            error: io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not in {}", p.display(), dir.path().display()),
            ),
        })
}

/// The steps of `f` for an unnamed file: create it in `dir` (the final name's directory),
/// fill it, link it to its final name; where that name exists, link it to the temp name and
/// rename. Until linked the file has no name, so a failure before then leaves nothing behind.
fn write_unnamed(f: &NewFile, dir: &DirFd) -> NewFileResult {
    let name = name_in(dir, &f.dest)?;
    let file = dir.create_unnamed(f.direct).map_err(at(Step::Create))?;
    fill(f, &file)?;
    match dir.link(&file, name) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            dir.link(&file, name_in(dir, &f.tmp)?)
                .map_err(at(Step::Link))?;
            drop(file);
            let r = sys::rename(&f.tmp, &f.dest).map_err(at(Step::Rename));
            if r.is_err() {
                let _ = sys::remove_file(&f.tmp);
            }
            r
        }
        Err(e) => Err(at(Step::Link)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &std::path::Path, name: &str, data: &[u8], prealloc: u64, tag: usize) -> NewFile {
        NewFile {
            tmp: dir.join(format!("{name}.tmp")),
            dest: dir.join(name),
            iov: vec![libc::iovec {
                iov_base: data.as_ptr().cast_mut().cast(),
                iov_len: data.len(),
            }],
            direct: false,
            prealloc,
            sync: true,
            unnamed: None,
            tag,
        }
    }

    /// Files are published whole; a file whose temp name exists already fails at `create`
    /// and leaves that file alone; one whose final name is a non-empty directory fails at
    /// `rename` and leaves no temp file.
    #[test]
    fn files_are_published_whole_and_failures_cleaned_up() {
        {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path();
            let a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
            let b = vec![5u8; 4096];
            std::fs::write(p.join("busy.tmp"), b"someone else's").unwrap();
            std::fs::create_dir(p.join("dirname")).unwrap();
            std::fs::write(p.join("dirname/x"), b"x").unwrap();
            let files = vec![
                file(p, "a", &a, 16384, 0),
                file(p, "b", &b, 0, 1),
                file(p, "busy", &b, 0, 2),
                file(p, "dirname", &b, 4096, 3),
            ];
            let mut out: Vec<Option<NewFileResult>> = (0..4).map(|_| None).collect();
            for f in &files {
                out[f.tag] = Some(write_blocking(f));
            }
            let name = "write_blocking";
            assert!(matches!(out[0], Some(Ok(()))), "{name}: {:?}", out[0]);
            assert!(matches!(out[1], Some(Ok(()))), "{name}: {:?}", out[1]);
            let e = out[2].take().unwrap().unwrap_err();
            assert_eq!(
                (e.step, e.error.kind()),
                (Step::Create, io::ErrorKind::AlreadyExists),
                "{name}"
            );
            let e = out[3].take().unwrap().unwrap_err();
            assert_eq!(e.step, Step::Rename, "{name}: {e}");
            let got = std::fs::read(p.join("a")).unwrap();
            assert_eq!(&got[..a.len()], &a[..], "{name}");
            assert!(got[a.len()..].iter().all(|x| *x == 0), "{name}");
            assert_eq!(std::fs::read(p.join("b")).unwrap(), b, "{name}");
            assert_eq!(
                std::fs::read(p.join("busy.tmp")).unwrap(),
                b"someone else's",
                "{name}"
            );
            assert!(!p.join("a.tmp").exists() && !p.join("b.tmp").exists());
            assert!(!p.join("dirname.tmp").exists(), "{name}: temp left behind");
        }
    }

    /// Unnamed files (`O_TMPFILE`, where the file system has it): a new file is linked whole
    /// to its final name and an existing final name replaced, leaving no temp name either
    /// way; a final name that is a non-empty directory fails at `rename` and leaves no temp
    /// file; a final name outside the held directory fails at `create`.
    #[test]
    fn unnamed_files_are_linked_whole_and_replace_existing_names() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        let mut d = DirFd::open(p).unwrap();
        if !d.probe_unnamed(false, p) {
            eprintln!("skipped: no O_TMPFILE here");
            return;
        }
        let d = Arc::new(d);
        let a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let b = vec![5u8; 4096];
        std::fs::write(p.join("old"), b"the old page").unwrap();
        std::fs::create_dir(p.join("dirname")).unwrap();
        std::fs::write(p.join("dirname/x"), b"x").unwrap();
        let unnamed = |name: &str, data: &[u8], prealloc| NewFile {
            unnamed: Some(d.clone()),
            ..file(p, name, data, prealloc, 0)
        };
        write_blocking(&unnamed("a", &a, 16384)).unwrap();
        let got = std::fs::read(p.join("a")).unwrap();
        assert_eq!(&got[..a.len()], &a[..]);
        assert!(got[a.len()..].iter().all(|x| *x == 0) && got.len() == 16384);
        write_blocking(&unnamed("old", &b, 0)).unwrap();
        assert_eq!(std::fs::read(p.join("old")).unwrap(), b);
        let e = write_blocking(&unnamed("dirname", &b, 0)).unwrap_err();
        assert_eq!(e.step, Step::Rename, "{e}");
        let e = write_blocking(&unnamed("nodir/x", &b, 0)).unwrap_err();
        assert_eq!(e.step, Step::Create, "{e}");
        let mut names: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["a", "dirname", "old"], "no temp name left");
    }
}
