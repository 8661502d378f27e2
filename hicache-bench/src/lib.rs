//! # hicache-bench
//!
//! The main job of hicache-rs and its component benches, as a library so the binary stays thin
//! and the workload generators and reports can be tested. Every bench prints a human table by
//! default and, with `--json`, one [`record::Record`] per measured case (DESIGN.md §7).
#![warn(missing_docs)]

pub mod cmd;
pub mod copy_gate;
pub mod error;
pub mod hicache_adapter;
pub mod record;
pub mod report;
pub mod setup;
pub mod sim;
pub mod trace;
pub mod workload;

pub use error::{BenchError, Result};
