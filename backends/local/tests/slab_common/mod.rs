//! The uring backend over the shared local-layout test harness (`hicache_backend_local::testing`).
#![allow(dead_code)]

use hicache_backend_local::slab::{UringBackend, UringOptions};
use hicache_backend_local::testing::{LayoutOps, LocalHarness, flip_byte, test_dir_in};
use hicache_storage::PageKey;
use tempfile::TempDir;

/// A directory under the target directory (on the work tree's disk, so O_DIRECT alignment is
/// really exercised; tmpfs would accept anything).
pub fn test_dir() -> TempDir {
    test_dir_in(env!("CARGO_TARGET_TMPDIR"))
}

/// Options for tests: small slab growth steps, a bounded capacity.
pub fn test_opts(dir: &std::path::Path) -> UringOptions {
    let mut o = UringOptions::new(dir);
    o.capacity_bytes = Some(512 << 20);
    o.grow_bytes = 16 << 20;
    o
}

/// Flips one byte in the middle of `key`'s stored bytes, behind the backend's back.
pub fn corrupt_page(backend: &UringBackend, key: &PageKey) -> std::io::Result<bool> {
    let Some((path, offset, len)) = backend.page_location(key) else {
        return Ok(false);
    };
    flip_byte(&path, offset + len as u64 / 2)
}

/// How the shared harness opens the uring backend.
pub const OPS: LayoutOps<UringBackend, UringOptions> = LayoutOps {
    options: |dir, capacity| {
        let mut o = test_opts(dir);
        if let Some(c) = capacity {
            o.capacity_bytes = Some(c);
        }
        o
    },
    open: UringBackend::open,
    options_of: |b| b.options().clone(),
    corrupt: corrupt_page,
};

/// Opens uring backends in fresh directories with options adjusted by a tweak.
pub struct UringHarness;

impl UringHarness {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(tweak: fn(&mut UringOptions)) -> LocalHarness<UringBackend, UringOptions> {
        LocalHarness::new(env!("CARGO_TARGET_TMPDIR"), OPS, tweak)
    }
}
