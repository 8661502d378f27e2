//! The durability tools end to end, and the crash test: `storage-write` is SIGKILLed at random
//! moments, several rounds on one directory; after each, `storage-check` reopens it and every
//! acknowledged page must read back bit-exact and no page may read back wrong.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use rand::{Rng, SeedableRng};

const EXE: &str = env!("CARGO_BIN_EXE_hicache-bench");

fn dir() -> tempfile::TempDir {
    // Under target/, on the work tree's disk: O_DIRECT paths really run.
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
    c.args(["storage-check", "--backend", "file", "--dir"])
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

#[test]
fn write_then_check_and_detect_damage() {
    let d = dir();
    let status = Command::new(EXE)
        .args(["storage-write", "--backend", "file", "--dir"])
        .arg(d.path())
        .args([
            "--page-bytes",
            "8192",
            "--seed",
            "5",
            "--batch",
            "8",
            "--pages",
            "20",
        ])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let acks: Vec<String> = String::from_utf8_lossy(&status.stdout)
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(acks, vec!["acked 7", "acked 15", "acked 19"]);
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
    // Claiming more than was written: missing pages, exit 1.
    let (code, s) = check(d.path(), 8192, 5, Some(24), "{}");
    assert_eq!(code, 1);
    assert_eq!(s["missing"].as_u64(), Some(5));
    assert_eq!(s["first_missing"].as_u64(), Some(20));
    // Damage one page's data on disk: detected, never served, reported missing.
    let victim = hicache_storage::pattern::page_key(hicache_storage::pattern::namespace(0), 5, 3);
    let p = d
        .path()
        .join("pages")
        .join(format!("{}.page", victim.to_hex()));
    let mut b = std::fs::read(&p).unwrap();
    let n = b.len();
    b[n - 100] ^= 0xff;
    std::fs::write(&p, b).unwrap();
    let (code, s) = check(d.path(), 8192, 5, Some(19), "{}");
    assert_eq!(code, 1, "{s}");
    assert_eq!(
        (
            s["missing"].as_u64(),
            s["wrong"].as_u64(),
            s["corrupt_detected"].as_u64()
        ),
        (Some(1), Some(0), Some(1))
    );
    // Bad input: exit code 2 with the field named.
    let out = Command::new(EXE)
        .args(["storage-check", "--backend", "file", "--dir"])
        .arg(d.path())
        .args(["--page-bytes", "8192", "--seed", "5"])
        .args(["--extra-config", r#"{"fsync": "often"}"#])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("fsync"));
    let out = Command::new(EXE)
        .args([
            "storage-check",
            "--backend",
            "nosuch",
            "--page-bytes",
            "1",
            "--seed",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("file, memory"));
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
    d: &Path,
    rng: &mut impl Rng,
    page_bytes: usize,
    seed: u64,
    extra: &str,
) -> Option<u64> {
    let mut child = Command::new(EXE)
        .args(["storage-write", "--backend", "file", "--dir"])
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
    // Acks printed after the ones read but before the kill count as acknowledged too.
    for l in lines.map_while(Result::ok) {
        last = Some(parse_ack(&l));
    }
    last
}

#[test]
fn crash_rounds_never_lose_acknowledged_pages() {
    let d = dir();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let mut checked = 0;
    let mut lasts: Vec<Option<u64>> = Vec::new();
    // Odd-sized pages (staging path) and aligned ones (in-place O_DIRECT), every fsync policy:
    // a process crash must lose nothing acknowledged under any of them.
    let cases = [
        (100_000, r#"{"fsync": "batch"}"#),
        (65_536, r#"{"fsync": "batch"}"#),
        (65_536, r#"{"fsync": "none"}"#),
        (30_000, r#"{"fsync": "always", "io_threads": 4}"#),
        (131_072, r#"{"fsync": "none", "direct_io": "off"}"#),
        (65_536, r#"{"fsync": "batch"}"#),
    ];
    for (round, (page_bytes, extra)) in cases.into_iter().enumerate() {
        let seed = 1000 + round as u64;
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
        // Earlier rounds' acknowledged pages are all still there after this round's crash
        // and reopen.
        for (r, (pb, ex)) in cases.iter().enumerate().take(round) {
            let (code, s) = check(d.path(), *pb, 1000 + r as u64, lasts[r], ex);
            assert_eq!(code, 0, "round {r} revisited: {s}");
            assert_eq!(s["wrong"].as_u64(), Some(0));
        }
    }
    assert!(
        checked > 0,
        "no round acknowledged anything; the test checked nothing"
    );
}
