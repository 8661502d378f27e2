//! # hicache-backend-local
//!
//! The local-disk L3 backends of hicache-rs, one crate over one I/O engine (foyer's block
//! engine is the model):
//!
//! - [`io`]: the engine. io_uring with registered buffers and fixed files, the thread-pool
//!   fallback behind the same [`io::Driver`] trait, group commit, the fsync policy, aligned
//!   buffers and the power-loss journal;
//! - [`pages`]: the page-file layout, registry name `file` (a file per page, crash-safe,
//!   shared directories), [`FileBackend`];
//! - [`slab`]: the slab layout, registry name `uring` (O_DIRECT slab files and a checksummed
//!   index log, for NVMe), [`UringBackend`];
//! - [`backend`]: the one generic backend, [`LocalBackend`], implementing the storage
//!   contract over any [`Layout`], and its [`Factory`];
//! - [`common`]: the stages and helpers both layouts share (errors, the read-only guard, the
//!   reclaim thread and watermarks, the factory's open task);
//! - `testing` (feature `testing`): the conformance harness, fault helpers and power-loss
//!   checks the layouts' tests share.
//!
//! [`register`] adds both registry names, as any third-party backend crate would.
//!
//! ```no_run
//! # fn f(registry: &hicache_storage::Registry) -> hicache_storage::Result<()> {
//! hicache_backend_local::register(registry)?; // "file" and "uring"
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod backend;
pub mod common;
pub mod io;
pub mod pages;
pub mod slab;
#[cfg(feature = "testing")]
pub mod testing;

pub use backend::{Factory, Layout, LocalBackend, Shape};
pub use common::LocalError;
pub use io::FsyncPolicy;
pub use pages::{FileBackend, FileFactory, FileOptions};
pub use slab::{UringBackend, UringFactory, UringOptions};

/// Adds both layouts to `registry`: [`FileBackend`] as `file` and [`UringBackend`] as `uring`
/// (one layout alone: [`FileFactory::register`], [`UringFactory::register`]).
pub fn register(registry: &hicache_storage::Registry) -> hicache_storage::Result<()> {
    FileFactory::register(registry)?;
    UringFactory::register(registry)
}
