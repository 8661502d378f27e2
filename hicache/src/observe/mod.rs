//! Observability endpoints an operator points tools at: KV events on ZMQ in SGLang's wire format
//! (for routers), and a Prometheus scrape endpoint (controller metrics, the L3 backend's own
//! statistics, per-tier resident pages and capacity).

mod collectors;
mod kv_events;
mod metrics_http;
pub mod wire;

pub use collectors::{StorageCollector, StorageSlot};
pub use hicache_zmtp::SocketStats;
pub use kv_events::{KvEventPublisher, KvEventsConfig, PublisherProgress};
pub use metrics_http::{
    ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF_MIN, AcceptBackoff, AcceptRetry,
    DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    MAX_HEADER_BUF_BYTES, MAX_HEADERS, MAX_REQUEST_BODY_BYTES, MetricsLimits, MetricsServer,
    RenderFn,
};

use hicache_core::KvEvent;

use crate::config::HiCacheConfig;
use crate::error::Result;

/// The endpoints a cache serves, started when it is built and stopped when it is dropped.
#[derive(Debug, Default)]
pub struct Endpoints {
    kv_events: Option<KvEventPublisher>,
    metrics: Option<MetricsServer>,
}

impl Endpoints {
    /// Binds what `cfg` asks for (`kv_events_config`, `metrics_addr`); errors name the field.
    /// `render` produces the metrics endpoint's text exposition.
    pub fn start(cfg: &HiCacheConfig, render: RenderFn) -> Result<Self> {
        Self::start_with(cfg.kv_events()?, cfg.metrics_addr.as_deref(), render)
    }

    /// Binds a KV-event publisher per `kv_events` and a metrics endpoint at `metrics_addr`
    /// (each only when given; the hybrid facade's builder passes its own settings here).
    pub fn start_with(
        kv_events: Option<KvEventsConfig>,
        metrics_addr: Option<&str>,
        render: RenderFn,
    ) -> Result<Self> {
        let kv_events = match kv_events {
            Some(k) => KvEventPublisher::start(&k)?,
            None => None,
        };
        let metrics = match metrics_addr {
            Some(addr) => Some(MetricsServer::start(addr, render)?),
            None => None,
        };
        Ok(Self { kv_events, metrics })
    }

    /// The KV-event publisher, if one runs.
    pub fn kv_events(&self) -> Option<&KvEventPublisher> {
        self.kv_events.as_ref()
    }

    /// The metrics endpoint, if one runs.
    pub fn metrics(&self) -> Option<&MetricsServer> {
        self.metrics.as_ref()
    }

    /// Whether a publisher takes the events (so the cache hands them over at every poll).
    pub fn publishes(&self) -> bool {
        self.kv_events.is_some()
    }

    /// Publishes one poll's events of a hybrid cache with component events on as one batch
    /// (Full events as [`publish`](Self::publish) writes them, SWA and Mamba ones with their
    /// component's fields); `l3` names the medium of L3 events.
    pub fn publish_tagged(&self, events: &[hicache_core::ComponentKvEvent], l3: wire::L3Medium) {
        if let Some(p) = &self.kv_events {
            p.publish(
                events
                    .iter()
                    .map(|e| wire::WireEvent::from_component_event(e, l3))
                    .collect(),
            );
        }
    }

    /// Publishes one poll's events as one batch; `l3` names the medium of L3 events.
    pub fn publish(&self, events: &[KvEvent], l3: wire::L3Medium) {
        if let Some(p) = &self.kv_events {
            p.publish(
                events
                    .iter()
                    .map(|e| wire::WireEvent::from_event(e, l3))
                    .collect(),
            );
        }
    }
}
