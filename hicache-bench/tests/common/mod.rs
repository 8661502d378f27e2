//! What the main-job tests share: the tiny workload they run.

use hicache_bench::cmd::multiturn::MultiturnArgs;

/// The main job's flags for a tiny workload: 6 clients × 4 rounds, 60 device pages of 16
/// tokens, at most 2 requests in flight.
pub const TINY_WORKLOAD: [&str; 16] = [
    "--clients",
    "6",
    "--rounds",
    "4",
    "--system-tokens",
    "128",
    "--user-tokens",
    "96",
    "--answer-tokens",
    "48",
    "--page-size",
    "16",
    "--device-pages",
    "60",
    "--max-parallel",
    "2",
];

/// The tiny workload, quiet, its report in `dir`, then `extra`.
#[allow(dead_code)] // main_job_attacked runs the binary and takes only the flags
pub fn tiny(extra: &[&str], dir: &std::path::Path) -> MultiturnArgs {
    let d = dir.display().to_string();
    let mut args = vec!["--quiet"];
    args.extend_from_slice(&TINY_WORKLOAD);
    args.extend_from_slice(&["--report-dir", &d]);
    args.extend_from_slice(extra);
    MultiturnArgs::try_parse(&args).unwrap()
}
