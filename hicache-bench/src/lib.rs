//! # hicache-bench
//!
//! The main job of hicache-rs and its component benches, as a library so the binary stays thin
//! and the workload generators and reports can be tested. Every bench prints a human table by
//! default and, with `--json`, one [`record::Record`] per measured case, with its same-run reference.
#![warn(missing_docs)]

pub mod cmd;
pub mod error;
pub mod record;
pub mod report;

pub use error::{BenchError, Result};
