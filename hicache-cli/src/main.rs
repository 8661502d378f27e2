//! `hicache`: the operator tools of hicache-rs (storage write / check / clear, page hashes).

use std::process::ExitCode;

use clap::Parser;
use hicache_cli::Tool;

/// hicache-rs operator tools: write, check and clear a storage backend's pages, and print the
/// page hashes of token ids.
#[derive(Debug, Parser)]
#[command(name = "hicache", version, about)]
struct Cli {
    #[command(subcommand)]
    tool: Tool,
}

fn main() -> ExitCode {
    match Cli::parse().tool.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hicache: error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_is_a_subcommand() {
        for tool in ["hash", "storage-write", "storage-check", "storage-clear"] {
            let e = Cli::try_parse_from(["hicache", tool, "--help"]).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp, "{tool}");
        }
        assert!(Cli::try_parse_from(["hicache", "multiturn"]).is_err());
    }
}
