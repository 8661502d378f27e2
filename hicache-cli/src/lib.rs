//! # hicache-cli
//!
//! The operator tools of hicache-rs, as the `hicache` binary and as a library (the
//! `hicache-bench` binary keeps its old tool subcommands as aliases of the same code):
//!
//! - `hicache storage-write`: writes deterministic pages, printing `acked <i>` after each
//!   acknowledged batch (kill it at any moment for a durability check);
//! - `hicache storage-check`: reopens a storage (read-only where the backend has a read-only
//!   mode) and checks that acknowledged pages are present and bit-exact;
//! - `hicache storage-clear`: removes every page of one namespace;
//! - `hicache hash`: the page hashes of token ids read from standard input.
//!
//! Backends are those of the facade's registry ([`hicache::backends::builtin_registry`]).
#![warn(missing_docs)]

pub mod backend;
pub mod error;
pub mod hash;
pub mod storage_check;
pub mod storage_clear;
pub mod storage_write;

use clap::Subcommand;

pub use error::{CliError, Result};

/// The tool subcommands (flattened into `hicache-bench`'s subcommands as its aliases).
#[derive(Debug, Subcommand)]
pub enum Tool {
    /// Print the page hashes of token ids read from standard input, one hex digest per page.
    Hash(hash::HashArgs),
    /// Write deterministic pages, printing `acked <i>` after each acknowledged batch.
    StorageWrite(storage_write::StorageWriteArgs),
    /// Reopen a storage and check that acknowledged pages are present and bit-exact.
    StorageCheck(storage_check::StorageCheckArgs),
    /// Remove every page of one namespace from a storage, printing how many were removed.
    StorageClear(storage_clear::StorageClearArgs),
}

impl Tool {
    /// Runs the tool on the process's standard input and output.
    pub fn run(&self) -> Result<()> {
        let out = std::io::stdout().lock();
        match self {
            Tool::Hash(args) => hash::run(args, std::io::stdin().lock(), out),
            Tool::StorageWrite(args) => storage_write::run(args, out),
            Tool::StorageCheck(args) => storage_check::run(args, out).map(drop),
            Tool::StorageClear(args) => storage_clear::run(args, out).map(drop),
        }
    }
}
