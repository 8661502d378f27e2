//! `hicache storage-clear`: opens a backend's storage and removes every page of one
//! namespace with [`Storage::clear`](hicache_storage::Storage::clear), printing a JSON line
//! `{"backend": …, "namespace": …, "removed": N}`. Pages of other namespaces and files that are
//! not the backend's are never touched. A backend without the capability is an error naming it
//! (exit 1); a malformed namespace is a usage error (exit 2).

use std::io::Write;

use clap::Args;
use hicache_core::NamespaceId;
use hicache_storage::pattern;
use serde::Serialize;

use crate::backend::{BackendArgs, runtime};
use crate::error::{CliError, Result};

/// Arguments of `storage-clear`.
#[derive(Debug, Args)]
pub struct StorageClearArgs {
    /// Backend selection.
    #[command(flatten)]
    pub backend: BackendArgs,
    /// The namespace to clear: its 32 hex digits (a `PageKey`'s first 16 bytes, as the cache
    /// logs and the file backend's page names show). Default: the namespace of the
    /// `storage-write` / `storage-check` tools.
    #[arg(long)]
    pub namespace: Option<String>,
}

/// The JSON summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClearSummary {
    /// The backend's name.
    pub backend: String,
    /// The namespace cleared, as hex.
    pub namespace: String,
    /// Pages removed.
    pub removed: u64,
}

/// Parses the `--namespace` value (default: the tools' namespace).
fn namespace(arg: Option<&str>) -> Result<NamespaceId> {
    match arg {
        None => Ok(pattern::namespace(0)),
        Some(s) => NamespaceId::from_hex(s.trim())
            .map_err(|e| CliError::Usage(format!("--namespace {s:?}: {e}"))),
    }
}

/// Runs `storage-clear`, printing the JSON summary to `out`.
pub fn run(args: &StorageClearArgs, mut out: impl Write) -> Result<ClearSummary> {
    let ns = namespace(args.namespace.as_deref())?;
    let rt = runtime()?;
    let summary = rt.block_on(async {
        // The page size only matters to backends that check a capacity against it.
        let storage = args.backend.open(&[], 4096).await?;
        let removed = storage.clear(ns).await?;
        Ok::<_, CliError>(ClearSummary {
            backend: storage.info().name,
            namespace: ns.to_hex(),
            removed,
        })
    })?;
    writeln!(
        out,
        "{}",
        serde_json::to_string(&summary).expect("a summary of strings and numbers serialises")
    )
    .map_err(CliError::io("<stdout>"))?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_argument() {
        assert_eq!(namespace(None).unwrap(), pattern::namespace(0));
        let n = pattern::namespace(3);
        assert_eq!(namespace(Some(&n.to_hex())).unwrap(), n);
        let e = namespace(Some("xyz")).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("--namespace"), "{e}");
        assert!(namespace(Some(&n.to_hex()[..10])).is_err());
    }
}
