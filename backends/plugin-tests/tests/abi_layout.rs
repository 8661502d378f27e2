//! The Rust mirror of the ABI (`hicache_backend_plugin::abi`) has the same layout as what the
//! C compiler makes of `hicache_storage.h`: every size and offset, compared one by one.

use hicache_backend_plugin::abi;
use hicache_plugin_tests::c_plugin;

#[test]
fn rust_and_c_agree_on_every_size_and_offset() {
    let path = c_plugin("layout_probe");
    // SAFETY: our own probe library; loading runs no initialisers of note.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    // SAFETY: the probe exports `const uint64_t hicache_layout_probe_len` and
    // `const uint64_t hicache_layout_probe[len]` (c/layout_probe.c).
    let c: Vec<u64> = unsafe {
        let len = **lib
            .get::<*const u64>(b"hicache_layout_probe_len\0")
            .unwrap();
        let arr = *lib.get::<*const u64>(b"hicache_layout_probe\0").unwrap();
        std::slice::from_raw_parts(arr, len as usize).to_vec()
    };
    let rust = abi::layout_probe();
    assert_eq!(
        c.len(),
        rust.len(),
        "the probe and abi::layout_probe list the same items"
    );
    for ((what, r), c) in rust.iter().zip(&c) {
        assert_eq!(*r as u64, *c, "{what}: Rust {r}, C {c}");
    }
    std::mem::forget(lib); // as the loader does: never unload
}
