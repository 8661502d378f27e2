//! `hicache-bench tree --components ...` writes, byte for byte, the log SGLang 0.5.23's own
//! `UnifiedRadixCache` wrote on every configuration of `tests/fixtures/unified/configs.txt`,
//! and with `--host-capacity-pages` the log of its hierarchical cache on every configuration
//! of `host_configs.txt` (SGLang's logs are committed under `expected/`; bindings/python's
//! `test_unified_replay.py` and `test_unified_host_replay.py` re-derive them from SGLang in
//! CI's Python step, so they cannot go stale unnoticed).

use std::path::{Path, PathBuf};
use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_hicache-bench");

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/unified")
}

/// One line of a configurations file: name, trace file, options.
struct Case {
    name: String,
    trace: PathBuf,
    opts: Vec<String>,
}

fn cases(file: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(fixtures().join(file)).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert_eq!(
                f.len(),
                3,
                "{file} line is not name<TAB>trace<TAB>options: {l}"
            );
            Case {
                name: f[0].to_string(),
                trace: fixtures().join(f[1]),
                opts: f[2].split_whitespace().map(str::to_string).collect(),
            }
        })
        .collect()
}

/// The first line where `a` and `b` differ, for the failure message.
fn first_difference(a: &str, b: &str) -> Option<String> {
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    for i in 0..la.len().max(lb.len()) {
        let (x, y) = (la.get(i), lb.get(i));
        if x != y {
            return Some(format!("line {}: SGLang {x:?}, ours {y:?}", i + 1));
        }
    }
    (a != b).then(|| "trailing bytes differ".to_string())
}

#[test]
fn every_configuration_writes_sglangs_log() {
    let cases = cases("configs.txt");
    assert!(
        cases.len() >= 20,
        "configs.txt lost configurations: {}",
        cases.len()
    );
    compare(&cases);
}

#[test]
fn every_host_configuration_writes_sglangs_hierarchical_log() {
    let cases = cases("host_configs.txt");
    assert!(
        cases.len() >= 5,
        "host_configs.txt lost configurations: {}",
        cases.len()
    );
    compare(&cases);
}

/// Runs every case and fails with each first difference from SGLang's committed log.
fn compare(cases: &[Case]) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let log = dir.path().join(format!("{}.log", case.name));
        let out = Command::new(EXE)
            .arg("tree")
            .arg("--trace")
            .arg(&case.trace)
            .args(&case.opts)
            .arg("--log")
            .arg(&log)
            .args(["--min-time-ms", "1"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: hicache-bench tree failed: {}",
            case.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let expected = fixtures()
            .join("expected")
            .join(format!("{}.log", case.name));
        let expected = std::fs::read_to_string(expected).unwrap();
        let ours = std::fs::read_to_string(&log).unwrap();
        if let Some(d) = first_difference(&expected, &ours) {
            failures.push(format!("{}: {d}", case.name));
        }
    }
    assert!(
        failures.is_empty(),
        "logs differ from SGLang's:\n{}",
        failures.join("\n")
    );
}
