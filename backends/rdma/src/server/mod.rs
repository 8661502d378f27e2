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

pub mod index;
pub mod pool;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hicache_core::PageKey;
use hicache_storage::EvictionPolicy;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::auth::{self, Grant, TenantTable};
use crate::error::{RdmaError, Result};
use crate::protocol::{
    self, FrameError, ProtocolError, Reply, ReplyFrame, Request, ServerInfo, ServerStats, code, op,
};
use crate::tls::{BoxRead, BoxWrite, ServerTls};
use index::{Index, Pinned};
use pool::{Allocator, Region};

/// Who may connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerAuth {
    /// Clients authenticate with one of these tenants' tokens and may touch only the
    /// namespaces granted to it. An empty table is refused at start.
    Tenants(TenantTable),
    /// Anyone who reaches the port may do anything (`--insecure-no-auth`). Only accepted on
    /// a loopback listen address; for tests.
    InsecureNoAuth,
}

impl Default for ServerAuth {
    /// No tenants: a server must be given credentials, or told explicitly to run insecure.
    fn default() -> Self {
        ServerAuth::Tenants(TenantTable::default())
    }
}

/// Options of a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerOptions {
    /// Address to listen on (`127.0.0.1:7470`; port 0 picks a free one).
    pub listen: String,
    /// Credentials; the default (none) is refused at start.
    pub auth: ServerAuth,
    /// Time a new connection has to complete the handshake.
    pub handshake_ms: u32,
    /// A connection that sends nothing for this long (or stalls mid-frame) is closed.
    pub idle_ms: u32,
    /// Most connections open at once; further ones are refused with [`code::BUSY`].
    pub max_connections: u32,
    /// Most connections of one tenant open at once.
    pub max_tenant_connections: u32,
    /// Most bytes one tenant may hold in flight: reserved for writes not yet committed plus
    /// pinned by reads (checked per `READ`, `LOOKUP` and `ALLOCATE` against the bytes it
    /// names; a request that would exceed it is refused with [`code::BUSY`]). `None`: no limit.
    pub max_tenant_inflight_bytes: Option<u64>,
    /// Bytes of the whole pool.
    pub pool_bytes: u64,
    /// Bytes of one region (one mapping, one RDMA registration); a page never spans two.
    pub region_bytes: u64,
    /// Allocation granule ("page class"): every page occupies a whole number of granules.
    pub granule: u64,
    /// Largest page accepted (never more than a region).
    pub max_page_bytes: u64,
    /// Eviction under capacity pressure; `None` refuses new pages when full.
    pub eviction: Option<EvictionPolicy>,
    /// Lifetime of a `LOOKUP` lease.
    pub lease_ms: u32,
    /// Lifetime of an uncommitted reservation.
    pub alloc_ttl_ms: u32,
    /// Largest list in one request.
    pub max_batch: u32,
    /// Pre-fault the regions at start (`MAP_POPULATE`).
    pub populate: bool,
    /// Register the regions for RDMA when built with `verbs` and a device is present.
    pub verbs: bool,
    /// TLS on every connection (`None`: plain TCP). See [`crate::tls`].
    pub tls: Option<ServerTls>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
            auth: ServerAuth::default(),
            handshake_ms: 5_000,
            idle_ms: 300_000,
            max_connections: 1024,
            max_tenant_connections: 256,
            max_tenant_inflight_bytes: None,
            pool_bytes: 1 << 30,
            region_bytes: 1 << 30,
            granule: 4096,
            max_page_bytes: 256 << 20,
            eviction: Some(EvictionPolicy::Lru),
            lease_ms: 10_000,
            alloc_ttl_ms: 30_000,
            max_batch: 4096,
            populate: false,
            verbs: true,
            tls: None,
        }
    }
}

impl ServerOptions {
    /// Checks the options, naming the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, why: String| Err(RdmaError::Setup(format!("{what}: {why}")));
        if self.granule == 0 || !self.granule.is_power_of_two() {
            return bad("granule", format!("{} is not a power of two", self.granule));
        }
        if self.pool_bytes < self.granule {
            return bad(
                "pool_bytes",
                format!("{} is below one granule", self.pool_bytes),
            );
        }
        if self.region_bytes < self.granule {
            return bad(
                "region_bytes",
                format!("{} is below one granule", self.region_bytes),
            );
        }
        if self.max_page_bytes == 0 {
            return bad("max_page_bytes", "must be at least 1".into());
        }
        if self.lease_ms == 0 || self.alloc_ttl_ms == 0 {
            return bad("lease_ms / alloc_ttl_ms", "must be at least 1 ms".into());
        }
        if let ServerAuth::Tenants(t) = &self.auth
            && t.is_empty()
        {
            return bad(
                "auth",
                "no credentials configured: give tenants (--tenants FILE) or a shared secret \
                 (--secret-file FILE), or explicitly --insecure-no-auth (loopback tests only)"
                    .into(),
            );
        }
        if self.handshake_ms == 0 || self.idle_ms == 0 {
            return bad("handshake_ms / idle_ms", "must be at least 1 ms".into());
        }
        if self.max_connections == 0 || self.max_tenant_connections == 0 {
            return bad(
                "max_connections / max_tenant_connections",
                "must be at least 1".into(),
            );
        }
        let regions = self
            .pool_bytes
            .div_ceil(self.region_bytes / self.granule * self.granule);
        if regions > protocol::MAX_REGIONS as u64 {
            return bad(
                "pool_bytes",
                format!(
                    "{} bytes in regions of {} bytes make {regions} regions, more than the {} \
                     the protocol can describe to clients (raise --region or lower --pool)",
                    self.pool_bytes,
                    self.region_bytes,
                    protocol::MAX_REGIONS
                ),
            );
        }
        if let Some(total) = hicache_storage::machine::memory_total_bytes()
            && self.pool_bytes > total
        {
            return bad(
                "pool_bytes",
                format!(
                    "{} bytes is more than this machine's physical memory ({total} bytes): the \
                     pool is held in memory",
                    self.pool_bytes
                ),
            );
        }
        if self.max_batch < 128 {
            return bad(
                "max_batch",
                format!("{} is below the controller's 128", self.max_batch),
            );
        }
        Ok(())
    }

    /// Region lengths: `pool_bytes` cut into `region_bytes` pieces, rounded down to granules.
    fn region_lens(&self) -> Vec<u64> {
        let mut left = self.pool_bytes / self.granule * self.granule;
        let per = self.region_bytes / self.granule * self.granule;
        let mut v = Vec::new();
        while left > 0 {
            let n = left.min(per);
            v.push(n);
            left -= n;
        }
        v
    }
}

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
        let mut regions = Vec::with_capacity(lens.len());
        for (i, &len) in lens.iter().enumerate() {
            regions.push(
                Region::map(i as u32, len as usize, opts.populate).map_err(|e| {
                    RdmaError::Setup(format!("mapping region {i} of {len} bytes: {e}"))
                })?,
            );
        }
        #[cfg(feature = "verbs")]
        let verbs = if opts.verbs {
            match crate::verbs::ServerVerbs::register(&regions) {
                Ok(v) => Some(v),
                Err(e) => {
                    tracing::info!("rdma server: verbs data plane off: {e}");
                    None
                }
            }
        } else {
            None
        };
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
            opts: opts.clone(),
            #[cfg(feature = "verbs")]
            verbs,
        });
        let mut tasks = JoinSet::new();
        tasks.spawn(sweeper(
            shared.clone(),
            Duration::from_millis((opts.lease_ms.min(opts.alloc_ttl_ms) as u64 / 4).max(5)),
        ));
        let task = tokio::spawn(accept_loop(listener, shared.clone(), tasks));
        tracing::info!(
            "rdma server listening on {local_addr}: pool {} bytes in {} regions, {}",
            shared.info.pool_bytes,
            shared.regions.len(),
            match &opts.auth {
                ServerAuth::Tenants(t) => format!("{} tenant(s)", t.tenants().len()),
                ServerAuth::InsecureNoAuth => "NO AUTHENTICATION (--insecure-no-auth)".into(),
            }
        );
        Ok(ServerHandle {
            local_addr,
            shared,
            task: Some(task),
        })
    }
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

/// How long a refusal or a closing error frame may take to send.
const FAREWELL: Duration = Duration::from_secs(1);

/// The connection's byte stream: `stream` itself, or with TLS on, the TLS session after its
/// handshake (bounded by `handshake_ms`; a failed or slow handshake ends the connection
/// without a word, since the peer does not speak TLS or is not trusted).
async fn open_stream(
    shared: &Shared,
    stream: TcpStream,
) -> std::result::Result<(BoxRead, BoxWrite), End> {
    let _ = stream.set_nodelay(true);
    match &shared.tls {
        None => Ok(crate::tls::split_tcp(stream)),
        Some(acceptor) => {
            let tls = bounded(
                shared.opts.handshake_ms,
                "the TLS handshake",
                true,
                acceptor.accept(stream),
            )
            .await?;
            Ok(crate::tls::split(tls))
        }
    }
}

/// Tells a connection it is refused, then closes it once the peer has had a moment to read
/// the error (reading what it sent meanwhile, so the close is not a reset that loses the
/// error frame). Bounded by [`FAREWELL`] twice (plus the TLS handshake, if on).
async fn refuse(shared: Arc<Shared>, stream: TcpStream, code: u16, message: String) {
    let Ok((mut r, w)) = open_stream(&shared, stream).await else {
        return;
    };
    let mut w = BufWriter::new(w);
    let _ = tokio::time::timeout(FAREWELL, send_error(&mut w, 0, code, &message)).await;
    let _ = tokio::time::timeout(FAREWELL, async {
        let _ = w.shutdown().await;
        let mut sink = [0u8; 4096];
        while matches!(r.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// Releases a connection's reservations and leases when its task ends, however it ends.
struct ConnGuard {
    shared: Arc<Shared>,
    conn: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.shared.index.lock().connection_closed(self.conn);
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            v.connection_closed(self.conn);
        }
        self.shared.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One authenticated connection's tenant; uncounts the connection from its tenant on drop.
struct Session {
    shared: Arc<Shared>,
    conn: u64,
    tenant: String,
    grant: Grant,
}

impl Drop for Session {
    fn drop(&mut self) {
        let mut m = self.shared.tenant_conns.lock();
        if let Some(v) = m.get_mut(&self.tenant) {
            v.retain(|c| *c != self.conn);
            if v.is_empty() {
                m.remove(&self.tenant);
            }
        }
    }
}

impl Session {
    /// The first namespace among `keys` the tenant may not use.
    fn forbidden<'k>(&self, mut keys: impl Iterator<Item = &'k PageKey>) -> Option<PageKey> {
        keys.find(|k| !self.grant.allows(&k.namespace)).copied()
    }

    /// Bytes the tenant holds in flight over all its connections.
    fn in_flight(&self) -> u64 {
        let conns = self
            .shared
            .tenant_conns
            .lock()
            .get(&self.tenant)
            .cloned()
            .unwrap_or_default();
        let ix = self.shared.index.lock();
        conns.iter().map(|c| ix.usage(*c).in_flight()).sum()
    }
}

/// Releases server-side read pins when a send ends, however it ends.
struct PinGuard<'a> {
    shared: &'a Shared,
    leases: Vec<u64>,
}

impl Drop for PinGuard<'_> {
    fn drop(&mut self) {
        if !self.leases.is_empty() {
            self.shared.index.lock().release(&self.leases);
        }
    }
}

/// Marks a reservation as no longer being written when a write ends, however it ends.
struct WriteGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.shared.index.lock().end_write(self.id);
    }
}

type Rd = BufReader<BoxRead>;
type Wr = BufWriter<BoxWrite>;

/// Why a connection ends early.
#[derive(Debug)]
enum End {
    /// A frame broke the protocol.
    Protocol(ProtocolError),
    /// The socket failed (or the peer closed mid-frame).
    Io(std::io::Error),
    /// The peer took too long; `silent`: close without an error frame (idle).
    Timeout {
        what: &'static str,
        ms: u32,
        silent: bool,
    },
    /// Refused with an error frame (authentication, a tenant's connection limit).
    Refused { code: u16, message: String },
}

impl From<FrameError> for End {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Protocol(p) => End::Protocol(p),
            FrameError::Io(e) => End::Io(e),
        }
    }
}

impl From<ProtocolError> for End {
    fn from(e: ProtocolError) -> Self {
        End::Protocol(e)
    }
}

impl From<std::io::Error> for End {
    fn from(e: std::io::Error) -> Self {
        End::Io(e)
    }
}

/// Runs `f`, ending the connection if it takes longer than `ms`.
async fn bounded<T, E: Into<End>>(
    ms: u32,
    what: &'static str,
    silent: bool,
    f: impl std::future::Future<Output = std::result::Result<T, E>>,
) -> std::result::Result<T, End> {
    match tokio::time::timeout(Duration::from_millis(ms as u64), f).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(End::Timeout { what, ms, silent }),
    }
}

async fn connection(shared: Arc<Shared>, stream: TcpStream, peer: SocketAddr, conn: u64) {
    let _guard = ConnGuard {
        shared: shared.clone(),
        conn,
    };
    let (r, w) = match open_stream(&shared, stream).await {
        Ok(halves) => halves,
        Err(e) => {
            shared.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::info!("rdma server: TLS handshake with {peer} failed: {e:?}");
            return;
        }
    };
    let mut r = BufReader::with_capacity(crate::protocol::READ_BUFFER, r);
    let mut w = BufWriter::with_capacity(crate::protocol::WRITE_BUFFER, w);
    let farewell = match serve(&shared, &mut r, &mut w, conn, peer).await {
        Ok(()) => None,
        Err(End::Protocol(e)) => {
            shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("rdma server: protocol error from {peer}: {e}");
            let c = match e {
                ProtocolError::Version { .. } => code::VERSION,
                _ => code::PROTOCOL,
            };
            Some((c, e.to_string()))
        }
        Err(End::Io(e)) => {
            tracing::debug!("rdma server: connection {peer} ended: {e}");
            None
        }
        Err(End::Timeout { what, ms, silent }) => {
            shared.timed_out_connections.fetch_add(1, Ordering::Relaxed);
            tracing::info!("rdma server: closing {peer}: {what} took over {ms} ms");
            (!silent).then(|| {
                (
                    code::TIMEOUT,
                    format!("closing the connection: {what} took over {ms} ms"),
                )
            })
        }
        Err(End::Refused { code, message }) => {
            tracing::warn!("rdma server: refusing {peer}: {message}");
            Some((code, message))
        }
    };
    if let Some((c, m)) = farewell {
        let _ = tokio::time::timeout(FAREWELL, send_error(&mut w, 0, c, &m)).await;
    }
}

async fn send_error(w: &mut Wr, id: u64, code: u16, message: &str) -> std::io::Result<()> {
    let f = ReplyFrame::Error {
        code,
        message: message.to_string(),
    };
    protocol::write_frame(w, id, op::ERROR, &f.encode(), 0).await?;
    w.flush().await
}

async fn send(
    shared: &Shared,
    w: &mut Wr,
    id: u64,
    reply: Reply,
    payload_len: u64,
) -> std::io::Result<()> {
    let occ = shared.occupancy(&shared.index.lock());
    let f = ReplyFrame::Ok(occ, reply);
    protocol::write_frame(w, id, f.op(), &f.encode(), payload_len).await
}

/// The handshake (protocol rule 1): `HELLO`, then `AUTH`; returns the connection's session.
async fn handshake(
    shared: &Arc<Shared>,
    r: &mut Rd,
    w: &mut Wr,
    conn: u64,
    peer: SocketAddr,
) -> Result<Session, End> {
    let (head, body) = protocol::read_frame_limited(r, protocol::MAX_HANDSHAKE_BODY).await?;
    if head.op != op::HELLO {
        return Err(ProtocolError::NoHello(head.op).into());
    }
    let Request::Hello {
        client,
        nonce: client_nonce,
        ..
    } = Request::decode(op::HELLO, &body)?
    else {
        unreachable!("decode of HELLO yields Hello")
    };
    if head.payload_len != 0 {
        return Err(ProtocolError::Invalid {
            what: "HELLO payload length",
            value: head.payload_len,
        }
        .into());
    }
    let server_nonce = auth::random_bytes::<{ auth::NONCE_LEN }>().map_err(|e| End::Refused {
        code: code::INTERNAL,
        message: e.to_string(),
    })?;
    let required = shared.opts.auth != ServerAuth::InsecureNoAuth;
    let hello = Reply::Hello {
        nonce: server_nonce,
        auth: required,
    };
    // Not authenticated yet: the reply carries no occupancy (the pool's totals are for
    // tenants only).
    let f = ReplyFrame::Ok(protocol::Occupancy::default(), hello);
    protocol::write_frame(w, head.id, f.op(), &f.encode(), 0).await?;
    w.flush().await?;
    let (head, body) = protocol::read_frame_limited(r, protocol::MAX_HANDSHAKE_BODY).await?;
    if head.op != op::AUTH {
        return Err(ProtocolError::NoAuth(head.op).into());
    }
    let Request::Auth { mac } = Request::decode(op::AUTH, &body)? else {
        unreachable!("decode of AUTH yields Auth")
    };
    if head.payload_len != 0 {
        return Err(ProtocolError::Invalid {
            what: "AUTH payload length",
            value: head.payload_len,
        }
        .into());
    }
    let fail = |message: &str| {
        shared.auth_failures.fetch_add(1, Ordering::Relaxed);
        End::Refused {
            code: code::AUTH,
            message: message.to_string(),
        }
    };
    let (tenant, grant, proof) = match (&shared.opts.auth, mac) {
        (ServerAuth::InsecureNoAuth, _) => ("insecure".to_string(), Grant::Any, None),
        (ServerAuth::Tenants(_), None) => {
            return Err(fail(
                "authentication required: this server accepts only clients with a token \
                 (`token` or `token_file` in the rdma extra-config)",
            ));
        }
        (ServerAuth::Tenants(table), Some(mac)) => {
            match table.authenticate(&client_nonce, &server_nonce, &mac) {
                Some(t) => (
                    t.name.clone(),
                    t.grant.clone(),
                    Some(auth::server_proof(&t.token, &client_nonce, &server_nonce)),
                ),
                None => {
                    return Err(fail(
                        "authentication failed: the token is not one this server knows",
                    ));
                }
            }
        }
    };
    {
        let max = shared.opts.max_tenant_connections;
        let mut m = shared.tenant_conns.lock();
        let conns = m.entry(tenant.clone()).or_default();
        if conns.len() >= max as usize {
            shared.refused_connections.fetch_add(1, Ordering::Relaxed);
            return Err(End::Refused {
                code: code::BUSY,
                message: format!(
                    "tenant {tenant:?} already has {max} connections open, its limit \
                     (--max-tenant-connections); try again later"
                ),
            });
        }
        conns.push(conn);
    }
    let session = Session {
        shared: shared.clone(),
        conn,
        tenant,
        grant,
    };
    tracing::debug!(
        "rdma server: {peer} ({client:?}) authenticated as tenant {:?}",
        session.tenant
    );
    let info = shared.info.clone();
    send(shared, w, head.id, Reply::Auth { info, proof }, 0).await?;
    w.flush().await?;
    Ok(session)
}

/// Serves one connection until it closes (`Ok`) or fails.
async fn serve(
    shared: &Arc<Shared>,
    r: &mut Rd,
    w: &mut Wr,
    conn: u64,
    peer: SocketAddr,
) -> Result<(), End> {
    let o = &shared.opts;
    let session = bounded(
        o.handshake_ms,
        "the handshake",
        false,
        handshake(shared, r, w, conn, peer),
    )
    .await?;
    // A connection carrying an RDMA queue pair may stay quiet (its reads bypass the socket).
    let mut verbs_attached = false;
    loop {
        let mut h = [0u8; protocol::HEAD_LEN];
        let got = if verbs_attached {
            r.read_exact(&mut h).await
        } else {
            match tokio::time::timeout(
                Duration::from_millis(o.idle_ms as u64),
                r.read_exact(&mut h),
            )
            .await
            {
                Ok(got) => got,
                Err(_) => {
                    return Err(End::Timeout {
                        what: "waiting for a request (idle connection)",
                        ms: o.idle_ms,
                        silent: true,
                    });
                }
            }
        };
        match got {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let head = protocol::FrameHead::decode(&h)?;
        let mut body = vec![0u8; head.body_len as usize];
        bounded(o.idle_ms, "a request body", false, r.read_exact(&mut body)).await?;
        let req = Request::decode(head.op, &body)?;
        let max = shared.info.max_batch as usize;
        let listed = match &req {
            Request::Exists { keys } | Request::Delete { keys } => keys.len(),
            Request::Read { pages } | Request::Lookup { pages } | Request::Allocate { pages } => {
                pages.len()
            }
            Request::Write { slots } | Request::Commit { slots } => slots.len(),
            Request::Abort { slots } | Request::Release { leases: slots } => slots.len(),
            Request::Drop { pages } => pages.len(),
            _ => 0,
        };
        if listed > max {
            return Err(ProtocolError::TooLarge {
                what: "request list",
                len: listed as u64,
                max: max as u64,
            }
            .into());
        }
        if head.payload_len != 0 && !matches!(req, Request::Write { .. }) {
            return Err(ProtocolError::Invalid {
                what: "payload length of a request without payload",
                value: head.payload_len,
            }
            .into());
        }
        // Authorization: every key of the request must be in the tenant's namespaces.
        let denied = match &req {
            Request::Exists { keys } | Request::Delete { keys } => session.forbidden(keys.iter()),
            Request::Read { pages } | Request::Lookup { pages } | Request::Allocate { pages } => {
                session.forbidden(pages.iter().map(|p| &p.key))
            }
            Request::Drop { pages } => session.forbidden(pages.iter().map(|p| &p.0)),
            _ => None,
        };
        if let Some(k) = denied {
            shared.forbidden.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "rdma server: tenant {:?} at {peer} denied namespace {}",
                session.tenant,
                k.namespace.to_hex()
            );
            let message = format!(
                "tenant {:?} may not use namespace {} (not in its grant)",
                session.tenant,
                k.namespace.to_hex()
            );
            bounded(
                o.idle_ms,
                "sending a reply",
                false,
                send_error(w, head.id, code::FORBIDDEN, &message),
            )
            .await?;
            continue;
        }
        // Per-tenant in-flight bytes (checked per request: a tenant's concurrent requests on
        // several connections may overshoot by at most one request each).
        let wanted = match &req {
            Request::Read { pages } | Request::Lookup { pages } | Request::Allocate { pages } => {
                pages.iter().fold(0u64, |a, p| a.saturating_add(p.len))
            }
            _ => 0,
        };
        if let Some(cap) = o.max_tenant_inflight_bytes
            && wanted > 0
        {
            let used = session.in_flight();
            if used.saturating_add(wanted) > cap {
                let message = format!(
                    "tenant {:?} holds {used} bytes in flight (reserved or being read); \
                     {wanted} more would exceed its limit of {cap} (--max-tenant-inflight)",
                    session.tenant
                );
                bounded(
                    o.idle_ms,
                    "sending a reply",
                    false,
                    send_error(w, head.id, code::BUSY, &message),
                )
                .await?;
                continue;
            }
        }
        let attach = matches!(req, Request::VerbsConnect { .. });
        let served = handle(shared, r, w, conn, head.id, head.payload_len, req).await?;
        verbs_attached |= attach && served;
        if r.buffer().is_empty() {
            bounded(o.idle_ms, "sending a reply", false, w.flush()).await?;
        }
    }
}

/// Answers request `id` with an error frame; the connection goes on.
async fn refuse_request(
    w: &mut Wr,
    id: u64,
    idle_ms: u32,
    code: u16,
    message: String,
) -> Result<bool, End> {
    bounded(
        idle_ms,
        "sending a reply",
        false,
        send_error(w, id, code, &message),
    )
    .await
    .map(|()| false)
}

/// Handles one request; `Ok(false)` if it was refused with an error frame (the connection
/// goes on).
async fn handle(
    shared: &Shared,
    r: &mut Rd,
    w: &mut Wr,
    conn: u64,
    id: u64,
    payload_len: u64,
    req: Request,
) -> Result<bool, End> {
    let now = Instant::now();
    let o = &shared.opts;
    let reply = match req {
        Request::Hello { .. } | Request::Auth { .. } => {
            return Err(ProtocolError::Invalid {
                what: "handshake op after the handshake (op)",
                value: op::HELLO as u64,
            }
            .into());
        }
        Request::Exists { keys } => Reply::Exists {
            run: shared.index.lock().exists(&keys) as u32,
        },
        Request::Read { pages } => {
            let statuses = shared.index.lock().read(conn, &pages);
            let pins: Vec<Pinned> = statuses.iter().filter_map(|s| s.1).collect();
            let guard = PinGuard {
                shared,
                leases: pins.iter().map(|p| p.lease).collect(),
            };
            let total: u64 = pins.iter().map(|p| p.len).sum();
            // The pins are read leases: the reply must be consumed within `lease_ms`, or the
            // connection ends and `guard` unpins (a reader that stops reading cannot keep
            // pages from eviction).
            bounded(o.lease_ms, "consuming a READ reply", false, async {
                send(
                    shared,
                    w,
                    id,
                    Reply::Read(statuses.into_iter().map(|s| s.0).collect()),
                    total,
                )
                .await?;
                for p in &pins {
                    let region = &shared.regions[p.extent.region as usize];
                    // SAFETY: the extent is pinned by `guard` until the send ends (index
                    // invariant 3): it is committed, hence immutable (invariant 2), and cannot
                    // be freed or reused while pinned.
                    let bytes = unsafe { region.bytes(p.extent.offset, p.len as usize) };
                    w.write_all(bytes).await?;
                }
                std::io::Result::Ok(())
            })
            .await?;
            drop(guard);
            return Ok(true);
        }
        Request::Lookup { pages } => {
            #[cfg(feature = "verbs")]
            let available = shared.verbs.is_some();
            #[cfg(not(feature = "verbs"))]
            let available = false;
            if !available {
                return refuse_request(
                    w,
                    id,
                    o.idle_ms,
                    code::UNSUPPORTED,
                    "LOOKUP needs the verbs data plane, which this server does not offer".into(),
                )
                .await;
            }
            let deadline = now + Duration::from_millis(o.lease_ms as u64);
            Reply::Lookup(shared.index.lock().lookup(conn, &pages, deadline))
        }
        Request::Release { leases } => Reply::Release {
            released: shared.index.lock().release_for(conn, &leases) as u32,
        },
        Request::Allocate { pages } => {
            let deadline = now + Duration::from_millis(o.alloc_ttl_ms as u64);
            Reply::Allocate(shared.index.lock().allocate(conn, &pages, deadline))
        }
        Request::Write { slots } => {
            let sum = slots
                .iter()
                .try_fold(0u64, |a, s| a.checked_add(s.1))
                .unwrap_or(u64::MAX);
            if sum != payload_len {
                return Err(ProtocolError::Invalid {
                    what: "WRITE payload length (must equal the sum of slot lengths)",
                    value: payload_len,
                }
                .into());
            }
            let mut ok = Vec::with_capacity(slots.len());
            for (slot, len) in slots {
                let extent = shared.index.lock().begin_write(conn, slot, len);
                // Each slot's bytes must arrive within the reservation's lifetime: a writer
                // that stalls cannot keep a reservation from expiring forever.
                let what = "receiving one page of a WRITE payload";
                match extent {
                    Some(e) => {
                        let _g = WriteGuard { shared, id: slot };
                        let region = &shared.regions[e.region as usize];
                        // SAFETY: the reservation belongs to this connection and is marked
                        // as being written (index invariant 4): nobody else reads or writes
                        // the extent until `_g` clears the mark, and it is not visible
                        // before commit (invariant 1).
                        let dst = unsafe { region.bytes_mut(e.offset, len as usize) };
                        bounded(o.alloc_ttl_ms, what, false, r.read_exact(dst)).await?;
                        ok.push(true);
                    }
                    None => {
                        bounded(o.alloc_ttl_ms, what, false, protocol::skip_payload(r, len))
                            .await?;
                        ok.push(false);
                    }
                }
            }
            Reply::Write(ok)
        }
        Request::Commit { slots } => {
            let mut ix = shared.index.lock();
            Reply::Commit(
                slots
                    .iter()
                    .map(|(s, sum)| ix.commit(conn, *s, *sum))
                    .collect(),
            )
        }
        Request::Abort { slots } => Reply::Abort {
            n: shared.index.lock().abort(conn, &slots) as u32,
        },
        Request::Drop { pages } => Reply::Drop {
            n: shared.index.lock().drop_if(&pages) as u32,
        },
        Request::Delete { keys } => Reply::Delete {
            n: shared.index.lock().delete(&keys) as u32,
        },
        Request::Stats => Reply::Stats(shared.stats()),
        Request::VerbsConnect { endpoint } => {
            #[cfg(feature = "verbs")]
            {
                match &shared.verbs {
                    Some(v) => match v.accept(conn, endpoint) {
                        Ok(mine) => Reply::VerbsConnect(mine),
                        Err(e) => {
                            return refuse_request(w, id, o.idle_ms, code::INTERNAL, e.to_string())
                                .await;
                        }
                    },
                    None => {
                        return refuse_request(
                            w,
                            id,
                            o.idle_ms,
                            code::UNSUPPORTED,
                            "this server has no RDMA device registered".into(),
                        )
                        .await;
                    }
                }
            }
            #[cfg(not(feature = "verbs"))]
            {
                let _ = endpoint;
                return refuse_request(
                    w,
                    id,
                    o.idle_ms,
                    code::UNSUPPORTED,
                    "this server was built without the verbs feature".into(),
                )
                .await;
            }
        }
    };
    bounded(
        o.idle_ms,
        "sending a reply",
        false,
        send(shared, w, id, reply, 0),
    )
    .await?;
    Ok(true)
}
