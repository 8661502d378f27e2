//! The Prometheus collector of the attached L3 backend's own [`StorageStats`], read at scrape
//! time.

use std::sync::Arc;

use hicache_storage::{Storage, StorageStats};
use parking_lot::RwLock;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The L3 backend currently attached (empty while detached), shared between the engine thread
/// (attach/detach) and the scrapes.
#[derive(Clone, Default)]
pub struct StorageSlot(Arc<RwLock<Option<Arc<dyn Storage>>>>);

impl std::fmt::Debug for StorageSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.0.read().as_ref().map(|s| s.info().name);
        f.debug_tuple("StorageSlot").field(&name).finish()
    }
}

impl StorageSlot {
    /// Sets (attach) or clears (detach) the backend.
    pub fn set(&self, storage: Option<Arc<dyn Storage>>) {
        *self.0.write() = storage;
    }

    /// The backend's name and statistics, if one is attached.
    pub fn stats(&self) -> Option<(String, StorageStats)> {
        let s = self.0.read().clone()?;
        Some((s.info().name, s.stats()))
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct BackendLabel {
    backend: String,
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    label: &BackendLabel,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(value).encode(metric.encode_family(label)?)
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    label: &BackendLabel,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(metric.encode_family(label)?)
}

/// The counters of [`StorageStats`]: name, help, value, in exposition order.
fn counters(s: &StorageStats) -> [(&'static str, &'static str, u64); 17] {
    [
        ("storage_exists_calls", "batch_exists calls", s.exists_calls),
        (
            "storage_exists_hits",
            "Pages batch_exists found",
            s.exists_hits,
        ),
        ("storage_get_pages", "Pages asked of batch_get", s.get_pages),
        ("storage_get_hits", "Pages batch_get returned", s.get_hits),
        ("storage_get_misses", "Pages batch_get missed", s.get_misses),
        (
            "storage_get_corrupt",
            "Stored pages that failed verification (counted misses)",
            s.get_corrupt,
        ),
        ("storage_get_errors", "Failed batch_get pages", s.get_errors),
        ("storage_get_bytes", "Bytes batch_get returned", s.get_bytes),
        (
            "storage_set_pages",
            "Pages offered to batch_set",
            s.set_pages,
        ),
        ("storage_set_stored", "Pages batch_set stored", s.set_stored),
        (
            "storage_set_present",
            "Pages batch_set found present",
            s.set_present,
        ),
        ("storage_set_errors", "Failed batch_set pages", s.set_errors),
        ("storage_set_bytes", "Bytes batch_set stored", s.set_bytes),
        (
            "storage_evicted_pages",
            "Pages the backend evicted",
            s.evicted_pages,
        ),
        (
            "storage_evicted_bytes",
            "Bytes the backend evicted",
            s.evicted_bytes,
        ),
        (
            "storage_cleared_pages",
            "Pages removed by clear",
            s.cleared_pages,
        ),
        (
            "storage_expired_pages",
            "Pages dropped as older than ttl_s",
            s.expired_pages,
        ),
    ]
}

/// `hicache_storage_*`: the attached backend's [`StorageStats`], labelled with its name.
#[derive(Debug)]
pub struct StorageCollector(pub StorageSlot);

impl Collector for StorageCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some((backend, s)) = self.0.stats() else {
            return Ok(());
        };
        let l = BackendLabel { backend };
        let e = &mut encoder;
        gauge(
            e,
            &l,
            "storage_pages",
            "Pages the L3 backend holds",
            s.pages,
        )?;
        gauge(
            e,
            &l,
            "storage_bytes",
            "Page bytes the L3 backend holds",
            s.bytes,
        )?;
        if let Some(cap) = s.capacity_bytes {
            gauge(
                e,
                &l,
                "storage_capacity_bytes",
                "Capacity of the L3 backend",
                cap,
            )?;
        }
        for (name, help, value) in counters(&s) {
            counter(e, &l, name, help, value)?;
        }
        Ok(())
    }
}
