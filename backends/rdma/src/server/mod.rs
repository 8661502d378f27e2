//! The memory-pool server: owns the pool's regions and the [`index`], and serves the
//! [`crate::protocol`] on a TCP listener.
//!
//! Start it in-process with [`RdmaServer::start`] (tests bind `127.0.0.1:0` and read
//! [`ServerHandle::local_addr`]) or as the `hicache-rdma-server` binary.
//!
//! # Connections
//!
//! One tokio task per connection handles its requests in order (pipelined requests are read
//! as they come; replies are flushed when no further request is buffered). Page bytes move
//! between the socket and the pool's memory directly: `WRITE` payloads are read straight into
//! the reserved extent, `READ` replies are written straight from the pinned extent. When a
//! connection ends, for any reason (close, error, server shutdown), its uncommitted
//! reservations and its leases are released (index invariant 4).
//!
//! A sweeper task expires leases and reservations whose time ran out.
//!
//! # Trust
//!
//! Every connection authenticates ([`crate::auth`]) before its first request, within
//! `handshake_ms`; each request's keys are checked against the tenant's namespace grant
//! before the index is touched. A connection is closed when it sends nothing for `idle_ms`
//! (except one carrying an RDMA queue pair, whose reads bypass the socket), when a frame
//! stalls half-way for `idle_ms`, when a `READ` reply is not consumed within `lease_ms` (its
//! pins go with it), or when one slot of a `WRITE` payload does not arrive within
//! `alloc_ttl_ms`. Beyond `max_connections` open connections (or `max_tenant_connections` of
//! one tenant) a new one gets a [`code::BUSY`] error and is closed.
//!
//! # Modules
//!
//! This module owns the shared state (`Shared`: index, regions, counters), start-up and the
//! accept loop. Below it, each owning its part: `options` ([`ServerOptions`]), `conn` (one
//! connection's stream, request loop and end), `session` (handshake, tenant limits and
//! per-request authorization), `handle` (one request), [`index`] and [`pool`].

mod conn;
mod frames;
mod handle;
pub mod index;
mod options;
pub mod pool;
mod session;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hicache_core::PageKey;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::error::{RdmaError, Result};
use crate::protocol::{self, ServerInfo, ServerStats, code};
use crate::tls::ServerTls;
use conn::{connection, refuse};
use index::Index;
pub use options::{ServerAuth, ServerOptions};
use pool::{Allocator, Region};

/// State shared by the server's tasks.
struct Shared {
    index: Mutex<Index>,
    regions: Vec<Region>,
    info: ServerInfo,
    opts: ServerOptions,
    seq: AtomicU64,
    connections: AtomicU64,
    protocol_errors: AtomicU64,
    auth_failures: AtomicU64,
    forbidden: AtomicU64,
    refused_connections: AtomicU64,
    timed_out_connections: AtomicU64,
    /// Connections open now (counted at accept, uncounted when their task ends).
    open: AtomicU64,
    /// Open authenticated connections (their ids) per tenant name.
    tenant_conns: Mutex<HashMap<String, Vec<u64>>>,
    /// The TLS acceptor when [`ServerOptions::tls`] is set.
    tls: Option<tokio_rustls::TlsAcceptor>,
    #[cfg(feature = "verbs")]
    verbs: Option<crate::verbs::ServerVerbs>,
}

impl Shared {
    fn occupancy(&self, ix: &Index) -> protocol::Occupancy {
        ix.occupancy(self.seq.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn stats(&self) -> ServerStats {
        let ix = self.index.lock();
        let c = ix.counters();
        ServerStats {
            occupancy: self.occupancy(&ix),
            pool_bytes: self.info.pool_bytes,
            reserved_bytes: c.reserved_bytes,
            reservations: ix.reservations() as u64,
            leases: ix.leases() as u64,
            reclaimed_reservations: c.reclaimed_reservations,
            expired_leases: c.expired_leases,
            connections: self.connections.load(Ordering::Relaxed),
            protocol_errors: self.protocol_errors.load(Ordering::Relaxed),
            auth_failures: self.auth_failures.load(Ordering::Relaxed),
            forbidden: self.forbidden.load(Ordering::Relaxed),
            refused_connections: self.refused_connections.load(Ordering::Relaxed),
            timed_out_connections: self.timed_out_connections.load(Ordering::Relaxed),
            open_connections: self.open.load(Ordering::Relaxed),
        }
    }
}

/// The memory-pool server.
#[derive(Debug)]
pub struct RdmaServer;

impl RdmaServer {
    /// Maps the pool, binds the listener and starts serving in the current tokio runtime.
    pub async fn start(opts: ServerOptions) -> Result<ServerHandle> {
        opts.validate()?;
        let lens = opts.region_lens();
        let regions = map_regions(&opts, &lens)?;
        #[cfg(feature = "verbs")]
        let verbs = register_verbs(&opts, &regions);
        #[allow(unused_mut)]
        let mut descs: Vec<protocol::RegionDesc> = regions
            .iter()
            .map(|r| protocol::RegionDesc {
                id: r.id(),
                len: r.len() as u64,
                addr: 0,
                rkey: 0,
            })
            .collect();
        #[cfg(feature = "verbs")]
        if let Some(v) = &verbs {
            v.publish(&mut descs);
        }
        let info = ServerInfo {
            version: protocol::VERSION,
            server_id: server_id(),
            pool_bytes: lens.iter().sum(),
            max_page_bytes: opts.max_page_bytes.min(opts.region_bytes),
            max_batch: opts.max_batch,
            lease_ms: opts.lease_ms,
            alloc_ttl_ms: opts.alloc_ttl_ms,
            verbs: descs.iter().any(|d| d.rkey != 0),
            regions: descs,
        };
        let tls = opts.tls.as_ref().map(ServerTls::acceptor).transpose()?;
        let (listener, local_addr) = bind(&opts).await?;
        let shared = Arc::new(Shared {
            index: Mutex::new(Index::new(
                Allocator::new(opts.granule, &lens),
                info.max_page_bytes,
                opts.eviction,
            )),
            regions,
            info,
            seq: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            forbidden: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            timed_out_connections: AtomicU64::new(0),
            open: AtomicU64::new(0),
            tenant_conns: Mutex::new(HashMap::new()),
            tls,
            opts,
            #[cfg(feature = "verbs")]
            verbs,
        });
        Ok(ServerHandle::run(listener, local_addr, shared))
    }
}

/// Maps the pool's regions, one mapping of `lens[i]` bytes each.
fn map_regions(opts: &ServerOptions, lens: &[u64]) -> Result<Vec<Region>> {
    lens.iter()
        .enumerate()
        .map(|(i, &len)| {
            Region::map(i as u32, len as usize, opts.populate)
                .map_err(|e| RdmaError::Setup(format!("mapping region {i} of {len} bytes: {e}")))
        })
        .collect()
}

/// Registers the regions with the first RDMA device when asked to; without one the server
/// runs without the verbs data plane (logged).
#[cfg(feature = "verbs")]
fn register_verbs(opts: &ServerOptions, regions: &[Region]) -> Option<crate::verbs::ServerVerbs> {
    if !opts.verbs {
        return None;
    }
    match crate::verbs::ServerVerbs::register(regions.iter().map(|r| (r.addr(), r.len()))) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::info!("rdma server: verbs data plane off: {e}");
            None
        }
    }
}

/// Binds the listener; refuses to serve without authentication on a non-loopback address.
async fn bind(opts: &ServerOptions) -> Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(&opts.listen)
        .await
        .map_err(|e| RdmaError::Setup(format!("bind {}: {e}", opts.listen)))?;
    let local_addr = listener
        .local_addr()
        .map_err(|e| RdmaError::Setup(format!("local address: {e}")))?;
    if opts.auth == ServerAuth::InsecureNoAuth && !local_addr.ip().is_loopback() {
        return Err(RdmaError::Setup(format!(
            "refusing to serve without authentication on {local_addr}, which is not a \
             loopback address: configure tenants or a shared secret, or listen on \
             127.0.0.1 / ::1"
        )));
    }
    Ok((listener, local_addr))
}

fn server_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    xxhash_rust::xxh3::xxh3_64(
        &[t.to_le_bytes(), (std::process::id() as u64).to_le_bytes()].concat(),
    )
}

/// A running server. Dropping it (or [`shutdown`](Self::shutdown)) stops it: the listener
/// closes and every connection is cut.
#[derive(Debug)]
pub struct ServerHandle {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("info", &self.info).finish()
    }
}

impl ServerHandle {
    /// Starts the sweeper and the accept loop of a set-up server.
    fn run(listener: TcpListener, local_addr: SocketAddr, shared: Arc<Shared>) -> Self {
        let o = &shared.opts;
        let mut tasks = JoinSet::new();
        tasks.spawn(sweeper(
            shared.clone(),
            Duration::from_millis((o.lease_ms.min(o.alloc_ttl_ms) as u64 / 4).max(5)),
        ));
        tracing::info!(
            "rdma server listening on {local_addr}: pool {} bytes in {} regions, {}",
            shared.info.pool_bytes,
            shared.regions.len(),
            match &o.auth {
                ServerAuth::Tenants(t) => format!("{} tenant(s)", t.tenants().len()),
                ServerAuth::InsecureNoAuth => "NO AUTHENTICATION (--insecure-no-auth)".into(),
            }
        );
        let task = tokio::spawn(accept_loop(listener, shared.clone(), tasks));
        Self {
            local_addr,
            shared,
            task: Some(task),
        }
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What clients are told at the handshake.
    pub fn info(&self) -> &ServerInfo {
        &self.shared.info
    }

    /// The server's counters.
    pub fn stats(&self) -> ServerStats {
        self.shared.stats()
    }

    /// Fault injection for tests and drills: flips one byte in the middle of the committed
    /// page of `key`, as a memory fault would, without touching its stored checksum. Returns
    /// `false` if the page is absent or being read right now (pinned).
    pub fn damage_page(&self, key: &PageKey) -> bool {
        let ix = self.shared.index.lock();
        let Some(p) = ix.page(key) else {
            return false;
        };
        if ix.is_pinned(key) {
            return false;
        }
        let region = &self.shared.regions[p.extent.region as usize];
        // SAFETY: the index lock is held and the page is not pinned, so no reader has its
        // bytes (readers pin under this lock before reading), and committed extents are never
        // written by anyone else (index invariant 2).
        let bytes = unsafe { region.bytes_mut(p.extent.offset, p.len as usize) };
        bytes[bytes.len() / 2] ^= 0x5a;
        true
    }

    /// Stops the server and cuts every connection, waiting until they are gone.
    pub async fn shutdown(mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

async fn sweeper(shared: Arc<Shared>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        shared.index.lock().sweep(Instant::now());
    }
}

/// Accepts connections; owns every connection task (aborting this task drops the set, which
/// aborts them all). Beyond `max_connections` open connections a new one is refused.
async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut tasks: JoinSet<()>) {
    let mut next_conn = 1u64;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let max = shared.opts.max_connections as u64;
                    if shared.open.load(Ordering::Relaxed) >= max {
                        shared.refused_connections.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            "rdma server: refusing {peer}: {max} connections open (--max-connections)"
                        );
                        tasks.spawn(refuse(
                            shared.clone(),
                            stream,
                            code::BUSY,
                            format!(
                                "server busy: it has {max} connections open, its limit \
                                 (--max-connections); try again later"
                            ),
                        ));
                        continue;
                    }
                    let id = next_conn;
                    next_conn += 1;
                    shared.connections.fetch_add(1, Ordering::Relaxed);
                    shared.open.fetch_add(1, Ordering::Relaxed);
                    tasks.spawn(connection(shared.clone(), stream, peer, id));
                }
                Err(e) => {
                    tracing::warn!("rdma server: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}
