//! `storage-check` is a read-only tool: on a damaged directory (a truncated log or torn page
//! file, foreign files, a torn page, a leftover temp file) it reports what it finds and never
//! deletes, truncates, creates or modifies anything. Every entry under the directory (type,
//! mode, length, mtime, SHA-256 of the content, symlink target) is recorded before and after
//! a check, per backend kind, and must be identical.

mod durability;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use durability::{EXE, dir};
use sha2::{Digest, Sha256};

/// What is recorded of one directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    kind: &'static str,
    mode: u32,
    len: u64,
    mtime_ns: i128,
    sha256: String,
    link: Option<PathBuf>,
}

/// Every entry under `root` (not following symlinks), by relative path.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, Entry> {
    fn walk(root: &Path, at: &Path, out: &mut BTreeMap<PathBuf, Entry>) {
        let mut names: Vec<_> = fs::read_dir(at)
            .unwrap_or_else(|e| panic!("list {}: {e}", at.display()))
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        for p in names {
            let m = fs::symlink_metadata(&p).unwrap();
            let ty = m.file_type();
            let (kind, sha256, link) = if ty.is_symlink() {
                ("symlink", String::new(), Some(fs::read_link(&p).unwrap()))
            } else if ty.is_dir() {
                ("dir", String::new(), None)
            } else {
                let bytes = fs::read(&p).unwrap();
                let digest = Sha256::digest(&bytes);
                let hex = digest.iter().map(|b| format!("{b:02x}")).collect();
                ("file", hex, None)
            };
            out.insert(
                p.strip_prefix(root).unwrap().to_path_buf(),
                Entry {
                    kind,
                    mode: m.mode(),
                    len: if ty.is_dir() { 0 } else { m.len() },
                    mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
                    sha256,
                    link,
                },
            );
            if ty.is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    // The directory itself: entries created and removed again still change its mtime.
    let m = fs::metadata(root).unwrap();
    out.insert(
        PathBuf::from("."),
        Entry {
            kind: "dir",
            mode: m.mode(),
            len: 0,
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            sha256: String::new(),
            link: None,
        },
    );
    out
}

/// Every difference between two snapshots, one line each.
fn diff(before: &BTreeMap<PathBuf, Entry>, after: &BTreeMap<PathBuf, Entry>) -> Vec<String> {
    let mut v = Vec::new();
    for (p, b) in before {
        match after.get(p) {
            None => v.push(format!("deleted {} ({b:?})", p.display())),
            Some(a) if a != b => v.push(format!("changed {}: {b:?} -> {a:?}", p.display())),
            Some(_) => {}
        }
    }
    for (p, a) in after {
        if !before.contains_key(p) {
            v.push(format!("created {} ({a:?})", p.display()));
        }
    }
    v
}

/// Writes `pages` pages of `page_bytes` with `storage-write`, the writer exiting normally.
fn write(backend: &str, d: &Path, page_bytes: usize, pages: u64) {
    let out = Command::new(EXE)
        .args(["storage-write", "--backend", backend, "--dir"])
        .arg(d)
        .args(["--page-bytes", &page_bytes.to_string(), "--seed", "9"])
        .args(["--batch", "8", "--pages", &pages.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "storage-write: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Plants foreign files, a foreign directory and a symlink out of the store in `d` and in
/// every directory under it.
fn plant_foreign(d: &Path, outside: &Path) {
    let mut dirs = vec![d.to_path_buf()];
    for e in fs::read_dir(d).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            dirs.push(e.path());
        }
    }
    for (i, dir) in dirs.iter().enumerate() {
        fs::write(dir.join("notes.txt"), format!("foreign {i}")).unwrap();
        fs::write(dir.join(".hidden"), [0xa5u8; 777]).unwrap();
        fs::create_dir_all(dir.join("foreign-subdir")).unwrap();
        fs::write(dir.join("foreign-subdir/data"), b"not yours").unwrap();
        symlink(outside, dir.join("link-out")).unwrap();
    }
}

/// Runs `storage-check` on `d` (acknowledged pages `0..=upto` of seed 9) and asserts that
/// nothing under `d` or `outside` changed; returns the check's JSON summary.
fn check_changes_nothing(
    backend: &str,
    d: &Path,
    outside: &Path,
    page_bytes: usize,
    upto: u64,
) -> serde_json::Value {
    let before = (snapshot(d), snapshot(outside));
    let (code, summary) = durability::check(backend, Some(d), page_bytes, 9, Some(upto), "{}");
    assert!(
        code == 0 || code == 1,
        "storage-check on a damaged {backend} store exited {code}: {summary}"
    );
    let after = (snapshot(d), snapshot(outside));
    let mut changes = diff(&before.0, &after.0);
    changes.extend(
        diff(&before.1, &after.1)
            .into_iter()
            .map(|c| format!("outside the store: {c}")),
    );
    assert!(
        changes.is_empty(),
        "storage-check (read-only) changed the {backend} store:\n{}\n(summary {summary})",
        changes.join("\n")
    );
    summary
}

/// The files of `d` (relative) under `sub` whose name ends with `suffix`, sorted.
fn files_in(d: &Path, sub: &str, suffix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(d.join(sub))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.to_string_lossy().ends_with(suffix))
        .collect();
    v.sort();
    v
}

fn truncate(p: &Path, len: u64) {
    fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(len)
        .unwrap();
}

// Was a defect (issue 13): `storage-check` opened the file store read-write, deleting the torn
// page files and rewriting `dir.lock`; it now opens it with `"read_only": true`.
#[test]
fn storage_check_never_changes_a_damaged_file_store() {
    let d = dir();
    let outside = dir();
    fs::write(outside.path().join("keep-me"), b"outside").unwrap();
    let pb = 8192;
    write("file", d.path(), pb, 24);
    // A torn page (a page file cut mid-way), a page file cut to nothing, a leftover temp file
    // of the kind a killed writer leaves, foreign files everywhere.
    let pages = files_in(d.path(), "pages", ".page");
    assert!(pages.len() >= 24, "{} page files", pages.len());
    truncate(&pages[3], (pb / 2) as u64);
    truncate(&pages[7], 0);
    fs::write(d.path().join("tmp/0000000000000001.tmp"), [1u8; 100]).unwrap();
    plant_foreign(d.path(), outside.path());
    let s = check_changes_nothing("file", d.path(), outside.path(), pb, 23);
    assert_eq!(s["wrong"].as_u64(), Some(0), "{s}");
    assert!(s["missing"].as_u64() >= Some(2), "the torn pages: {s}");
    // A second check finds the same (nothing was repaired behind its back).
    let again = check_changes_nothing("file", d.path(), outside.path(), pb, 23);
    assert_eq!(again, s);
}

// Was a defect (issue 13): `storage-check` opened the uring store read-write, rewriting `lock`
// and `index.log` and creating `index.log.damaged-<n>`; it now opens it with
// `"read_only": true`.
#[cfg(feature = "uring")]
#[test]
fn storage_check_never_changes_a_damaged_uring_store() {
    let d = dir();
    let outside = dir();
    fs::write(outside.path().join("keep-me"), b"outside").unwrap();
    let pb = 8192;
    write("uring", d.path(), pb, 24);
    // A truncated index log (cut mid-record), a torn page (the second half of the first
    // page's bytes in its slab zeroed), foreign files everywhere.
    let log = d.path().join("index.log");
    let len = fs::metadata(&log).unwrap().len();
    assert!(len > 1000, "index.log of {len} bytes");
    truncate(&log, len - 100);
    let slabs: Vec<PathBuf> = fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.file_name().unwrap().to_string_lossy().contains("slab"))
        .collect();
    assert!(!slabs.is_empty(), "no slab file in {}", d.path().display());
    let f = fs::OpenOptions::new().write(true).open(&slabs[0]).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &vec![0u8; pb / 2], (pb / 2) as u64).unwrap();
    drop(f);
    plant_foreign(d.path(), outside.path());
    let s = check_changes_nothing("uring", d.path(), outside.path(), pb, 23);
    assert_eq!(s["wrong"].as_u64(), Some(0), "{s}");
    assert!(s["missing"].as_u64() >= Some(1), "the truncated log: {s}");
    let again = check_changes_nothing("uring", d.path(), outside.path(), pb, 23);
    assert_eq!(again, s);
}
