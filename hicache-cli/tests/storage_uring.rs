//! The durability tools on the `uring` backend, and its crash test: `storage-write --backend
//! uring` is SIGKILLed at random moments, several rounds on one directory; after each,
//! `storage-check` reopens it (replaying the index log) and every acknowledged page must read
//! back bit-exact and no page may read back wrong (harness in `durability/`).
#![cfg(feature = "uring")]

mod durability;

use std::path::Path;
use std::process::Command;

use durability::{EXE, dir};

fn check(
    dir: &Path,
    page_bytes: usize,
    seed: u64,
    upto: Option<u64>,
    extra: &str,
) -> (i32, serde_json::Value) {
    durability::check("uring", Some(dir), page_bytes, seed, upto, extra)
}

#[test]
fn write_then_check_on_uring() {
    let d = dir();
    let out = Command::new(EXE)
        .args(["storage-write", "--backend", "uring", "--dir"])
        .arg(d.path())
        .args(["--page-bytes", "8192", "--seed", "5", "--batch", "8"])
        .args(["--pages", "20"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (code, s) = check(d.path(), 8192, 5, Some(19), "{}");
    assert_eq!(code, 0, "{s}");
    assert_eq!(
        (
            s["present"].as_u64(),
            s["missing"].as_u64(),
            s["wrong"].as_u64()
        ),
        (Some(20), Some(0), Some(0))
    );
    let (code, s) = check(d.path(), 8192, 5, Some(24), "{}");
    assert_eq!((code, s["missing"].as_u64()), (1, Some(5)));
    // Bad input: exit code 2 with the field named.
    let out = Command::new(EXE)
        .args(["storage-check", "--backend", "uring", "--dir"])
        .arg(d.path())
        .args(["--page-bytes", "8192", "--seed", "5"])
        .args(["--extra-config", r#"{"queue_depth": 0}"#])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("queue_depth"));
}

/// Group commit: four batches in flight, their slab syncs and index-log appends merged,
/// SIGKILL at random points; every acknowledged page survives and none reads back wrong.
#[test]
fn uring_crash_rounds_with_concurrent_batches_never_lose_acknowledged_pages() {
    let d = dir();
    durability::crash_rounds_inflight(
        "uring",
        Some(d.path()),
        0x9c1,
        4000,
        4,
        &[
            (65_536, r#"{"fsync": "batch", "grow_bytes": "4MiB"}"#),
            (100_000, r#"{"fsync": "batch", "grow_bytes": "4MiB"}"#),
            (30_000, r#"{"fsync": "always", "grow_bytes": "4MiB"}"#),
            (65_536, r#"{"fsync": "batch", "grow_bytes": "4MiB"}"#),
        ],
    );
}

#[test]
fn uring_crash_rounds_never_lose_acknowledged_pages() {
    // Odd-sized pages (bounce path) and aligned ones (direct), every fsync policy, several
    // size classes in one directory: a process crash loses nothing acknowledged.
    let d = dir();
    durability::crash_rounds(
        "uring",
        Some(d.path()),
        0x0b1e,
        2000,
        &[
            (100_000, r#"{"fsync": "batch", "grow_bytes": "4MiB"}"#),
            (65_536, r#"{"fsync": "batch", "grow_bytes": "4MiB"}"#),
            (65_536, r#"{"fsync": "none", "grow_bytes": "4MiB"}"#),
            (
                30_000,
                r#"{"fsync": "always", "queue_depth": 4, "grow_bytes": "4MiB"}"#,
            ),
            (
                131_072,
                r#"{"fsync": "none", "fixed_files": false, "grow_bytes": "4MiB"}"#,
            ),
            (65_536, r#"{"fsync": "batch", "grow_bytes": "4MiB"}"#),
        ],
    );
}

/// Issue 18: SIGKILL while the reclaim thread evicts between the watermarks (a 4 MiB store,
/// 64 KiB pages, two batches in flight): no page ever reads back wrong.
#[test]
fn uring_crash_rounds_with_watermark_eviction_never_serve_wrong_pages() {
    let d = dir();
    let wm = |fsync: &str| {
        format!(
            r#"{{"fsync": "{fsync}", "capacity": "4MiB", "grow_bytes": "1MiB", "high_watermark": 0.5, "low_watermark": 0.2}}"#
        )
    };
    let (batch, none) = (wm("batch"), wm("none"));
    let present = durability::crash_rounds_evicting(
        "uring",
        Some(d.path()),
        0x2fe,
        6000,
        &[(65_536, &batch), (65_536, &none), (65_536, &batch)],
        true,
    );
    assert!(present > 0, "no round left a page to check");
}
