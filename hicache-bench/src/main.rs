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
    /// L1<->L2 page transfers (backup, per-layer load) against bulk pinned copies.
    Transfer(cmd::transfer::TransferArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Hash(args)) => {
            cmd::hash::run(&args, std::io::stdin().lock(), std::io::stdout().lock())
        }
        Some(Command::Transfer(args)) => cmd::transfer::run(&args, std::io::stdout().lock()),
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
