//! [`KvEventsConfig`]: SGLang's `--kv-events-config`, parsed and checked. Plain configuration:
//! [`HiCacheConfig`](crate::HiCacheConfig) validates it, the `observe` module's publisher
//! binds what it names.

use serde::{Deserialize, Serialize};

use crate::error::{HiCacheError, Result};

/// SGLang's `--kv-events-config` (the fields this publisher implements; any other field is an
/// error that names it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// `null` (events are only collected in-process) or `zmq`.
    pub publisher: String,
    /// `tcp://HOST:PORT` the PUB socket binds (`*` for every interface; port 0 picks one).
    pub endpoint: String,
    /// `tcp://HOST:PORT` of the ROUTER socket that replays buffered batches.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Batches queued for the publisher thread before new ones are dropped.
    pub max_queue_size: usize,
    /// The first frame of every message (subscribers filter on it).
    pub topic: String,
    /// `default` (SGLang's format; the only one implemented).
    pub format: String,
    /// Our extension, hybrid models only (default off): also publish the sliding-window
    /// pages and Mamba states, as `BlockStored` / `BlockRemoved` carrying vLLM's fields
    /// `group_idx`, `kv_cache_spec_kind` (`sliding_window`, `mamba`) and
    /// `kv_cache_spec_sliding_window`. Only for subscribers that read those fields (the
    /// fleet index does): SGLang's decoder ignores unknown fields and would take them for
    /// Full-attention pages. Full events are the same with it on or off; a dense cache
    /// publishes no component event.
    pub component_events: bool,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            publisher: "null".into(),
            // SGLang binds every interface (`tcp://*:5557`) by default; we bind loopback unless
            // told otherwise, so a router on another host is an explicit choice.
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            max_queue_size: 100_000,
            topic: String::new(),
            format: "default".into(),
            component_events: false,
        }
    }
}

impl KvEventsConfig {
    /// Parses the JSON (SGLang's `--kv-events-config` value) and checks every field.
    pub fn from_json(text: &str) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text).map_err(|e| {
            HiCacheError::config("kv_events_config", text, format!("not a valid config: {e}"))
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the publisher name, the endpoints and the sizes.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: &dyn std::fmt::Display, why: &str| {
            Err(HiCacheError::config(field, value, why.to_string()))
        };
        if !matches!(self.publisher.as_str(), "null" | "zmq") {
            return bad(
                "kv_events_config.publisher",
                &self.publisher,
                "unknown publisher (known: null, zmq)",
            );
        }
        if self.format != "default" {
            return bad(
                "kv_events_config.format",
                &self.format,
                "only SGLang's `default` event format is implemented",
            );
        }
        bind_address(&self.endpoint).map_err(|why| {
            HiCacheError::config("kv_events_config.endpoint", &self.endpoint, why)
        })?;
        if let Some(r) = &self.replay_endpoint {
            bind_address(r)
                .map_err(|why| HiCacheError::config("kv_events_config.replay_endpoint", r, why))?;
        }
        if self.buffer_steps == 0 {
            return bad("kv_events_config.buffer_steps", &0, "must be at least 1");
        }
        if self.max_queue_size == 0 {
            return bad("kv_events_config.max_queue_size", &0, "must be at least 1");
        }
        // tokio's bounded channel panics above this (it counts permits in the low bits).
        if self.max_queue_size > MAX_QUEUE_SIZE {
            return bad(
                "kv_events_config.max_queue_size",
                &self.max_queue_size,
                "must be at most 2^61 - 1 (the queue's implementation limit; batches are queued in memory, so any useful size is far smaller)",
            );
        }
        Ok(())
    }
}

/// The largest `max_queue_size` accepted: tokio's bounded channel holds at most
/// `Semaphore::MAX_PERMITS` (2^61 - 1) messages and panics when asked for more.
pub const MAX_QUEUE_SIZE: usize = tokio::sync::Semaphore::MAX_PERMITS;

/// The socket address of a `tcp://HOST:PORT` endpoint (`*` is every IPv4 interface).
pub(crate) fn bind_address(endpoint: &str) -> std::result::Result<std::net::SocketAddr, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| "must be tcp://HOST:PORT".to_string())?;
    let rest = rest
        .strip_prefix("*:")
        .map_or_else(|| rest.to_string(), |port| format!("0.0.0.0:{port}"));
    rest.parse()
        .map_err(|e| format!("must be tcp://HOST:PORT with a numeric host: {e}"))
}
