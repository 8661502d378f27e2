//! The `hicache-bench` command line as users' scripts call it: the operator tools still answer
//! under their old names (aliases of `hicache`'s code), and the `storage` bench rejects bad
//! input with a clear usage error.

use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_hicache-bench");

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(EXE).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `hicache-bench storage-write`, `storage-check`, `storage-clear` and `hash` still work: a
/// write, its check, a clear of the namespace, and a page hash.
#[test]
fn the_old_tool_subcommands_still_work() {
    let d = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = d.path().display().to_string();
    let common = [
        "--backend",
        "file",
        "--dir",
        &dir,
        "--page-bytes",
        "4096",
        "--seed",
        "3",
    ];
    let (code, out, err) = run(&[
        &["storage-write"][..],
        &common,
        &["--batch", "4", "--pages", "8"],
    ]
    .concat());
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().collect::<Vec<_>>(), ["acked 3", "acked 7"]);
    let (code, out, err) = run(&[&["storage-check"][..], &common, &["--upto", "7"]].concat());
    assert_eq!(code, 0, "{err}");
    let summary: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(summary["present"], 8, "{summary}");
    assert_eq!(summary["wrong"], 0, "{summary}");
    let (code, out, err) = run(&["storage-clear", "--backend", "file", "--dir", &dir]);
    assert_eq!(code, 0, "{err}");
    let cleared: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(cleared["removed"], 8, "{cleared}");
    let mut hash = Command::new(EXE)
        .args(["hash", "--page-size", "2"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    hash.stdin.take().unwrap().write_all(b"1 2 3 4 5").unwrap();
    let out = hash.wait_with_output().unwrap();
    assert!(out.status.success());
    let digests: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(digests.len(), 2, "two whole pages of 2 tokens: {digests:?}");
    assert!(digests.iter().all(|d| d.len() == 64), "{digests:?}");
}

/// Bad input of the `storage` bench is exit code 2 with a message naming the flag: before,
/// `--total 0` silently ran 128 pages and a huge `--page-bytes` overflowed into a confusing
/// message.
#[test]
fn bad_storage_bench_input_is_a_clear_usage_error() {
    let d = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = d.path().display().to_string();
    let (code, _, err) = run(&[
        "storage",
        "--backend",
        "file",
        "--dir",
        &dir,
        "--total",
        "0",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--total"), "{err}");
    let huge = usize::MAX.to_string();
    let (code, _, err) = run(&[
        "storage",
        "--backend",
        "file",
        "--dir",
        &dir,
        "--page-bytes",
        &huge,
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--page-bytes") && err.contains("too large"),
        "{err}"
    );
}
