//! `hicache-bench`: the main job and the component benches of hicache-rs.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hicache_bench::cmd;

/// hicache-rs benches and the multi-turn serving simulation.
///
/// With no subcommand it runs the main job, `multiturn --compare`, and accepts every flag of
/// `multiturn` (`hicache-bench --clients 4 --report-dir DIR` is
/// `hicache-bench multiturn --compare --clients 4 --report-dir DIR`).
#[derive(Debug, Parser)]
#[command(
    name = "hicache-bench",
    version,
    about,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// The main job's flags (those of `multiturn`), used when no subcommand is given.
    #[command(flatten)]
    main_job: Box<cmd::multiturn::MultiturnArgs>,
}

impl Cli {
    /// The main job's arguments: `multiturn` with the given flags and `--compare` always on.
    fn main_job_args(
        mut main_job: Box<cmd::multiturn::MultiturnArgs>,
    ) -> Box<cmd::multiturn::MultiturnArgs> {
        main_job.compare = true;
        main_job
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The controller's own cost per scheduler tick with many running requests (sim device).
    Controller(cmd::controller::ControllerArgs),
    /// A long load-back from L2 overlapped with a simulated forward, against a bulk copy.
    Loadback(cmd::loadback::LoadbackArgs),
    /// The main job: a multi-turn serving simulation through the whole stack, per tier.
    Multiturn(Box<cmd::multiturn::MultiturnArgs>),
    /// Cache-aware routing of a fleet of simulated engines, every policy on one workload.
    Fleet(Box<cmd::fleet::FleetArgs>),
    /// L1<->L2 page transfers (backup, per-layer load) against bulk pinned copies.
    Transfer(cmd::transfer::TransferArgs),
    /// The plugin ABI's cost: the memory backend natively vs through the example plugin.
    Plugin(cmd::plugin::PluginArgs),
    /// Replay a request trace through the HiRadixTree and report requests/s.
    Tree(cmd::tree::TreeArgs),
    /// Storage backend throughput next to raw O_DIRECT I/O of the same bytes (or memcpy).
    Storage(cmd::storage::StorageArgs),
    /// Replay a fleet KV-event file through the fleet index, next to a reference index.
    Index(cmd::index::IndexArgs),
    /// Write a fleet KV-event file from a trace (Mooncake) or the multi-turn workload.
    IndexGen(cmd::index_gen::IndexGenArgs),
    /// The operator tools of `hicache` (hash, storage-write, storage-check, storage-clear),
    /// kept here as aliases: the same code and flags.
    #[command(flatten)]
    Tool(hicache_cli::Tool),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Controller(args)) => cmd::controller::run(&args, std::io::stdout().lock()),
        Some(Command::Plugin(args)) => cmd::plugin::run(&args, std::io::stdout().lock()),
        Some(Command::Loadback(args)) => cmd::loadback::run(&args, std::io::stdout().lock()),
        Some(Command::Multiturn(args)) => cmd::multiturn::run(
            &args,
            std::io::stdout().lock(),
            &hicache_sim::adapter::HiCacheFactory,
        )
        .map(drop),
        Some(Command::Fleet(args)) => cmd::fleet::run(&args, std::io::stdout().lock()).map(drop),
        Some(Command::Tree(args)) => cmd::tree::run(&args, std::io::stdout().lock()),
        Some(Command::Transfer(args)) => cmd::transfer::run(&args, std::io::stdout().lock()),
        Some(Command::Storage(args)) => {
            cmd::storage::run(&args, std::io::stdout().lock()).map(drop)
        }
        Some(Command::Index(args)) => cmd::index::run(&args, std::io::stdout().lock()),
        Some(Command::IndexGen(args)) => cmd::index_gen::run(&args, std::io::stdout().lock()),
        Some(Command::Tool(tool)) => tool.run().map_err(Into::into),
        // The main job: the multi-turn workload on the embedded default (sim device, host
        // pool, file L3 in a temp dir), every tier side by side; then its compact fleet table.
        None => {
            let args = Cli::main_job_args(cli.main_job);
            cmd::multiturn::run(
                &args,
                std::io::stdout().lock(),
                &hicache_sim::adapter::HiCacheFactory,
            )
            .map(drop)
            .and_then(|()| cmd::fleet::main_job_table(&args, std::io::stdout().lock()).map(drop))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("hicache-bench").chain(args.iter().copied()))
    }

    #[test]
    fn no_subcommand_is_the_main_job_with_its_flags() {
        let cli = parse(&["--report-dir", "/tmp/r", "--clients", "4", "--rounds", "2"]).unwrap();
        assert!(cli.command.is_none());
        let args = Cli::main_job_args(cli.main_job);
        let expected = cmd::multiturn::MultiturnArgs::try_parse(&[
            "--compare",
            "--report-dir",
            "/tmp/r",
            "--clients",
            "4",
            "--rounds",
            "2",
        ])
        .unwrap();
        assert_eq!(format!("{args:?}"), format!("{expected:?}"));
    }

    #[test]
    fn bare_invocation_is_the_default_main_job() {
        let cli = parse(&[]).unwrap();
        let args = Cli::main_job_args(cli.main_job);
        let expected = cmd::multiturn::MultiturnArgs::main_job();
        assert_eq!(format!("{args:?}"), format!("{expected:?}"));
    }

    #[test]
    fn subcommands_still_parse_and_main_job_flags_do_not_mix_with_them() {
        let cli = parse(&["multiturn", "--clients", "2"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Multiturn(ref a)) if a.clients == 2));
        assert!(parse(&["--clients", "2", "tree"]).is_err());
        assert!(parse(&["--no-such-flag"]).is_err());
        let cli = parse(&[
            "storage-check",
            "--page-bytes",
            "4096",
            "--seed",
            "1",
            "--upto",
            "3",
        ])
        .unwrap();
        assert!(matches!(
            cli.command,
            Some(Command::Tool(hicache_cli::Tool::StorageCheck(_)))
        ));
        for tool in [
            &["hash"][..],
            &["storage-write", "--page-bytes", "4096", "--seed", "1"],
            &["storage-clear", "--dir", "/tmp/d"],
        ] {
            let cli = parse(tool).unwrap();
            assert!(matches!(cli.command, Some(Command::Tool(_))), "{tool:?}");
        }
    }
}
