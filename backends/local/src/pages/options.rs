//! [`FileOptions`]: the file backend's extra-config fields, parsed strictly.

use std::path::PathBuf;

use hicache_storage::{CommonConfig, ConfigFields, EvictionPolicy, Lifecycle, Result};

use crate::common::SharedFields;

/// When written pages are flushed to stable storage before `Stored` is returned (shared with
/// the uring layout). Here: `none` never syncs (pages are complete and atomic, temp + rename,
/// checksummed, but a power loss may lose acknowledged ones); `batch` (default) makes a
/// batch's pages and renames durable before any is acknowledged, the way [`BatchSync`] says,
/// merged across concurrent batches; `always` `fdatasync`s each page before its rename and
/// syncs its directory after it.
pub use crate::io::{FsyncPolicy, IoEngine};

/// Whether page data bypasses the page cache.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum DirectIo {
    /// O_DIRECT where the file system accepts it, buffered I/O otherwise (default).
    #[default]
    Auto,
    /// O_DIRECT or fail to open.
    On,
    /// Always buffered.
    Off,
}

impl DirectIo {
    /// Configuration spellings.
    pub const NAMES: [&'static str; 3] = ["auto", "on", "off"];

    fn parse(s: &str) -> Self {
        match s {
            "on" => Self::On,
            "off" => Self::Off,
            _ => Self::Auto,
        }
    }
}

/// How `fsync: batch` makes a batch durable.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum BatchSync {
    /// Pages are written and renamed without syncs of their own, then one `syncfs(2)` of the
    /// storage directory's file system per commit group makes data, block maps and names
    /// durable at once (default). It also writes out other processes' dirty data on that file
    /// system: on a dedicated cache disk that is nothing; beside heavy buffered writers, a
    /// barrier waits for them too.
    #[default]
    Syncfs,
    /// Each page `fdatasync`ed before its rename, then one sync per directory per commit
    /// group: touches only the cache's own files, at one device cache flush per page.
    PerPage,
}

impl BatchSync {
    /// Configuration spellings.
    pub const NAMES: [&'static str; 2] = ["syncfs", "per_page"];

    fn parse(s: &str) -> Self {
        match s {
            "per_page" => Self::PerPage,
            _ => Self::Syncfs,
        }
    }
}

/// Options of a [`FileBackend`](crate::pages::FileBackend).
#[derive(Clone, Debug, PartialEq)]
pub struct FileOptions {
    /// The storage directory (`dir`, required).
    pub dir: PathBuf,
    /// Capacity in bytes of page files, headers and padding included (common field
    /// `capacity`). `None`: 90% of what the directory holds plus the file system's free space,
    /// measured at open.
    pub capacity_bytes: Option<u64>,
    /// Durability of acknowledged pages (`fsync`: `none` | `batch` | `always`, default `batch`).
    pub fsync: FsyncPolicy,
    /// How `fsync: batch` syncs (`batch_sync`: `syncfs` | `per_page`, default `syncfs`).
    pub batch_sync: BatchSync,
    /// O_DIRECT use (`direct_io`: `auto` | `on` | `off`, default `auto`).
    pub direct_io: DirectIo,
    /// Eviction order (`eviction`: `lru` | `fifo`, default `lru`).
    pub eviction: EvictionPolicy,
    /// How page reads are issued (`io_engine`: `auto` | `uring` | `threads`, default `auto`);
    /// page files are written on threads either way.
    pub io_engine: IoEngine,
    /// io_uring engine: page reads of a batch in flight at once (`queue_depth`, 1–1024,
    /// default 128: a whole controller batch).
    pub queue_depth: usize,
    /// Threads engine: threads a batch's page reads are spread over (`io_threads`, 1–256,
    /// default 32); writes use at most 8 of them. Also the parallelism of the scan at open
    /// and, under io_uring, of the verification of a batch's reads.
    pub io_threads: usize,
    /// Largest batch accepted (`max_batch`, 128–4096, default 256).
    pub max_batch: usize,
    /// Several processes may use the directory at once (`shared`, default false).
    pub shared: bool,
    /// Shared mode: bytes a process writes between two janitor rescans of the directory
    /// (`rescan_bytes`, default capacity / 16).
    pub rescan_bytes: Option<u64>,
    /// Verify every page's data checksum when opening (`verify_on_open`, default false:
    /// headers and sizes are checked at open, data on every read).
    pub verify_on_open: bool,
    /// Open for inspection only (`read_only`, default false): nothing in the directory is
    /// created, modified or deleted (no lock file written, no recovery applied, no janitor);
    /// what a read-write open would discard is counted and reported; writes are refused.
    pub read_only: bool,
    /// Page expiry and background eviction (`ttl_s`, `high_watermark`, `low_watermark`;
    /// default none: pages never expire, eviction only when a write needs room). See
    /// [`hicache_storage::lifecycle`].
    pub lifecycle: Lifecycle,
}

impl FileOptions {
    /// Options for `dir` with every default.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            capacity_bytes: None,
            fsync: FsyncPolicy::Batch,
            batch_sync: BatchSync::Syncfs,
            direct_io: DirectIo::Auto,
            eviction: EvictionPolicy::Lru,
            io_engine: IoEngine::Auto,
            queue_depth: 128,
            io_threads: 32,
            max_batch: 256,
            shared: false,
            rescan_bytes: None,
            verify_on_open: false,
            read_only: false,
            lifecycle: Lifecycle::default(),
        }
    }

    /// Reads the options from the common config and the backend's fields (strict: unknown
    /// fields, wrong types and out-of-range values are errors naming the field).
    pub fn from_config(common: &CommonConfig, mut f: ConfigFields) -> Result<Self> {
        let c = SharedFields::take(&mut f, "the directory to store pages in")?;
        let d = Self::new(c.dir);
        let o = Self {
            fsync: c.fsync,
            batch_sync: BatchSync::parse(f.choice("batch_sync", "syncfs", &BatchSync::NAMES)?),
            direct_io: DirectIo::parse(f.choice("direct_io", "auto", &DirectIo::NAMES)?),
            eviction: c.eviction,
            io_engine: c.io_engine,
            queue_depth: f.u64("queue_depth", d.queue_depth as u64, 1..=1024)? as usize,
            io_threads: f.u64("io_threads", d.io_threads as u64, 1..=256)? as usize,
            max_batch: c.max_batch,
            shared: f.bool("shared", false)?,
            rescan_bytes: f.opt_bytes("rescan_bytes", 1)?,
            verify_on_open: f.bool("verify_on_open", false)?,
            read_only: c.read_only,
            lifecycle: c.lifecycle,
            capacity_bytes: common.capacity_bytes,
            dir: d.dir,
        };
        f.finish().map(|()| o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::parse_options;

    fn parse(extra: &str) -> Result<FileOptions> {
        parse_options("file", extra, FileOptions::from_config)
    }

    #[test]
    fn every_field() {
        let o = parse(
            r#"{"dir": "/d", "capacity": "2GiB", "fsync": "always", "direct_io": "off",
                "batch_sync": "per_page",
                "eviction": "fifo", "io_engine": "threads", "queue_depth": 16, "io_threads": 4, "max_batch": 512, "shared": true,
                "rescan_bytes": "64MiB", "verify_on_open": true, "read_only": true,
                "ttl_s": 60, "high_watermark": 0.8, "low_watermark": 0.6}"#,
        )
        .unwrap();
        assert_eq!(o.capacity_bytes, Some(2 << 30));
        assert_eq!(o.fsync, FsyncPolicy::Always);
        assert_eq!(o.batch_sync, BatchSync::PerPage);
        assert_eq!(o.direct_io, DirectIo::Off);
        assert_eq!(o.eviction, EvictionPolicy::Fifo);
        assert_eq!((o.io_threads, o.max_batch), (4, 512));
        assert_eq!((o.io_engine, o.queue_depth), (IoEngine::Threads, 16));
        assert_eq!(
            parse(r#"{"dir": "/d", "io_engine": "uring"}"#)
                .unwrap()
                .io_engine,
            IoEngine::Uring
        );
        assert!(o.shared && o.verify_on_open && o.read_only);
        assert_eq!(o.rescan_bytes, Some(64 << 20));
        assert_eq!(o.lifecycle.ttl, Some(std::time::Duration::from_secs(60)));
        assert_eq!(
            o.lifecycle.watermarks,
            Some(hicache_storage::Watermarks {
                high: 0.8,
                low: 0.6
            })
        );
    }

    #[test]
    fn every_own_error_names_its_field() {
        for (extra, field) in [
            (r#"{"dir": "/d", "batch_sync": "never"}"#, "batch_sync"),
            (r#"{"dir": "/d", "direct_io": "yes"}"#, "direct_io"),
            (r#"{"dir": "/d", "queue_depth": 0}"#, "queue_depth"),
            (r#"{"dir": "/d", "queue_depth": 4096}"#, "queue_depth"),
            (r#"{"dir": "/d", "io_threads": 0}"#, "io_threads"),
            (r#"{"dir": "/d", "io_threads": 1000}"#, "io_threads"),
            (r#"{"dir": "/d", "io_threads": "8"}"#, "io_threads"),
            (r#"{"dir": "/d", "shared": "yes"}"#, "shared"),
            (r#"{"dir": "/d", "rescan_bytes": "x"}"#, "rescan_bytes"),
            (r#"{"dir": "/d", "verify_on_open": 1}"#, "verify_on_open"),
            (r#"{"dir": "/d", "capacity": -5}"#, "capacity"),
            (r#"{"dir": "/d", "max_size": 5}"#, "max_size"),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains(&format!("`{field}`")), "{extra}: {e}");
        }
    }
}
