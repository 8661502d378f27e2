//! [`CacheSetup`]: the cache configuration the `multiturn` command collects from its flags, in
//! plain data with SGLang's names, for whoever builds the cache under test (the `hicache`
//! adapter turns it into a `HiCacheConfig`).

use std::path::PathBuf;
use std::time::Duration;

use hicache_core::{KvShape, LayoutKind, PrefetchPolicy, StrategyKind, WritePolicy};
use hicache_gpu::IoBackend;
use serde::{Serialize, Serializer};

use crate::cache::CacheUnderTest;
use crate::error::Result;

/// Which device holds L1.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// The sim device (host memory; every kernel replaced by its CPU reference).
    Sim,
    /// CUDA device 0.
    Cuda,
}

/// Size of the L2 host pool (SGLang: `--hicache-ratio`, or `--hicache-size` which overrides it).
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostSize {
    /// Host tokens = device tokens × ratio (`hicache_ratio`).
    Ratio(f64),
    /// Gigabytes (1e9 bytes) per rank (`hicache_size`).
    Gigabytes(f64),
}

/// How L2 and L3 share pages when both are used (`hicache_host_memory_mode`,
/// `storage_write_mode`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TieringMode {
    /// L2 caches; L3 is written at L2 admission (SGLang's default).
    Inclusive,
    /// `hicache_host_memory_mode = buffer_only`: L2 only stages L1↔L3 traffic.
    BufferOnly,
    /// `storage_write_mode = exclusive`: L3 is written from the coldest L2 pages.
    Exclusive,
}

/// Which tiers a run uses. L1 always exists; L3 needs L2.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Tiers {
    /// The L2 host pool.
    pub host: bool,
    /// The L3 storage backend.
    pub storage: bool,
    /// How L2 and L3 share pages (only with L3).
    pub mode: TieringMode,
}

impl Tiers {
    /// L1 only.
    pub const L1: Tiers = Tiers {
        host: false,
        storage: false,
        mode: TieringMode::Inclusive,
    };
    /// L1 and L2.
    pub const L1_L2: Tiers = Tiers {
        host: true,
        storage: false,
        mode: TieringMode::Inclusive,
    };
    /// All three tiers.
    pub const L1_L2_L3: Tiers = Tiers {
        host: true,
        storage: true,
        mode: TieringMode::Inclusive,
    };
    /// All three tiers, host memory as a staging buffer only.
    pub const L1_L3_BUFFER_ONLY: Tiers = Tiers {
        host: true,
        storage: true,
        mode: TieringMode::BufferOnly,
    };
    /// All three tiers, L3 written from the coldest L2 pages.
    pub const L1_L2_L3_EXCLUSIVE: Tiers = Tiers {
        host: true,
        storage: true,
        mode: TieringMode::Exclusive,
    };

    /// The label of the configuration: `L1`, `L1+L2`, `L1+L2+L3`, `L1+L3 buffer_only`
    /// (L2 only stages) or `L1+L2+L3 exclusive`.
    pub fn label(self) -> &'static str {
        match (self.host, self.storage, self.mode) {
            (false, _, _) => "L1",
            (true, false, _) => "L1+L2",
            (true, true, TieringMode::Inclusive) => "L1+L2+L3",
            (true, true, TieringMode::BufferOnly) => "L1+L3 buffer_only",
            (true, true, TieringMode::Exclusive) => "L1+L2+L3 exclusive",
        }
    }
}

/// What a run's pages carry.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Payload {
    /// The KV bytes (default): pools populated, pages copied, L3 pages written and read.
    #[default]
    Bytes,
    /// No bytes, for runs whose figures do not depend on them (hits, TTFT, bytes moved as
    /// counted; not GB/s). On the sim device only ([`hicache::Device::sim_without_payload`]):
    /// pages are counted at the model's page bytes, the pools are mapped but never populated,
    /// and page copies queue and complete without moving bytes. Its L3, where that answers
    /// the same ([`crate::presence::stands_in_for`]), records which pages it holds and no
    /// bytes ([`crate::presence::PresenceStorage`]); any other L3 stores and returns the
    /// (never written, zero) pool bytes. On a CUDA device a run keeps its bytes.
    Counted,
}

/// What a run's cache did with page bytes ([`Payload`]), as its adapter reports it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PayloadUsed {
    /// No bytes populated or copied (a sim device without payload).
    pub counted_only: bool,
    /// The L3 recorded presence only ([`crate::presence::PresenceStorage`]).
    pub l3_presence_only: bool,
}

/// The L3 backend and its extra-config.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StorageSetup {
    /// Backend name (`storage_backend`).
    pub backend: String,
    /// The extra-config object (`storage_backend_extra_config`), already checked to parse as a
    /// `hicache_storage::StorageConfig` for `backend`. For the `file` backend without a `dir`,
    /// the command adds a fresh temporary directory per run.
    pub extra_config: serde_json::Map<String, serde_json::Value>,
}

fn io_backend_name<S: Serializer>(io: &IoBackend, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(io.as_str())
}

/// The cache configuration of one run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CacheSetup {
    /// L1 device.
    pub device: DeviceKind,
    /// KV shape of one rank, page size included (`page_size`).
    pub kv_shape: KvShape,
    /// L1 pages.
    pub device_pages: usize,
    /// L2 size (`hicache_ratio` / `hicache_size`).
    pub host_size: HostSize,
    /// `write_policy`.
    pub write_policy: WritePolicy,
    /// `storage_prefetch_policy`.
    pub prefetch_policy: PrefetchPolicy,
    /// `io_backend`.
    #[serde(serialize_with = "io_backend_name")]
    pub io_backend: IoBackend,
    /// `mem_layout` of the host pool.
    pub mem_layout: LayoutKind,
    /// Eviction strategy of the tree (`radix_eviction_policy`).
    pub eviction_policy: StrategyKind,
    /// L3 (used when `tiers.storage`).
    pub storage: StorageSetup,
    /// Tiers of this run.
    pub tiers: Tiers,
    /// Directory the command created for this run's L3 (removed at the end), if any.
    pub scratch_dir: Option<PathBuf>,
    /// Endpoints an operator watches the run through.
    pub observe: ObserveSetup,
    /// What this run's pages carry (set per run; not recorded: each run's cache reports what
    /// it did in [`CacheStats::payload`](crate::CacheStats::payload)).
    #[serde(skip)]
    pub payload: Payload,
}

impl CacheSetup {
    /// Whether this run's cache moves no bytes: [`Payload::Counted`] on the sim device.
    pub fn counted_only(&self) -> bool {
        self.payload == Payload::Counted && self.device == DeviceKind::Sim
    }

    /// Whether this run's L3 is a [`crate::presence::PresenceStorage`]: a run without bytes
    /// whose L3 backend it stands in for (in the command's fresh scratch directory).
    pub fn l3_presence_only(&self) -> bool {
        self.counted_only()
            && self.tiers.storage
            && crate::presence::stands_in_for(&self.storage, self.scratch_dir.is_some())
    }

    /// The sim device of this run: without payload when [`counted_only`](Self::counted_only).
    pub fn sim_device(&self) -> hicache::Device {
        if self.counted_only() {
            hicache::Device::sim_without_payload()
        } else {
            hicache::Device::sim()
        }
    }

    /// What this run's cache does with bytes, for its [`CacheStats`](crate::CacheStats).
    pub fn payload_used(&self) -> PayloadUsed {
        PayloadUsed {
            counted_only: self.counted_only(),
            l3_presence_only: self.l3_presence_only(),
        }
    }
}

/// `--metrics-addr` and `--kv-events`: the cache's Prometheus endpoint and KV-event publisher
/// (the same settings as `metrics_addr` and `kv_events_config` of the cache's config).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ObserveSetup {
    /// `IP:PORT` of `GET /metrics`.
    pub metrics_addr: Option<String>,
    /// SGLang's `--kv-events-config` JSON.
    pub kv_events: Option<String>,
    /// `--kv-events-hold`: how long the last run's cache stays open after the run, at most,
    /// for a subscriber to replay its stream (not recorded: it changes no figure).
    #[serde(skip)]
    pub kv_events_hold: Option<Duration>,
}

/// Builds the cache under test for one run (`Sync`: runs that do not measure the machine, such
/// as the copies-free counterfactuals, may build their caches on threads side by side).
pub trait CacheFactory: Sync {
    /// A fresh, empty cache configured by `setup`. Configuration errors should be
    /// [`SimError::Usage`](crate::SimError::Usage) (exit code 2).
    fn build(&self, setup: &CacheSetup) -> Result<Box<dyn CacheUnderTest>>;
}

impl<F> CacheFactory for F
where
    F: Fn(&CacheSetup) -> Result<Box<dyn CacheUnderTest>> + Sync,
{
    fn build(&self, setup: &CacheSetup) -> Result<Box<dyn CacheUnderTest>> {
        self(setup)
    }
}

/// Whether `device` is the emulated driver (`hicache-cuda-emu`), whose figures are CPU copies.
pub fn is_emulated(device: &hicache_gpu::Device) -> bool {
    device.name().contains("hicache-cuda-emu")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_labels() {
        assert_eq!(Tiers::L1.label(), "L1");
        assert_eq!(Tiers::L1_L2.label(), "L1+L2");
        assert_eq!(Tiers::L1_L2_L3.label(), "L1+L2+L3");
        assert_eq!(Tiers::L1_L3_BUFFER_ONLY.label(), "L1+L3 buffer_only");
        assert_eq!(Tiers::L1_L2_L3_EXCLUSIVE.label(), "L1+L2+L3 exclusive");
    }

    #[test]
    fn serialises_with_config_names() {
        let s = CacheSetup {
            device: DeviceKind::Sim,
            kv_shape: KvShape::llama3_8b(64),
            device_pages: 10,
            host_size: HostSize::Ratio(2.0),
            write_policy: WritePolicy::WriteThrough,
            prefetch_policy: PrefetchPolicy::WaitComplete,
            io_backend: IoBackend::Direct,
            mem_layout: LayoutKind::PageFirst,
            eviction_policy: StrategyKind::Lru,
            storage: StorageSetup {
                backend: "file".into(),
                extra_config: serde_json::Map::new(),
            },
            tiers: Tiers::L1_L2,
            scratch_dir: None,
            observe: ObserveSetup::default(),
            payload: Payload::Bytes,
        };
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["io_backend"], "direct");
        assert_eq!(v["write_policy"], "write_through");
        assert_eq!(v["prefetch_policy"], "wait_complete");
        assert_eq!(v["mem_layout"], "page_first");
        assert_eq!(v["eviction_policy"], "lru");
        assert_eq!(v["host_size"]["ratio"], 2.0);
        assert_eq!(v["device"], "sim");
    }
}
