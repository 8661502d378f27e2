//! The Rust SDK for plugin authors (feature `sdk`): implement [`Plugin`] for a type naming your
//! [`Storage`] backend and how to open it, then write `export_plugin!(MyPlugin);` in a
//! `cdylib` crate. The result is a shared library any hicache-rs host loads with
//! `{"backend": "plugin", "plugin_path": "…/libmy_plugin.so", "plugin_config": {…}}`.
//!
//! ```ignore
//! use std::ffi::CStr;
//! use hicache_backend_plugin::sdk::{OpenArgs, Plugin};
//! use hicache_storage::{MemoryBackend, MemoryOptions, PageKey, Result};
//!
//! pub struct MemoryPlugin;
//!
//! impl Plugin for MemoryPlugin {
//!     type Backend = MemoryBackend;
//!     const NAME: &'static CStr = c"example-memory";
//!     const VERSION: &'static CStr = c"0.1.0";
//!     async fn open(args: OpenArgs) -> Result<MemoryBackend> {
//!         Ok(MemoryBackend::new(MemoryOptions::from_config(&args.common, args.fields)?))
//!     }
//! }
//!
//! hicache_backend_plugin::export_plugin!(MemoryPlugin);
//! ```
//!
//! What the SDK does at the boundary (so the plugin author does not have to):
//! 1. **No unwinding.** Every exported function runs its body under `catch_unwind`; a panic
//!    becomes `HICACHE_ERR_PANIC` with the panic message in the error buffer. (This needs the
//!    default `panic = "unwind"`; with `panic = "abort"` a panic aborts the host process.)
//! 2. **Validation.** Null pointers, unknown layout tags and iovecs that do not add up to the
//!    page length are `HICACHE_ERR_INVALID_ARGUMENT`, never undefined behaviour.
//! 3. **Async.** `Storage` methods are `async`; the SDK drives them to completion with the
//!    plugin's own multi-threaded tokio runtime (two workers, created on the first `create`,
//!    named `hicache-plugin`). The host's runtime is not reachable from a plugin (its own
//!    statics), so backends that spawn tasks or use tokio I/O get this one.
//! 4. **Logging.** `tracing` events of the backend are forwarded to the host's log callback
//!    (see [`log`](self::log)'s invariants); the host re-emits them under the target
//!    `hicache_plugin`.
//! 5. **Configuration.** `plugin_config` reaches [`Plugin::open`] as [`ConfigFields`] (strict,
//!    typed accessors; call [`ConfigFields::finish`]), the common `capacity` in
//!    [`OpenArgs::common`], the deployment in [`OpenArgs::context`].
//! 6. **Capabilities.** The batch-context entries (1.1) and `clear` (1.2) are exported for
//!    every plugin; `get_info` reports `HICACHE_INFO_CLEAR` when the backend's
//!    [`BackendInfo::clear`](hicache_storage::BackendInfo::clear) is set, so the host calls
//!    `clear` only on instances that support it.

mod ffi;
mod log;

use std::ffi::CStr;
use std::future::Future;

use hicache_core::PageKey;
use hicache_storage::{BackendContext, CommonConfig, ConfigFields, Result, Storage, StorageError};

use crate::abi::{self, StaticVtable, Vtable};

/// What [`Plugin::open`] receives from the host's `create` call.
#[derive(Debug)]
pub struct OpenArgs {
    /// The plugin's own configuration (`plugin_config`), scoped
    /// `plugin <name> plugin_config` in errors. Read it with the typed accessors, then
    /// [`finish`](ConfigFields::finish) it so unknown fields are refused.
    pub fields: ConfigFields,
    /// HiCache-level fields the host passes on: `capacity_bytes` (the extra-config's
    /// `capacity`, `None` if not set); the others keep their defaults.
    pub common: CommonConfig,
    /// The deployment (page bytes, layout, TP/PP rank and size, namespace).
    pub context: BackendContext,
    /// The host's ABI version (major, minor).
    pub host_abi: (u32, u32),
}

/// A storage backend exported as a plugin. Implement it, then invoke
/// [`export_plugin!`](crate::export_plugin) with the type.
pub trait Plugin: 'static {
    /// The backend an instance wraps.
    type Backend: Storage;

    /// The plugin's name, reported to the host (logs, errors).
    const NAME: &'static CStr;

    /// The plugin's version string.
    const VERSION: &'static CStr;

    /// Whether [`corrupt_page`](Self::corrupt_page) is implemented (exported as the test-only
    /// capability `HICACHE_CAP_TEST_CORRUPT`, which the conformance suite's corruption case
    /// needs).
    const TEST_CORRUPT: bool = false;

    /// Opens a backend. Runs on the plugin's runtime; errors reach the host's `create` caller
    /// with their text (`StorageError::Config` as `HICACHE_ERR_CONFIG`).
    fn open(args: OpenArgs) -> impl Future<Output = Result<Self::Backend>> + Send;

    /// Test hook: damages the stored bytes of `key` without fixing its checksum, as a fault
    /// would; `Ok(false)` if absent. Only called when [`TEST_CORRUPT`](Self::TEST_CORRUPT).
    fn corrupt_page(backend: &Self::Backend, key: &PageKey) -> Result<bool> {
        let _ = (backend, key);
        Err(StorageError::backend(
            Self::NAME.to_string_lossy(),
            "test_corrupt_page is not supported",
        ))
    }
}

/// The vtable of plugin `P` (what [`export_plugin!`](crate::export_plugin) exports).
pub const fn vtable<P: Plugin>() -> StaticVtable {
    StaticVtable(Vtable {
        abi_major: abi::ABI_MAJOR,
        abi_minor: abi::ABI_MINOR,
        struct_size: std::mem::size_of::<Vtable>() as u32,
        capabilities: abi::CAP_REGISTER_MEMORY
            | abi::CAP_BATCH_CONTEXT
            | abi::CAP_CLEAR
            | if P::TEST_CORRUPT {
                abi::CAP_TEST_CORRUPT
            } else {
                0
            },
        name: P::NAME.as_ptr(),
        version: P::VERSION.as_ptr(),
        create: Some(ffi::create::<P> as abi::CreateFn),
        destroy: Some(ffi::destroy::<P> as abi::DestroyFn),
        get_info: Some(ffi::get_info::<P> as abi::GetInfoFn),
        batch_exists: Some(ffi::batch_exists::<P> as abi::BatchExistsFn),
        batch_get: Some(ffi::batch_get::<P> as abi::BatchGetFn),
        batch_set: Some(ffi::batch_set::<P> as abi::BatchSetFn),
        batch_delete: Some(ffi::batch_delete::<P> as abi::BatchDeleteFn),
        get_stats: Some(ffi::get_stats::<P> as abi::GetStatsFn),
        register_memory: Some(ffi::register_memory::<P> as abi::RegisterMemoryFn),
        test_corrupt_page: if P::TEST_CORRUPT {
            Some(ffi::test_corrupt_page::<P> as abi::TestCorruptFn)
        } else {
            None
        },
        batch_exists_ctx: Some(ffi::batch_exists_ctx::<P> as abi::BatchExistsCtxFn),
        batch_get_ctx: Some(ffi::batch_get_ctx::<P> as abi::BatchGetCtxFn),
        batch_set_ctx: Some(ffi::batch_set_ctx::<P> as abi::BatchSetCtxFn),
        // Exported for every plugin; an instance whose backend clears says so with
        // HICACHE_INFO_CLEAR (get_info), and one that does not answers HICACHE_ERR_UNSUPPORTED.
        clear: Some(ffi::clear::<P> as abi::ClearFn),
    })
}

/// Exports a [`Plugin`] implementation as the library's entry symbol
/// (`hicache_storage_plugin`). Use it once, in a `cdylib` crate:
/// `hicache_backend_plugin::export_plugin!(MyPlugin);`
#[macro_export]
macro_rules! export_plugin {
    ($plugin:ty) => {
        /// The hicache storage plugin entry point (see `hicache_storage.h`).
        #[unsafe(no_mangle)]
        pub extern "C" fn hicache_storage_plugin() -> *const $crate::abi::Vtable {
            static VTABLE: $crate::abi::StaticVtable = $crate::sdk::vtable::<$plugin>();
            &VTABLE.0
        }
    };
}
