//! The host's log callback: plugin log records become `tracing` events.
//!
//! A plugin has its own statics, so it cannot reach the host's `tracing` dispatcher; it calls
//! this function instead (through `hicache_host.log`). Events are emitted with target
//! `hicache_plugin`, the plugin's name in the `plugin` field and the plugin's own target in
//! `source`.
//!
//! Invariants:
//! 1. The context pointer is a `&'static LogContext` (it lives in a leaked
//!    [`PluginLibrary`](crate::PluginLibrary)), so the callback is valid for the life of the
//!    process, as the header promises.
//! 2. Nothing unwinds out of the callback: its body runs under `catch_unwind`.
//! 3. Text is read during the call only and never trusted to be UTF-8 (lossy conversion).

use std::ffi::{c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use tracing::level_filters::LevelFilter;

use crate::abi;

/// What the callback needs to label a plugin's records.
#[derive(Debug)]
pub(crate) struct LogContext {
    /// The plugin's name.
    pub plugin: String,
}

/// The most verbose level the host currently records, as an `abi::LOG_*` level (0 = none).
pub(crate) fn max_level() -> i32 {
    match LevelFilter::current() {
        LevelFilter::OFF => 0,
        LevelFilter::ERROR => abi::LOG_ERROR,
        LevelFilter::WARN => abi::LOG_WARN,
        LevelFilter::INFO => abi::LOG_INFO,
        LevelFilter::DEBUG => abi::LOG_DEBUG,
        _ => abi::LOG_TRACE,
    }
}

/// Reads `len` bytes at `ptr` as (lossy) UTF-8; null or empty gives "".
///
/// # Safety
/// `ptr` is null or valid for reads of `len` bytes.
unsafe fn text(ptr: *const c_char, len: u64) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    let Ok(len) = usize::try_from(len) else {
        return String::from("<log text of impossible length>");
    };
    // SAFETY: the caller guarantees `len` readable bytes at the non-null `ptr`.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// The `hicache_log_fn` the host passes to every plugin.
///
/// # Safety
/// `ctx` is the `&'static LogContext` the host passed with it; the strings are valid for their
/// lengths (or null).
pub(crate) unsafe extern "C" fn host_log(
    ctx: *mut c_void,
    level: i32,
    target: *const c_char,
    target_len: u64,
    message: *const c_char,
    message_len: u64,
) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if ctx.is_null() {
            return;
        }
        // SAFETY: invariant 1: the host only ever passes a pointer to a leaked LogContext.
        let cx = unsafe { &*ctx.cast::<LogContext>() };
        // SAFETY: the header's log rule: the strings are valid for their lengths during the
        // call.
        let (source, msg) = unsafe { (text(target, target_len), text(message, message_len)) };
        let plugin = cx.plugin.as_str();
        match level {
            abi::LOG_ERROR => {
                tracing::error!(target: "hicache_plugin", plugin, source, "{msg}")
            }
            abi::LOG_WARN => tracing::warn!(target: "hicache_plugin", plugin, source, "{msg}"),
            abi::LOG_INFO => tracing::info!(target: "hicache_plugin", plugin, source, "{msg}"),
            abi::LOG_DEBUG => {
                tracing::debug!(target: "hicache_plugin", plugin, source, "{msg}")
            }
            abi::LOG_TRACE => {
                tracing::trace!(target: "hicache_plugin", plugin, source, "{msg}")
            }
            other => tracing::warn!(
                target: "hicache_plugin",
                plugin,
                source,
                "(invalid log level {other}) {msg}"
            ),
        }
    }));
}
