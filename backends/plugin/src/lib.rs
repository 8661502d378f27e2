//! # hicache-backend-plugin
//!
//! L3 storage backends written by anyone, in any language, loaded from a shared library named
//! in the extra-config:
//!
//! ```json
//! {"backend": "plugin", "plugin_path": "/opt/x/libfoo.so", "plugin_config": {"…": "…"}}
//! ```
//!
//! - **The ABI** is `include/hicache_storage.h`: one exported entry symbol returning a
//!   versioned vtable (ABI major/minor, struct size, capability flags), `create` from JSON plus
//!   a host log callback, `destroy`, batch exists / get / set / delete over caller-owned
//!   `(ptr, len)` iovecs with per-page result codes, info, stats, optional memory registration
//!   and a test-only corruption hook. [`abi`] mirrors it in Rust. `docs/plugin-abi.md` explains
//!   the rules with worked examples.
//! - **The loader** (feature `loader`, default): [`PluginLibrary::load`] checks the library and
//!   its ABI version, [`PluginStorage`] is one instance used as a
//!   [`Storage`](hicache_storage::Storage) that trusts nothing coming back, and
//!   [`PluginFactory`] registers it as `plugin` ([`register`]). [`conformance::PluginHarness`]
//!   runs `hicache_storage::conformance` on any plugin through the loader.
//! - **The SDK** (feature `sdk`): implement [`sdk::Plugin`] for your backend and write
//!   [`export_plugin!`]`(MyPlugin);` in a `cdylib` crate.
//!
//! ## The rules in brief (the header has them in full)
//!
//! - *Versioning*: another major version is refused; a newer minor is used through the common
//!   prefix of the vtable; fields beyond an older plugin's `struct_size` are absent.
//! - *Ownership*: nothing allocated on one side is freed by the other; the instance is made by
//!   `create` and freed by `destroy`, once. Error text is copied into a host-owned buffer per
//!   call. The host never unloads a library, so the plugin's static data lives forever.
//! - *Threading*: calls are synchronous and may block; all but `create`/`destroy` may run
//!   concurrently on one instance. The loader runs them in tokio blocking sections.
//! - *No unwinding* across the boundary, in either direction; the SDK catches panics.
//!
//! ```no_run
//! # #[tokio::main(flavor = "multi_thread")] async fn main() -> hicache_storage::Result<()> {
//! use hicache_storage::{BackendContext, Registry, StorageConfig};
//! let registry = Registry::with_builtins();
//! hicache_backend_plugin::register(&registry)?;
//! let config = StorageConfig::parse(
//!     Some("dynamic"),
//!     Some(r#"{"backend": "plugin", "plugin_path": "/opt/x/libfoo.so", "plugin_config": {}}"#),
//! )?;
//! let storage = registry.open(&config, &BackendContext::default()).await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod abi;
#[cfg(feature = "loader")]
pub mod conformance;
#[cfg(feature = "loader")]
mod elf;
mod error;
#[cfg(feature = "loader")]
mod factory;
#[cfg(feature = "loader")]
mod host_log;
#[cfg(feature = "loader")]
mod library;
#[cfg(feature = "sdk")]
pub mod sdk;
#[cfg(feature = "loader")]
mod storage;

#[cfg(feature = "loader")]
pub use error::PluginError;
#[cfg(feature = "loader")]
pub use factory::{PluginFactory, parse_fields, register};
#[cfg(feature = "loader")]
pub use library::PluginLibrary;
#[cfg(feature = "loader")]
pub use storage::{HostParams, PluginStorage};

/// The registry name of the plugin backend (also the `name` in its
/// [`BackendInfo`](hicache_storage::BackendInfo); the plugin's own name is
/// [`PluginLibrary::name`]).
pub const NAME: &str = "plugin";
