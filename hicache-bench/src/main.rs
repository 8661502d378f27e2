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
    /// The controller's own cost per scheduler tick with many running requests (sim device).
    Controller(cmd::controller::ControllerArgs),
    /// A long load-back from L2 overlapped with a simulated forward, against a bulk copy.
    Loadback(cmd::loadback::LoadbackArgs),
    /// The main job: a multi-turn serving simulation through the whole stack, per tier.
    Multiturn(Box<cmd::multiturn::MultiturnArgs>),
    /// Print the page hashes of token ids read from standard input, one hex digest per page.
    Hash(cmd::hash::HashArgs),
    /// L1<->L2 page transfers (backup, per-layer load) against bulk pinned copies.
    Transfer(cmd::transfer::TransferArgs),
    /// The plugin ABI's cost: the memory backend natively vs through the example plugin.
    Plugin(cmd::plugin::PluginArgs),
    /// Replay a request trace through the HiRadixTree and report requests/s.
    Tree(cmd::tree::TreeArgs),
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
        Some(Command::Controller(args)) => cmd::controller::run(&args, std::io::stdout().lock()),
        Some(Command::Plugin(args)) => cmd::plugin::run(&args, std::io::stdout().lock()),
        Some(Command::Loadback(args)) => cmd::loadback::run(&args, std::io::stdout().lock()),
        Some(Command::Multiturn(args)) => cmd::multiturn::run(
            &args,
            std::io::stdout().lock(),
            &hicache_bench::hicache_adapter::HiCacheFactory,
        )
        .map(drop),
        Some(Command::Tree(args)) => cmd::tree::run(&args, std::io::stdout().lock()),
        Some(Command::Transfer(args)) => cmd::transfer::run(&args, std::io::stdout().lock()),
        Some(Command::Storage(args)) => {
            cmd::storage::run(&args, std::io::stdout().lock()).map(drop)
        }
        Some(Command::StorageWrite(args)) => {
            cmd::storage_write::run(&args, std::io::stdout().lock())
        }
        Some(Command::StorageCheck(args)) => {
            cmd::storage_check::run(&args, std::io::stdout().lock()).map(drop)
        }
        // The main job: the multi-turn workload on the embedded default (sim device, host
        // pool, file L3 in a temp dir), every tier side by side.
        None => cmd::multiturn::run(
            &cmd::multiturn::MultiturnArgs::main_job(),
            std::io::stdout().lock(),
            &hicache_bench::hicache_adapter::HiCacheFactory,
        )
        .map(drop),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hicache-bench: error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
