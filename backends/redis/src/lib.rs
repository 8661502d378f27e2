//! # hicache-backend-redis
//!
//! The L3 tier shared by a fleet of inference nodes, on an existing distributed engine: a
//! Redis Cluster or Valkey Cluster (or, for small setups, one standalone server). A prefix
//! computed by any node is a hit for every node.
//!
//! ## Model
//!
//! - **One value per page** under `key_prefix` + the [`PageKey`](hicache_core::PageKey) in hex
//!   (namespace id and page hash). No hash tag: pages spread over every shard by hash slot.
//! - **Value** = a 72-byte header (magic, version, layout, length, XXH3-64 checksum, the page
//!   key) + the page bytes ([`value`]). A read verifies all of it; a mismatch is a counted
//!   `Corrupt` outcome (a miss) and the bad copy is deleted — wrong bytes are never a hit.
//! - **Data path** ([`conn`], [`resp`]): page commands go over the backend's own
//!   connections (a small pool per node, TCP or rustls TLS, ACL auth): a `SET` is one vectored
//!   write of a small command head, the header, the page's bytes from the caller's buffer and
//!   a small tail; a `GET` reply's header is verified before its bytes are read straight into
//!   the caller's page buffer. A value longer than `read_chunk_bytes` (1 MiB) is read as
//!   `GETRANGE`s in one `MULTI`/`EXEC` instead, each range straight into the buffer: Redis
//!   gives a `GET` reply of 8 MiB or more fresh memory every time (page faults on the server); an ACL user that may not run those commands gets one `GET` per page after the first refusal. The slot map and the checks at open use the same connections
//!   ([`nodes`]); every reply is read within the bound of what its command can return.
//! - **One budget per call** ([`deadline`]): `timeout_ms` covers everything a call does —
//!   connecting, redirections, slot-map refreshes, retries, each `SCAN` round of `clear` —
//!   and a call that spends it fails with an error saying what was pending.
//! - **Routing** ([`exec`]): a batch is split by the primary owning each key's slot (the slot
//!   map from `CLUSTER SLOTS`, [`topology`]); each shard gets pipelines (one round trip each),
//!   all shards at once, bytes in flight bounded by `max_inflight_bytes`. `batch_exists` of a
//!   batch is one pipeline of `EXISTS` per shard: one round trip per shard, or none for keys
//!   the opt-in presence cache ([`presence`], `presence_cache_keys`) knows: it keeps what the
//!   servers confirmed, and the servers' own invalidation messages (`CLIENT TRACKING`) take
//!   back every key another client changes, deletes or evicts.
//! - **Writes** are `SET key value NX [EX ttl_s]` (one round trip for a new page); a key that
//!   exists is `Present` if its stored header has the same layout and length, else it is
//!   overwritten. With `min_replicas_acked: n ≥ 1` every pipeline ends with `WAIT n
//!   t` (`t`: most of what is left of the call's budget) and its pages are `Stored` only if `n` replicas confirmed them.
//! - **Failover**: `MOVED` re-reads the slot map, `ASK` follows the redirection once,
//!   `TRYAGAIN`/`CLUSTERDOWN`/unreachable nodes are retried with pauses within `timeout_ms`,
//!   then the pages fail alone (a miss for reads, a failed write for sets); the cache keeps
//!   serving from L1/L2 and the backend recovers by itself once the cluster heals.
//! - **Eviction** is the cluster's (`maxmemory` + `maxmemory-policy allkeys-lru`); an evicted
//!   page is a miss. [`StorageStats::pages`](hicache_storage::StorageStats) and `bytes` count
//!   what this process stored minus what it deleted, not the cluster's contents.
//!
//! ## Extra-config (`--storage-backend redis`)
//!
//! See [`RedisOptions`]: `nodes` (required), `cluster`, `username`, `password`, `tls`,
//! `tls_ca_file`, `key_prefix`, `ttl_s`, `min_replicas_acked`, `timeout_ms`,
//! `max_inflight_bytes`, `read_chunk_bytes`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
pub mod conn;
pub mod deadline;
pub mod error;
pub mod exec;
pub mod nodes;
pub mod presence;
pub mod resp;
pub mod storage;
#[cfg(feature = "testing")]
pub mod testing;
pub mod topology;
pub mod value;

use std::sync::Arc;

use hicache_storage::{
    BackendContext, BackendFactory, CommonConfig, ConfigFields, Registry, Result, Storage,
    async_trait,
};

pub use config::RedisOptions;
pub use error::RedisError;
pub use storage::RedisStorage;

/// The registry name of this backend.
pub const NAME: &str = "redis";

/// Opens [`RedisStorage`] from extra-config.
#[derive(Debug, Default, Clone, Copy)]
pub struct RedisFactory;

#[async_trait]
impl BackendFactory for RedisFactory {
    fn name(&self) -> &str {
        NAME
    }

    async fn open(
        &self,
        _common: &CommonConfig,
        fields: ConfigFields,
        _ctx: &BackendContext,
    ) -> Result<Arc<dyn Storage>> {
        let opts = RedisOptions::from_fields(fields)?;
        Ok(Arc::new(RedisStorage::open(opts).await?))
    }
}

/// Adds the `redis` backend to `registry`.
pub fn register(registry: &Registry) -> Result<()> {
    registry.register(RedisFactory)
}
