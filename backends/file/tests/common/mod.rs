//! A conformance harness for the file backend, shared by the test files.
#![allow(dead_code)]

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use hicache_backend_file::format::{HEADER_LEN, Header};
use hicache_backend_file::{FileBackend, FileOptions};
use hicache_storage::conformance::Harness;
use hicache_storage::{PageKey, Result, StorageError, async_trait};
use parking_lot::Mutex;
use tempfile::TempDir;

/// A directory under the target directory (on the work tree's disk, so O_DIRECT alignment is
/// really exercised; tmpfs would accept anything).
pub fn test_dir() -> TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temp dir under target/")
}

/// Opens file backends in fresh directories with options adjusted by `tweak`.
pub struct FileHarness {
    dirs: Mutex<Vec<TempDir>>,
    tweak: fn(&mut FileOptions),
}

impl FileHarness {
    pub fn new(tweak: fn(&mut FileOptions)) -> Self {
        Self {
            dirs: Mutex::new(Vec::new()),
            tweak,
        }
    }
}

/// Flips one byte in the middle of a page file's data.
pub fn corrupt_file(path: &PathBuf) -> std::io::Result<bool> {
    let f = match OpenOptions::new().read(true).write(true).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let mut h = vec![0u8; HEADER_LEN];
    f.read_exact_at(&mut h, 0)?;
    let len = Header::decode(&h).map(|h| h.meta.len).unwrap_or(1);
    let off = (HEADER_LEN + len / 2) as u64;
    let mut b = [0u8];
    f.read_exact_at(&mut b, off)?;
    b[0] ^= 0x5a;
    f.write_all_at(&b, off)?;
    f.sync_all()?;
    Ok(true)
}

#[async_trait]
impl Harness for FileHarness {
    type Backend = FileBackend;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<FileBackend>> {
        let dir = test_dir();
        let mut o = FileOptions::new(dir.path());
        o.capacity_bytes = Some(capacity_bytes.unwrap_or(512 << 20));
        o.io_threads = 8;
        (self.tweak)(&mut o);
        self.dirs.lock().push(dir);
        Ok(Arc::new(FileBackend::open(o)?))
    }

    async fn corrupt(&self, backend: &FileBackend, key: &PageKey) -> Result<bool> {
        let p = backend.page_path(key);
        corrupt_file(&p).map_err(StorageError::io("corrupt", p))
    }

    async fn reopen(&self, backend: Arc<FileBackend>) -> Result<Option<Arc<FileBackend>>> {
        let opts = backend.options().clone();
        drop(backend);
        Ok(Some(Arc::new(FileBackend::open(opts)?)))
    }
}
