//! The durability tools on the `uring` backend, and its crash test: `storage-write --backend
//! uring` is SIGKILLed at random moments, several rounds on one directory; after each,
//! `storage-check` reopens it (replaying the index log) and every acknowledged page must read
//! back bit-exact and no page may read back wrong.
#![cfg(feature = "uring")]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use rand::{Rng, SeedableRng};

const EXE: &str = env!("CARGO_BIN_EXE_hicache-bench");

fn dir() -> tempfile::TempDir {
    // Under target/, on the work tree's disk: O_DIRECT really runs.
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn check(
    dir: &Path,
    page_bytes: usize,
    seed: u64,
    upto: Option<u64>,
    extra: &str,
) -> (i32, serde_json::Value) {
    let mut c = Command::new(EXE);
    c.args(["storage-check", "--backend", "uring", "--dir"])
        .arg(dir)
        .args(["--page-bytes", &page_bytes.to_string()])
        .args(["--seed", &seed.to_string()])
        .args(["--extra-config", extra]);
    if let Some(u) = upto {
        c.args(["--upto", &u.to_string()]);
    }
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(stdout.lines().last().unwrap_or("null"))
        .unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), json)
}

fn parse_ack(line: &str) -> u64 {
    line.strip_prefix("acked ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected writer output {line:?}"))
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

/// One crash round: SIGKILL the writer after a random number of acknowledgements plus a random
/// delay (during open, mid-batch, between batches). Returns the last acknowledged index.
fn crash_round(
    d: &Path,
    rng: &mut impl Rng,
    page_bytes: usize,
    seed: u64,
    extra: &str,
) -> Option<u64> {
    let mut child = Command::new(EXE)
        .args(["storage-write", "--backend", "uring", "--dir"])
        .arg(d)
        .args(["--page-bytes", &page_bytes.to_string()])
        .args(["--seed", &seed.to_string(), "--batch", "16"])
        .args(["--extra-config", extra])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let target_acks: u32 = rng.random_range(0..6);
    let delay = Duration::from_micros(rng.random_range(0..40_000));
    let mut last = None;
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = 0;
    while seen < target_acks {
        match lines.next() {
            Some(Ok(l)) => {
                last = Some(parse_ack(&l));
                seen += 1;
            }
            _ => break,
        }
    }
    std::thread::sleep(delay);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    for l in lines.map_while(Result::ok) {
        last = Some(parse_ack(&l));
    }
    last
}

#[test]
fn uring_crash_rounds_never_lose_acknowledged_pages() {
    let d = dir();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x0b1e);
    let mut checked = 0;
    let mut lasts: Vec<Option<u64>> = Vec::new();
    // Odd-sized pages (bounce path) and aligned ones (direct), every fsync policy, several
    // size classes in one directory: a process crash loses nothing acknowledged.
    let cases = [
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
    ];
    for (round, (page_bytes, extra)) in cases.into_iter().enumerate() {
        let seed = 2000 + round as u64;
        let last = crash_round(d.path(), &mut rng, page_bytes, seed, extra);
        let (code, s) = check(d.path(), page_bytes, seed, last, extra);
        assert_eq!(
            code, 0,
            "round {round} ({page_bytes} B, {extra}): acked up to {last:?}: {s}"
        );
        assert_eq!(s["wrong"].as_u64(), Some(0), "round {round}: {s}");
        assert_eq!(s["missing"].as_u64(), Some(0), "round {round}: {s}");
        checked += s["present"].as_u64().unwrap();
        lasts.push(last);
        for (r, (pb, ex)) in cases.iter().enumerate().take(round) {
            let (code, s) = check(d.path(), *pb, 2000 + r as u64, lasts[r], ex);
            assert_eq!(code, 0, "round {r} revisited: {s}");
            assert_eq!(s["wrong"].as_u64(), Some(0));
        }
    }
    assert!(
        checked > 0,
        "no round acknowledged anything; the test checked nothing"
    );
}
