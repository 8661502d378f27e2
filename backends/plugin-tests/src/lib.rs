//! Helpers of the plugin ABI tests: where the test plugins are.
//!
//! - C plugins are built by this crate's build script (`cargo test` builds them).
//! - Rust plugins are `cdylib` crates, which `cargo test` does not build. [`rust_plugin`] builds
//!   them itself on first use: it runs `cargo build` (the same cargo that runs the tests, found
//!   through `$CARGO`, driven by the `escargot` crate) for the workspace's plugin crates in the
//!   same target directory and profile, and takes each `.so` path from cargo's own artifact
//!   messages. So `cargo test --workspace` passes from an empty target directory with no other
//!   command before it. A plugin that fails to build fails the test with cargo's output; no
//!   test skips itself because a library is missing.
//!
//! Invariant: the build runs at most once per test process (a `OnceLock`); several test
//! processes building at the same time are serialised by cargo's own lock on the target
//! directory, and a second build is a no-op once the first has finished.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use escargot::format::Message;

/// The workspace's Rust plugin crates, built together by [`rust_plugin`].
pub const RUST_PLUGINS: &[&str] = &["hicache-plugin-example", "hicache-plugin-faulty"];

/// The shared library `lib<name>.so` built from this crate's C sources.
pub fn c_plugin(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("HICACHE_TEST_C_PLUGINS")).join(format!("lib{name}.so"));
    assert!(
        p.exists(),
        "{} is missing: the build script of hicache-plugin-tests should have built it",
        p.display()
    );
    p
}

/// The `cdylib` of workspace crate `crate_name` (one of [`RUST_PLUGINS`]), built on first use
/// with the tests' own cargo, target directory and profile (dev or release).
///
/// Panics (failing the calling test) with cargo's error output if the build fails, or if
/// `crate_name` is not one of [`RUST_PLUGINS`].
pub fn rust_plugin(crate_name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<HashMap<String, PathBuf>, String>> = OnceLock::new();
    let built = match BUILT.get_or_init(build_rust_plugins) {
        Ok(built) => built,
        Err(e) => panic!("{e}"),
    };
    built.get(crate_name).cloned().unwrap_or_else(|| {
        panic!("{crate_name} is not a plugin crate of this workspace (known: {RUST_PLUGINS:?})")
    })
}

/// `lib<crate_name with _>.so`, the file name cargo gives a cdylib on Linux.
fn cdylib_file_name(crate_name: &str) -> String {
    format!("lib{}.so", crate_name.replace('-', "_"))
}

/// Runs `cargo build -p <each plugin>` on the workspace manifest and maps each crate name to the
/// `.so` that cargo reports having produced (fresh or rebuilt).
fn build_rust_plugins() -> Result<HashMap<String, PathBuf>, String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let mut build = escargot::CargoBuild::new()
        .manifest_path(&manifest)
        .current_release();
    for krate in RUST_PLUGINS {
        build = build.package(krate);
    }
    let what = format!(
        "building the Rust test plugins {RUST_PLUGINS:?} with `cargo build` ({})",
        manifest.display()
    );
    let messages = build
        .exec()
        .map_err(|e| format!("{what}: cannot start cargo: {e}"))?;
    let wanted: HashMap<String, &str> = RUST_PLUGINS
        .iter()
        .map(|k| (cdylib_file_name(k), *k))
        .collect();
    let mut found = HashMap::new();
    for message in messages {
        let message = message.map_err(|e| format!("{what} failed: {e}"))?;
        let Ok(Message::CompilerArtifact(artifact)) = message.decode() else {
            continue;
        };
        for file in &artifact.filenames {
            let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if let Some(krate) = wanted.get(name) {
                found.insert((*krate).to_string(), file.to_path_buf());
            }
        }
    }
    match RUST_PLUGINS.iter().find(|k| !found.contains_key(**k)) {
        Some(missing) => Err(format!(
            "{what}: cargo reported no {} for {missing}",
            cdylib_file_name(missing)
        )),
        None => Ok(found),
    }
}
