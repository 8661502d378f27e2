//! The crash-test harness shared by every backend's durability test: `storage-write` is
//! SIGKILLed at random moments, several rounds on one store; after each, `storage-check`
//! reopens it and every acknowledged page must read back bit-exact and no page may read back
//! wrong, this round's and every earlier round's.
// Each test binary compiles this module and uses only the helpers it needs.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use rand::{Rng, SeedableRng};

/// The `hicache` binary under test.
pub const EXE: &str = env!("CARGO_BIN_EXE_hicache");

/// A fresh directory under target/, on the work tree's disk, so O_DIRECT paths really run.
pub fn dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Runs `storage-check` on `backend` (in `dir` when given) and returns its exit code and its
/// JSON summary (the last line of stdout).
pub fn check(
    backend: &str,
    dir: Option<&Path>,
    page_bytes: usize,
    seed: u64,
    upto: Option<u64>,
    extra: &str,
) -> (i32, serde_json::Value) {
    let mut c = Command::new(EXE);
    c.args(["storage-check", "--backend", backend]);
    if let Some(d) = dir {
        c.arg("--dir").arg(d);
    }
    c.args(["--page-bytes", &page_bytes.to_string()])
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

/// One crash round: start a writer, SIGKILL it after a random number of acknowledgements plus
/// a random delay (so the kill lands anywhere: during open, mid-batch, between batches).
/// Returns the last acknowledged index.
fn crash_round(
    backend: &str,
    dir: Option<&Path>,
    rng: &mut impl Rng,
    page_bytes: usize,
    seed: u64,
    extra: &str,
    inflight: usize,
) -> Option<u64> {
    let mut c = Command::new(EXE);
    c.args(["storage-write", "--backend", backend]);
    c.args(["--inflight", &inflight.to_string()]);
    if let Some(d) = dir {
        c.arg("--dir").arg(d);
    }
    let mut child = c
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
    // Acks printed after the ones read but before the kill count as acknowledged too.
    for l in lines.map_while(Result::ok) {
        last = Some(parse_ack(&l));
    }
    last
}

/// Runs one crash round per `(page_bytes, extra-config)` case on the same store (seeds
/// `seed_base + round`) and checks after each that this round's and every earlier round's
/// acknowledged pages are all present and none reads back wrong.
pub fn crash_rounds(
    backend: &str,
    dir: Option<&Path>,
    rng_seed: u64,
    seed_base: u64,
    cases: &[(usize, &str)],
) {
    crash_rounds_inflight(backend, dir, rng_seed, seed_base, 1, cases);
}

/// [`crash_rounds`] with `inflight` batches written at once (their durability barriers merge
/// in the backend's group commit); the writer acknowledges up to its watermark, every page
/// at or below which was acknowledged.
pub fn crash_rounds_inflight(
    backend: &str,
    dir: Option<&Path>,
    rng_seed: u64,
    seed_base: u64,
    inflight: usize,
    cases: &[(usize, &str)],
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rng_seed);
    let mut checked = 0;
    let mut lasts: Vec<Option<u64>> = Vec::new();
    for (round, &(page_bytes, extra)) in cases.iter().enumerate() {
        let seed = seed_base + round as u64;
        let last = crash_round(backend, dir, &mut rng, page_bytes, seed, extra, inflight);
        let (code, s) = check(backend, dir, page_bytes, seed, last, extra);
        assert_eq!(
            code, 0,
            "{backend} round {round} ({page_bytes} B, {extra}): acked up to {last:?}: {s}"
        );
        assert_eq!(s["wrong"].as_u64(), Some(0), "round {round}: {s}");
        assert_eq!(s["missing"].as_u64(), Some(0), "round {round}: {s}");
        checked += s["present"].as_u64().unwrap();
        lasts.push(last);
        for (r, &(pb, ex)) in cases.iter().enumerate().take(round) {
            let (code, s) = check(backend, dir, pb, seed_base + r as u64, lasts[r], ex);
            assert_eq!(code, 0, "{backend} round {r} revisited: {s}");
            assert_eq!(s["wrong"].as_u64(), Some(0));
        }
    }
    assert!(
        checked > 0,
        "no round acknowledged anything; the test checked nothing"
    );
}

/// Crash rounds on a store that evicts while it is written (a small capacity with
/// `high_watermark` / `low_watermark`: the background reclaim thread deletes pages as the
/// writer runs, and is killed with it). Acknowledged pages may have been evicted by design,
/// so a round may report them missing; what must hold is crash safety: no page, of this
/// round or an earlier one, reads back wrong, nothing torn is served, and the store reopens.
/// `detected_corrupt_ok`: whether a page the backend itself detects as damaged (and refuses:
/// a miss) is acceptable. It is for uring, whose evicted slots are reused before their `del`
/// records reach the log, so a crash can leave a `put` record naming rewritten bytes (caught
/// by its checksum); a file backend never shows one. Returns the pages found present over all
/// rounds.
pub fn crash_rounds_evicting(
    backend: &str,
    dir: Option<&Path>,
    rng_seed: u64,
    seed_base: u64,
    cases: &[(usize, &str)],
    detected_corrupt_ok: bool,
) -> u64 {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rng_seed);
    let mut present = 0;
    let mut lasts: Vec<Option<u64>> = Vec::new();
    for (round, &(page_bytes, extra)) in cases.iter().enumerate() {
        let seed = seed_base + round as u64;
        let last = crash_round(backend, dir, &mut rng, page_bytes, seed, extra, 2);
        lasts.push(last);
        for (r, &(pb, ex)) in cases.iter().enumerate().take(round + 1) {
            let (code, s) = check(backend, dir, pb, seed_base + r as u64, lasts[r], ex);
            assert!(
                code == 0 || (code == 1 && s["missing"].as_u64() > Some(0)),
                "{backend} round {r} (checked in round {round}, {extra}): {s}"
            );
            assert_eq!(s["wrong"].as_u64(), Some(0), "round {r}: {s}");
            if !detected_corrupt_ok {
                assert_eq!(s["corrupt_detected"].as_u64(), Some(0), "round {r}: {s}");
            }
            if r == round {
                present += s["present"].as_u64().unwrap() + s["beyond_present"].as_u64().unwrap();
            }
        }
    }
    present
}
