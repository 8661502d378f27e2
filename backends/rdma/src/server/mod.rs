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

pub mod index;
pub mod pool;

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

use crate::error::{RdmaError, Result};
use crate::protocol::{
    self, FrameError, ProtocolError, Reply, ReplyFrame, Request, ServerInfo, ServerStats, code, op,
};
use index::{Index, Pinned};
use pool::{Allocator, Region};

/// Options of a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerOptions {
    /// Address to listen on (`0.0.0.0:7470`; port 0 picks a free one).
    pub listen: String,
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
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
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
    seq: AtomicU64,
    connections: AtomicU64,
    protocol_errors: AtomicU64,
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
        let listener = TcpListener::bind(&opts.listen)
            .await
            .map_err(|e| RdmaError::Setup(format!("bind {}: {e}", opts.listen)))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| RdmaError::Setup(format!("local address: {e}")))?;
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
            "rdma server listening on {local_addr}: pool {} bytes in {} regions",
            shared.info.pool_bytes,
            shared.regions.len()
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
/// aborts them all).
async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut tasks: JoinSet<()>) {
    let mut next_conn = 1u64;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let id = next_conn;
                    next_conn += 1;
                    shared.connections.fetch_add(1, Ordering::Relaxed);
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

type Rd = BufReader<tokio::net::tcp::OwnedReadHalf>;
type Wr = BufWriter<tokio::net::tcp::OwnedWriteHalf>;

async fn connection(shared: Arc<Shared>, stream: TcpStream, peer: SocketAddr, conn: u64) {
    let _guard = ConnGuard {
        shared: shared.clone(),
        conn,
    };
    let _ = stream.set_nodelay(true);
    let (r, w) = stream.into_split();
    let mut r = BufReader::with_capacity(crate::protocol::READ_BUFFER, r);
    let mut w = BufWriter::with_capacity(crate::protocol::WRITE_BUFFER, w);
    match serve(&shared, &mut r, &mut w, conn).await {
        Ok(()) => {}
        Err(FrameError::Protocol(e)) => {
            shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("rdma server: protocol error from {peer}: {e}");
            let c = match e {
                ProtocolError::Version { .. } => code::VERSION,
                _ => code::PROTOCOL,
            };
            let _ = send_error(&mut w, 0, c, &e.to_string()).await;
        }
        Err(FrameError::Io(e)) => tracing::debug!("rdma server: connection {peer} ended: {e}"),
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

/// Serves one connection until it closes (`Ok`) or fails.
async fn serve(shared: &Shared, r: &mut Rd, w: &mut Wr, conn: u64) -> Result<(), FrameError> {
    // Rule 1: the handshake.
    let (head, body) = protocol::read_frame(r).await?;
    if head.op != op::HELLO {
        return Err(ProtocolError::NoHello(head.op).into());
    }
    let Request::Hello { version, .. } = Request::decode(op::HELLO, &body)? else {
        unreachable!("decode of HELLO yields Hello")
    };
    if version != protocol::VERSION {
        return Err(ProtocolError::Version {
            got: version,
            want: protocol::VERSION,
        }
        .into());
    }
    if head.payload_len != 0 {
        return Err(ProtocolError::Invalid {
            what: "HELLO payload length",
            value: head.payload_len,
        }
        .into());
    }
    send(shared, w, head.id, Reply::Hello(shared.info.clone()), 0).await?;
    w.flush().await?;
    loop {
        let mut h = [0u8; protocol::HEAD_LEN];
        match r.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let head = protocol::FrameHead::decode(&h)?;
        let mut body = vec![0u8; head.body_len as usize];
        r.read_exact(&mut body).await?;
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
        handle(shared, r, w, conn, head.id, head.payload_len, req).await?;
        if r.buffer().is_empty() {
            w.flush().await?;
        }
    }
}

async fn handle(
    shared: &Shared,
    r: &mut Rd,
    w: &mut Wr,
    conn: u64,
    id: u64,
    payload_len: u64,
    req: Request,
) -> Result<(), FrameError> {
    let now = Instant::now();
    let reply = match req {
        Request::Hello { .. } => {
            return Err(ProtocolError::Invalid {
                what: "second HELLO on a connection (op)",
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
                // SAFETY: the extent is pinned by `guard` until the send ends (index invariant
                // 3): it is committed, hence immutable (invariant 2), and cannot be freed or
                // reused while pinned.
                let bytes = unsafe { region.bytes(p.extent.offset, p.len as usize) };
                w.write_all(bytes).await?;
            }
            drop(guard);
            return Ok(());
        }
        Request::Lookup { pages } => {
            #[cfg(feature = "verbs")]
            let available = shared.verbs.is_some();
            #[cfg(not(feature = "verbs"))]
            let available = false;
            if !available {
                let _ = send_error(
                    w,
                    id,
                    code::UNSUPPORTED,
                    "LOOKUP needs the verbs data plane, which this server does not offer",
                )
                .await;
                return Ok(());
            }
            let deadline = now + Duration::from_millis(shared.info.lease_ms as u64);
            Reply::Lookup(shared.index.lock().lookup(conn, &pages, deadline))
        }
        Request::Release { leases } => Reply::Release {
            released: shared.index.lock().release(&leases) as u32,
        },
        Request::Allocate { pages } => {
            let deadline = now + Duration::from_millis(shared.info.alloc_ttl_ms as u64);
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
                match extent {
                    Some(e) => {
                        let _g = WriteGuard { shared, id: slot };
                        let region = &shared.regions[e.region as usize];
                        // SAFETY: the reservation belongs to this connection and is marked
                        // as being written (index invariant 4): nobody else reads or writes
                        // the extent until `_g` clears the mark, and it is not visible
                        // before commit (invariant 1).
                        let dst = unsafe { region.bytes_mut(e.offset, len as usize) };
                        r.read_exact(dst).await?;
                        ok.push(true);
                    }
                    None => {
                        protocol::skip_payload(r, len).await?;
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
                            let _ = send_error(w, id, code::INTERNAL, &e.to_string()).await;
                            return Ok(());
                        }
                    },
                    None => {
                        let _ = send_error(
                            w,
                            id,
                            code::UNSUPPORTED,
                            "this server has no RDMA device registered",
                        )
                        .await;
                        return Ok(());
                    }
                }
            }
            #[cfg(not(feature = "verbs"))]
            {
                let _ = endpoint;
                let _ = send_error(
                    w,
                    id,
                    code::UNSUPPORTED,
                    "this server was built without the verbs feature",
                )
                .await;
                return Ok(());
            }
        }
    };
    send(shared, w, id, reply, 0).await?;
    Ok(())
}
