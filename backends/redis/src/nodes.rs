//! Connections to the cluster's nodes and the current slot map.
//!
//! Every connection is the backend's own ([`Conn`], a pool per node of at most
//! [`DATA_CONNS_PER_NODE`], opened on first use with the configured credentials and TLS), one
//! command or pipeline at a time ([`Lease`]): page commands ([`exec`](crate::exec)) and the
//! control commands — the checks at open (`INFO cluster`, `CONFIG GET proto-max-bulk-len`) and
//! the slot map (`CLUSTER SLOTS`), read at open and again whenever a node answers `MOVED` or
//! cannot be reached. Every control reply is read within [`Limits::control`].
//!
//! Invariants:
//! - every network wait runs under the calling [`Budget`]: open tries the seeds in turn, each
//!   with a share of what is left of `timeout_ms`, so one silent seed cannot starve the others
//!   and the whole open keeps its budget; a refresh stops when its call's budget is spent;
//! - a node whose connection failed is forgotten (its idle connections dropped), so the next
//!   use reconnects; a connection that failed mid-reply is never reused;
//! - replies that break the protocol or their bound are counted ([`Nodes::protocol_errors`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::config::RedisOptions;
use crate::conn::{Conn, ConnError, Connector};
use crate::deadline::Budget;
use crate::error::RedisError;
use crate::resp::{self, Frame, Limits};
use crate::topology::Topology;

/// The default of `proto-max-bulk-len` (512 MB), assumed where `CONFIG GET` is not allowed.
pub const DEFAULT_MAX_BULK: u64 = 512 * 1024 * 1024;

/// Most data connections open to one node at once (pipelines to a node beyond this wait).
pub const DATA_CONNS_PER_NODE: usize = 16;

/// Shortest share of the budget one candidate node gets during a slot-map refresh (where
/// that much is left), so that a silent node does not take all of it from the next one.
const REFRESH_SHARE_MIN: Duration = Duration::from_millis(250);

/// A control command a probe or a refresh sends: its name (for messages) and its arguments.
#[derive(Clone, Copy)]
struct ControlQuery {
    name: &'static str,
    args: &'static [&'static [u8]],
}

/// `INFO cluster`: whether the node runs in cluster mode.
const INFO_CLUSTER: ControlQuery = ControlQuery {
    name: "INFO",
    args: &[b"INFO", b"cluster"],
};
/// `CONFIG GET proto-max-bulk-len`: the largest value the node accepts.
const MAX_BULK_LEN: ControlQuery = ControlQuery {
    name: "CONFIG GET",
    args: &[b"CONFIG", b"GET", b"proto-max-bulk-len"],
};
/// `CLUSTER SLOTS`: the slot map.
const CLUSTER_SLOTS: ControlQuery = ControlQuery {
    name: "CLUSTER SLOTS",
    args: &[b"CLUSTER", b"SLOTS"],
};

/// The data connections of one node: the idle ones and a bound on how many exist.
struct Pool {
    idle: Mutex<Vec<Conn>>,
    slots: Arc<Semaphore>,
}

/// A data connection held by one pipeline. [`Lease::release`] gives it back for reuse once
/// every reply of the pipeline was read; dropped otherwise (closed: its state is unknown).
pub struct Lease {
    /// The connection.
    pub conn: Conn,
    pool: Arc<Pool>,
    _slot: OwnedSemaphorePermit,
}

/// Values from this size on leave a value-sized query buffer on the server's side of the
/// connection that carried them (Redis's `PROTO_MBULK_BIG_ARG`: it reads a large argument
/// into a buffer of its size and keeps such a buffer for the next one until the connection
/// has been idle about a second), and that buffer counts against `maxmemory`.
pub const BIG_VALUE: usize = 32 << 10;

impl Lease {
    /// Returns the connection to its node's idle list. One that carried values of
    /// [`BIG_VALUE`] or more (`carried_big`) is kept only where the node has no idle
    /// connection, else closed: each would hold a page-sized buffer of the server's memory
    /// (at 16 connections of 8 MiB pages, 128 MiB a node) where one serves the next caller.
    pub fn release(self, carried_big: bool) {
        let mut idle = self.pool.idle.lock();
        if !carried_big || idle.is_empty() {
            idle.push(self.conn);
        }
    }
}

/// Node connections and the slot map.
pub struct Nodes {
    opts: Arc<RedisOptions>,
    connector: Arc<Connector>,
    pools: Mutex<HashMap<String, Arc<Pool>>>,
    topology: RwLock<Arc<Topology>>,
    /// Pipelines sent per node (each one network round trip), for [`Nodes::round_trips`].
    round_trips: Mutex<HashMap<String, u64>>,
    /// Connections closed because a reply was not RESP or broke its bound.
    protocol_errors: AtomicU64,
    /// Largest value a node accepts (`proto-max-bulk-len`), read at open.
    pub max_value_bytes: u64,
    /// Whether page reads may be ranged (`MULTI`, `STRLEN`, `GETRANGE`s, `EXEC`; see
    /// [`RedisOptions::read_chunk_bytes`]): on until a node refuses one for permissions
    /// ([`Nodes::refuse_ranged_reads`]), then off for the rest of the backend's life.
    ranged_reads: AtomicBool,
}

impl Nodes {
    /// Connects to the first seed that answers, checks that it is what the configuration says
    /// (cluster or standalone), and reads the slot map, all within one `timeout_ms` budget:
    /// each seed is given a share of what is left (the rest divided by the seeds not tried).
    pub async fn open(opts: Arc<RedisOptions>) -> Result<Self, RedisError> {
        let root_cert = match &opts.tls_ca_file {
            Some(p) => Some(std::fs::read(p).map_err(|e| {
                RedisError::Tls(format!("reading tls_ca_file {}: {e}", p.display()))
            })?),
            None => None,
        };
        if opts.tls {
            // rustls needs one process-wide crypto provider; a provider installed earlier
            // by the application is kept.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let connector = Connector::new(&opts, root_cert.as_deref())
            .map_err(|e| RedisError::Tls(e.to_string()))?;
        let mut nodes = Self {
            topology: RwLock::new(Arc::new(Topology::standalone(&opts.nodes[0]))),
            opts,
            connector: Arc::new(connector),
            pools: Mutex::new(HashMap::new()),
            round_trips: Mutex::new(HashMap::new()),
            protocol_errors: AtomicU64::new(0),
            max_value_bytes: DEFAULT_MAX_BULK,
            ranged_reads: AtomicBool::new(true),
        };
        let budget = Budget::new("open", nodes.opts.timeout);
        let seeds = nodes.opts.nodes.clone();
        let mut failed: Vec<RedisError> = Vec::new();
        for (n, seed) in seeds.iter().enumerate() {
            if budget.spent() {
                break;
            }
            let left = budget.end().saturating_duration_since(Instant::now());
            let share = left / (seeds.len() - n) as u32;
            let seed_end = Instant::now() + share;
            let res = match tokio::time::timeout_at(seed_end, nodes.probe(seed, &budget)).await {
                Ok(r) => r,
                Err(_) => Err(RedisError::Timeout {
                    op: "open",
                    doing: format!(
                        "seed {seed} (given {} ms of the {} ms budget)",
                        share.as_millis(),
                        budget.total_ms()
                    ),
                    budget_ms: budget.total_ms(),
                }),
            };
            match res {
                Ok(()) => return Ok(nodes),
                Err(
                    e @ (RedisError::Auth { .. }
                    | RedisError::WrongMode { .. }
                    | RedisError::Tls(_)),
                ) => return Err(e),
                Err(e) => failed.push(e),
            }
        }
        // A seed that answered something wrong says more than those that could not be
        // reached: that error is the one reported.
        if let Some(i) = failed.iter().position(|e| !e.is_unreachable()) {
            return Err(failed.swap_remove(i));
        }
        Err(RedisError::Unreachable {
            tried: seeds.join(", "),
            last: failed
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        })
    }

    /// Reads `seed`'s mode, value limit and slot map on one connection, and takes the slot map
    /// as the current one.
    async fn probe(&mut self, seed: &str, budget: &Budget) -> Result<(), RedisError> {
        let mut lease = self
            .lease(seed)
            .await
            .map_err(|e| self.failed(seed, "connect", e))?;
        let conn = &mut lease.conn;
        let enabled = self.cluster_enabled(conn, seed, budget).await?;
        // An error reply (CONFIG not allowed to this user, renamed): the default is assumed.
        let limit = self.probe_query(conn, seed, MAX_BULK_LEN, budget).await?;
        let value = match &limit {
            Frame::Array(v) => v.get(1),
            Frame::Map(m) => m.first().map(|(_, v)| v),
            _ => None,
        };
        if let Some(v) = value
            .and_then(frame_text)
            .and_then(|s| s.parse::<u64>().ok())
        {
            self.max_value_bytes = v;
        }
        let topology = if enabled {
            self.cluster_slots(conn, seed, budget).await?
        } else {
            Topology::standalone(seed)
        };
        lease.release(false);
        *self.topology.write() = Arc::new(topology);
        Ok(())
    }

    /// One of the probe's control queries, on its connection.
    async fn probe_query(
        &self,
        conn: &mut Conn,
        seed: &str,
        q: ControlQuery,
        budget: &Budget,
    ) -> Result<Frame, RedisError> {
        self.query(conn, seed, q.name, q.args, &Limits::control(), budget)
            .await
    }

    /// Whether `seed` is a cluster node (`INFO cluster`); an error if that is not the mode the
    /// configuration asks for.
    async fn cluster_enabled(
        &self,
        conn: &mut Conn,
        seed: &str,
        budget: &Budget,
    ) -> Result<bool, RedisError> {
        let info = match self.probe_query(conn, seed, INFO_CLUSTER, budget).await? {
            Frame::Bulk(b) => String::from_utf8_lossy(&b).into_owned(),
            Frame::Simple(s) => s,
            Frame::Error(msg) => return Err(server_error(seed, "INFO", msg)),
            other => {
                return Err(RedisError::Protocol {
                    node: seed.to_string(),
                    command: "INFO",
                    detail: format!("expected a string, got {other:?}"),
                });
            }
        };
        let enabled = info.lines().any(|l| l.trim() == "cluster_enabled:1");
        let wrong = match (self.opts.cluster, enabled) {
            (true, false) => {
                "a standalone server (cluster_enabled:0) but the configuration says \"cluster\": true; set \"cluster\": false or list cluster nodes"
            }
            (false, true) => {
                "a cluster node (cluster_enabled:1) but the configuration says \"cluster\": false; remove it to use the cluster"
            }
            _ => return Ok(enabled),
        };
        Err(RedisError::WrongMode {
            node: seed.to_string(),
            detail: wrong.into(),
        })
    }

    /// The cluster's slot map as `seed` sees it (`CLUSTER SLOTS`); an error if no slot is
    /// assigned.
    async fn cluster_slots(
        &self,
        conn: &mut Conn,
        seed: &str,
        budget: &Budget,
    ) -> Result<Topology, RedisError> {
        let reply = self.probe_query(conn, seed, CLUSTER_SLOTS, budget).await?;
        if let Frame::Error(msg) = reply {
            return Err(server_error(seed, "CLUSTER SLOTS", msg));
        }
        let t =
            Topology::from_cluster_slots(&reply, seed).map_err(|detail| RedisError::Protocol {
                node: seed.to_string(),
                command: "CLUSTER SLOTS",
                detail,
            })?;
        if t.nodes.is_empty() {
            return Err(RedisError::WrongMode {
                node: seed.to_string(),
                detail:
                    "the cluster has no slots assigned (run `redis-cli --cluster create` first)"
                        .into(),
            });
        }
        Ok(t)
    }

    /// Sends one control command on `conn` (to `addr`) and reads its reply within
    /// [`Limits::control`] and `budget`. An error reply is returned as [`Frame::Error`]
    /// (authentication errors excepted: [`RedisError::Auth`]). On an error the connection
    /// must be dropped.
    async fn query(
        &self,
        conn: &mut Conn,
        addr: &str,
        command: &'static str,
        args: &[&[u8]],
        limits: &Limits,
        budget: &Budget,
    ) -> Result<Frame, RedisError> {
        let mut cmd = Vec::new();
        resp::put_command(&mut cmd, args);
        let sent = async {
            conn.write_all(&mut [std::io::IoSlice::new(&cmd)]).await?;
            conn.read_frame(limits).await
        };
        let frame = budget
            .run(|| format!("{command} on node {addr}"), async {
                sent.await.map_err(|e| self.failed(addr, command, e))
            })
            .await?;
        if let Frame::Error(msg) = &frame
            && matches!(
                msg.split_whitespace().next(),
                Some("NOAUTH" | "WRONGPASS" | "NOPERM")
            )
            && command == "INFO"
        {
            return Err(RedisError::Auth {
                node: addr.to_string(),
                detail: msg.clone(),
            });
        }
        Ok(frame)
    }

    /// Runs one control command on a connection leased from `addr`'s pool (given back once
    /// the reply was read whole, dropped on any failure), its reply read within `limits` and
    /// `budget`. An error reply is a [`Frame::Error`].
    pub async fn control(
        &self,
        addr: &str,
        command: &'static str,
        args: &[&[u8]],
        limits: &Limits,
        budget: &Budget,
    ) -> Result<Frame, RedisError> {
        let mut lease = budget
            .run(|| format!("connecting to node {addr}"), async {
                self.lease(addr)
                    .await
                    .map_err(|e| self.failed(addr, "connect", e))
            })
            .await?;
        let res = self
            .query(&mut lease.conn, addr, command, args, limits, budget)
            .await;
        match res {
            Ok(f) => {
                lease.release(false);
                Ok(f)
            }
            Err(e) => {
                drop(lease);
                self.forget(addr);
                Err(e)
            }
        }
    }

    /// Counts a connection failure `e` of `command` on `addr` and names it.
    pub fn failed(&self, addr: &str, command: &'static str, e: ConnError) -> RedisError {
        self.note(&e);
        RedisError::conn(addr, command, e)
    }

    /// Counts `e` where it is a protocol error (the connection it came from is closed by its
    /// user).
    pub fn note(&self, e: &ConnError) {
        if e.is_protocol() {
            self.protocol_errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether page reads longer than `read_chunk_bytes` are still made in ranges (no node
    /// refused one for permissions).
    pub fn ranged_reads(&self) -> bool {
        self.ranged_reads.load(Ordering::Relaxed)
    }

    /// `addr` refused a ranged page read for permissions (`why`, its `NOPERM`: the ACL user
    /// lacks `MULTI`, `EXEC`, `STRLEN` or `GETRANGE`): page reads are one `GET` each from now
    /// on, for the rest of the backend's life (said once, in a warning).
    pub fn refuse_ranged_reads(&self, addr: &str, why: &str) {
        if self.ranged_reads.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                node = %addr,
                reply = %why,
                "redis: a ranged page read (MULTI, STRLEN, GETRANGE, EXEC) was refused for \
                 permissions; page values are read with one GET each from now on. Allow \
                 those commands to the ACL user, or set read_chunk_bytes to 0 to read with GET \
                 from the start without this warning"
            );
        }
    }

    /// Connections closed since open because a node sent something that is not RESP or a
    /// reply over the bound of its command.
    pub fn protocol_errors(&self) -> u64 {
        self.protocol_errors.load(Ordering::Relaxed)
    }

    /// The current slot map.
    pub fn topology(&self) -> Arc<Topology> {
        self.topology.read().clone()
    }

    /// Reads the slot map again from the first node that answers (known primaries first, then
    /// the seeds), within `budget`: each candidate gets what is left divided by the
    /// candidates not tried (at least [`REFRESH_SHARE_MIN`] where that much is left). Keeps
    /// the old map if none answers in time.
    pub async fn refresh(&self, budget: &Budget) {
        if !self.opts.cluster {
            return;
        }
        let mut candidates = self.topology().nodes.clone();
        for s in &self.opts.nodes {
            if !candidates.contains(s) {
                candidates.push(s.clone());
            }
        }
        let n = candidates.len();
        let limits = Limits::control();
        for (i, addr) in candidates.into_iter().enumerate() {
            let now = Instant::now();
            if now >= budget.end() {
                return;
            }
            let left = budget.end() - now;
            let share = (left / (n - i) as u32).max(REFRESH_SHARE_MIN.min(left));
            let ask = self.control(
                &addr,
                CLUSTER_SLOTS.name,
                CLUSTER_SLOTS.args,
                &limits,
                budget,
            );
            let reply = match tokio::time::timeout(share, ask).await {
                Ok(r) => r,
                Err(_) => {
                    self.forget(&addr);
                    continue;
                }
            };
            if let Ok(f) = reply
                && let Ok(t) = Topology::from_cluster_slots(&f, &addr)
                && !t.nodes.is_empty()
            {
                *self.topology.write() = Arc::new(t);
                return;
            }
        }
    }

    /// A data connection to `addr` for one pipeline: an idle one, else a new one (waiting
    /// while the node has [`DATA_CONNS_PER_NODE`] in use). Unbounded in time: callers run it
    /// under their call's budget.
    pub async fn lease(&self, addr: &str) -> Result<Lease, ConnError> {
        let pool = self
            .pools
            .lock()
            .entry(addr.to_string())
            .or_insert_with(|| {
                Arc::new(Pool {
                    idle: Mutex::new(Vec::new()),
                    slots: Arc::new(Semaphore::new(DATA_CONNS_PER_NODE)),
                })
            })
            .clone();
        let slot = pool
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the pool's semaphore is never closed");
        let idle = pool.idle.lock().pop();
        let conn = match idle {
            Some(c) => c,
            None => self.connector.connect(addr).await?,
        };
        Ok(Lease {
            conn,
            pool,
            _slot: slot,
        })
    }

    /// How this backend opens its connections (TLS, credentials), for connections kept
    /// outside the pools ([`presence`](crate::presence)).
    pub fn connector(&self) -> Arc<Connector> {
        self.connector.clone()
    }

    /// Counts one pipeline (one network round trip) sent to `addr`.
    pub fn count_round_trip(&self, addr: &str) {
        *self.round_trips.lock().entry(addr.to_string()).or_insert(0) += 1;
    }

    /// Pipelines of page commands sent per node (`host:port`) since open: each is one
    /// network round trip. Connection setup and slot-map reads are not counted.
    pub fn round_trips(&self) -> HashMap<String, u64> {
        self.round_trips.lock().clone()
    }

    /// Drops the idle connections to `addr` (after one failed), so the next use reconnects.
    pub fn forget(&self, addr: &str) {
        if let Some(p) = self.pools.lock().get(addr) {
            p.idle.lock().clear();
        }
    }
}

/// The text of a string reply.
fn frame_text(f: &Frame) -> Option<String> {
    match f {
        Frame::Bulk(b) => std::str::from_utf8(b).ok().map(str::to_string),
        Frame::Simple(s) => Some(s.clone()),
        _ => None,
    }
}

fn server_error(node: &str, command: &'static str, msg: String) -> RedisError {
    if matches!(
        msg.split_whitespace().next(),
        Some("NOAUTH" | "WRONGPASS" | "NOPERM")
    ) {
        return RedisError::Auth {
            node: node.to_string(),
            detail: msg,
        };
    }
    RedisError::Server {
        node: node.to_string(),
        command,
        msg,
    }
}
