//! Connections to the cluster's nodes and the current slot map.
//!
//! Two kinds of connection, both opened on first use with the configured credentials and TLS:
//! - **control** (redis-rs, one multiplexed connection per node): the checks at open
//!   (`INFO`, `CONFIG GET`) and the slot map (`CLUSTER SLOTS`), read at open and again
//!   whenever a node answers `MOVED` or cannot be reached;
//! - **data** ([`Conn`], a pool per node of at most [`DATA_CONNS_PER_NODE`]): page commands,
//!   one pipeline per connection at a time ([`Lease`]).
//!
//! A node whose connection failed is forgotten (its control connection and idle data
//! connections dropped), so the next use reconnects.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo, Value,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{RedisOptions, split_addr};
use crate::conn::{Conn, ConnError, Connector};
use crate::error::RedisError;
use crate::resp::Limits;
use crate::topology::Topology;

/// The default of `proto-max-bulk-len` (512 MB), assumed where `CONFIG GET` is not allowed.
pub const DEFAULT_MAX_BULK: u64 = 512 * 1024 * 1024;

/// Most data connections open to one node at once (pipelines to a node beyond this wait).
pub const DATA_CONNS_PER_NODE: usize = 16;

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
    root_cert: Option<Vec<u8>>,
    conns: Mutex<HashMap<String, MultiplexedConnection>>,
    connector: Connector,
    pools: Mutex<HashMap<String, Arc<Pool>>>,
    topology: RwLock<Arc<Topology>>,
    /// Pipelines sent per node (each one network round trip), for [`Nodes::round_trips`].
    round_trips: Mutex<HashMap<String, u64>>,
    /// Largest value a node accepts (`proto-max-bulk-len`), read at open.
    pub max_value_bytes: u64,
}

impl Nodes {
    /// Connects to the first seed that answers, checks that it is what the configuration says
    /// (cluster or standalone), and reads the slot map.
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
            root_cert,
            conns: Mutex::new(HashMap::new()),
            connector,
            pools: Mutex::new(HashMap::new()),
            round_trips: Mutex::new(HashMap::new()),
            max_value_bytes: DEFAULT_MAX_BULK,
        };
        let mut last = String::new();
        for seed in nodes.opts.nodes.clone() {
            match nodes.probe(&seed).await {
                Ok(()) => return Ok(nodes),
                Err(
                    e @ (RedisError::Auth { .. }
                    | RedisError::WrongMode { .. }
                    | RedisError::Tls(_)),
                ) => return Err(e),
                Err(e) => last = e.to_string(),
            }
        }
        Err(RedisError::Unreachable {
            tried: nodes.opts.nodes.join(", "),
            last,
        })
    }

    async fn probe(&mut self, seed: &str) -> Result<(), RedisError> {
        let mut conn = self.conn(seed).await?;
        let info: String = redis::cmd("INFO")
            .arg("cluster")
            .query_async(&mut conn)
            .await
            .map_err(|e| RedisError::client(seed, e))?;
        let enabled = info.lines().any(|l| l.trim() == "cluster_enabled:1");
        match (self.opts.cluster, enabled) {
            (true, false) => {
                return Err(RedisError::WrongMode {
                    node: seed.to_string(),
                    detail: "a standalone server (cluster_enabled:0) but the configuration says \"cluster\": true; set \"cluster\": false or list cluster nodes".into(),
                });
            }
            (false, true) => {
                return Err(RedisError::WrongMode {
                    node: seed.to_string(),
                    detail: "a cluster node (cluster_enabled:1) but the configuration says \"cluster\": false; remove it to use the cluster".into(),
                });
            }
            _ => {}
        }
        let limit: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("proto-max-bulk-len")
            .query_async(&mut conn)
            .await;
        if let Some(v) = limit
            .ok()
            .and_then(|v| v.get(1).and_then(|s| s.parse::<u64>().ok()))
        {
            self.max_value_bytes = v;
        }
        let topology = if enabled {
            let reply: Value = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async(&mut conn)
                .await
                .map_err(|e| RedisError::client(seed, e))?;
            let t = Topology::from_cluster_slots(&reply, seed).map_err(|detail| {
                RedisError::Protocol {
                    node: seed.to_string(),
                    command: "CLUSTER SLOTS",
                    detail,
                }
            })?;
            if t.nodes.is_empty() {
                return Err(RedisError::WrongMode {
                    node: seed.to_string(),
                    detail:
                        "the cluster has no slots assigned (run `redis-cli --cluster create` first)"
                            .into(),
                });
            }
            t
        } else {
            Topology::standalone(seed)
        };
        *self.topology.write() = Arc::new(topology);
        Ok(())
    }

    /// Whether the backend talks to a cluster (else one standalone server).
    pub fn is_cluster(&self) -> bool {
        self.opts.cluster
    }

    /// The current slot map.
    pub fn topology(&self) -> Arc<Topology> {
        self.topology.read().clone()
    }

    /// Reads the slot map again from the first node that answers (known primaries first, then
    /// the seeds). Keeps the old map if none answers.
    pub async fn refresh(&self) {
        if !self.opts.cluster {
            return;
        }
        let mut candidates = self.topology().nodes.clone();
        for s in &self.opts.nodes {
            if !candidates.contains(s) {
                candidates.push(s.clone());
            }
        }
        for addr in candidates {
            let Ok(mut conn) = self.conn(&addr).await else {
                continue;
            };
            let reply: redis::RedisResult<Value> = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async(&mut conn)
                .await;
            match reply {
                Ok(v) => {
                    if let Ok(t) = Topology::from_cluster_slots(&v, &addr)
                        && !t.nodes.is_empty()
                    {
                        *self.topology.write() = Arc::new(t);
                        return;
                    }
                }
                Err(_) => self.forget(&addr),
            }
        }
    }

    /// The connection to `addr`, opened if there is none.
    pub async fn conn(&self, addr: &str) -> Result<MultiplexedConnection, RedisError> {
        if let Some(c) = self.conns.lock().get(addr) {
            return Ok(c.clone());
        }
        let client = self.client(addr)?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.opts.timeout))
            .set_response_timeout(Some(self.opts.timeout * 2));
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| RedisError::client(addr, e))?;
        self.conns.lock().insert(addr.to_string(), conn.clone());
        Ok(conn)
    }

    /// A data connection to `addr` for one pipeline: an idle one, else a new one (waiting
    /// while the node has [`DATA_CONNS_PER_NODE`] in use).
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
            None => {
                let limits = Limits {
                    max_bulk: usize::try_from(self.max_value_bytes).unwrap_or(usize::MAX),
                    ..Limits::default()
                };
                tokio::time::timeout(self.opts.timeout, self.connector.connect(addr, limits))
                    .await
                    .map_err(|_| {
                        ConnError::Io(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "connect timed out",
                        ))
                    })??
            }
        };
        Ok(Lease {
            conn,
            pool,
            _slot: slot,
        })
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

    /// Drops the connections to `addr` (after one failed), so the next use reconnects.
    pub fn forget(&self, addr: &str) {
        self.conns.lock().remove(addr);
        if let Some(p) = self.pools.lock().get(addr) {
            p.idle.lock().clear();
        }
    }

    fn client(&self, addr: &str) -> Result<redis::Client, RedisError> {
        let (host, port) = split_addr(addr).ok_or_else(|| RedisError::Protocol {
            node: addr.to_string(),
            command: "connect",
            detail: "not a host:port address".into(),
        })?;
        let conn_addr = if self.opts.tls {
            ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host, port)
        };
        let mut redis_info = RedisConnectionInfo::default();
        if let Some(u) = &self.opts.username {
            redis_info = redis_info.set_username(u);
        }
        if let Some(p) = &self.opts.password {
            redis_info = redis_info.set_password(p);
        }
        let info = conn_addr
            .into_connection_info()
            .map_err(|e| RedisError::client(addr, e))?
            .set_redis_settings(redis_info);
        let client = match &self.root_cert {
            Some(pem) => redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            ),
            None => redis::Client::open(info),
        };
        client.map_err(|e| RedisError::client(addr, e))
    }
}
