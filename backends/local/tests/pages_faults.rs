//! The fault-injection suite of hicache-storage on the file backend, with the threads engine
//! and buffered I/O (so the small file system of the disk-full case may be a tmpfs) and with
//! the default engine choice and O_DIRECT where the file system allows it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hicache_backend_local::pages::{DirectIo, FileBackend, FileOptions, IoEngine, format};
use hicache_storage::faults::FaultTarget;
use hicache_storage::{Result, Storage, async_trait};

/// Opens the file backend on the suite's directories with options adjusted by `tweak`.
struct FileTarget {
    tweak: fn(&mut FileOptions),
}

#[async_trait]
impl FaultTarget for FileTarget {
    async fn open(&self, dir: &Path, capacity_bytes: u64) -> Result<Arc<dyn Storage>> {
        let mut o = FileOptions::new(dir);
        o.capacity_bytes = Some(capacity_bytes);
        (self.tweak)(&mut o);
        Ok(Arc::new(FileBackend::open(o)?))
    }

    fn scratch_root(&self) -> PathBuf {
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("faults")
    }

    fn record_bytes(&self) -> u64 {
        format::HEADER_LEN as u64
    }

    fn identity_files(&self) -> Vec<PathBuf> {
        vec![PathBuf::from(format::MARKER)]
    }
}

hicache_storage::fault_tests!(
    threads_buffered,
    FileTarget {
        tweak: |o| {
            o.io_engine = IoEngine::Threads;
            o.direct_io = DirectIo::Off;
        }
    }
);

hicache_storage::fault_tests!(default_engine, FileTarget { tweak: |_| {} });
