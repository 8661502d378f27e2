//! # hicache-bench
//!
//! The main job of hicache-rs and its component benches, as a library so the binary stays thin
//! and the reports can be tested. The main job runs on the simulated serving engine of the
//! `hicache-sim` crate; the operator tools (`storage-write`, `storage-check`, `storage-clear`,
//! `hash`) are the `hicache-cli` crate's, kept here as subcommand aliases. Every bench prints a
//! human table by default and, with `--json`, one [`record::Record`] per measured case, with
//! its same-run reference.
#![warn(missing_docs)]

pub mod cmd;
pub mod error;
pub mod record;
pub mod report;

pub use error::{BenchError, Result};
