//! # hicache-backend-rdma
//!
//! An L3 backend over remote memory: a memory-pool server and a [`Storage`] client.
//!
//! ## Architecture
//!
//! - **Server** ([`server`], binary `hicache-rdma-server`): owns the pool, a few large
//!   anonymous mappings ([`server::pool::Region`]s, registered with libibverbs when built with
//!   `verbs` and a device is present), a best-fit granule allocator, and the [`server::index`]
//!   that maps a [`PageKey`] (namespace + page hash, 48 bytes) to its committed page (region,
//!   offset, length, layout tag, XXH3-64 checksum). It serves the [`protocol`] on TCP.
//!   In-process: [`RdmaServer::start`] → [`ServerHandle`] (`local_addr()`, `stats()`,
//!   `damage_page()`, `shutdown()`).
//! - **Client** ([`RdmaStorage`], backend name `rdma`): a pool of TCP connections (the
//!   control plane, and with `transport: "tcp"` the data plane too); batches are striped over
//!   connections and run in parallel. With `transport: "verbs"` (feature `verbs`) page bytes
//!   move by one-sided RDMA READ/WRITE between the caller's registered host memory and the
//!   server's regions, at the addresses and rkeys the server publishes.
//!
//! ## Modules and their dependency direction
//!
//! Each module uses only the modules below it, never one above:
//!
//! ```text
//! client (spawn: server only with feature `server`)   server (feature `server`, on by default)
//!    |                                                   |
//!    +---------------------> verbs (feature `verbs`) <---+
//!    +----> tls ----> auth ----> error ----> protocol <--+
//! ```
//!
//! - [`protocol`]: the wire format (frames, messages, limits, op and error codes); depends on
//!   nothing else in the crate.
//! - [`error`]: [`RdmaError`] (wraps [`protocol::ProtocolError`]); [`auth`]: tokens, tenants,
//!   the handshake MACs; [`tls`]: rustls set-up for both sides.
//! - `verbs`: the RDMA data plane of both sides; it takes plain parameters (memory ranges,
//!   device names) and knows neither the client nor the server.
//! - `server` and [`client`] share only the modules above: the client reaches the server
//!   in one place (`client::spawn`, for the `spawn_server` option), and only when the crate
//!   is built with the `server` feature. `--no-default-features` builds the client alone
//!   (then `spawn_server` is refused with a configuration error).
//!
//! ## Protocol (summary; details in [`protocol`])
//!
//! Length-prefixed frames (`u32 body | u64 payload | u64 request id | u8 op`), a `HELLO` →
//! `AUTH` handshake (magic, version, HMAC-SHA256 challenge-response over both sides' nonces:
//! [`auth`]), pipelined requests answered in order. Ops: `EXISTS`
//! (leading run), `READ` (statuses + bytes), `LOOKUP`/`RELEASE` (leased locations for RDMA
//! READ), `ALLOCATE` → `WRITE` → `COMMIT` (or `ABORT`), `DROP` (a corrupt copy), `DELETE`,
//! `STATS`, `VERBS_CONNECT`.
//!
//! ## Invariants
//!
//! 1. A page is visible only after `COMMIT` of a reservation whose bytes were written; a
//!    reservation never committed (client crash, timeout) is never visible and its space is
//!    reclaimed when its connection closes or its `alloc_ttl_ms` runs out.
//! 2. Committed bytes are immutable; an overwrite goes to a new extent and swaps at commit.
//! 3. Every read of page bytes happens under a lease. A leased page is never evicted or
//!    reused; if deleted or replaced meanwhile it vanishes from the index at once, and its
//!    memory is freed when the last lease ends.
//! 4. Eviction (LRU by default) runs on the server when an allocation finds no room, and only
//!    takes unleased committed pages.
//! 5. The client verifies every page read against the checksum stored at commit; a mismatch is
//!    a `Corrupt` outcome (a miss, counted), the destination is zeroed, and the bad copy is
//!    dropped on the server. Bad bytes are never a hit.
//! 6. Namespaces are part of the key: clients of different namespaces sharing a server never
//!    see each other's pages, and a tenant's token is bound to the namespaces it may use:
//!    every key of every request is checked before the index is touched (threat model in the
//!    crate README).
//! 7. No connection holds server resources without progress: the handshake, an idle
//!    connection, a `READ` reply (`lease_ms`) and a `WRITE` slot (`alloc_ttl_ms`) are all
//!    bounded in time, and connections are capped per server and per tenant.
//!
//! ## Lease rules
//!
//! - `READ` (TCP): the server pins the hits while it sends their bytes and unpins when the
//!   send ends, however it ends (a dead reader's connection closes and its pins go). The
//!   reply must be consumed within `lease_ms`, or the connection is closed and the pins go.
//! - `LOOKUP` (verbs): leases last `lease_ms` (server flag `--lease-ms`, default 10 s); the
//!   client releases them after its RDMA READs complete; a lease not released in time
//!   expires, and a connection that closes releases all of its leases, so a dead client never
//!   pins memory for long. A client whose read took longer than its lease still verifies the
//!   checksum, so a page reused under it reads as corrupt, never as a wrong hit.
//!
//! ## Known limits
//!
//! - One server per client (no sharding or replication across servers); pages live as long as
//!   the server process (not persistent).
//! - The allocator is best fit without compaction: with uniform page sizes (the normal case
//!   for a KV cache) an eviction frees exactly one slot, while with mixed sizes an allocation
//!   may evict several pages before a large enough run appears.
//! - verbs: the queue pair is tied to one dedicated control connection; if that connection
//!   breaks, verbs calls fail until the backend is reopened (TCP calls are unaffected).
//!   Completions are busy-polled on the calling thread. Not yet run on RDMA hardware.
//!
//! ## Extra-config (`--storage-backend rdma`)
//!
//! See [`RdmaOptions`]: `server` ("host:port", required unless `spawn_server`), `token` or
//! `token_file` (required by every server not started `--insecure-no-auth`), `spawn_server`, `spawn_populate`, `transport` (`tcp` | `verbs`), `connections`, `connect_timeout_ms`,
//! `io_timeout_ms`, `retry_backoff_ms`, `max_batch`, `stripe_bytes`, `client_name`,
//! `device`, `ib_port`, `gid_index`, `tls_ca_file`, `tls_server_name`, `tls_cert_file`,
//! `tls_key_file` (TLS on the TCP channel: [`tls`]); the common `capacity` sizes a spawned
//! server's pool.
#![warn(missing_docs)]

pub mod auth;
pub mod client;
pub mod error;
pub mod protocol;
#[cfg(feature = "server")]
pub mod server;
pub mod tls;
#[cfg(feature = "verbs")]
pub mod verbs;

use std::sync::Arc;

use async_trait::async_trait;
use hicache_storage::{
    BackendContext, BackendFactory, CommonConfig, ConfigFields, Registry, Storage,
};

pub use auth::{Grant, Tenant, TenantTable, Token};
pub use client::{Connection, RdmaOptions, RdmaStorage, Transport};
pub use error::RdmaError;
pub use hicache_core::PageKey;
#[cfg(feature = "server")]
pub use server::{RdmaServer, ServerAuth, ServerHandle, ServerOptions};

/// The registry name of this backend.
pub const BACKEND_NAME: &str = "rdma";

/// Opens [`RdmaStorage`] from an extra-config.
#[derive(Copy, Clone, Debug, Default)]
pub struct RdmaFactory;

#[async_trait]
impl BackendFactory for RdmaFactory {
    fn name(&self) -> &str {
        BACKEND_NAME
    }

    async fn open(
        &self,
        common: &CommonConfig,
        fields: ConfigFields,
        _ctx: &BackendContext,
    ) -> hicache_storage::Result<Arc<dyn Storage>> {
        let opts = RdmaOptions::from_config(common, fields)?;
        Ok(Arc::new(RdmaStorage::connect(opts).await?))
    }
}

/// Registers the `rdma` backend in `registry`.
pub fn register(registry: &Registry) -> hicache_storage::Result<()> {
    registry.register(RdmaFactory)
}
