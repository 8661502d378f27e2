//! The local-disk I/O engine both layouts share. It knows no backend and
//! no on-disk format: a layout (page files, slabs with an index log) decides *what* to read
//! and write; this module decides *how*:
//!
//! - [`ring`]: the one io_uring driver (a dedicated thread, registered buffers, fixed files,
//!   short transfers continued), and [`driver::Threads`], the thread-pool fallback, behind
//!   one trait, [`Driver`];
//! - [`newfile`]: a file created, written, synced and renamed into place as one unit, with
//!   blocking calls; [`dir`]: the directory such files are created and linked in, held open;
//! - [`FsyncPolicy`], the one durability setting, and [`GroupCommit`], which merges the
//!   durability barriers of concurrent batches into one;
//! - [`buf`]: 4096-aligned buffers and their pool (O_DIRECT staging and bounce buffers);
//! - [`probe_direct`], the O_DIRECT probe, and [`sys`]: free-space checks, preallocation,
//!   `flock`, directory syncs and the other system calls `std` lacks;
//! - [`par`]: running a batch's blocking work from async code and over a few threads;
//! - [`journal`]: in test mode (feature `journal`), every write, sync, create, rename and
//!   unlink issued, and the crash states a file system may leave after any prefix of them;
//!
//! ```no_run
//! use hicache_backend_local::io::{Driver, ring::{Dir, FileRef, Req, Ring}};
//! # fn f(fd: std::os::fd::RawFd) -> std::io::Result<()> {
//! let ring = Ring::new(32, false)?;
//! let mut page = vec![0u8; 4096];
//! let req = Req {
//!     dir: Dir::Read,
//!     file: FileRef { fd, fixed: None },
//!     offset: 0,
//!     iov: vec![libc::iovec { iov_base: page.as_mut_ptr().cast(), iov_len: page.len() }],
//!     fixed_buf: None,
//!     dsync: false,
//!     eof_ok: false,
//!     tag: 0,
//! };
//! ring.run(vec![req], &mut |tag, r| println!("{tag}: {r:?}"));
//! # Ok(()) }
//! ```

pub mod buf;
pub mod dir;
mod direct;
pub mod driver;
pub mod group;
pub mod journal;
pub mod newfile;
pub mod par;
mod policy;
pub mod ring;
pub mod sys;

pub use buf::{ALIGN, AlignedBuf, BufPool};
pub use dir::DirFd;
pub use direct::probe_direct;
pub use driver::{Driver, Threads};
pub use group::GroupCommit;
pub use newfile::{NewFile, NewFileError, NewFileResult};
pub use policy::{FsyncPolicy, IoEngine};
pub use ring::Ring;
