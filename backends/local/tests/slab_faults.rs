//! The fault-injection suite of hicache-storage on the uring backend (scratch directories on
//! the work tree's disk, which accepts O_DIRECT; small slab growth steps so the disk-full case
//! grows slabs many times).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hicache_backend_local::slab::{UringBackend, UringOptions, format};
use hicache_storage::faults::FaultTarget;
use hicache_storage::{Result, Storage, async_trait};

struct UringTarget;

#[async_trait]
impl FaultTarget for UringTarget {
    async fn open(&self, dir: &Path, capacity_bytes: u64) -> Result<Arc<dyn Storage>> {
        let mut o = UringOptions::new(dir);
        o.capacity_bytes = Some(capacity_bytes);
        o.grow_bytes = 4 << 20;
        Ok(Arc::new(UringBackend::open(o)?))
    }

    fn scratch_root(&self) -> PathBuf {
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("faults")
    }

    fn record_bytes(&self) -> u64 {
        format::RECORD_LEN as u64
    }
}

hicache_storage::fault_tests!(UringTarget);
