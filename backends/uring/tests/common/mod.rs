//! A conformance harness for the uring backend, shared by the test files.
#![allow(dead_code)]

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use hicache_backend_uring::{UringBackend, UringOptions};
use hicache_storage::conformance::Harness;
use hicache_storage::{PageKey, Result, StorageError, async_trait};
use parking_lot::Mutex;
use tempfile::TempDir;

/// A directory under the target directory (on the work tree's disk, so O_DIRECT alignment is
/// really exercised; tmpfs would accept anything).
pub fn test_dir() -> TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temp dir under target/")
}

/// Options for tests: small slab growth steps, a bounded capacity.
pub fn test_opts(dir: &std::path::Path) -> UringOptions {
    let mut o = UringOptions::new(dir);
    o.capacity_bytes = Some(512 << 20);
    o.grow_bytes = 16 << 20;
    o
}

/// Opens uring backends in fresh directories with options adjusted by `tweak`.
pub struct UringHarness {
    dirs: Mutex<Vec<TempDir>>,
    tweak: fn(&mut UringOptions),
}

impl UringHarness {
    pub fn new(tweak: fn(&mut UringOptions)) -> Self {
        Self {
            dirs: Mutex::new(Vec::new()),
            tweak,
        }
    }
}

/// Flips one byte in the middle of `key`'s stored bytes, behind the backend's back.
pub fn corrupt_page(backend: &UringBackend, key: &PageKey) -> std::io::Result<bool> {
    let Some((path, offset, len)) = backend.page_location(key) else {
        return Ok(false);
    };
    let f = OpenOptions::new().read(true).write(true).open(&path)?;
    let at = offset + len as u64 / 2;
    let mut b = [0u8];
    f.read_exact_at(&mut b, at)?;
    b[0] ^= 0x5a;
    f.write_all_at(&b, at)?;
    f.sync_all()?;
    Ok(true)
}

#[async_trait]
impl Harness for UringHarness {
    type Backend = UringBackend;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<UringBackend>> {
        let dir = test_dir();
        let mut o = test_opts(dir.path());
        if let Some(c) = capacity_bytes {
            o.capacity_bytes = Some(c);
        }
        (self.tweak)(&mut o);
        self.dirs.lock().push(dir);
        Ok(Arc::new(UringBackend::open(o)?))
    }

    async fn corrupt(&self, backend: &UringBackend, key: &PageKey) -> Result<bool> {
        corrupt_page(backend, key).map_err(StorageError::io("corrupt", "slab"))
    }

    async fn reopen(&self, backend: Arc<UringBackend>) -> Result<Option<Arc<UringBackend>>> {
        let opts = backend.options().clone();
        drop(backend);
        Ok(Some(Arc::new(UringBackend::open(opts)?)))
    }
}
