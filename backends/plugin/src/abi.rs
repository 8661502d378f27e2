//! The C ABI of `include/hicache_storage.h`, mirrored in Rust: `#[repr(C)]` structs with the
//! same fields in the same order, and the same constants. The header is the contract; this
//! module follows it (a test of `hicache-plugin-tests` compares every size and offset with what
//! a C compiler makes of the header).
//!
//! Names follow the header without its `hicache_` prefix (`hicache_plugin_vtable` is
//! [`Vtable`], `HICACHE_PAGE_HIT` is [`PAGE_HIT`]). Everything here is plain data; the rules
//! (who frees what, threading, versioning, no unwinding) are the header's, summarised in the
//! crate documentation.

use std::ffi::{c_char, c_void};
use std::mem::{offset_of, size_of};

use hicache_core::{LayoutKind, PageKey};

/// ABI major version: a plugin of another major version is refused.
pub const ABI_MAJOR: u32 = 1;
/// ABI minor version of this host (1.1: the batch-context entries; 1.2: `clear`).
pub const ABI_MINOR: u32 = 2;
/// The exported entry symbol, NUL-terminated (for `dlsym`).
pub const ENTRY_SYMBOL: &[u8] = b"hicache_storage_plugin\0";

/// Outcome of a whole call.
pub type Status = i32;
/// The call did its work.
pub const OK: Status = 0;
/// A pointer, count or page description was invalid.
pub const ERR_INVALID_ARGUMENT: Status = -1;
/// `create`: the configuration was refused.
pub const ERR_CONFIG: Status = -2;
/// The batch has more pages than `max_batch`.
pub const ERR_BATCH_TOO_LARGE: Status = -3;
/// The storage cannot serve calls now.
pub const ERR_UNAVAILABLE: Status = -4;
/// The function is not supported.
pub const ERR_UNSUPPORTED: Status = -5;
/// An I/O error concerning the whole call.
pub const ERR_IO: Status = -6;
/// Any other failure.
pub const ERR_INTERNAL: Status = -7;
/// A Rust plugin panicked inside the call.
pub const ERR_PANIC: Status = -8;

/// The header's name of a status code, for messages.
pub fn status_name(s: Status) -> &'static str {
    match s {
        OK => "HICACHE_OK",
        ERR_INVALID_ARGUMENT => "HICACHE_ERR_INVALID_ARGUMENT",
        ERR_CONFIG => "HICACHE_ERR_CONFIG",
        ERR_BATCH_TOO_LARGE => "HICACHE_ERR_BATCH_TOO_LARGE",
        ERR_UNAVAILABLE => "HICACHE_ERR_UNAVAILABLE",
        ERR_UNSUPPORTED => "HICACHE_ERR_UNSUPPORTED",
        ERR_IO => "HICACHE_ERR_IO",
        ERR_INTERNAL => "HICACHE_ERR_INTERNAL",
        ERR_PANIC => "HICACHE_ERR_PANIC",
        _ => "an unknown status code",
    }
}

/// Outcome of one page of a batch.
pub type PageResult = i32;
/// Never valid: result arrays are pre-filled with it.
pub const PAGE_UNSET: PageResult = 0;
/// get: the destination holds the page.
pub const PAGE_HIT: PageResult = 1;
/// get: absent or other metadata.
pub const PAGE_MISS: PageResult = 2;
/// get: the stored copy failed verification.
pub const PAGE_CORRUPT: PageResult = 3;
/// set: written and committed.
pub const PAGE_STORED: PageResult = 4;
/// set: already present.
pub const PAGE_PRESENT: PageResult = 5;
/// The page has no bytes.
pub const PAGE_ERR_EMPTY: PageResult = 10;
/// The page is larger than the plugin accepts.
pub const PAGE_ERR_TOO_LARGE: PageResult = 11;
/// Full, nothing evictable.
pub const PAGE_ERR_NO_SPACE: PageResult = 12;
/// An I/O error for this page.
pub const PAGE_ERR_IO: PageResult = 13;
/// Any other failure of this page.
pub const PAGE_ERR_BACKEND: PageResult = 14;

/// Capability: `register_memory` is provided.
pub const CAP_REGISTER_MEMORY: u32 = 1 << 0;
/// Capability: `test_corrupt_page` is provided.
pub const CAP_TEST_CORRUPT: u32 = 1 << 1;
/// Capability (1.1): `batch_exists_ctx`, `batch_get_ctx` and `batch_set_ctx` are provided.
pub const CAP_BATCH_CONTEXT: u32 = 1 << 2;
/// Capability (1.2): `clear` is provided (an instance supports it when its info has
/// [`INFO_CLEAR`]).
pub const CAP_CLEAR: u32 = 1 << 3;

/// Batch-context flag: `prefix_keys` / `prefix_count` are given (possibly 0 keys).
pub const CONTEXT_HAS_PREFIX: u32 = 1 << 0;
/// Batch-context flag: `extra_info` / `extra_info_len` are given.
pub const CONTEXT_HAS_EXTRA_INFO: u32 = 1 << 1;

/// Info flag: zero-copy.
pub const INFO_ZERO_COPY: u32 = 1 << 0;
/// Info flag: persistent.
pub const INFO_PERSISTENT: u32 = 1 << 1;
/// Info flag: shared between processes.
pub const INFO_SHARED: u32 = 1 << 2;
/// Info flag (1.2): the instance supports `clear`.
pub const INFO_CLEAR: u32 = 1 << 3;

/// Memory flag: page-locked with the GPU driver.
pub const MEMORY_CUDA_REGISTERED: u32 = 1 << 0;
/// Memory flag: huge pages.
pub const MEMORY_HUGE_PAGES: u32 = 1 << 1;

/// Log level: error.
pub const LOG_ERROR: i32 = 1;
/// Log level: warn.
pub const LOG_WARN: i32 = 2;
/// Log level: info.
pub const LOG_INFO: i32 = 3;
/// Log level: debug.
pub const LOG_DEBUG: i32 = 4;
/// Log level: trace.
pub const LOG_TRACE: i32 = 5;

/// Bytes of a key.
pub const KEY_LEN: usize = 48;
/// Bytes of the namespace id at the start of a key.
pub const NAMESPACE_LEN: usize = 16;

/// A page key: namespace id then page hash (`hicache_key`).
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Key {
    /// [`PageKey::to_bytes`].
    pub bytes: [u8; KEY_LEN],
}

impl From<&PageKey> for Key {
    fn from(k: &PageKey) -> Self {
        Self {
            bytes: k.to_bytes(),
        }
    }
}

impl From<&Key> for PageKey {
    fn from(k: &Key) -> Self {
        PageKey::from_bytes(&k.bytes)
    }
}

/// One contiguous part of a page (`hicache_iovec`).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct Iovec {
    /// Start of the part.
    pub base: *mut c_void,
    /// Bytes in the part.
    pub len: u64,
}

/// One page: parts and metadata (`hicache_page`).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct Page {
    /// `part_count` parts.
    pub parts: *const Iovec,
    /// Number of parts.
    pub part_count: u64,
    /// Total bytes.
    pub len: u64,
    /// Layout tag.
    pub layout: u32,
    /// Zero.
    pub reserved: u32,
}

/// A call's host-owned error buffer (`hicache_error`).
#[repr(C)]
#[derive(Debug)]
pub struct ErrorBuf {
    /// `capacity` bytes, `""` on entry.
    pub message: *mut c_char,
    /// Size of `message`.
    pub capacity: u64,
}

/// The context of one batch (`hicache_batch_context`, 1.1): the keys of the request's pages
/// before the batch and the engine's extra info, lent for the call.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct BatchContext {
    /// `size_of::<BatchContext>()` as the host compiled it.
    pub struct_size: u32,
    /// `CONTEXT_*` flags.
    pub flags: u32,
    /// `prefix_count` keys, root first (non-null when `prefix_count > 0`).
    pub prefix_keys: *const Key,
    /// Number of prefix keys.
    pub prefix_count: u64,
    /// UTF-8 text of `extra_info_len` bytes, not NUL-terminated (non-null when the length > 0).
    pub extra_info: *const c_char,
    /// Bytes of `extra_info`.
    pub extra_info_len: u64,
}

/// The host's log callback (`hicache_log_fn`).
pub type LogFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    level: i32,
    target: *const c_char,
    target_len: u64,
    message: *const c_char,
    message_len: u64,
);

/// What the host tells `create` (`hicache_host`).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct Host {
    /// `size_of::<Host>()` as the host compiled it.
    pub struct_size: u32,
    /// Host ABI major.
    pub abi_major: u32,
    /// Host ABI minor.
    pub abi_minor: u32,
    /// Most verbose level recorded (0 = none).
    pub max_log_level: i32,
    /// Log callback (never null in a valid host).
    pub log: Option<LogFn>,
    /// Its context.
    pub log_ctx: *mut c_void,
    /// Configured capacity; 0 = plugin default.
    pub capacity_bytes: u64,
    /// Page bytes; 0 = unknown.
    pub page_bytes: u64,
    /// Layout tag of the host pool.
    pub layout: u32,
    /// TP rank.
    pub tp_rank: u32,
    /// TP size.
    pub tp_size: u32,
    /// PP rank.
    pub pp_rank: u32,
    /// PP size.
    pub pp_size: u32,
    /// Whether `namespace_id` is set.
    pub has_namespace: u32,
    /// This rank's namespace id.
    pub namespace_id: [u8; NAMESPACE_LEN],
}

/// What an instance is (`hicache_plugin_info`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Info {
    /// Bytes the plugin may write.
    pub struct_size: u32,
    /// `INFO_*` flags.
    pub flags: u32,
    /// Largest batch (≥ 1).
    pub max_batch: u64,
    /// Largest page; 0 = no limit.
    pub max_page_bytes: u64,
    /// Capacity; 0 = unbounded.
    pub capacity_bytes: u64,
}

/// Counters (`hicache_stats`), as `StorageStats`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)] // one field per StorageStats counter of the same name
pub struct Stats {
    pub struct_size: u32,
    pub reserved: u32,
    pub pages: u64,
    pub bytes: u64,
    pub capacity_bytes: u64,
    pub exists_calls: u64,
    pub exists_keys: u64,
    pub exists_hits: u64,
    pub get_pages: u64,
    pub get_hits: u64,
    pub get_misses: u64,
    pub meta_mismatches: u64,
    pub get_corrupt: u64,
    pub get_errors: u64,
    pub get_bytes: u64,
    pub set_pages: u64,
    pub set_stored: u64,
    pub set_present: u64,
    pub set_errors: u64,
    pub set_bytes: u64,
    pub evicted_pages: u64,
    pub evicted_bytes: u64,
    pub deleted_pages: u64,
    pub discarded_on_open: u64,
    /// 1.2.
    pub cleared_pages: u64,
}

/// An instance, opaque (`hicache_plugin`).
#[repr(C)]
pub struct PluginHandle {
    _opaque: [u8; 0],
}

/// `create`.
pub type CreateFn = unsafe extern "C" fn(
    config_json: *const c_char,
    config_len: u64,
    host: *const Host,
    out: *mut *mut PluginHandle,
    err: *mut ErrorBuf,
) -> Status;
/// `destroy`.
pub type DestroyFn = unsafe extern "C" fn(plugin: *mut PluginHandle);
/// `get_info`.
pub type GetInfoFn =
    unsafe extern "C" fn(plugin: *mut PluginHandle, out: *mut Info, err: *mut ErrorBuf) -> Status;
/// `batch_exists`.
pub type BatchExistsFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    keys: *const Key,
    count: u64,
    present: *mut u64,
    err: *mut ErrorBuf,
) -> Status;
/// `batch_get`.
pub type BatchGetFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    keys: *const Key,
    pages: *const Page,
    count: u64,
    results: *mut PageResult,
    lengths: *mut u64,
    err: *mut ErrorBuf,
) -> Status;
/// `batch_set`.
pub type BatchSetFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    keys: *const Key,
    pages: *const Page,
    count: u64,
    results: *mut PageResult,
    err: *mut ErrorBuf,
) -> Status;
/// `batch_delete`.
pub type BatchDeleteFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    keys: *const Key,
    count: u64,
    removed: *mut u64,
    err: *mut ErrorBuf,
) -> Status;
/// `get_stats`.
pub type GetStatsFn =
    unsafe extern "C" fn(plugin: *mut PluginHandle, out: *mut Stats, err: *mut ErrorBuf) -> Status;
/// `register_memory`.
pub type RegisterMemoryFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    addr: *mut c_void,
    len: u64,
    flags: u32,
    err: *mut ErrorBuf,
) -> Status;
/// `test_corrupt_page`.
pub type TestCorruptFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    key: *const Key,
    found: *mut u32,
    err: *mut ErrorBuf,
) -> Status;
/// `batch_exists_ctx` (1.1).
pub type BatchExistsCtxFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    keys: *const Key,
    count: u64,
    ctx: *const BatchContext,
    present: *mut u64,
    err: *mut ErrorBuf,
) -> Status;
/// `batch_get_ctx` (1.1).
pub type BatchGetCtxFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    keys: *const Key,
    pages: *const Page,
    count: u64,
    ctx: *const BatchContext,
    results: *mut PageResult,
    lengths: *mut u64,
    err: *mut ErrorBuf,
) -> Status;
/// `batch_set_ctx` (1.1).
pub type BatchSetCtxFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    keys: *const Key,
    pages: *const Page,
    count: u64,
    ctx: *const BatchContext,
    results: *mut PageResult,
    err: *mut ErrorBuf,
) -> Status;
/// `clear` (1.2).
pub type ClearFn = unsafe extern "C" fn(
    plugin: *mut PluginHandle,
    namespace_id: *const [u8; NAMESPACE_LEN],
    removed: *mut u64,
    err: *mut ErrorBuf,
) -> Status;
/// The entry function.
pub type EntryFn = unsafe extern "C" fn() -> *const Vtable;

/// The first three fields every vtable of every version starts with.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct VtableHeader {
    /// ABI major.
    pub abi_major: u32,
    /// ABI minor.
    pub abi_minor: u32,
    /// Size of the plugin's vtable.
    pub struct_size: u32,
}

/// The plugin's functions (`hicache_plugin_vtable`). Function pointers are `Option` so that a
/// zeroed (absent) field reads as `None`.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct Vtable {
    /// ABI major the plugin was built against.
    pub abi_major: u32,
    /// ABI minor.
    pub abi_minor: u32,
    /// `size_of` the plugin's vtable.
    pub struct_size: u32,
    /// `CAP_*` bits.
    pub capabilities: u32,
    /// Static NUL-terminated name.
    pub name: *const c_char,
    /// Static NUL-terminated version.
    pub version: *const c_char,
    /// Required.
    pub create: Option<CreateFn>,
    /// Required.
    pub destroy: Option<DestroyFn>,
    /// Required.
    pub get_info: Option<GetInfoFn>,
    /// Required.
    pub batch_exists: Option<BatchExistsFn>,
    /// Required.
    pub batch_get: Option<BatchGetFn>,
    /// Required.
    pub batch_set: Option<BatchSetFn>,
    /// Required.
    pub batch_delete: Option<BatchDeleteFn>,
    /// Required.
    pub get_stats: Option<GetStatsFn>,
    /// With [`CAP_REGISTER_MEMORY`].
    pub register_memory: Option<RegisterMemoryFn>,
    /// With [`CAP_TEST_CORRUPT`].
    pub test_corrupt_page: Option<TestCorruptFn>,
    /// 1.1, with [`CAP_BATCH_CONTEXT`].
    pub batch_exists_ctx: Option<BatchExistsCtxFn>,
    /// 1.1, with [`CAP_BATCH_CONTEXT`].
    pub batch_get_ctx: Option<BatchGetCtxFn>,
    /// 1.1, with [`CAP_BATCH_CONTEXT`].
    pub batch_set_ctx: Option<BatchSetCtxFn>,
    /// 1.2, with [`CAP_CLEAR`].
    pub clear: Option<ClearFn>,
}

/// Size of the v1.0 vtable: the smallest `struct_size` this host accepts for major 1.
pub const VTABLE_V1_0_SIZE: usize = offset_of!(Vtable, test_corrupt_page) + size_of::<usize>();
/// Size of the v1.1 vtable (the batch-context entries): a plugin whose `struct_size` is
/// smaller does not have them, whatever its capability bits say.
pub const VTABLE_V1_1_SIZE: usize = offset_of!(Vtable, batch_set_ctx) + size_of::<usize>();
/// Size of the v1.2 vtable (the `clear` entry): a plugin whose `struct_size` is smaller does
/// not have it, whatever its capability bits say.
pub const VTABLE_V1_2_SIZE: usize = offset_of!(Vtable, clear) + size_of::<usize>();

/// A vtable in a `static`: raw pointers are not `Sync`, but the vtable and the strings it points
/// to are immutable static data, so sharing it between threads is sound.
#[repr(transparent)]
#[derive(Debug)]
pub struct StaticVtable(pub Vtable);

// SAFETY: the vtable's pointers are to immutable static strings and to functions; nothing is
// ever written through them, so concurrent reads from any thread are sound.
unsafe impl Sync for StaticVtable {}

/// The layout tag of a [`LayoutKind`] (`HICACHE_LAYOUT_*`).
pub fn layout_tag(l: LayoutKind) -> u32 {
    u32::from(l.tag())
}

/// The [`LayoutKind`] of a tag, if known.
pub fn layout_from_tag(tag: u32) -> Option<LayoutKind> {
    LayoutKind::ALL.into_iter().find(|l| layout_tag(*l) == tag)
}

/// `("sizeof(c_type)", size_of::<RustType>())`: one entry of [`layout_probe`].
macro_rules! size_entry {
    ($c:ident, $t:ty) => {
        (concat!("sizeof(", stringify!($c), ")"), size_of::<$t>())
    };
}

/// `("offsetof(c_type, field)", offset_of!(RustType, field))`: one entry of [`layout_probe`].
macro_rules! offset_entry {
    ($c:ident, $t:ty, $f:ident) => {
        (
            concat!("offsetof(", stringify!($c), ", ", stringify!($f), ")"),
            offset_of!($t, $f),
        )
    };
}

/// Sizes and offsets of every ABI struct, in the order `layout_probe.c` (in the
/// `hicache-plugin-tests` crate) lists them for the same header, so a test can compare the two.
pub fn layout_probe() -> Vec<(&'static str, usize)> {
    vec![
        size_entry!(hicache_key, Key),
        size_entry!(hicache_iovec, Iovec),
        offset_entry!(hicache_iovec, Iovec, len),
        size_entry!(hicache_page, Page),
        offset_entry!(hicache_page, Page, part_count),
        offset_entry!(hicache_page, Page, len),
        offset_entry!(hicache_page, Page, layout),
        size_entry!(hicache_error, ErrorBuf),
        offset_entry!(hicache_error, ErrorBuf, capacity),
        size_entry!(hicache_host, Host),
        offset_entry!(hicache_host, Host, max_log_level),
        offset_entry!(hicache_host, Host, log),
        offset_entry!(hicache_host, Host, log_ctx),
        offset_entry!(hicache_host, Host, capacity_bytes),
        offset_entry!(hicache_host, Host, page_bytes),
        offset_entry!(hicache_host, Host, layout),
        offset_entry!(hicache_host, Host, pp_size),
        offset_entry!(hicache_host, Host, has_namespace),
        offset_entry!(hicache_host, Host, namespace_id),
        size_entry!(hicache_plugin_info, Info),
        offset_entry!(hicache_plugin_info, Info, max_batch),
        offset_entry!(hicache_plugin_info, Info, capacity_bytes),
        size_entry!(hicache_stats, Stats),
        offset_entry!(hicache_stats, Stats, pages),
        offset_entry!(hicache_stats, Stats, meta_mismatches),
        offset_entry!(hicache_stats, Stats, discarded_on_open),
        size_entry!(hicache_plugin_vtable, Vtable),
        offset_entry!(hicache_plugin_vtable, Vtable, struct_size),
        offset_entry!(hicache_plugin_vtable, Vtable, name),
        offset_entry!(hicache_plugin_vtable, Vtable, create),
        offset_entry!(hicache_plugin_vtable, Vtable, destroy),
        offset_entry!(hicache_plugin_vtable, Vtable, get_info),
        offset_entry!(hicache_plugin_vtable, Vtable, batch_exists),
        offset_entry!(hicache_plugin_vtable, Vtable, batch_get),
        offset_entry!(hicache_plugin_vtable, Vtable, batch_set),
        offset_entry!(hicache_plugin_vtable, Vtable, batch_delete),
        offset_entry!(hicache_plugin_vtable, Vtable, get_stats),
        offset_entry!(hicache_plugin_vtable, Vtable, register_memory),
        offset_entry!(hicache_plugin_vtable, Vtable, test_corrupt_page),
        offset_entry!(hicache_plugin_vtable, Vtable, batch_exists_ctx),
        offset_entry!(hicache_plugin_vtable, Vtable, batch_get_ctx),
        offset_entry!(hicache_plugin_vtable, Vtable, batch_set_ctx),
        offset_entry!(hicache_plugin_vtable, Vtable, clear),
        ("HICACHE_VTABLE_V1_0_SIZE", VTABLE_V1_0_SIZE),
        ("HICACHE_VTABLE_V1_1_SIZE", VTABLE_V1_1_SIZE),
        ("HICACHE_VTABLE_V1_2_SIZE", VTABLE_V1_2_SIZE),
        offset_entry!(hicache_stats, Stats, cleared_pages),
        size_entry!(hicache_batch_context, BatchContext),
        offset_entry!(hicache_batch_context, BatchContext, prefix_keys),
        offset_entry!(hicache_batch_context, BatchContext, prefix_count),
        offset_entry!(hicache_batch_context, BatchContext, extra_info),
        offset_entry!(hicache_batch_context, BatchContext, extra_info_len),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_round_trip_through_tags() {
        for l in LayoutKind::ALL {
            assert_eq!(layout_from_tag(layout_tag(l)), Some(l));
        }
        assert_eq!(layout_from_tag(0), None);
        assert_eq!(layout_from_tag(99), None);
    }

    #[test]
    fn keys_are_the_48_byte_form() {
        let k = hicache_storage::pattern::page_key(hicache_storage::pattern::namespace(3), 1, 2);
        let c = Key::from(&k);
        assert_eq!(PageKey::from(&c), k);
        assert_eq!(size_of::<Key>(), KEY_LEN);
    }

    #[test]
    fn header_fields_are_the_prefix_of_every_vtable() {
        assert_eq!(
            offset_of!(Vtable, abi_major),
            offset_of!(VtableHeader, abi_major)
        );
        assert_eq!(
            offset_of!(Vtable, abi_minor),
            offset_of!(VtableHeader, abi_minor)
        );
        assert_eq!(
            offset_of!(Vtable, struct_size),
            offset_of!(VtableHeader, struct_size)
        );
        assert_eq!(
            VTABLE_V1_2_SIZE,
            size_of::<Vtable>(),
            "v1.2 is this host's vtable"
        );
        assert_eq!(VTABLE_V1_0_SIZE + 3 * size_of::<usize>(), VTABLE_V1_1_SIZE);
        assert_eq!(VTABLE_V1_1_SIZE + size_of::<usize>(), VTABLE_V1_2_SIZE);
    }
}
