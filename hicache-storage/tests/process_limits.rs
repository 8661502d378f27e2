//! Hostile configuration (issue 38, item 9): a memory size checked against the limits of the
//! process, not only the machine. An 8 GiB memory backend under a 1.5 GiB `RLIMIT_DATA` (or
//! `RLIMIT_AS`) used to be accepted and abort the process when it filled; it is now refused
//! when opened, naming the limit.
//!
//! Each case re-runs this test binary as a child under `prlimit` (util-linux), so the limit
//! is real (`/proc/self/limits` of the child) and stays in the child.

use std::process::Command;

use hicache_storage::{MemoryOptions, StorageConfig, machine::MemoryLimits};

const CHILD: &str = "HICACHE_PROCESS_LIMITS_CHILD";

/// In the child: opens the memory backend's options with `capacity` and prints the outcome.
fn child_checks(capacity: &str) -> String {
    let cfg = StorageConfig::parse(
        Some("memory"),
        Some(&format!(r#"{{"capacity": "{capacity}"}}"#)),
    )
    .unwrap();
    match MemoryOptions::from_config(&cfg.common, cfg.backend_fields) {
        Ok(o) => format!("accepted {}", o.capacity_bytes),
        Err(e) => format!("refused {e}"),
    }
}

/// Runs test `name` of this binary in a child under `prlimit <limit>`; its stdout.
fn in_child(name: &str, limit: &str) -> Option<String> {
    let exe = std::env::current_exe().unwrap();
    let out = match Command::new("prlimit")
        .arg(limit)
        .arg("--")
        .arg(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("prlimit cannot run here ({e}): case skipped");
            return None;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(stdout)
}

fn case(name: &str, limit: &str, named: &str) {
    if std::env::var_os(CHILD).is_some() {
        println!("RESULT8 {}", child_checks("8gib"));
        println!("RESULT1 {}", child_checks("256mib"));
        return;
    }
    let Some(out) = in_child(name, limit) else {
        return;
    };
    let line = |tag: &str| {
        out.lines()
            .find_map(|l| l.split_once(tag).map(|(_, r)| r))
            .unwrap_or_else(|| panic!("no {tag} in {out}"))
            .to_string()
    };
    let big = line("RESULT8 ");
    assert!(
        big.starts_with("refused")
            && big.contains("`capacity` = 8589934592")
            && big.contains(named),
        "{big}"
    );
    assert_eq!(line("RESULT1 "), format!("accepted {}", 256u64 << 20));
}

#[test]
fn a_capacity_above_rlimit_data_is_refused() {
    case(
        "a_capacity_above_rlimit_data_is_refused",
        "--data=1610612736",
        "RLIMIT_DATA (data segment) is 1610612736 bytes (1.5 GiB)",
    );
}

#[test]
fn a_capacity_above_rlimit_as_is_refused() {
    // The address space holds the binary, its libraries and thread stacks too: 4 GiB leaves
    // room for them and is still below 8 GiB.
    case(
        "a_capacity_above_rlimit_as_is_refused",
        "--as=4294967296",
        "RLIMIT_AS (address space) is 4294967296 bytes",
    );
}

#[test]
fn this_process_reads_its_limits() {
    let l = MemoryLimits::of_this_process();
    assert!(l.machine.is_some_and(|m| m > 0));
    assert!(l.smallest().is_some());
}
