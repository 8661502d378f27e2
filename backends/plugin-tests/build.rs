//! Builds the C plugins of the tests as shared libraries in OUT_DIR with the C compiler the
//! `cc` crate finds (gcc or clang), and tells the tests where they are
//! (`HICACHE_TEST_C_PLUGINS`). The C example lives beside the header, in
//! `backends/plugin/examples/c/`; the broken plugins in `c/`. Everything is compiled with
//! warnings as errors, and the header is also checked as C++ when a C++ compiler exists.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));
    let plugin = manifest.join("../plugin");
    let include = plugin.join("include");
    let example = plugin.join("examples/c/memory_plugin.c");
    let c = manifest.join("c");

    let broken = c.join("broken.c");
    let mut libs: Vec<(&str, PathBuf, Vec<&str>)> = vec![
        ("hicache_c_memory", example.clone(), vec![]),
        (
            "hicache_c_memory_next",
            example.clone(),
            vec!["HICACHE_EXAMPLE_NEWER_MINOR"],
        ),
        (
            "hicache_c_memory_v1_0",
            example.clone(),
            vec!["HICACHE_EXAMPLE_V1_0"],
        ),
        (
            "hicache_c_memory_v1_1",
            example.clone(),
            vec!["HICACHE_EXAMPLE_V1_1"],
        ),
        ("broken_plain", broken.clone(), vec![]),
        ("not_a_plugin", c.join("not_a_plugin.c"), vec![]),
        ("layout_probe", c.join("layout_probe.c"), vec![]),
    ];
    let variants = [
        ("broken_abi_major", "BROKEN_ABI_MAJOR"),
        ("broken_null_vtable", "BROKEN_NULL_VTABLE"),
        ("broken_small_vtable", "BROKEN_SMALL_VTABLE"),
        ("broken_null_function", "BROKEN_NULL_FUNCTION"),
        ("broken_cap_without_fn", "BROKEN_CAP_WITHOUT_FN"),
        (
            "broken_context_cap_without_fn",
            "BROKEN_CONTEXT_CAP_WITHOUT_FN",
        ),
        ("broken_clear_cap_without_fn", "BROKEN_CLEAR_CAP_WITHOUT_FN"),
        ("broken_create_fails", "BROKEN_CREATE_FAILS"),
        ("broken_zero_batch", "BROKEN_ZERO_BATCH"),
        ("broken_garbage", "BROKEN_GARBAGE"),
    ];
    for (name, flag) in variants {
        libs.push((name, broken.clone(), vec![flag]));
    }

    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    for (name, src, defines) in &libs {
        let target = out.join(format!("lib{name}.so"));
        let mut cmd = compiler.to_command();
        cmd.args([
            "-std=c11",
            "-O2",
            "-g",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            "-Wall",
            "-Wextra",
            "-Wpedantic",
            "-Werror",
        ])
        .arg("-I")
        .arg(&include);
        for d in defines {
            cmd.arg(format!("-D{d}"));
        }
        cmd.arg("-o").arg(&target).arg(src).arg("-lpthread");
        run(cmd, name);
    }

    match cc::Build::new()
        .cpp(true)
        .cargo_metadata(false)
        .try_get_compiler()
    {
        Ok(cxx) => {
            let mut cmd = cxx.to_command();
            cmd.args(["-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror"])
                .arg("-I")
                .arg(&include)
                .arg(c.join("header_check.cpp"));
            run(cmd, "header_check.cpp");
        }
        Err(e) => println!("cargo:warning=no C++ compiler, header not checked as C++: {e}"),
    }

    println!("cargo:rustc-env=HICACHE_TEST_C_PLUGINS={}", out.display());
    for p in [&include.join("hicache_storage.h"), &example, &c] {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}

fn run(mut cmd: Command, what: &str) {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler for {what}: {e}"));
    if !output.status.success() {
        panic!(
            "compiling {what} failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
