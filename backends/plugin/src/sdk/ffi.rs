//! The exported functions of an SDK plugin, generic over the [`Plugin`]: each checks its
//! arguments, turns them into `hicache-storage` types, runs the backend's method on the plugin
//! runtime under the instance's log forwarder, and writes results back, all inside
//! `catch_unwind` ([`guard`]).
//!
//! Invariants:
//! 1. An instance handle is a `Box<Instance<P>>` made by `create::<P>` and freed by
//!    `destroy::<P>` only; the host passes it back unchanged (header §2).
//! 2. Nothing unwinds out of these functions: [`guard`] catches every panic.
//! 3. Every pointer is checked for null before use where the header allows a count of zero;
//!    for a count of zero no pointer is dereferenced.

use std::any::Any;
use std::ffi::{c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use hicache_core::{MemoryRegion, NamespaceId, PageKey};
use hicache_storage::{
    BackendContext, BatchContext, CommonConfig, ConfigFields, PageBuf, PageBufMut, PageError,
    PageOutcome, StorageError, StorageStats,
};
use tokio::runtime::Runtime;
use tracing::Dispatch;

use super::log::{Forwarder, HostSink};
use super::{OpenArgs, Plugin};
use crate::abi::{self, Status};
use hicache_storage::Storage as _;

/// One plugin instance.
struct Instance<P: Plugin> {
    backend: P::Backend,
    dispatch: Dispatch,
    runtime: &'static Runtime,
}

impl<P: Plugin> Instance<P> {
    /// Runs `fut` to completion on the plugin runtime with the instance's log forwarder.
    fn run<F: std::future::Future>(&self, fut: F) -> F::Output {
        tracing::dispatcher::with_default(&self.dispatch, || self.runtime.block_on(fut))
    }
}

/// A failed call: its status and error text.
struct Failure {
    status: Status,
    message: String,
}

impl Failure {
    fn invalid(message: impl Into<String>) -> Self {
        Failure {
            status: abi::ERR_INVALID_ARGUMENT,
            message: message.into(),
        }
    }
}

impl From<StorageError> for Failure {
    fn from(e: StorageError) -> Self {
        let status = match &e {
            StorageError::Config { .. } | StorageError::ConfigSyntax { .. } => abi::ERR_CONFIG,
            StorageError::BatchTooLarge { .. } => abi::ERR_BATCH_TOO_LARGE,
            StorageError::LengthMismatch { .. } => abi::ERR_INVALID_ARGUMENT,
            StorageError::Io { .. } => abi::ERR_IO,
            StorageError::Unavailable { .. } => abi::ERR_UNAVAILABLE,
            StorageError::Unsupported { .. } => abi::ERR_UNSUPPORTED,
            _ => abi::ERR_INTERNAL,
        };
        Failure {
            status,
            message: e.to_string(),
        }
    }
}

/// Copies `msg` into the host's error buffer (truncated at a character boundary,
/// NUL-terminated).
///
/// # Safety
/// `err` is null or a valid `hicache_error` whose buffer holds `capacity` writable bytes.
unsafe fn write_error(err: *mut abi::ErrorBuf, msg: &str) {
    // SAFETY: the caller's guarantee.
    let Some(e) = (unsafe { err.as_ref() }) else {
        return;
    };
    if e.message.is_null() || e.capacity == 0 {
        return;
    }
    let cap = usize::try_from(e.capacity).unwrap_or(usize::MAX);
    let n = msg.floor_char_boundary(msg.len().min(cap - 1));
    // SAFETY: `n + 1 <= capacity` bytes are written into the host's buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr(), e.message.cast::<u8>(), n);
        *e.message.add(n) = 0;
    }
}

fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}

/// Runs an exported function's body: catches panics (invariant 2), writes the error text of a
/// failure, or the note of a successful call (a per-page detail), into the error buffer.
fn guard<P: Plugin>(
    op: &'static str,
    err: *mut abi::ErrorBuf,
    body: impl FnOnce() -> Result<Option<String>, Failure>,
) -> Status {
    let (status, text) = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(note)) => (abi::OK, note),
        Ok(Err(f)) => (f.status, Some(f.message)),
        Err(payload) => (
            abi::ERR_PANIC,
            Some(format!(
                "plugin `{}` panicked in {op}: {}",
                P::NAME.to_string_lossy(),
                panic_text(&*payload)
            )),
        ),
    };
    if let Some(t) = text {
        // SAFETY: the header's error rule: `err` is the host's valid buffer.
        unsafe { write_error(err, &t) };
    }
    status
}

/// The instance behind a handle.
///
/// # Safety
/// `plugin` is null or a handle made by `create::<P>` and not yet destroyed (invariant 1).
unsafe fn instance<'a, P: Plugin>(
    plugin: *mut abi::PluginHandle,
) -> Result<&'a Instance<P>, Failure> {
    // SAFETY: the caller's guarantee.
    unsafe { plugin.cast::<Instance<P>>().as_ref() }
        .ok_or_else(|| Failure::invalid("null plugin instance"))
}

fn count(n: u64) -> Result<usize, Failure> {
    usize::try_from(n).map_err(|_| Failure::invalid(format!("count {n} does not fit in memory")))
}

/// The `n` elements at `ptr` (invariant 3: null is allowed only for `n == 0`).
///
/// # Safety
/// `ptr` is null or valid for reads of `n` elements for `'a`.
unsafe fn slice<'a, T>(ptr: *const T, n: usize, what: &str) -> Result<&'a [T], Failure> {
    if n == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL for {n} entries")));
    }
    // SAFETY: the caller's guarantee.
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// Mutable variant of [`slice`].
///
/// # Safety
/// `ptr` is null or valid for writes of `n` elements for `'a`, not aliased.
unsafe fn slice_mut<'a, T>(ptr: *mut T, n: usize, what: &str) -> Result<&'a mut [T], Failure> {
    if n == 0 {
        return Ok(&mut []);
    }
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL for {n} entries")));
    }
    // SAFETY: the caller's guarantee.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, n) })
}

/// # Safety
/// As [`slice`] for `n` keys.
unsafe fn keys(ptr: *const abi::Key, n: usize) -> Result<Vec<PageKey>, Failure> {
    // SAFETY: the caller's guarantee.
    let ks = unsafe { slice(ptr, n, "keys") }?;
    Ok(ks.iter().map(PageKey::from).collect())
}

/// The layout and the parts of page `i`, checked: known layout, parts adding up to `len`,
/// non-null bases for non-empty parts.
///
/// # Safety
/// `p.parts` is null or valid for `p.part_count` iovecs.
unsafe fn page_parts<'a>(
    i: usize,
    p: &abi::Page,
) -> Result<(hicache_core::LayoutKind, &'a [abi::Iovec]), Failure> {
    let layout = abi::layout_from_tag(p.layout)
        .ok_or_else(|| Failure::invalid(format!("page {i}: unknown layout tag {}", p.layout)))?;
    let n = count(p.part_count)?;
    // SAFETY: the caller's guarantee.
    let parts = unsafe { slice(p.parts, n, "page parts") }?;
    let mut total = 0u64;
    for (j, iov) in parts.iter().enumerate() {
        if iov.len > 0 && iov.base.is_null() {
            return Err(Failure::invalid(format!(
                "page {i}: part {j} is NULL with {} bytes",
                iov.len
            )));
        }
        total = total.saturating_add(iov.len);
    }
    if total != p.len {
        return Err(Failure::invalid(format!(
            "page {i}: parts add up to {total} bytes, the page says {}",
            p.len
        )));
    }
    Ok((layout, parts))
}

fn outcome_code(o: &PageOutcome) -> abi::PageResult {
    match o {
        PageOutcome::Hit => abi::PAGE_HIT,
        PageOutcome::Miss => abi::PAGE_MISS,
        PageOutcome::Corrupt => abi::PAGE_CORRUPT,
        PageOutcome::Stored => abi::PAGE_STORED,
        PageOutcome::Present => abi::PAGE_PRESENT,
        PageOutcome::Failed(PageError::EmptyPage) => abi::PAGE_ERR_EMPTY,
        PageOutcome::Failed(PageError::TooLarge { .. }) => abi::PAGE_ERR_TOO_LARGE,
        PageOutcome::Failed(PageError::NoSpace) => abi::PAGE_ERR_NO_SPACE,
        PageOutcome::Failed(PageError::Io { .. }) => abi::PAGE_ERR_IO,
        _ => abi::PAGE_ERR_BACKEND,
    }
}

/// The first failed page's description, if any (the note of a successful call).
fn first_failure(outcomes: &[PageOutcome]) -> Option<String> {
    outcomes.iter().enumerate().find_map(|(i, o)| match o {
        PageOutcome::Failed(e) => Some(format!("page {i}: {e}")),
        _ => None,
    })
}

fn check_outcomes(op: &str, outcomes: &[PageOutcome], n: usize) -> Result<(), Failure> {
    if outcomes.len() != n {
        return Err(Failure {
            status: abi::ERR_INTERNAL,
            message: format!(
                "{op}: the backend returned {} outcomes for {n} pages",
                outcomes.len()
            ),
        });
    }
    Ok(())
}

/// Writes `value` into a host struct whose first u32 is its `struct_size`: only the bytes
/// within that size (header §1), keeping the host's `struct_size`.
///
/// # Safety
/// `out` is valid for reads of a u32 and writes of its own `struct_size` bytes; `T` starts
/// with a u32 `struct_size`.
unsafe fn write_sized<T: Copy>(out: *mut T, value: &T) {
    // SAFETY: the caller's guarantee: the first u32 is readable.
    let host_size = unsafe { std::ptr::read(out.cast::<u32>()) } as usize;
    let n = host_size.min(std::mem::size_of::<T>());
    // SAFETY: `n` bytes fit in both structs; skip the first 4 (the host's struct_size).
    unsafe {
        if n > 4 {
            std::ptr::copy_nonoverlapping(
                std::ptr::from_ref(value).cast::<u8>().add(4),
                out.cast::<u8>().add(4),
                n - 4,
            );
        }
    }
}

/// The plugin library's runtime (see the SDK's point 3), created on first use.
fn runtime() -> Result<&'static Runtime, Failure> {
    static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("hicache-plugin")
                .enable_all()
                .on_thread_start(|| {
                    if let Some(d) = WORKER_DISPATCH.get() {
                        // Kept for the thread's life: the guard is deliberately leaked.
                        std::mem::forget(tracing::dispatcher::set_default(d));
                    }
                })
                .build()
                .map_err(|e| format!("cannot start the plugin's tokio runtime: {e}"))
        })
        .as_ref()
        .map_err(|e| Failure {
            status: abi::ERR_INTERNAL,
            message: e.clone(),
        })
}

/// The log forwarder of the runtime's threads: the first instance's (every instance of one
/// library gets the same host callback and context from the host).
static WORKER_DISPATCH: OnceLock<Dispatch> = OnceLock::new();

pub(super) unsafe extern "C" fn create<P: Plugin>(
    config_json: *const c_char,
    config_len: u64,
    host: *const abi::Host,
    out: *mut *mut abi::PluginHandle,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("create", err, || {
        // SAFETY: the header: `host` is valid during create (null is refused).
        let h = unsafe { host.as_ref() }.ok_or_else(|| Failure::invalid("host is NULL"))?;
        if h.abi_major != abi::ABI_MAJOR {
            return Err(Failure::invalid(format!(
                "host ABI {}.{} is not major version {}",
                h.abi_major,
                h.abi_minor,
                abi::ABI_MAJOR
            )));
        }
        if (h.struct_size as usize) < std::mem::size_of::<abi::Host>() {
            return Err(Failure::invalid(format!(
                "hicache_host of {} bytes is smaller than v1.0's {}",
                h.struct_size,
                std::mem::size_of::<abi::Host>()
            )));
        }
        if out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        let log = h
            .log
            .ok_or_else(|| Failure::invalid("host log callback is NULL"))?;
        let n = count(config_len)?;
        // SAFETY: the header: `config_len` bytes of config text.
        let bytes = unsafe { slice(config_json.cast::<u8>(), n, "config_json") }?;
        let config_err = |m: String| Failure {
            status: abi::ERR_CONFIG,
            message: m,
        };
        let text = std::str::from_utf8(bytes)
            .map_err(|e| config_err(format!("plugin_config is not UTF-8: {e}")))?;
        let map = match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Object(m)) => m,
            Ok(other) => {
                return Err(config_err(format!(
                    "plugin_config must be a JSON object, got {other}"
                )));
            }
            Err(e) => return Err(config_err(format!("plugin_config is not valid JSON: {e}"))),
        };
        let dispatch = Dispatch::new(Forwarder::new(HostSink::new(
            log,
            h.log_ctx,
            h.max_log_level,
        )));
        let _ = WORKER_DISPATCH.set(dispatch.clone());
        let runtime = runtime()?;
        let name = P::NAME.to_string_lossy();
        let args = OpenArgs {
            fields: ConfigFields::new(format!("plugin {name} plugin_config"), map),
            common: CommonConfig {
                capacity_bytes: (h.capacity_bytes != 0).then_some(h.capacity_bytes),
                ..CommonConfig::default()
            },
            context: BackendContext {
                page_bytes: usize::try_from(h.page_bytes).unwrap_or(0),
                layout: abi::layout_from_tag(h.layout).unwrap_or_default(),
                namespace: (h.has_namespace != 0).then_some(NamespaceId(h.namespace_id)),
                tp_rank: h.tp_rank,
                tp_size: h.tp_size,
                pp_rank: h.pp_rank,
                pp_size: h.pp_size,
                memory: None,
            },
            host_abi: (h.abi_major, h.abi_minor),
        };
        let backend =
            tracing::dispatcher::with_default(&dispatch, || runtime.block_on(P::open(args)))?;
        let inst = Box::new(Instance::<P> {
            backend,
            dispatch,
            runtime,
        });
        // SAFETY: `out` is non-null and valid for a write (header).
        unsafe { *out = Box::into_raw(inst).cast::<abi::PluginHandle>() };
        Ok(None)
    })
}

pub(super) unsafe extern "C" fn destroy<P: Plugin>(plugin: *mut abi::PluginHandle) {
    if plugin.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: invariant 1: made by create::<P>, destroyed once.
        let inst = unsafe { Box::from_raw(plugin.cast::<Instance<P>>()) };
        let dispatch = inst.dispatch.clone();
        let _rt = inst.runtime.enter();
        tracing::dispatcher::with_default(&dispatch, || drop(inst));
    }));
}

pub(super) unsafe extern "C" fn get_info<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    out: *mut abi::Info,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("get_info", err, || {
        // SAFETY: invariant 1.
        let inst = unsafe { instance::<P>(plugin) }?;
        if out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        let i = inst.backend.info();
        let mut flags = 0;
        if i.zero_copy {
            flags |= abi::INFO_ZERO_COPY;
        }
        if i.persistent {
            flags |= abi::INFO_PERSISTENT;
        }
        if i.shared {
            flags |= abi::INFO_SHARED;
        }
        if i.clear {
            flags |= abi::INFO_CLEAR;
        }
        let info = abi::Info {
            struct_size: 0,
            flags,
            max_batch: i.max_batch as u64,
            max_page_bytes: if i.max_page_bytes == usize::MAX {
                0
            } else {
                i.max_page_bytes as u64
            },
            capacity_bytes: i.capacity_bytes.unwrap_or(0),
        };
        // SAFETY: `out` is the host's struct with its struct_size set (header).
        unsafe { write_sized(out, &info) };
        Ok(None)
    })
}

/// A batch context copied out of the host's `hicache_batch_context` (1.1).
#[derive(Default)]
struct OwnedContext {
    prefix_keys: Option<Vec<PageKey>>,
    extra_info: Option<String>,
}

impl OwnedContext {
    /// The context at `ctx` (null: none), checked: a flagged part with a null pointer and a
    /// non-zero length, or extra info that is not UTF-8, is an invalid argument.
    ///
    /// # Safety
    /// `ctx` is null or valid for reads of its `struct_size` bytes, and its pointers for their
    /// lengths, for the call.
    unsafe fn read(ctx: *const abi::BatchContext) -> Result<Self, Failure> {
        if ctx.is_null() {
            return Ok(Self::default());
        }
        // Read only the fields within the host's struct_size (header §1); zero the rest.
        // SAFETY: the caller's guarantee; the first field is the struct_size.
        let size = unsafe { std::ptr::read(ctx.cast::<u32>()) } as usize;
        let mut c = std::mem::MaybeUninit::<abi::BatchContext>::zeroed();
        let n = size.min(std::mem::size_of::<abi::BatchContext>());
        // SAFETY: `n` bytes are readable at `ctx` (the caller's guarantee) and fit in `c`;
        // zero is a valid value of every field (integers and null pointers).
        let c = unsafe {
            std::ptr::copy_nonoverlapping(ctx.cast::<u8>(), c.as_mut_ptr().cast::<u8>(), n);
            c.assume_init()
        };
        let prefix_keys = if c.flags & abi::CONTEXT_HAS_PREFIX != 0 {
            // SAFETY: the caller's guarantee: `prefix_count` keys.
            Some(unsafe { keys(c.prefix_keys, count(c.prefix_count)?) }?)
        } else {
            None
        };
        let extra_info = if c.flags & abi::CONTEXT_HAS_EXTRA_INFO != 0 {
            // SAFETY: the caller's guarantee: `extra_info_len` bytes.
            let bytes = unsafe {
                slice(
                    c.extra_info.cast::<u8>(),
                    count(c.extra_info_len)?,
                    "extra_info",
                )
            }?;
            Some(
                std::str::from_utf8(bytes)
                    .map_err(|e| Failure::invalid(format!("extra_info is not UTF-8: {e}")))?
                    .to_owned(),
            )
        } else {
            None
        };
        Ok(Self {
            prefix_keys,
            extra_info,
        })
    }

    fn borrow(&self) -> BatchContext<'_> {
        let mut c = match &self.prefix_keys {
            Some(p) => BatchContext::with_prefix_keys(p),
            None => BatchContext::NONE,
        };
        if let Some(t) = &self.extra_info {
            c = c.extra_info(t);
        }
        c
    }
}

pub(super) unsafe extern "C" fn batch_exists<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    keys_ptr: *const abi::Key,
    n: u64,
    present: *mut u64,
    err: *mut abi::ErrorBuf,
) -> Status {
    // SAFETY: forwarded from the host's call (header); no context.
    unsafe { batch_exists_ctx::<P>(plugin, keys_ptr, n, std::ptr::null(), present, err) }
}

pub(super) unsafe extern "C" fn batch_exists_ctx<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    keys_ptr: *const abi::Key,
    n: u64,
    ctx: *const abi::BatchContext,
    present: *mut u64,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("batch_exists", err, || {
        // SAFETY: invariant 1.
        let inst = unsafe { instance::<P>(plugin) }?;
        // SAFETY: the header: `n` keys, a context valid for the call or null.
        let (ks, cx) = unsafe { (keys(keys_ptr, count(n)?)?, OwnedContext::read(ctx)?) };
        if present.is_null() {
            return Err(Failure::invalid("present is NULL"));
        }
        let hits = inst.run(inst.backend.batch_exists_with(&ks, cx.borrow()))?;
        // SAFETY: non-null out-param of the call.
        unsafe { *present = hits as u64 };
        Ok(None)
    })
}

pub(super) unsafe extern "C" fn batch_get<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    keys_ptr: *const abi::Key,
    pages: *const abi::Page,
    n: u64,
    results: *mut abi::PageResult,
    lengths: *mut u64,
    err: *mut abi::ErrorBuf,
) -> Status {
    // SAFETY: forwarded from the host's call (header); no context.
    unsafe {
        batch_get_ctx::<P>(
            plugin,
            keys_ptr,
            pages,
            n,
            std::ptr::null(),
            results,
            lengths,
            err,
        )
    }
}

#[allow(clippy::too_many_arguments)] // the C signature
pub(super) unsafe extern "C" fn batch_get_ctx<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    keys_ptr: *const abi::Key,
    pages: *const abi::Page,
    n: u64,
    ctx: *const abi::BatchContext,
    results: *mut abi::PageResult,
    lengths: *mut u64,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("batch_get", err, || {
        // SAFETY: invariant 1.
        let inst = unsafe { instance::<P>(plugin) }?;
        let n = count(n)?;
        // SAFETY: the header: a context valid for the call, or null.
        let cx = unsafe { OwnedContext::read(ctx) }?;
        // SAFETY: the header: `n` keys, pages, results and lengths.
        let (ks, descs, results, lengths) = unsafe {
            (
                keys(keys_ptr, n)?,
                slice(pages, n, "pages")?,
                slice_mut(results, n, "results")?,
                slice_mut(lengths, n, "lengths")?,
            )
        };
        let mut dst = Vec::with_capacity(n);
        for (i, p) in descs.iter().enumerate() {
            // SAFETY: the header: each page's parts array holds part_count iovecs.
            let (layout, parts) = unsafe { page_parts(i, p) }?;
            dst.push(PageBufMut::from_parts(
                layout,
                parts.iter().map(|iov| -> &mut [u8] {
                    if iov.len == 0 {
                        return &mut [];
                    }
                    // SAFETY: the header: the iovec is writable caller memory for this call,
                    // and the iovecs of one batch_get never overlap.
                    unsafe {
                        std::slice::from_raw_parts_mut(iov.base.cast::<u8>(), iov.len as usize)
                    }
                }),
            ));
        }
        let outcomes = inst.run(inst.backend.batch_get_with(&ks, &mut dst, cx.borrow()))?;
        check_outcomes("batch_get", &outcomes, n)?;
        for (i, o) in outcomes.iter().enumerate() {
            results[i] = outcome_code(o);
            lengths[i] = if o.is_hit() { dst[i].len() as u64 } else { 0 };
        }
        Ok(first_failure(&outcomes))
    })
}

pub(super) unsafe extern "C" fn batch_set<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    keys_ptr: *const abi::Key,
    pages: *const abi::Page,
    n: u64,
    results: *mut abi::PageResult,
    err: *mut abi::ErrorBuf,
) -> Status {
    // SAFETY: forwarded from the host's call (header); no context.
    unsafe { batch_set_ctx::<P>(plugin, keys_ptr, pages, n, std::ptr::null(), results, err) }
}

pub(super) unsafe extern "C" fn batch_set_ctx<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    keys_ptr: *const abi::Key,
    pages: *const abi::Page,
    n: u64,
    ctx: *const abi::BatchContext,
    results: *mut abi::PageResult,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("batch_set", err, || {
        // SAFETY: invariant 1.
        let inst = unsafe { instance::<P>(plugin) }?;
        let n = count(n)?;
        // SAFETY: the header: a context valid for the call, or null.
        let cx = unsafe { OwnedContext::read(ctx) }?;
        // SAFETY: the header: `n` keys, pages and results.
        let (ks, descs, results) = unsafe {
            (
                keys(keys_ptr, n)?,
                slice(pages, n, "pages")?,
                slice_mut(results, n, "results")?,
            )
        };
        let mut src = Vec::with_capacity(n);
        for (i, p) in descs.iter().enumerate() {
            // SAFETY: the header: each page's parts array holds part_count iovecs.
            let (layout, parts) = unsafe { page_parts(i, p) }?;
            src.push(PageBuf::from_parts(
                layout,
                parts.iter().map(|iov| -> &[u8] {
                    if iov.len == 0 {
                        return &[];
                    }
                    // SAFETY: the header: the iovec is readable caller memory for this call.
                    unsafe { std::slice::from_raw_parts(iov.base.cast::<u8>(), iov.len as usize) }
                }),
            ));
        }
        let outcomes = inst.run(inst.backend.batch_set_with(&ks, &src, cx.borrow()))?;
        check_outcomes("batch_set", &outcomes, n)?;
        for (r, o) in results.iter_mut().zip(&outcomes) {
            *r = outcome_code(o);
        }
        Ok(first_failure(&outcomes))
    })
}

pub(super) unsafe extern "C" fn batch_delete<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    keys_ptr: *const abi::Key,
    n: u64,
    removed: *mut u64,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("batch_delete", err, || {
        // SAFETY: invariant 1.
        let inst = unsafe { instance::<P>(plugin) }?;
        // SAFETY: the header: `n` keys.
        let ks = unsafe { keys(keys_ptr, count(n)?) }?;
        if removed.is_null() {
            return Err(Failure::invalid("removed is NULL"));
        }
        let k = inst.run(inst.backend.delete(&ks))?;
        // SAFETY: non-null out-param of the call.
        unsafe { *removed = k as u64 };
        Ok(None)
    })
}

pub(super) unsafe extern "C" fn clear<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    namespace_id: *const [u8; abi::NAMESPACE_LEN],
    removed: *mut u64,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("clear", err, || {
        // SAFETY: invariant 1.
        let inst = unsafe { instance::<P>(plugin) }?;
        // SAFETY: the header: 16 readable bytes, or null (refused).
        let Some(ns) = (unsafe { namespace_id.as_ref() }) else {
            return Err(Failure::invalid("namespace_id is NULL"));
        };
        if removed.is_null() {
            return Err(Failure::invalid("removed is NULL"));
        }
        // A backend without the capability answers Unsupported (HICACHE_ERR_UNSUPPORTED).
        let k = inst.run(inst.backend.clear(NamespaceId(*ns)))?;
        // SAFETY: non-null out-param of the call.
        unsafe { *removed = k };
        Ok(None)
    })
}

fn stats_abi(s: &StorageStats) -> abi::Stats {
    abi::Stats {
        struct_size: 0,
        reserved: 0,
        pages: s.pages,
        bytes: s.bytes,
        capacity_bytes: s.capacity_bytes.unwrap_or(0),
        exists_calls: s.exists_calls,
        exists_keys: s.exists_keys,
        exists_hits: s.exists_hits,
        get_pages: s.get_pages,
        get_hits: s.get_hits,
        get_misses: s.get_misses,
        meta_mismatches: s.meta_mismatches,
        get_corrupt: s.get_corrupt,
        get_errors: s.get_errors,
        get_bytes: s.get_bytes,
        set_pages: s.set_pages,
        set_stored: s.set_stored,
        set_present: s.set_present,
        set_errors: s.set_errors,
        set_bytes: s.set_bytes,
        evicted_pages: s.evicted_pages,
        evicted_bytes: s.evicted_bytes,
        deleted_pages: s.deleted_pages,
        discarded_on_open: s.discarded_on_open,
        cleared_pages: s.cleared_pages,
    }
}

pub(super) unsafe extern "C" fn get_stats<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    out: *mut abi::Stats,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("get_stats", err, || {
        // SAFETY: invariant 1.
        let inst = unsafe { instance::<P>(plugin) }?;
        if out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        let s = tracing::dispatcher::with_default(&inst.dispatch, || inst.backend.stats());
        // SAFETY: `out` is the host's struct with its struct_size set (header).
        unsafe { write_sized(out, &stats_abi(&s)) };
        Ok(None)
    })
}

pub(super) unsafe extern "C" fn register_memory<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    addr: *mut c_void,
    len: u64,
    flags: u32,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("register_memory", err, || {
        // SAFETY: invariant 1.
        let inst = unsafe { instance::<P>(plugin) }?;
        let region = MemoryRegion {
            addr: addr as usize,
            len: count(len)?,
            cuda_registered: flags & abi::MEMORY_CUDA_REGISTERED != 0,
            huge_pages: flags & abi::MEMORY_HUGE_PAGES != 0,
        };
        let _rt = inst.runtime.enter();
        tracing::dispatcher::with_default(&inst.dispatch, || inst.backend.register_memory(region))?;
        Ok(None)
    })
}

pub(super) unsafe extern "C" fn test_corrupt_page<P: Plugin>(
    plugin: *mut abi::PluginHandle,
    key: *const abi::Key,
    found: *mut u32,
    err: *mut abi::ErrorBuf,
) -> Status {
    guard::<P>("test_corrupt_page", err, || {
        // SAFETY: invariant 1.
        let inst = unsafe { instance::<P>(plugin) }?;
        // SAFETY: the header: one key.
        let k = unsafe { keys(key, 1) }?;
        if found.is_null() {
            return Err(Failure::invalid("found is NULL"));
        }
        let hit = P::corrupt_page(&inst.backend, &k[0])?;
        // SAFETY: non-null out-param of the call.
        unsafe { *found = u32::from(hit) };
        Ok(None)
    })
}
