//! [`PluginError`]: what can go wrong loading a plugin or talking to it. Each variant names the
//! library (path and, once known, the plugin's own name) so a log line alone finds the cause.
//! At the [`Storage`](hicache_storage::Storage) boundary it becomes a
//! [`StorageError`] (see the `From` impl).

use std::path::PathBuf;

use hicache_storage::StorageError;
use thiserror::Error;

use crate::abi;

/// Why loading, creating or calling a plugin failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PluginError {
    /// The configured path does not exist.
    #[error("plugin {path}: no such file")]
    NotFound {
        /// The configured path.
        path: PathBuf,
    },
    /// The file is not an ELF shared object (checked before the dynamic loader sees it): what
    /// it is instead (empty, text, an executable, another architecture …).
    #[error(
        "plugin {path}: refused: {what}; a plugin must be an ELF shared object (.so) built for \
         this machine"
    )]
    NotSharedObject {
        /// The configured path.
        path: PathBuf,
        /// What the file is, from its first bytes.
        what: String,
    },
    /// The dynamic loader refused the file (not a shared object, wrong architecture, missing
    /// dependencies, …).
    #[error("plugin {path}: cannot load the shared library: {reason}")]
    Load {
        /// The configured path.
        path: PathBuf,
        /// The dynamic loader's message.
        reason: String,
    },
    /// The library does not export the entry symbol: it is not a hicache storage plugin.
    #[error(
        "plugin {path}: not a hicache storage plugin: the entry symbol `{symbol}` is missing ({reason})"
    )]
    MissingEntry {
        /// The configured path.
        path: PathBuf,
        /// The symbol looked for.
        symbol: &'static str,
        /// The dynamic loader's message.
        reason: String,
    },
    /// The entry function returned a null vtable.
    #[error("plugin {path}: the entry function returned a null vtable")]
    NullVtable {
        /// The configured path.
        path: PathBuf,
    },
    /// The plugin was built for another ABI major version.
    #[error(
        "plugin {path}: ABI major version mismatch: the plugin was built for {plugin_major}.{plugin_minor}, this host speaks {host_major}.x (rebuild the plugin against the host's hicache_storage.h)"
    )]
    AbiMismatch {
        /// The configured path.
        path: PathBuf,
        /// The plugin's major version.
        plugin_major: u32,
        /// The plugin's minor version.
        plugin_minor: u32,
        /// The host's major version.
        host_major: u32,
    },
    /// The plugin's vtable is smaller than the v1.0 vtable.
    #[error(
        "plugin {path}: vtable struct_size {size} is smaller than the {min} bytes of a v{major}.0 vtable"
    )]
    VtableTooSmall {
        /// The configured path.
        path: PathBuf,
        /// The plugin's `struct_size`.
        size: u32,
        /// The smallest accepted size.
        min: usize,
        /// The ABI major version.
        major: u32,
    },
    /// A required function (or one a capability flag promises) is null, or a required string
    /// is missing.
    #[error("plugin {path}: invalid vtable: {what}")]
    InvalidVtable {
        /// The configured path.
        path: PathBuf,
        /// What is wrong (`batch_get is NULL`, …).
        what: String,
    },
    /// `create` failed; `message` is the plugin's error text.
    #[error("plugin `{plugin}` ({path}): create failed with {status_name} ({status}): {message}")]
    Create {
        /// The plugin's name.
        plugin: String,
        /// The configured path.
        path: PathBuf,
        /// The status returned.
        status: i32,
        /// The header's name of that status.
        status_name: &'static str,
        /// The plugin's error text (or a note that it gave none).
        message: String,
    },
    /// A call failed (a non-OK status) with the plugin's error text.
    #[error("plugin `{plugin}`: {op} failed with {status_name} ({status}): {message}")]
    Call {
        /// The plugin's name.
        plugin: String,
        /// The function called.
        op: &'static str,
        /// The status returned.
        status: i32,
        /// The header's name of that status.
        status_name: &'static str,
        /// The plugin's error text.
        message: String,
    },
    /// The plugin broke the ABI's rules in what it returned (a count past the batch, a
    /// `max_batch` of 0, …). The value is not used.
    #[error("plugin `{plugin}`: {op} returned invalid data: {detail}")]
    Protocol {
        /// The plugin's name.
        plugin: String,
        /// The function called.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The plugin does not provide an optional function.
    #[error("plugin `{plugin}` does not support {op}")]
    Unsupported {
        /// The plugin's name.
        plugin: String,
        /// The function.
        op: &'static str,
    },
}

impl PluginError {
    /// A [`PluginError::Call`] for `status` and the plugin's message (the loader's calls).
    #[cfg(feature = "loader")]
    pub(crate) fn call(plugin: &str, op: &'static str, status: i32, message: String) -> Self {
        PluginError::Call {
            plugin: plugin.to_string(),
            op,
            status,
            status_name: abi::status_name(status),
            message,
        }
    }
}

impl From<PluginError> for StorageError {
    fn from(e: PluginError) -> Self {
        match &e {
            PluginError::Call {
                plugin,
                status: abi::ERR_UNAVAILABLE,
                ..
            } => StorageError::Unavailable {
                backend: format!("plugin {plugin}"),
                reason: e.to_string(),
            },
            _ => StorageError::backend_caused(crate::NAME, "", e),
        }
    }
}
