//! The shared test harness of the local layouts (feature `test-util`): a conformance
//! [`Harness`] that opens a layout in fresh directories under a given base (on a real disk,
//! so O_DIRECT alignment is exercised; tmpfs would accept anything), and the fault helpers
//! the layouts' tests share.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hicache_storage::conformance::Harness;
use hicache_storage::{PageKey, Result, Storage, StorageError, async_trait};
use parking_lot::Mutex;
use tempfile::TempDir;

/// A fresh directory under `base` (tests pass their `CARGO_TARGET_TMPDIR`).
pub fn test_dir_in(base: impl AsRef<Path>) -> TempDir {
    tempfile::tempdir_in(base).expect("a temp dir under the base")
}

/// Flips one byte (xor `0x5a`) of the file at `path` at `offset`, and syncs it. Returns
/// `Ok(false)` if the file does not exist.
pub fn flip_byte(path: &Path, offset: u64) -> io::Result<bool> {
    let f = match OpenOptions::new().read(true).write(true).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset)?;
    b[0] ^= 0x5a;
    f.write_all_at(&b, offset)?;
    f.sync_all()?;
    Ok(true)
}

/// How a [`LocalHarness`] handles one layout `B` with options `O`.
#[derive(Clone, Copy)]
pub struct LayoutOps<B, O> {
    /// Test options for a directory and a capacity (`None`: the layout's test default).
    pub options: fn(&Path, Option<u64>) -> O,
    /// Opens (or reopens) the layout.
    pub open: fn(O) -> Result<B>,
    /// The options an open layout was opened with.
    pub options_of: fn(&B) -> O,
    /// Damages `key`'s stored bytes behind the layout's back (`Ok(false)`: absent).
    pub corrupt: fn(&B, &PageKey) -> io::Result<bool>,
}

/// Opens a local layout in fresh directories with options adjusted by a tweak.
pub struct LocalHarness<B, O> {
    base: PathBuf,
    dirs: Mutex<Vec<TempDir>>,
    ops: LayoutOps<B, O>,
    tweak: fn(&mut O),
}

impl<B, O> LocalHarness<B, O> {
    /// A harness making its directories under `base`.
    pub fn new(base: impl Into<PathBuf>, ops: LayoutOps<B, O>, tweak: fn(&mut O)) -> Self {
        Self {
            base: base.into(),
            dirs: Mutex::new(Vec::new()),
            ops,
            tweak,
        }
    }
}

#[async_trait]
impl<B, O> Harness for LocalHarness<B, O>
where
    B: Storage,
    O: Send + Sync + 'static,
{
    type Backend = B;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<B>> {
        let dir = test_dir_in(&self.base);
        let mut o = (self.ops.options)(dir.path(), capacity_bytes);
        (self.tweak)(&mut o);
        self.dirs.lock().push(dir);
        Ok(Arc::new((self.ops.open)(o)?))
    }

    async fn corrupt(&self, backend: &B, key: &PageKey) -> Result<bool> {
        (self.ops.corrupt)(backend, key).map_err(StorageError::io("corrupt", "page"))
    }

    async fn reopen(&self, backend: Arc<B>) -> Result<Option<Arc<B>>> {
        let opts = (self.ops.options_of)(&backend);
        drop(backend);
        Ok(Some(Arc::new((self.ops.open)(opts)?)))
    }
}
