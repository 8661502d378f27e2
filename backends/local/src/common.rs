//! What both layouts share, each piece owning its own state: the crate's error type
//! ([`LocalError`]), the read-only guard ([`WriteGuard`]), the background reclaim thread with
//! the watermark check that wakes it ([`ReclaimStage`]), the extra-config fields both layouts
//! read ([`SharedFields`]) and the factory's open task ([`open_in_background`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hicache_storage::lifecycle::Reclaimer;
use hicache_storage::{
    ConfigFields, EvictionPolicy, Lifecycle, Result, StatsCounters, Storage, StorageError,
    Watermarks,
};
use parking_lot::Mutex;

use crate::io::{FsyncPolicy, IoEngine};

/// Errors of this crate's shared stages. They reach callers as a
/// [`StorageError::Backend`] naming the layout ([`LocalError::into_storage`]).
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// A write (`batch_set`, `delete`, `clear`) to an instance opened read-only.
    #[error("{op} refused: {} was opened read-only (\"read_only\": true)", dir.display())]
    ReadOnly {
        /// The refused operation.
        op: &'static str,
        /// The storage directory.
        dir: PathBuf,
    },
    /// The reclaim thread could not be started.
    #[error("cannot start the reclaim thread: {0}")]
    ReclaimThread(#[source] std::io::Error),
    /// The blocking open task panicked or was cancelled.
    #[error("open task failed")]
    OpenTask(#[source] tokio::task::JoinError),
}

impl LocalError {
    /// This error as the storage contract's error of the backend named `backend`.
    pub fn into_storage(self, backend: &str) -> StorageError {
        match self {
            LocalError::OpenTask(e) => StorageError::backend_caused(backend, "open task failed", e),
            other => StorageError::backend(backend, other.to_string()),
        }
    }
}

/// What the generic backend ([`LocalBackend`](crate::LocalBackend)) needs of every layout's
/// state: the read-only guard, the operation counters, the capacity and the page index
/// (`I`, the layout's) that `stats()` counts.
#[derive(Debug)]
pub struct Core<I> {
    /// Refuses writes to a read-only open.
    pub guard: WriteGuard,
    /// The operation counters behind `stats()`.
    pub counters: Arc<StatsCounters>,
    /// Bytes of pages the layout may hold.
    pub capacity: u64,
    /// The layout's page index.
    pub index: Arc<Mutex<I>>,
}

/// What `stats()` reads of a layout's page index.
pub trait PageCount {
    /// Pages held.
    fn pages(&self) -> u64;
    /// Bytes of page data held.
    fn bytes(&self) -> u64;
}

/// Refuses writes to an instance opened read-only.
#[derive(Clone, Debug)]
pub struct WriteGuard {
    backend: &'static str,
    read_only: bool,
    dir: PathBuf,
}

impl WriteGuard {
    /// The guard of the backend `backend` opened on `dir`.
    pub fn new(backend: &'static str, read_only: bool, dir: &Path) -> Self {
        Self {
            backend,
            read_only,
            dir: dir.to_path_buf(),
        }
    }

    /// The storage directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the instance was opened read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// An error naming `op` and the directory when the instance is read-only.
    pub fn check(&self, op: &'static str) -> Result<()> {
        if !self.read_only {
            return Ok(());
        }
        Err(LocalError::ReadOnly {
            op,
            dir: self.dir.clone(),
        }
        .into_storage(self.backend))
    }
}

/// The background reclaim stage: the thread that expires pages (`ttl_s`) and evicts down to
/// the low watermark, and the check that wakes it when writes pass the high watermark. The
/// layout supplies the pass; this owns the thread, its schedule and the watermark arithmetic.
#[derive(Debug, Default)]
pub(crate) struct ReclaimStage {
    thread: Option<Reclaimer>,
    watermarks: Option<Watermarks>,
    capacity: u64,
}

impl ReclaimStage {
    /// No reclaim thread (none asked for, or a read-only open).
    pub(crate) fn none() -> Self {
        Self::default()
    }

    /// Starts the reclaim thread `name` running `pass` when `ttl` or `watermarks` ask for
    /// one (never for a read-only open), and asks it for a first pass (pages already expired
    /// or above the high watermark at open). With a ttl it also wakes on its own every quarter
    /// of it (1 s to 60 s) to reclaim pages nobody asks for.
    pub(crate) fn start(
        name: &str,
        read_only: bool,
        ttl: Option<Duration>,
        watermarks: Option<Watermarks>,
        capacity: u64,
        pass: impl FnMut() + Send + 'static,
    ) -> std::result::Result<Self, LocalError> {
        if read_only || (ttl.is_none() && watermarks.is_none()) {
            return Ok(Self::none());
        }
        let period = ttl.map(|t| (t / 4).clamp(Duration::from_secs(1), Duration::from_secs(60)));
        let thread = Reclaimer::spawn(name, period, pass).map_err(LocalError::ReclaimThread)?;
        thread.wake();
        Ok(Self {
            thread: Some(thread),
            watermarks,
            capacity,
        })
    }

    /// Asks the thread for a pass (an expired page was seen).
    pub(crate) fn wake(&self) {
        if let Some(t) = &self.thread {
            t.wake();
        }
    }

    /// Wakes the thread when `used` bytes exceed the high watermark.
    pub(crate) fn check_watermark(&self, used: impl FnOnce() -> u64) {
        if let (Some(w), Some(t)) = (self.watermarks, &self.thread)
            && used() > w.bytes(self.capacity).0
        {
            t.wake();
        }
    }

    /// Waits at most `timeout` until the thread has no pass asked for or running; true at
    /// once without a thread.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> bool {
        self.thread.as_ref().is_none_or(|t| t.wait_idle(timeout))
    }

    /// Stops and joins the thread (first thing a backend does when it drops).
    pub(crate) fn stop(&mut self) {
        drop(self.thread.take());
    }
}

/// Runs `open` on tokio's blocking pool (opening scans and repairs directories) and returns
/// the backend as the registry wants it; `backend` names it in a failed task's error.
pub(crate) async fn open_in_background<S: Storage>(
    backend: &'static str,
    open: impl FnOnce() -> Result<S> + Send + 'static,
) -> Result<Arc<dyn Storage>> {
    let s = tokio::task::spawn_blocking(open)
        .await
        .map_err(|e| LocalError::OpenTask(e).into_storage(backend))??;
    Ok(Arc::new(s))
}

/// A backend error of `backend` saying `reason`.
pub(crate) fn err(backend: &'static str, reason: impl Into<String>) -> StorageError {
    StorageError::backend(backend, reason)
}

/// A backend error of `backend` caused by `cause`, which stays reachable as its `source()`.
pub(crate) fn caused(
    backend: &'static str,
    reason: impl Into<String>,
    cause: impl std::error::Error + Send + Sync + 'static,
) -> StorageError {
    StorageError::backend_caused(backend, reason, cause)
}

/// The extra-config fields both layouts read, with the same names, defaults and ranges:
/// `dir` (required), `fsync`, `eviction`, `io_engine`, `max_batch`, `read_only` and the
/// lifecycle fields (`ttl_s`, `high_watermark`, `low_watermark`).
#[derive(Debug)]
pub(crate) struct SharedFields {
    pub(crate) dir: PathBuf,
    pub(crate) fsync: FsyncPolicy,
    pub(crate) eviction: EvictionPolicy,
    pub(crate) io_engine: IoEngine,
    pub(crate) max_batch: usize,
    pub(crate) read_only: bool,
    pub(crate) lifecycle: Lifecycle,
}

impl SharedFields {
    /// Takes the shared fields out of `f`; `dir_is` says what the directory is for (in the
    /// error when it is missing).
    pub(crate) fn take(f: &mut ConfigFields, dir_is: &str) -> Result<Self> {
        let dir = f.opt_path("dir")?.ok_or_else(|| {
            StorageError::config(f.scope(), "dir", "<missing>", format!("required: {dir_is}"))
        })?;
        Ok(Self {
            dir,
            fsync: FsyncPolicy::from_name(f.choice("fsync", "batch", &FsyncPolicy::NAMES)?)
                .unwrap_or_default(),
            eviction: EvictionPolicy::parse(f.choice("eviction", "lru", &EvictionPolicy::NAMES)?)
                .unwrap_or_default(),
            io_engine: IoEngine::from_name(f.choice("io_engine", "auto", &IoEngine::NAMES)?)
                .unwrap_or_default(),
            max_batch: f.u64("max_batch", 256, 128..=4096)? as usize,
            read_only: f.bool("read_only", false)?,
            lifecycle: Lifecycle::take_from(f)?,
        })
    }
}

/// Parses the extra-config JSON `extra` of the backend `backend` with `from_config` (the
/// layouts' option tests).
#[cfg(test)]
pub(crate) fn parse_options<T>(
    backend: &str,
    extra: &str,
    from_config: fn(&hicache_storage::CommonConfig, ConfigFields) -> Result<T>,
) -> Result<T> {
    let c = hicache_storage::StorageConfig::parse(Some(backend), Some(extra))?;
    from_config(&c.common, c.backend_fields)
}

#[cfg(test)]
mod tests {
    use super::parse_options;
    use crate::{FileOptions, UringOptions};

    /// With only `dir`, each layout's options are its defaults.
    #[test]
    fn only_dir_gives_the_defaults() {
        let dir = r#"{"dir": "/d"}"#;
        let file = parse_options("file", dir, FileOptions::from_config).unwrap();
        assert_eq!(file, FileOptions::new("/d"));
        let uring = parse_options("uring", dir, UringOptions::from_config).unwrap();
        assert_eq!(uring, UringOptions::new("/d"));
    }

    /// An error in a field both layouts read names the field, in either layout's
    /// extra-config.
    #[test]
    fn shared_field_errors_name_their_field() {
        for (extra, field) in [
            (r#"{}"#, "dir"),
            (r#"{"dir": ""}"#, "dir"),
            (r#"{"dir": 5}"#, "dir"),
            (r#"{"dir": "/d", "fsync": "sometimes"}"#, "fsync"),
            (r#"{"dir": "/d", "fsync": true}"#, "fsync"),
            (r#"{"dir": "/d", "eviction": "random"}"#, "eviction"),
            (r#"{"dir": "/d", "io_engine": "aio"}"#, "io_engine"),
            (r#"{"dir": "/d", "io_engine": 1}"#, "io_engine"),
            (r#"{"dir": "/d", "max_batch": 64}"#, "max_batch"),
            (r#"{"dir": "/d", "read_only": "yes"}"#, "read_only"),
            (r#"{"dir": "/d", "ttl_s": 0}"#, "ttl_s"),
            (r#"{"dir": "/d", "ttl_s": -5}"#, "ttl_s"),
            (r#"{"dir": "/d", "ttl_s": "1h"}"#, "ttl_s"),
            (
                r#"{"dir": "/d", "high_watermark": 0.5, "low_watermark": 0.7}"#,
                "low_watermark",
            ),
            (
                r#"{"dir": "/d", "high_watermark": 0.5, "low_watermark": 0.5}"#,
                "low_watermark",
            ),
            (r#"{"dir": "/d", "high_watermark": 2}"#, "high_watermark"),
        ] {
            let file = parse_options("file", extra, FileOptions::from_config).unwrap_err();
            let uring = parse_options("uring", extra, UringOptions::from_config).unwrap_err();
            for e in [file.to_string(), uring.to_string()] {
                assert!(e.contains(&format!("`{field}`")), "{extra}: {e}");
            }
        }
    }
}
