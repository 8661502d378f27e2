//! Metrics of the cache, rendered for Prometheus (`prometheus-client`) and readable as a plain
//! [`MetricsSnapshot`] (for reports and tests).
//!
//! Names follow Prometheus conventions: `hicache_` prefix, `_total` counters, base units
//! (bytes, seconds). Labels: `direction` (`d2h`, `h2d`, `l2_to_l3`, `l3_to_l2`), `tier`
//! (`l1`, `l2`, `l3`), `outcome` for prefetches, `reason` for dropped tokens, `op` (`write`,
//! `read`) for L3 pages lost to storage errors (`hicache_l3_failed_pages_total`).
//!
//! Besides our own: `hicache_storage_*{backend}`, the attached L3 backend's own statistics
//! (read at scrape time), `hicache_capacity_pages{tier}` beside `hicache_resident_pages{tier}`,
//! and SGLang's names for the quantities both systems measure the same way
//! (`sglang:hicache_host_used_tokens`, `sglang:hicache_host_total_tokens`,
//! `sglang:prefetched_tokens_total`, `sglang:backuped_tokens_total`), so dashboards built for
//! SGLang's HiCache read ours.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// A data movement between tiers.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Direction {
    /// L1 → L2 (backup, write-through).
    d2h,
    /// L2 → L1 (load-back).
    h2d,
    /// L2 → L3 (storage backup).
    l2_to_l3,
    /// L3 → L2 (prefetch).
    l3_to_l2,
}

impl Direction {
    /// Every direction.
    pub const ALL: [Direction; 4] = [
        Direction::d2h,
        Direction::h2d,
        Direction::l2_to_l3,
        Direction::l3_to_l2,
    ];
}

/// A cache tier.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Tier {
    /// GPU memory.
    l1,
    /// Pinned host memory.
    l2,
    /// Storage.
    l3,
}

impl Tier {
    /// Every tier.
    pub const ALL: [Tier; 3] = [Tier::l1, Tier::l2, Tier::l3];
}

/// How a prefetch from L3 ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum PrefetchOutcome {
    /// Every page found in L3 arrived.
    completed,
    /// Terminated by policy (best effort or timeout) with part of the hit transferred.
    partial,
    /// Fewer hit tokens than the prefetch threshold: nothing fetched.
    below_threshold,
    /// Not started: the capacity limit of in-flight prefetches was reached.
    rate_limited,
    /// No host memory for the hit.
    no_host_memory,
    /// The request was aborted.
    aborted,
    /// The backend failed; the request recomputes.
    failed,
}

/// Why cached tokens were dropped without being kept in any tier.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum DropReason {
    /// write_back eviction found the host pool full.
    host_pressure,
}

/// An L3 operation whose pages can fail.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum L3Op {
    /// Backups (L2 → L3): pages a backup was to store that are not stored.
    write,
    /// Prefetches (L3 → L2): pages whose lookup failed, and hit pages a fetch did not bring
    /// because a read failed.
    read,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: L3Op,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: Direction,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: Tier,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: PrefetchOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: DropReason,
}

fn seconds_histogram() -> Histogram {
    // 10 µs … ~42 s.
    Histogram::new(exponential_buckets(1e-5, 4.0, 12))
}

/// A family's series for each value of a one-field label, looked up in the family on first
/// use and kept: the hot path (several records per tick) then reaches a series with one
/// atomic load instead of the family's lock and a hash of the label. A series is created at
/// the same moment as without it (first record), so what is rendered does not change.
struct Series<M, const N: usize>([OnceLock<M>; N]);

impl<M, const N: usize> Default for Series<M, N> {
    fn default() -> Self {
        Self(std::array::from_fn(|_| OnceLock::new()))
    }
}

impl<M: Clone, const N: usize> Series<M, N> {
    /// The series of label value `i` (its index in the label enum) of `family`.
    fn get<L, C>(&self, i: usize, family: &Family<L, M, C>, label: L) -> &M
    where
        L: Clone + std::hash::Hash + Eq,
        C: prometheus_client::metrics::family::MetricConstructor<M>,
    {
        self.0[i].get_or_init(|| family.get_or_create(&label).clone())
    }
}

/// The series [`Metrics::transfer`] records, per direction.
#[derive(Default)]
struct TransferSeries {
    pages: Series<Counter, 4>,
    bytes: Series<Counter, 4>,
    seconds: Series<Histogram, 4>,
    busy_seconds: Series<Counter<f64, AtomicU64>, 4>,
    batches: Series<Counter, 4>,
}

/// Every metric of one cache instance.
pub struct Metrics {
    pages: Family<DirectionLabel, Counter>,
    bytes: Family<DirectionLabel, Counter>,
    seconds: Family<DirectionLabel, Histogram, fn() -> Histogram>,
    busy_seconds: Family<DirectionLabel, Counter<f64, AtomicU64>>,
    batches: Family<DirectionLabel, Counter>,
    hit_tokens: Family<TierLabel, Counter>,
    request_tokens: Counter,
    prefetch: Family<OutcomeLabel, Counter>,
    dropped_tokens: Family<ReasonLabel, Counter>,
    evicted_pages: Family<TierLabel, Counter>,
    l3_failed_pages: Family<OpLabel, Counter>,
    resident_pages: Family<TierLabel, Gauge>,
    capacity_pages: Family<TierLabel, Gauge>,
    page_size: Arc<AtomicU64>,
    storage: crate::observe::StorageSlot,
    registry: Registry,
    /// Series of the families recorded per tick (see [`Series`]).
    transfer_series: TransferSeries,
    hit_series: Series<Counter, 3>,
    evicted_series: Series<Counter, 3>,
    resident_series: Series<Gauge, 3>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("snapshot", &self.snapshot())
            .finish()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh set of metrics, registered under the `hicache` prefix.
    pub fn new() -> Self {
        let mut metrics = Self {
            pages: Family::default(),
            bytes: Family::default(),
            seconds: Family::new_with_constructor(seconds_histogram),
            busy_seconds: Family::default(),
            batches: Family::default(),
            hit_tokens: Family::default(),
            request_tokens: Counter::default(),
            prefetch: Family::default(),
            dropped_tokens: Family::default(),
            evicted_pages: Family::default(),
            l3_failed_pages: Family::default(),
            resident_pages: Family::default(),
            capacity_pages: Family::default(),
            page_size: Arc::new(AtomicU64::new(0)),
            storage: crate::observe::StorageSlot::default(),
            registry: Registry::default(),
            transfer_series: TransferSeries::default(),
            hit_series: Series::default(),
            evicted_series: Series::default(),
            resident_series: Series::default(),
        };
        metrics.register();
        metrics
    }

    /// Registers every metric in `self.registry`: SGLang's names at the root (a collector),
    /// ours under the `hicache` prefix, and the L3 backend's own statistics.
    fn register(&mut self) {
        let mut root = std::mem::take(&mut self.registry);
        root.register_collector(Box::new(SglangCollector {
            pages: self.pages.clone(),
            resident_pages: self.resident_pages.clone(),
            capacity_pages: self.capacity_pages.clone(),
            page_size: self.page_size.clone(),
        }));
        let registry = root.sub_registry_with_prefix("hicache");
        registry.register(
            "transfer_pages",
            "Pages moved between tiers",
            self.pages.clone(),
        );
        registry.register(
            "transfer_bytes",
            "Bytes moved between tiers",
            self.bytes.clone(),
        );
        registry.register(
            "transfer_seconds",
            "Duration of one batched transfer between tiers",
            self.seconds.clone(),
        );
        registry.register(
            "transfer_busy_seconds",
            "Sum of the durations of batched transfers",
            self.busy_seconds.clone(),
        );
        registry.register(
            "transfer_batches",
            "Batched transfers between tiers",
            self.batches.clone(),
        );
        registry.register(
            "hit_tokens",
            "Prompt tokens served from each tier",
            self.hit_tokens.clone(),
        );
        registry.register(
            "request_tokens",
            "Prompt tokens of admitted requests",
            self.request_tokens.clone(),
        );
        registry.register(
            "prefetch",
            "L3 prefetches by how they ended",
            self.prefetch.clone(),
        );
        registry.register(
            "dropped_tokens",
            "Cached tokens dropped without a copy in any tier",
            self.dropped_tokens.clone(),
        );
        registry.register(
            "evicted_pages",
            "Pages evicted from each tier",
            self.evicted_pages.clone(),
        );
        registry.register(
            "l3_failed_pages",
            "L3 pages lost to storage errors (write: not stored by a backup; read: not \
             fetched by a prefetch)",
            self.l3_failed_pages.clone(),
        );
        registry.register(
            "resident_pages",
            "Pages currently held by the tree in each tier",
            self.resident_pages.clone(),
        );
        registry.register(
            "capacity_pages",
            "Pages each tier can hold (L3: while a backend is attached and bounded)",
            self.capacity_pages.clone(),
        );
        registry.register_collector(Box::new(crate::observe::StorageCollector(
            self.storage.clone(),
        )));
        self.registry = root;
    }

    /// Sets the pool sizes and tokens per page (once, when the cache is built).
    pub fn set_geometry(&self, page_size: u32, device_pages: u64, host_pages: u64) {
        self.page_size
            .store(u64::from(page_size), Ordering::Relaxed);
        self.set_capacity(Tier::l1, device_pages);
        self.set_capacity(Tier::l2, host_pages);
    }

    /// Sets the number of pages `tier` can hold.
    pub fn set_capacity(&self, tier: Tier, pages: u64) {
        self.capacity_pages
            .get_or_create(&TierLabel { tier })
            .set(pages as i64);
    }

    /// Sets (attach) or clears (detach) the L3 backend whose statistics are exported.
    pub fn set_storage(&self, storage: Option<Arc<dyn hicache_storage::Storage>>) {
        self.storage.set(storage);
    }

    /// Records one finished batched transfer.
    pub fn transfer(&self, direction: Direction, pages: u64, bytes: u64, seconds: f64) {
        let l = DirectionLabel { direction };
        let (s, i) = (&self.transfer_series, direction as usize);
        s.pages.get(i, &self.pages, l.clone()).inc_by(pages);
        s.bytes.get(i, &self.bytes, l.clone()).inc_by(bytes);
        s.seconds.get(i, &self.seconds, l.clone()).observe(seconds);
        s.busy_seconds
            .get(i, &self.busy_seconds, l.clone())
            .inc_by(seconds);
        s.batches.get(i, &self.batches, l).inc();
    }

    /// Records tokens of an admitted request served from `tier`.
    pub fn hit(&self, tier: Tier, tokens: u64) {
        self.hit_series
            .get(tier as usize, &self.hit_tokens, TierLabel { tier })
            .inc_by(tokens);
    }

    /// Records the prompt length of an admitted request.
    pub fn request(&self, tokens: u64) {
        self.request_tokens.inc_by(tokens);
    }

    /// Records how a prefetch ended.
    pub fn prefetch(&self, outcome: PrefetchOutcome) {
        self.prefetch.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    /// Records dropped tokens.
    pub fn dropped(&self, reason: DropReason, tokens: u64) {
        self.dropped_tokens
            .get_or_create(&ReasonLabel { reason })
            .inc_by(tokens);
    }

    /// Records evicted pages.
    pub fn evicted(&self, tier: Tier, pages: u64) {
        self.evicted_series
            .get(tier as usize, &self.evicted_pages, TierLabel { tier })
            .inc_by(pages);
    }

    /// Records L3 pages lost to storage errors.
    pub fn l3_failed(&self, op: L3Op, pages: u64) {
        self.l3_failed_pages
            .get_or_create(&OpLabel { op })
            .inc_by(pages);
    }

    /// Sets the number of pages the tree holds in `tier`.
    pub fn set_resident(&self, tier: Tier, pages: u64) {
        self.resident_series
            .get(tier as usize, &self.resident_pages, TierLabel { tier })
            .set(pages as i64);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// Reads one counter of a family. The family's read guard is dropped before returning: two
    /// guards of one family alive in the same expression deadlock when the second label has to
    /// be created.
    fn counter<L>(&self, family: &Family<L, Counter>, label: L) -> u64
    where
        L: Clone + std::hash::Hash + Eq,
    {
        family.get_or_create(&label).get()
    }

    /// The current values as plain numbers.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let dir = |d: Direction| {
            let l = DirectionLabel { direction: d };
            TransferTotals {
                pages: self.pages.get_or_create(&l).get(),
                bytes: self.bytes.get_or_create(&l).get(),
                seconds: self.busy_seconds.get_or_create(&l).get(),
                batches: self.batches.get_or_create(&l).get(),
            }
        };
        let tier = |t: Tier| self.hit_tokens.get_or_create(&TierLabel { tier: t }).get();
        let outcome = |o: PrefetchOutcome| {
            self.prefetch
                .get_or_create(&OutcomeLabel { outcome: o })
                .get()
        };
        MetricsSnapshot {
            d2h: dir(Direction::d2h),
            h2d: dir(Direction::h2d),
            l2_to_l3: dir(Direction::l2_to_l3),
            l3_to_l2: dir(Direction::l3_to_l2),
            hit_tokens_l1: tier(Tier::l1),
            hit_tokens_l2: tier(Tier::l2),
            hit_tokens_l3: tier(Tier::l3),
            request_tokens: self.request_tokens.get(),
            prefetch_completed: outcome(PrefetchOutcome::completed),
            prefetch_partial: outcome(PrefetchOutcome::partial),
            prefetch_below_threshold: outcome(PrefetchOutcome::below_threshold),
            prefetch_rate_limited: outcome(PrefetchOutcome::rate_limited),
            prefetch_no_host_memory: outcome(PrefetchOutcome::no_host_memory),
            prefetch_aborted: outcome(PrefetchOutcome::aborted),
            prefetch_failed: outcome(PrefetchOutcome::failed),
            dropped_tokens: self.counter(
                &self.dropped_tokens,
                ReasonLabel {
                    reason: DropReason::host_pressure,
                },
            ),
            evicted_pages_l1: self.counter(&self.evicted_pages, TierLabel { tier: Tier::l1 }),
            evicted_pages_l2: self.counter(&self.evicted_pages, TierLabel { tier: Tier::l2 }),
            l3_write_failures: self.counter(&self.l3_failed_pages, OpLabel { op: L3Op::write }),
            l3_read_failures: self.counter(&self.l3_failed_pages, OpLabel { op: L3Op::read }),
        }
    }
}

/// SGLang's names (its `metrics_collector.py`) for figures read from our families at scrape
/// time: host-pool tokens used and total, tokens prefetched from and backed up to L3.
#[derive(Debug)]
struct SglangCollector {
    pages: Family<DirectionLabel, Counter>,
    resident_pages: Family<TierLabel, Gauge>,
    capacity_pages: Family<TierLabel, Gauge>,
    page_size: Arc<AtomicU64>,
}

impl Collector for SglangCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let ps = self.page_size.load(Ordering::Relaxed) as i64;
        let tier = |f: &Family<TierLabel, Gauge>, tier| f.get_or_create(&TierLabel { tier }).get();
        let moved = |direction| {
            self.pages
                .get_or_create(&DirectionLabel { direction })
                .get()
        };
        for (name, help, pages) in [
            (
                "sglang:hicache_host_used_tokens",
                "Tokens held in the host (L2) pool",
                tier(&self.resident_pages, Tier::l2),
            ),
            (
                "sglang:hicache_host_total_tokens",
                "Token capacity of the host (L2) pool",
                tier(&self.capacity_pages, Tier::l2),
            ),
        ] {
            let metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(pages.saturating_mul(ps)).encode(metric)?;
        }
        for (name, help, pages) in [
            (
                "sglang:prefetched_tokens",
                "Tokens prefetched from L3 into the host pool",
                moved(Direction::l3_to_l2),
            ),
            (
                "sglang:backuped_tokens",
                "Tokens backed up from the host pool to L3",
                moved(Direction::l2_to_l3),
            ),
        ] {
            let metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(pages.saturating_mul(ps as u64)).encode(metric)?;
        }
        Ok(())
    }
}

/// Totals of one direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct TransferTotals {
    /// Pages moved.
    pub pages: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Sum of batch durations in seconds (wall time of each batch from launch to completion).
    pub seconds: f64,
    /// Number of batches.
    pub batches: u64,
}

impl TransferTotals {
    /// Achieved bandwidth over the batches' durations, in GB/s (1e9 bytes).
    pub fn gbps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

/// Plain numbers read from [`Metrics`].
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct MetricsSnapshot {
    /// L1 → L2.
    pub d2h: TransferTotals,
    /// L2 → L1.
    pub h2d: TransferTotals,
    /// L2 → L3.
    pub l2_to_l3: TransferTotals,
    /// L3 → L2.
    pub l3_to_l2: TransferTotals,
    /// Prompt tokens served from L1.
    pub hit_tokens_l1: u64,
    /// Prompt tokens served from L2 (loaded back).
    pub hit_tokens_l2: u64,
    /// Prompt tokens served from L3 (prefetched).
    pub hit_tokens_l3: u64,
    /// Prompt tokens of admitted requests.
    pub request_tokens: u64,
    /// Prefetches that brought every hit page.
    pub prefetch_completed: u64,
    /// Prefetches terminated with part of the hit.
    pub prefetch_partial: u64,
    /// Prefetches whose hit was below the threshold.
    pub prefetch_below_threshold: u64,
    /// Prefetches not started for the capacity limit.
    pub prefetch_rate_limited: u64,
    /// Prefetches without host memory for the hit.
    pub prefetch_no_host_memory: u64,
    /// Prefetches of aborted requests.
    pub prefetch_aborted: u64,
    /// Prefetches that failed in the backend.
    pub prefetch_failed: u64,
    /// Tokens dropped under host pressure (write_back).
    pub dropped_tokens: u64,
    /// Pages evicted from L1.
    pub evicted_pages_l1: u64,
    /// Pages evicted from L2.
    pub evicted_pages_l2: u64,
    /// L3 pages backups were to store that were not stored (storage errors).
    pub l3_write_failures: u64,
    /// L3 pages lost to failed lookups and reads of prefetches (storage errors).
    pub l3_read_failures: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_and_render_agree() {
        let m = Metrics::new();
        m.transfer(Direction::d2h, 4, 4096, 0.001);
        m.transfer(Direction::d2h, 2, 2048, 0.001);
        m.hit(Tier::l2, 128);
        m.prefetch(PrefetchOutcome::completed);
        m.dropped(DropReason::host_pressure, 64);
        m.l3_failed(L3Op::write, 3);
        m.l3_failed(L3Op::read, 5);
        let s = m.snapshot();
        assert_eq!((s.l3_write_failures, s.l3_read_failures), (3, 5));
        assert_eq!(s.d2h.pages, 6);
        assert_eq!(s.d2h.bytes, 6144);
        assert_eq!(s.d2h.batches, 2);
        assert!((s.d2h.gbps() - 6144.0 / 0.002 / 1e9).abs() < 1e-9);
        assert_eq!(s.hit_tokens_l2, 128);
        assert_eq!(s.prefetch_completed, 1);
        assert_eq!(s.dropped_tokens, 64);
        let text = m.render();
        assert!(
            text.contains("hicache_transfer_pages_total{direction=\"d2h\"} 6"),
            "{text}"
        );
        assert!(
            text.contains("hicache_hit_tokens_total{tier=\"l2\"} 128"),
            "{text}"
        );
        assert!(text.contains("hicache_dropped_tokens_total{reason=\"host_pressure\"} 64"));
        assert!(
            text.contains("hicache_l3_failed_pages_total{op=\"read\"} 5"),
            "{text}"
        );
    }
}
