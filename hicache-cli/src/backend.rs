//! What the storage subcommands share: choosing and opening a backend from `--backend`,
//! `--dir` and `--extra-config` (any backend of the facade's registry,
//! [`hicache::backends::builtin_registry`]), the page keys of a seed, and page-aligned buffers.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use hicache_core::{LayoutKind, PageKey};
use hicache_storage::{BackendContext, Storage, StorageConfig, pattern};
use memmap2::MmapMut;
use serde_json::Value;

use crate::error::{CliError, Result};

/// The layout tag the tools store pages with.
pub const LAYOUT: LayoutKind = LayoutKind::PageFirst;

/// Backend selection, shared by `storage`, `storage-write` and `storage-check`.
#[derive(Debug, Clone, Args)]
pub struct BackendArgs {
    /// Storage backend (any compiled in: see the error of an unknown name for the list).
    #[arg(long, default_value = "file")]
    pub backend: String,
    /// Directory of a file-system backend (passed as the extra-config field `dir`).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Backend extra-config: JSON object, or `@path` to a JSON file.
    #[arg(long)]
    pub extra_config: Option<String>,
}

impl BackendArgs {
    /// The configuration: the extra-config with `dir` (from `--dir`) and any `overrides` set
    /// where the document does not set them.
    pub fn config(&self, overrides: &[(&str, Value)]) -> Result<StorageConfig> {
        let mut doc = match self.extra_config.as_deref().map(str::trim) {
            None | Some("") => serde_json::Map::new(),
            Some(s) => {
                let text = match s.strip_prefix('@') {
                    Some(p) => hicache_storage::read_config_file(std::path::Path::new(p))
                        .map_err(|e| CliError::Usage(format!("--extra-config: {e}")))?,
                    None => s.to_string(),
                };
                match serde_json::from_str::<Value>(&text) {
                    Ok(Value::Object(m)) => m,
                    Ok(_) => {
                        return Err(CliError::Usage(
                            "--extra-config must be a JSON object".into(),
                        ));
                    }
                    Err(e) => return Err(CliError::Usage(format!("--extra-config: {e}"))),
                }
            }
        };
        if let Some(d) = &self.dir {
            doc.entry("dir")
                .or_insert_with(|| Value::String(d.display().to_string()));
        }
        for (k, v) in overrides {
            doc.entry(k.to_string()).or_insert_with(|| v.clone());
        }
        Ok(StorageConfig::from_value(
            Some(&self.backend),
            Value::Object(doc),
            "--extra-config",
        )?)
    }

    /// Opens the backend.
    pub async fn open(
        &self,
        overrides: &[(&str, Value)],
        page_bytes: usize,
    ) -> Result<Arc<dyn Storage>> {
        let config = self.config(overrides)?;
        let ctx = BackendContext {
            page_bytes,
            layout: LAYOUT,
            ..BackendContext::default()
        };
        Ok(hicache::backends::builtin_registry()?
            .open(&config, &ctx)
            .await?)
    }
}

/// The key of page `index` of `seed` (namespace 0): a hash of (seed, index).
pub fn seed_key(seed: u64, index: u64) -> PageKey {
    pattern::page_key(pattern::namespace(0), seed, index)
}

/// A page-aligned region of `pages` pages of `page_bytes` each (as the pinned host pool is),
/// so backends can use their zero-copy paths.
pub fn aligned_region(pages: usize, page_bytes: usize) -> Result<MmapMut> {
    let len = pages.checked_mul(page_bytes).ok_or_else(|| {
        CliError::Usage(format!(
            "--page-bytes {page_bytes} is too large: {pages} pages of it overflow a {}-bit \
             byte count",
            usize::BITS
        ))
    })?;
    MmapMut::map_anon(len.max(1)).map_err(|e| {
        CliError::Usage(format!(
            "cannot map {pages} pages of {page_bytes} bytes: {e}"
        ))
    })
}

/// A multi-threaded tokio runtime for the storage commands.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::Usage(format!("cannot start a tokio runtime: {e}")))
}
