//! Helpers of the plugin ABI tests: where the test plugins are.
//!
//! - C plugins are built by this crate's build script (`cargo test` builds them).
//! - Rust plugins are `cdylib` crates, which `cargo test` does not build: CI runs
//!   `cargo build --workspace --all-features` first, and so must you (or
//!   `cargo build -p hicache-plugin-example -p hicache-plugin-faulty`). A missing `.so` is a
//!   test failure with that instruction, never a silent skip.
#![forbid(unsafe_code)]

use std::path::PathBuf;

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

/// The `cdylib` of workspace crate `crate_name` (`hicache-plugin-example`), next to the test
/// executable's profile directory (`target/<profile>/lib<crate>.so`).
pub fn rust_plugin(crate_name: &str) -> PathBuf {
    let file = format!("lib{}.so", crate_name.replace('-', "_"));
    let exe = std::env::current_exe().expect("the test executable's path");
    // target/<profile>/deps/<test-binary> → target/<profile>
    let mut dir = exe.parent().expect("deps/").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let p = dir.join(&file);
    assert!(
        p.exists(),
        "{} is missing. `cargo test` does not build cdylib crates: run \
         `cargo build --workspace --all-features` (or `cargo build -p {crate_name}`) with the \
         same profile first, as CI does.",
        p.display()
    );
    p
}
