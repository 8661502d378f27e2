//! `hicache-bench`: the main job and the component benches of hicache-rs.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hicache_bench::cmd;

/// hicache-rs benches and the multi-turn serving simulation.
#[derive(Debug, Parser)]
#[command(name = "hicache-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the page hashes of token ids read from standard input, one hex digest per page.
    Hash(cmd::hash::HashArgs),
    /// Storage backend throughput next to raw O_DIRECT I/O of the same bytes (or memcpy).
    Storage(cmd::storage::StorageArgs),
    /// Write deterministic pages, printing `acked <i>` after each acknowledged batch.
    StorageWrite(cmd::storage_write::StorageWriteArgs),
    /// Reopen a storage and check that acknowledged pages are present and bit-exact.
    StorageCheck(cmd::storage_check::StorageCheckArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Hash(args)) => {
            cmd::hash::run(&args, std::io::stdin().lock(), std::io::stdout().lock())
        }
        Some(Command::Storage(args)) => {
            cmd::storage::run(&args, std::io::stdout().lock()).map(drop)
        }
        Some(Command::StorageWrite(args)) => {
            cmd::storage_write::run(&args, std::io::stdout().lock())
        }
        Some(Command::StorageCheck(args)) => {
            cmd::storage_check::run(&args, std::io::stdout().lock()).map(drop)
        }
        None => {
            use clap::CommandFactory;
            Cli::command().print_help().ok();
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hicache-bench: error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
