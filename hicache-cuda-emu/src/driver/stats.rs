//! Call and launch counters, readable by tests through exported symbols
//! (`hicache_emu_call_count`, `hicache_emu_launch_count`, `hicache_emu_reset_counts`,
//! `hicache_emu_stats_json`): a test `dlsym`s them from the same `libcuda.so` the CUDA path
//! loaded.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

static CALLS: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
static VIOLATIONS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static FAIL_NEXT: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());

/// Counts one call of `name`.
pub fn count(name: &'static str) {
    *CALLS.lock().entry(name).or_insert(0) += 1;
}

/// Adds `n` to the counter `name` (e.g. the copies carried by batched copy calls).
pub fn count_n(name: &'static str, n: u64) {
    *CALLS.lock().entry(name).or_insert(0) += n;
}

/// The failure injected for the next call of `name`, consumed (see [`hicache_emu_fail_next`]).
pub fn take_injected(name: &str) -> Option<u32> {
    let mut f = FAIL_NEXT.lock();
    let i = f.iter().position(|(n, _)| n == name)?;
    Some(f.remove(i).1)
}

/// Makes the next call of the entry point `name` fail with `code` without doing anything
/// (fault injection for tests: a failing `cuEventDestroy_v2`, a refused module image …).
///
/// # Safety
/// `name` must be a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hicache_emu_fail_next(name: *const c_char, code: u32) {
    if name.is_null() {
        return;
    }
    // SAFETY: per the contract.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    FAIL_NEXT.lock().push((name, code));
}

/// Counts one kernel launch.
pub fn count_launch() {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

/// Records a checked rule that was broken (also returned to the caller as an error).
pub fn violation(what: String) {
    eprintln!("hicache-cuda-emu: {what}");
    VIOLATIONS.lock().push(what);
}

/// Calls of the entry point `name` (e.g. `"cuMemcpyHtoDAsync_v2"`) since the last reset.
///
/// # Safety
/// `name` must be a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hicache_emu_call_count(name: *const c_char) -> u64 {
    if name.is_null() {
        return 0;
    }
    // SAFETY: per the contract.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    CALLS.lock().get(name.as_ref()).copied().unwrap_or(0)
}

/// Kernel launches since the last reset.
#[unsafe(no_mangle)]
pub extern "C" fn hicache_emu_launch_count() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Zeroes every counter and forgets recorded violations and injected failures.
#[unsafe(no_mangle)]
pub extern "C" fn hicache_emu_reset_counts() {
    CALLS.lock().clear();
    LAUNCHES.store(0, Ordering::Relaxed);
    VIOLATIONS.lock().clear();
    FAIL_NEXT.lock().clear();
}

/// Every counter and violation as JSON (`{"calls":{..},"launches":N,"violations":[..]}`); free
/// with [`hicache_emu_free_string`].
#[unsafe(no_mangle)]
pub extern "C" fn hicache_emu_stats_json() -> *mut c_char {
    let calls: Vec<String> = CALLS
        .lock()
        .iter()
        .map(|(k, v)| format!("\"{k}\":{v}"))
        .collect();
    let violations: Vec<String> = VIOLATIONS
        .lock()
        .iter()
        .map(|v| format!("\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
        .collect();
    let s = format!(
        "{{\"calls\":{{{}}},\"launches\":{},\"violations\":[{}]}}",
        calls.join(","),
        hicache_emu_launch_count(),
        violations.join(",")
    );
    CString::new(s).expect("no NUL in JSON").into_raw()
}

/// Frees a string from [`hicache_emu_stats_json`].
///
/// # Safety
/// `s` must come from `hicache_emu_stats_json` and be freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hicache_emu_free_string(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: per the contract.
        drop(unsafe { CString::from_raw(s) });
    }
}
