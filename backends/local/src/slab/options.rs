//! [`UringOptions`]: the uring backend's extra-config fields, parsed strictly.

use std::path::PathBuf;
use std::time::Duration;

use hicache_storage::{
    CommonConfig, ConfigFields, EvictionPolicy, Result, StorageError, Watermarks,
};

use crate::common::SharedFields;

/// When written pages are made durable before `Stored` is returned (shared with the file
/// layout). Here: `none` never syncs (a power loss may lose acknowledged pages); `batch`
/// (default) syncs each slab a commit group wrote once, then appends and syncs the group's
/// index records; `always` writes each page with `RWF_DSYNC` (FUA on NVMe) and syncs index
/// appends, deletes too.
pub use crate::io::{FsyncPolicy, IoEngine};

/// Largest `grow_bytes` the configuration accepts (1 TiB); at open it is also bounded by the
/// file system ([`UringBackend::open`](crate::slab::UringBackend::open)).
pub const MAX_GROW_BYTES: u64 = 1 << 40;

/// Default `grow_bytes`: 256 MiB.
pub const DEFAULT_GROW_BYTES: u64 = 256 << 20;

/// Options of a [`UringBackend`](crate::slab::UringBackend).
#[derive(Clone, Debug, PartialEq)]
pub struct UringOptions {
    /// The storage directory (`dir`, required), on the NVMe to use.
    pub dir: PathBuf,
    /// Capacity in bytes of slab slots (common field `capacity`). `None`: 90% of what the
    /// slabs hold plus the file system's free space, measured at open.
    pub capacity_bytes: Option<u64>,
    /// Durability of acknowledged pages (`fsync`: `none` | `batch` | `always`, default
    /// `batch`).
    pub fsync: FsyncPolicy,
    /// Eviction order (`eviction`: `lru` | `fifo`, default `lru`).
    pub eviction: EvictionPolicy,
    /// Requests in flight at once (`queue_depth`, 1–4096, default 64; the threads engine
    /// runs at most 32 at once).
    pub queue_depth: u32,
    /// Which driver issues the slab I/O (`io_engine`: `auto` | `uring` | `threads`, default
    /// `auto`): `auto` probes io_uring at open and falls back to the threads engine where the
    /// kernel refuses it; `uring` fails to open there instead.
    pub io_engine: IoEngine,
    /// Largest batch accepted (`max_batch`, 128–4096, default 256).
    pub max_batch: usize,
    /// Register the memory announced by `register_memory` as io_uring fixed buffers
    /// (`fixed_buffers`, default true).
    pub fixed_buffers: bool,
    /// Register slab files with the ring (`fixed_files`, default true).
    pub fixed_files: bool,
    /// Step by which a slab file grows (`grow_bytes`, default 256 MiB, 4096 to 1 TiB, and at
    /// open at most the larger of the default and a quarter of the file system's size; one
    /// growth also takes at most half of the free space).
    pub grow_bytes: u64,
    /// The deployment's page size (`page_bytes`): its slab is created at open. Default: the
    /// engine's page size when it passes one, else none (slabs appear with their first page).
    pub page_bytes: Option<u64>,
    /// Open for inspection only (`read_only`, default false): nothing in the directory is
    /// created, modified or deleted (no lock written, no log repaired, no slab created or
    /// punched); what a read-write open would discard is counted and reported; writes are
    /// refused.
    pub read_only: bool,
    /// Background eviction between two fill levels (`high_watermark`, `low_watermark`,
    /// fractions of the capacity; default none). See [`hicache_storage::lifecycle`].
    pub watermarks: Option<Watermarks>,
    /// Pages expire this long after their write (`ttl_s`, whole seconds, at least 1; default
    /// never): an expired page is a miss, a set rewrites it, the reclaim thread deletes it.
    pub ttl: Option<Duration>,
}

impl UringOptions {
    /// Options for `dir` with every default.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            capacity_bytes: None,
            fsync: FsyncPolicy::Batch,
            eviction: EvictionPolicy::Lru,
            queue_depth: 64,
            io_engine: IoEngine::Auto,
            max_batch: 256,
            fixed_buffers: true,
            fixed_files: true,
            grow_bytes: DEFAULT_GROW_BYTES,
            page_bytes: None,
            read_only: false,
            watermarks: None,
            ttl: None,
        }
    }

    /// Reads the options from the common config and the backend's fields (strict: unknown
    /// fields, wrong types and out-of-range values are errors naming the field).
    pub fn from_config(common: &CommonConfig, mut f: ConfigFields) -> Result<Self> {
        let c = SharedFields::take(
            &mut f,
            "the directory (on the NVMe device) to store pages in",
        )?;
        let d = Self::new(c.dir);
        let o = Self {
            fsync: c.fsync,
            eviction: c.eviction,
            queue_depth: f.u64("queue_depth", d.queue_depth as u64, 1..=4096)? as u32,
            io_engine: c.io_engine,
            max_batch: c.max_batch,
            fixed_buffers: f.bool("fixed_buffers", d.fixed_buffers)?,
            fixed_files: f.bool("fixed_files", d.fixed_files)?,
            grow_bytes: match f.opt_bytes("grow_bytes", 4096)? {
                Some(g) if g > MAX_GROW_BYTES => {
                    return Err(StorageError::config(
                        f.scope(),
                        "grow_bytes",
                        g.to_string(),
                        format!(
                            "must be at most {MAX_GROW_BYTES} bytes (1 TiB): a slab grows by \
                             this much at once"
                        ),
                    ));
                }
                g => g.unwrap_or(d.grow_bytes),
            },
            page_bytes: f.opt_bytes("page_bytes", 1)?,
            read_only: c.read_only,
            watermarks: c.lifecycle.watermarks,
            ttl: c.lifecycle.ttl,
            capacity_bytes: common.capacity_bytes,
            dir: d.dir,
        };
        f.finish()?;
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use hicache_storage::{EvictionPolicy, Result};

    use super::{FsyncPolicy, IoEngine, UringOptions};

    /// `extra` parsed as the uring backend's extra-config.
    fn parse(extra: &str) -> Result<UringOptions> {
        crate::common::parse_options("uring", extra, UringOptions::from_config)
    }

    #[test]
    fn every_field() {
        let o = parse(
            r#"{"dir": "/d", "capacity": "2GiB", "fsync": "always", "eviction": "fifo",
                "queue_depth": 256, "max_batch": 512, "fixed_buffers": false,
                "fixed_files": false, "grow_bytes": "64MiB", "page_bytes": 262144,
                "read_only": true, "ttl_s": 60, "io_engine": "threads"}"#,
        )
        .unwrap();
        assert_eq!(o.capacity_bytes, Some(2 << 30));
        assert_eq!(o.fsync, FsyncPolicy::Always);
        assert_eq!(o.eviction, EvictionPolicy::Fifo);
        assert_eq!((o.queue_depth, o.max_batch), (256, 512));
        assert!(!o.fixed_buffers && !o.fixed_files);
        assert_eq!(o.grow_bytes, 64 << 20);
        assert_eq!(o.page_bytes, Some(262_144));
        assert!(o.read_only);
        assert_eq!(o.ttl, Some(Duration::from_secs(60)));
        assert_eq!(o.io_engine, IoEngine::Threads);
        let e = parse(r#"{"dir": "/d", "io_engine": "aio"}"#).unwrap_err();
        assert!(e.to_string().contains("io_engine"), "{e}");
    }

    #[test]
    fn every_own_error_names_its_field() {
        for (extra, field) in [
            (r#"{"dir": "/d", "queue_depth": 0}"#, "queue_depth"),
            (r#"{"dir": "/d", "queue_depth": 5000}"#, "queue_depth"),
            (r#"{"dir": "/d", "queue_depth": "8"}"#, "queue_depth"),
            (r#"{"dir": "/d", "fixed_buffers": "yes"}"#, "fixed_buffers"),
            (r#"{"dir": "/d", "fixed_files": 1}"#, "fixed_files"),
            (r#"{"dir": "/d", "grow_bytes": 100}"#, "grow_bytes"),
            (r#"{"dir": "/d", "grow_bytes": "lots"}"#, "grow_bytes"),
            (
                r#"{"dir": "/d", "grow_bytes": 18446744073709551615}"#,
                "grow_bytes",
            ),
            (r#"{"dir": "/d", "grow_bytes": "2TiB"}"#, "grow_bytes"),
            (r#"{"dir": "/d", "page_bytes": 0}"#, "page_bytes"),
            (r#"{"dir": "/d", "page_bytes": -1}"#, "page_bytes"),
            (r#"{"dir": "/d", "capacity": "many"}"#, "capacity"),
            (r#"{"dir": "/d", "io_threads": 4}"#, "io_threads"),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains(&format!("`{field}`")), "{extra}: {e}");
        }
    }
}
