//! The file backend over the shared local-layout test harness (`hicache_backend_local::testing`).
#![allow(dead_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use hicache_backend_local::pages::format::{HEADER_LEN, Header};
use hicache_backend_local::pages::{FileBackend, FileOptions};
use hicache_backend_local::testing::{LayoutOps, LocalHarness, flip_byte, test_dir_in};
use tempfile::TempDir;

/// A directory under the target directory (on the work tree's disk, so O_DIRECT alignment is
/// really exercised; tmpfs would accept anything).
pub fn test_dir() -> TempDir {
    test_dir_in(env!("CARGO_TARGET_TMPDIR"))
}

/// Flips one byte in the middle of a page file's data.
pub fn corrupt_file(path: &PathBuf) -> std::io::Result<bool> {
    let len = match File::open(path) {
        Ok(f) => {
            let mut h = vec![0u8; HEADER_LEN];
            f.read_exact_at(&mut h, 0)?;
            Header::decode(&h).map(|h| h.meta.len).unwrap_or(1)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    flip_byte(path, (HEADER_LEN + len / 2) as u64)
}

/// How the shared harness opens the file backend.
pub const OPS: LayoutOps<FileBackend, FileOptions> = LayoutOps {
    options: |dir, capacity| {
        let mut o = FileOptions::new(dir);
        o.capacity_bytes = Some(capacity.unwrap_or(512 << 20));
        o.io_threads = 8;
        o
    },
    open: FileBackend::open,
    options_of: |b| b.options().clone(),
    corrupt: |b, k| corrupt_file(&b.page_path(k)),
};

/// Opens file backends in fresh directories with options adjusted by a tweak.
pub struct FileHarness;

impl FileHarness {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(tweak: fn(&mut FileOptions)) -> LocalHarness<FileBackend, FileOptions> {
        LocalHarness::new(env!("CARGO_TARGET_TMPDIR"), OPS, tweak)
    }
}
