//! [`PluginStorage`]: one plugin instance used as a [`Storage`].
//!
//! # How calls are made
//!
//! Plugin calls are synchronous and may block. They borrow the caller's page buffers, which
//! rules out `spawn_blocking` (it needs `'static` data, and a cancelled future would leave the
//! plugin writing into freed buffers). So a call runs in place inside
//! [`tokio::task::block_in_place`] when the current runtime is multi-threaded: the worker hands
//! its other tasks to another thread first, so the runtime keeps running while the plugin
//! blocks. Outside a runtime, or on a current-thread runtime (which cannot hand its tasks
//! away), the call runs directly on the calling thread.
//!
//! # What is checked (invariants)
//!
//! 1. Batch rules are the host's: key and buffer counts, and `max_batch` from the plugin's
//!    info, are checked before the plugin is called ([`check_batch`]).
//! 2. Nothing coming back is trusted. Result arrays are pre-filled with `HICACHE_PAGE_UNSET`,
//!    so a page the plugin left unwritten is an error; a code that is unknown or of the wrong
//!    kind for the call, or a hit whose reported length is not the page's, becomes
//!    `PageOutcome::Failed` for that page (the other pages are unaffected); a count larger
//!    than the batch fails the call. Each violation is logged and counted in
//!    [`PluginStorage::protocol_violations`].
//! 3. A non-OK status fails the call with the plugin's error text (read from the host-owned
//!    buffer only after the call returned, at most its capacity, lossy UTF-8).
//! 4. A batch context reaches the plugin only through the 1.1 `*_ctx` entries of a plugin
//!    that declared them (`HICACHE_CAP_BATCH_CONTEXT`); a call without context, or to a 1.0
//!    plugin, uses the plain entries (the context is dropped, as the trait's defaults do).
//! 5. `clear` reaches the plugin only when the library provides the 1.2 entry
//!    (`HICACHE_CAP_CLEAR`) and the instance's info says it clears (`HICACHE_INFO_CLEAR`);
//!    otherwise it answers [`StorageError::Unsupported`] without calling the plugin, as a
//!    backend without the capability does (contract rule 10).
//! 6. The instance is destroyed exactly once, in `Drop`, when no call can be in flight (calls
//!    borrow `&self`). `destroy` runs on the dropping thread, directly.

use std::ffi::{c_char, c_void};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use hicache_core::{MemoryRegion, NamespaceId, PageKey};
use hicache_storage::{
    BackendContext, BackendInfo, BatchContext, CommonConfig, PageBuf, PageBufMut, PageError,
    PageOutcome, Result, Storage, StorageError, StorageStats, check_batch,
};

use crate::abi::{self, Vtable};
use crate::error::PluginError;
use crate::host_log;
use crate::library::PluginLibrary;

/// Capacity of the error buffer the host lends each call.
const ERROR_CAPACITY: usize = 1024;

/// What the host tells a plugin's `create` besides its JSON configuration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostParams {
    /// The extra-config's `capacity`; `None` lets the plugin choose.
    pub capacity_bytes: Option<u64>,
    /// The deployment the backend serves.
    pub context: BackendContext,
}

impl HostParams {
    /// From the common extra-config fields and the engine's context.
    pub fn new(common: &CommonConfig, context: &BackendContext) -> Self {
        Self {
            capacity_bytes: common.capacity_bytes,
            context: context.clone(),
        }
    }

    /// With a capacity.
    pub fn with_capacity(mut self, capacity_bytes: Option<u64>) -> Self {
        self.capacity_bytes = capacity_bytes;
        self
    }
}

/// Runs a plugin call: inside `block_in_place` on a multi-threaded runtime, else directly (see
/// the [module documentation](self)).
pub(crate) fn blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// The host-owned error buffer of one call.
struct ErrorText {
    buf: [u8; ERROR_CAPACITY],
}

impl ErrorText {
    fn new() -> Self {
        Self {
            buf: [0; ERROR_CAPACITY],
        }
    }

    /// The ABI view, valid while `self` is neither moved nor dropped.
    fn abi(&mut self) -> abi::ErrorBuf {
        abi::ErrorBuf {
            message: self.buf.as_mut_ptr().cast::<c_char>(),
            capacity: ERROR_CAPACITY as u64,
        }
    }

    /// The text up to the first NUL (or the whole buffer), lossy UTF-8.
    fn text(&self) -> String {
        let end = self
            .buf
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(self.buf.len());
        String::from_utf8_lossy(&self.buf[..end]).into_owned()
    }

    fn text_or(&self, default: &str) -> String {
        let t = self.text();
        if t.is_empty() { default.to_string() } else { t }
    }
}

/// One instance of a plugin, used as a [`Storage`]. See the [module documentation](self).
pub struct PluginStorage {
    lib: &'static PluginLibrary,
    handle: NonNull<abi::PluginHandle>,
    info: BackendInfo,
    violations: AtomicU64,
}

// SAFETY: the ABI's threading rule (header §3): every function but `destroy` may be called
// concurrently from any thread on one instance; `destroy` runs in `Drop`, with `&mut self`.
unsafe impl Send for PluginStorage {}
// SAFETY: as above.
unsafe impl Sync for PluginStorage {}

impl std::fmt::Debug for PluginStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginStorage")
            .field("library", &self.lib)
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl PluginStorage {
    /// Loads the plugin at `path` (once per process) and creates an instance from
    /// `config_json` (a JSON object).
    pub fn open(
        path: impl AsRef<Path>,
        config_json: &str,
        params: &HostParams,
    ) -> Result<Self, PluginError> {
        Self::create(PluginLibrary::load(path)?, config_json, params)
    }

    /// Creates an instance of an already loaded plugin.
    pub fn create(
        lib: &'static PluginLibrary,
        config_json: &str,
        params: &HostParams,
    ) -> Result<Self, PluginError> {
        let vt = lib.vtable();
        let ctx = &params.context;
        let host = abi::Host {
            struct_size: std::mem::size_of::<abi::Host>() as u32,
            abi_major: abi::ABI_MAJOR,
            abi_minor: abi::ABI_MINOR,
            max_log_level: host_log::max_level(),
            log: Some(host_log::host_log),
            log_ctx: lib.log_ctx(),
            capacity_bytes: params.capacity_bytes.unwrap_or(0),
            page_bytes: ctx.page_bytes as u64,
            layout: abi::layout_tag(ctx.layout),
            tp_rank: ctx.tp_rank,
            tp_size: ctx.tp_size,
            pp_rank: ctx.pp_rank,
            pp_size: ctx.pp_size,
            has_namespace: u32::from(ctx.namespace.is_some()),
            namespace_id: ctx.namespace.map(|n| n.0).unwrap_or_default(),
        };
        // The config text, NUL-terminated (the header promises a NUL after `config_len` bytes).
        let mut config = Vec::with_capacity(config_json.len() + 1);
        config.extend_from_slice(config_json.as_bytes());
        config.push(0);
        let mut err = ErrorText::new();
        let mut out: *mut abi::PluginHandle = std::ptr::null_mut();
        let create = vt.create.expect("checked at load");
        let status = blocking(|| {
            let mut eb = err.abi();
            // SAFETY: every pointer is valid for the call: `config` holds `len` bytes and a
            // NUL, `host` and `out` are locals, `eb` points into `err`.
            unsafe {
                create(
                    config.as_ptr().cast::<c_char>(),
                    config_json.len() as u64,
                    &host,
                    &mut out,
                    &mut eb,
                )
            }
        });
        if status != abi::OK {
            return Err(PluginError::Create {
                plugin: lib.name().to_string(),
                path: lib.path().to_path_buf(),
                status,
                status_name: abi::status_name(status),
                message: err.text_or("(the plugin gave no error text)"),
            });
        }
        let handle = NonNull::new(out).ok_or_else(|| PluginError::Protocol {
            plugin: lib.name().to_string(),
            op: "create",
            detail: "returned HICACHE_OK but no instance (NULL)".into(),
        })?;
        // From here on the instance is owned: dropping `storage` destroys it.
        let mut storage = PluginStorage {
            lib,
            handle,
            info: BackendInfo::new(crate::NAME, 1),
            violations: AtomicU64::new(0),
        };
        storage.info = storage.fetch_info()?;
        tracing::debug!(
            target: "hicache_plugin",
            plugin = lib.name(),
            info = ?storage.info,
            "plugin instance created"
        );
        Ok(storage)
    }

    fn fetch_info(&self) -> Result<BackendInfo, PluginError> {
        let mut info = abi::Info {
            struct_size: std::mem::size_of::<abi::Info>() as u32,
            ..Default::default()
        };
        let mut err = ErrorText::new();
        let get_info = self.vt().get_info.expect("checked at load");
        let status = blocking(|| {
            let mut eb = err.abi();
            // SAFETY: a live instance; `info` and `eb` are valid locals for the call.
            unsafe { get_info(self.handle.as_ptr(), &mut info, &mut eb) }
        });
        if status != abi::OK {
            return Err(PluginError::call(
                self.plugin(),
                "get_info",
                status,
                err.text(),
            ));
        }
        if info.max_batch == 0 {
            return Err(self.protocol("get_info", "max_batch is 0 (must be at least 1)".into()));
        }
        let mut i = BackendInfo::new(
            crate::NAME,
            usize::try_from(info.max_batch).unwrap_or(usize::MAX),
        );
        i.zero_copy = info.flags & abi::INFO_ZERO_COPY != 0;
        i.persistent = info.flags & abi::INFO_PERSISTENT != 0;
        i.shared = info.flags & abi::INFO_SHARED != 0;
        i.max_page_bytes = match info.max_page_bytes {
            0 => usize::MAX,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        i.capacity_bytes = (info.capacity_bytes != 0).then_some(info.capacity_bytes);
        i.batch_context = self.lib.batch_context();
        // Invariant 5: both the entry and the instance's word.
        i.clear = self.lib.clear() && info.flags & abi::INFO_CLEAR != 0;
        Ok(i)
    }

    /// The library this instance belongs to (name, version, path, ABI version).
    pub fn library(&self) -> &'static PluginLibrary {
        self.lib
    }

    /// How many results of this instance broke the ABI's rules and were turned into errors
    /// (see invariant 2 of the [module documentation](self)).
    pub fn protocol_violations(&self) -> u64 {
        self.violations.load(Ordering::Relaxed)
    }

    /// Test hook: asks the plugin to damage the stored copy of `key` (capability
    /// `HICACHE_CAP_TEST_CORRUPT`); `Ok(false)` if the page is absent.
    pub fn test_corrupt_page(&self, key: &PageKey) -> Result<bool, PluginError> {
        let f = match self.vt().test_corrupt_page {
            Some(f) if self.vt().capabilities & abi::CAP_TEST_CORRUPT != 0 => f,
            _ => {
                return Err(PluginError::Unsupported {
                    plugin: self.plugin().to_string(),
                    op: "test_corrupt_page",
                });
            }
        };
        let k = abi::Key::from(key);
        let mut found = 0u32;
        let mut err = ErrorText::new();
        let status = blocking(|| {
            let mut eb = err.abi();
            // SAFETY: a live instance; `k`, `found` and `eb` are valid locals for the call.
            unsafe { f(self.handle.as_ptr(), &k, &mut found, &mut eb) }
        });
        if status != abi::OK {
            return Err(PluginError::call(
                self.plugin(),
                "test_corrupt_page",
                status,
                err.text(),
            ));
        }
        Ok(found != 0)
    }

    /// The context in the ABI's form, when it goes to the plugin (invariant 4).
    fn context<'a>(&self, ctx: BatchContext<'a>) -> Option<CContext<'a>> {
        (!ctx.is_empty() && self.info.batch_context).then(|| CContext::new(ctx))
    }

    fn vt(&self) -> &Vtable {
        self.lib.vtable()
    }

    fn plugin(&self) -> &str {
        self.lib.name()
    }

    fn protocol(&self, op: &'static str, detail: String) -> PluginError {
        self.violations.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(target: "hicache_plugin", plugin = self.plugin(), op, "{detail}");
        PluginError::Protocol {
            plugin: self.plugin().to_string(),
            op,
            detail,
        }
    }

    /// A per-page protocol violation: counted, logged, and the page's outcome.
    fn bad_page(&self, op: &'static str, detail: String) -> PageOutcome {
        let e = self.protocol(op, detail);
        PageOutcome::Failed(PageError::Backend(e.to_string()))
    }

    /// Calls a vtable entry that answers one count for a batch of keys (`batch_exists`,
    /// `batch_delete`, `batch_exists_ctx`) off the async runtime, and refuses a count larger
    /// than the batch as a protocol violation described by `too_many(count, batch_len)`.
    /// `call(instance, keys, count, out, err)` makes the C call.
    fn count_call(
        &self,
        op: &'static str,
        keys: &[PageKey],
        too_many: impl FnOnce(u64, usize) -> String,
        call: impl FnOnce(
            *mut abi::PluginHandle,
            *const abi::Key,
            u64,
            *mut u64,
            *mut abi::ErrorBuf,
        ) -> abi::Status,
    ) -> Result<usize> {
        let ckeys: Vec<abi::Key> = keys.iter().map(abi::Key::from).collect();
        let mut count = 0u64;
        let mut err = ErrorText::new();
        let status = blocking(|| {
            let mut eb = err.abi();
            call(
                self.handle.as_ptr(),
                ckeys.as_ptr(),
                ckeys.len() as u64,
                &mut count,
                &mut eb,
            )
        });
        if status != abi::OK {
            return Err(self.call_error(op, status, keys.len(), &err));
        }
        if count > keys.len() as u64 {
            return Err(self.protocol(op, too_many(count, keys.len())).into());
        }
        Ok(count as usize)
    }

    fn call_error(&self, op: &'static str, status: i32, n: usize, err: &ErrorText) -> StorageError {
        if status == abi::ERR_BATCH_TOO_LARGE {
            return StorageError::BatchTooLarge {
                len: n,
                max: self.info.max_batch,
            };
        }
        PluginError::call(self.plugin(), op, status, err.text_or("(no error text)")).into()
    }

    /// The outcome of a per-page error code, with the call's error text as detail.
    fn page_error(&self, code: abi::PageResult, len: usize, err: &ErrorText) -> PageOutcome {
        let detail = || {
            format!(
                "plugin `{}`: {}",
                self.plugin(),
                err.text_or("no detail given")
            )
        };
        PageOutcome::Failed(match code {
            abi::PAGE_ERR_EMPTY => PageError::EmptyPage,
            abi::PAGE_ERR_TOO_LARGE => PageError::TooLarge {
                len,
                max: self.info.max_page_bytes,
            },
            abi::PAGE_ERR_NO_SPACE => PageError::NoSpace,
            abi::PAGE_ERR_IO => PageError::Io {
                op: "plugin",
                detail: detail(),
            },
            _ => PageError::Backend(detail()),
        })
    }

    /// Maps one `batch_get` result, checking its kind and length.
    fn get_outcome(
        &self,
        i: usize,
        code: abi::PageResult,
        written: u64,
        len: usize,
        err: &ErrorText,
    ) -> PageOutcome {
        match code {
            abi::PAGE_HIT if written == len as u64 => PageOutcome::Hit,
            abi::PAGE_HIT => self.bad_page(
                "batch_get",
                format!("page {i}: reported a hit with {written} bytes for a {len}-byte page"),
            ),
            abi::PAGE_MISS => PageOutcome::Miss,
            abi::PAGE_CORRUPT => PageOutcome::Corrupt,
            abi::PAGE_ERR_EMPTY
            | abi::PAGE_ERR_TOO_LARGE
            | abi::PAGE_ERR_NO_SPACE
            | abi::PAGE_ERR_IO
            | abi::PAGE_ERR_BACKEND => self.page_error(code, len, err),
            abi::PAGE_UNSET => self.bad_page(
                "batch_get",
                format!("page {i}: no result written (HICACHE_PAGE_UNSET)"),
            ),
            other => self.bad_page(
                "batch_get",
                format!("page {i}: result code {other} is not a batch_get result"),
            ),
        }
    }

    /// Maps one `batch_set` result, checking its kind.
    fn set_outcome(
        &self,
        i: usize,
        code: abi::PageResult,
        len: usize,
        err: &ErrorText,
    ) -> PageOutcome {
        match code {
            abi::PAGE_STORED => PageOutcome::Stored,
            abi::PAGE_PRESENT => PageOutcome::Present,
            abi::PAGE_ERR_EMPTY
            | abi::PAGE_ERR_TOO_LARGE
            | abi::PAGE_ERR_NO_SPACE
            | abi::PAGE_ERR_IO
            | abi::PAGE_ERR_BACKEND => self.page_error(code, len, err),
            abi::PAGE_UNSET => self.bad_page(
                "batch_set",
                format!("page {i}: no result written (HICACHE_PAGE_UNSET)"),
            ),
            other => self.bad_page(
                "batch_set",
                format!("page {i}: result code {other} is not a batch_set result"),
            ),
        }
    }
}

/// A batch context in the ABI's form (`hicache_batch_context`) with the prefix keys it points
/// to; the extra-info text stays the caller's (borrowed for `'a`).
struct CContext<'a> {
    /// The prefix keys `raw.prefix_keys` points to (a heap buffer: moving the vector does not
    /// move it).
    _keys: Vec<abi::Key>,
    raw: abi::BatchContext,
    _text: std::marker::PhantomData<&'a str>,
}

// SAFETY: the raw pointers point to the owned key buffer and to a borrowed `&'a str`, both
// immutable while the value lives; nothing is written through them.
unsafe impl Send for CContext<'_> {}
// SAFETY: as above.
unsafe impl Sync for CContext<'_> {}

impl<'a> CContext<'a> {
    fn new(ctx: BatchContext<'a>) -> Self {
        let keys: Vec<abi::Key> = ctx
            .prefix_keys
            .unwrap_or(&[])
            .iter()
            .map(abi::Key::from)
            .collect();
        let text = ctx.extra_info.unwrap_or("");
        let mut flags = 0;
        if ctx.prefix_keys.is_some() {
            flags |= abi::CONTEXT_HAS_PREFIX;
        }
        if ctx.extra_info.is_some() {
            flags |= abi::CONTEXT_HAS_EXTRA_INFO;
        }
        let raw = abi::BatchContext {
            struct_size: std::mem::size_of::<abi::BatchContext>() as u32,
            flags,
            prefix_keys: if keys.is_empty() {
                std::ptr::null()
            } else {
                keys.as_ptr()
            },
            prefix_count: keys.len() as u64,
            extra_info: if text.is_empty() {
                std::ptr::null()
            } else {
                text.as_ptr().cast::<c_char>()
            },
            extra_info_len: text.len() as u64,
        };
        Self {
            _keys: keys,
            raw,
            _text: std::marker::PhantomData,
        }
    }
}

/// Builds the iovec array of a batch, then the page array pointing into it. The iovec vector
/// is complete before any page takes a pointer into it, so the pointers stay valid.
fn describe_pages<'p, I>(pages: I, n: usize) -> (Vec<abi::Iovec>, Vec<abi::Page>)
where
    I: Iterator<Item = (hicache_core::LayoutKind, usize, Vec<abi::Iovec>)> + 'p,
{
    let mut iovs = Vec::new();
    let mut spans = Vec::with_capacity(n);
    for (layout, len, parts) in pages {
        spans.push((iovs.len(), parts.len(), layout, len));
        iovs.extend(parts);
    }
    let base = iovs.as_ptr();
    let descs = spans
        .into_iter()
        .map(|(start, count, layout, len)| abi::Page {
            // In bounds: `start + count <= iovs.len()`.
            parts: base.wrapping_add(start),
            part_count: count as u64,
            len: len as u64,
            layout: abi::layout_tag(layout),
            reserved: 0,
        })
        .collect();
    (iovs, descs)
}

#[async_trait]
impl Storage for PluginStorage {
    fn info(&self) -> BackendInfo {
        self.info.clone()
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        self.batch_exists_with(keys, BatchContext::NONE).await
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>> {
        self.batch_get_with(keys, dst, BatchContext::NONE).await
    }

    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        self.batch_set_with(keys, src, BatchContext::NONE).await
    }

    async fn batch_exists_with(&self, keys: &[PageKey], ctx: BatchContext<'_>) -> Result<usize> {
        check_batch("batch_exists", self.info.max_batch, keys.len(), keys.len())?;
        let too_many = |present, n| format!("{present} keys present out of a batch of {n}");
        match self.context(ctx) {
            Some(c) => {
                let f = self.vt().batch_exists_ctx.expect("checked at load");
                self.count_call("batch_exists", keys, too_many, |h, k, n, out, eb| {
                    // SAFETY: a live instance; `k` holds `n` keys; `c.raw` and the prefix keys
                    // and text it points to live until after the call; out-params are locals.
                    unsafe { f(h, k, n, &c.raw, out, eb) }
                })
            }
            None => {
                let f = self.vt().batch_exists.expect("checked at load");
                self.count_call("batch_exists", keys, too_many, |h, k, n, out, eb| {
                    // SAFETY: a live instance; `k` holds `n` keys; out-params are locals.
                    unsafe { f(h, k, n, out, eb) }
                })
            }
        }
    }

    async fn batch_get_with(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
        ctx: BatchContext<'_>,
    ) -> Result<Vec<PageOutcome>> {
        check_batch("batch_get", self.info.max_batch, keys.len(), dst.len())?;
        let n = keys.len();
        let ckeys: Vec<abi::Key> = keys.iter().map(abi::Key::from).collect();
        let lens: Vec<usize> = dst.iter().map(|d| d.len()).collect();
        let (_iovs, pages) = describe_pages(
            dst.iter_mut().map(|d| {
                let (layout, len) = (d.layout(), d.len());
                let parts = d
                    .parts_mut()
                    .iter_mut()
                    .map(|p| abi::Iovec {
                        base: p.as_mut_ptr().cast::<c_void>(),
                        len: p.len() as u64,
                    })
                    .collect();
                (layout, len, parts)
            }),
            n,
        );
        let mut results = vec![abi::PAGE_UNSET; n];
        let mut written = vec![0u64; n];
        let mut err = ErrorText::new();
        let c = self.context(ctx);
        let status = blocking(|| {
            let mut eb = err.abi();
            let (h, k, p, r, w) = (
                self.handle.as_ptr(),
                ckeys.as_ptr(),
                pages.as_ptr(),
                results.as_mut_ptr(),
                written.as_mut_ptr(),
            );
            // SAFETY: a live instance; `ckeys`, `pages`, `results`, `written` hold `n` entries;
            // the iovecs point into the caller's buffers, borrowed mutably for this call; a
            // context and what it points to live until after the call.
            unsafe {
                match &c {
                    Some(c) => self.vt().batch_get_ctx.expect("checked at load")(
                        h, k, p, n as u64, &c.raw, r, w, &mut eb,
                    ),
                    None => self.vt().batch_get.expect("checked at load")(
                        h, k, p, n as u64, r, w, &mut eb,
                    ),
                }
            }
        });
        if status != abi::OK {
            return Err(self.call_error("batch_get", status, n, &err));
        }
        Ok((0..n)
            .map(|i| self.get_outcome(i, results[i], written[i], lens[i], &err))
            .collect())
    }

    async fn batch_set_with(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        ctx: BatchContext<'_>,
    ) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", self.info.max_batch, keys.len(), src.len())?;
        let n = keys.len();
        let ckeys: Vec<abi::Key> = keys.iter().map(abi::Key::from).collect();
        let (_iovs, pages) = describe_pages(
            src.iter().map(|p| {
                let parts = p
                    .parts()
                    .iter()
                    .map(|part| abi::Iovec {
                        // Read-only for the plugin (header §5); the C type has no const.
                        base: part.as_ptr().cast_mut().cast::<c_void>(),
                        len: part.len() as u64,
                    })
                    .collect();
                (p.layout(), p.len(), parts)
            }),
            n,
        );
        let mut results = vec![abi::PAGE_UNSET; n];
        let mut err = ErrorText::new();
        let c = self.context(ctx);
        let status = blocking(|| {
            let mut eb = err.abi();
            let (h, k, p, r) = (
                self.handle.as_ptr(),
                ckeys.as_ptr(),
                pages.as_ptr(),
                results.as_mut_ptr(),
            );
            // SAFETY: a live instance; `ckeys`, `pages`, `results` hold `n` entries; the
            // iovecs point into the caller's buffers, borrowed for this call; a context and
            // what it points to live until after the call.
            unsafe {
                match &c {
                    Some(c) => self.vt().batch_set_ctx.expect("checked at load")(
                        h, k, p, n as u64, &c.raw, r, &mut eb,
                    ),
                    None => {
                        self.vt().batch_set.expect("checked at load")(h, k, p, n as u64, r, &mut eb)
                    }
                }
            }
        });
        if status != abi::OK {
            return Err(self.call_error("batch_set", status, n, &err));
        }
        Ok((0..n)
            .map(|i| self.set_outcome(i, results[i], src[i].len(), &err))
            .collect())
    }

    fn register_memory(&self, region: MemoryRegion) -> Result<()> {
        let f = match self.vt().register_memory {
            Some(f) if self.vt().capabilities & abi::CAP_REGISTER_MEMORY != 0 => f,
            _ => return Ok(()),
        };
        let mut flags = 0;
        if region.cuda_registered {
            flags |= abi::MEMORY_CUDA_REGISTERED;
        }
        if region.huge_pages {
            flags |= abi::MEMORY_HUGE_PAGES;
        }
        let mut err = ErrorText::new();
        let status = blocking(|| {
            let mut eb = err.abi();
            // SAFETY: a live instance; the region is only described here (its owner keeps it
            // mapped while the instance lives, as the trait's contract requires).
            unsafe {
                f(
                    self.handle.as_ptr(),
                    region.addr as *mut c_void,
                    region.len as u64,
                    flags,
                    &mut eb,
                )
            }
        });
        if status != abi::OK {
            return Err(self.call_error("register_memory", status, 0, &err));
        }
        Ok(())
    }

    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        let f = self.vt().batch_delete.expect("checked at load");
        let too_many = |removed, n| format!("removed {removed} pages out of a batch of {n}");
        self.count_call("batch_delete", keys, too_many, |h, k, n, out, eb| {
            // SAFETY: a live instance; `k` holds `n` keys; out-params are locals.
            unsafe { f(h, k, n, out, eb) }
        })
    }

    async fn clear(&self, namespace: NamespaceId) -> Result<u64> {
        // Invariant 5.
        let f = match self.vt().clear {
            Some(f) if self.info.clear => f,
            _ => {
                return Err(StorageError::Unsupported {
                    backend: self.info.name.clone(),
                    op: "clear",
                });
            }
        };
        let ns = *namespace.as_bytes();
        let mut removed = 0u64;
        let mut err = ErrorText::new();
        let status = blocking(|| {
            let mut eb = err.abi();
            // SAFETY: a live instance; `ns` (16 bytes), `removed` and `eb` are valid locals
            // for the call.
            unsafe { f(self.handle.as_ptr(), &ns, &mut removed, &mut eb) }
        });
        match status {
            abi::OK => Ok(removed),
            abi::ERR_UNSUPPORTED => Err(StorageError::Unsupported {
                backend: self.info.name.clone(),
                op: "clear",
            }),
            _ => Err(self.call_error("clear", status, 0, &err)),
        }
    }

    fn stats(&self) -> StorageStats {
        let mut s = abi::Stats {
            struct_size: std::mem::size_of::<abi::Stats>() as u32,
            ..Default::default()
        };
        let mut err = ErrorText::new();
        let f = self.vt().get_stats.expect("checked at load");
        let status = blocking(|| {
            let mut eb = err.abi();
            // SAFETY: a live instance; `s` and `eb` are valid locals for the call.
            unsafe { f(self.handle.as_ptr(), &mut s, &mut eb) }
        });
        let mut out = StorageStats::default();
        out.capacity_bytes = self.info.capacity_bytes;
        if status != abi::OK {
            tracing::warn!(
                target: "hicache_plugin",
                plugin = self.plugin(),
                "get_stats failed with {} ({status}): {}; reporting zeros",
                abi::status_name(status),
                err.text()
            );
            return out;
        }
        out.pages = s.pages;
        out.bytes = s.bytes;
        if s.capacity_bytes != 0 {
            out.capacity_bytes = Some(s.capacity_bytes);
        }
        out.exists_calls = s.exists_calls;
        out.exists_keys = s.exists_keys;
        out.exists_hits = s.exists_hits;
        out.get_pages = s.get_pages;
        out.get_hits = s.get_hits;
        out.get_misses = s.get_misses;
        out.meta_mismatches = s.meta_mismatches;
        out.get_corrupt = s.get_corrupt;
        out.get_errors = s.get_errors;
        out.get_bytes = s.get_bytes;
        out.set_pages = s.set_pages;
        out.set_stored = s.set_stored;
        out.set_present = s.set_present;
        out.set_errors = s.set_errors;
        out.set_bytes = s.set_bytes;
        out.evicted_pages = s.evicted_pages;
        out.evicted_bytes = s.evicted_bytes;
        out.deleted_pages = s.deleted_pages;
        out.cleared_pages = s.cleared_pages;
        out.discarded_on_open = s.discarded_on_open;
        out
    }
}

impl Drop for PluginStorage {
    fn drop(&mut self) {
        let destroy = self.vt().destroy.expect("checked at load");
        let handle = self.handle.as_ptr();
        // Called in place, not in a blocking section: a drop may run while a runtime shuts
        // down, where handing the worker away is not possible, and a panic in `drop` aborts.
        // SAFETY: invariant 6: the instance is live, no call is in flight (`&mut self`), and it
        // is never used again.
        unsafe { destroy(handle) };
    }
}
