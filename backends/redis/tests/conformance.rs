//! The storage conformance suite on a real 3-primary + 3-replica Redis Cluster and on a
//! standalone server, both on loopback.
//!
//! Every case runs except `CapacityEviction`: capacity and eviction belong to the cluster
//! (`maxmemory` + `allkeys-lru`), not to the backend, so its byte accounting cannot be what
//! that case checks; `tests/bad_input.rs` checks eviction (an evicted page is a plain miss)
//! and a full cluster (OOM: nothing acknowledged that is not stored) on real servers instead.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hicache_backend_redis::testing::{RedisCluster, RedisServer, redis_available};
use hicache_backend_redis::value::HEADER_LEN;
use hicache_backend_redis::{RedisOptions, RedisStorage};
use hicache_storage::conformance::{Case, Harness, case_async};
use hicache_storage::{PageKey, Result, StorageError, async_trait};

struct RedisHarness {
    seeds: Vec<String>,
    cluster: bool,
    next: AtomicU64,
    /// `read_chunk_bytes` of every backend opened (`None`: the default).
    read_chunk: Option<u64>,
    /// `presence_cache_keys` of every backend opened.
    presence: u64,
}

impl RedisHarness {
    /// A harness on `seeds` opening backends with their defaults.
    fn new(seeds: Vec<String>, cluster: bool) -> Self {
        Self {
            seeds,
            cluster,
            next: AtomicU64::new(0),
            read_chunk: None,
            presence: 0,
        }
    }

    fn options(&self) -> RedisOptions {
        let mut o = RedisOptions::new(self.seeds.clone());
        o.cluster = self.cluster;
        o.key_prefix = format!("conf{}:", self.next.fetch_add(1, Ordering::Relaxed));
        if let Some(c) = self.read_chunk {
            o.read_chunk_bytes = c;
        }
        o.presence_cache_keys = self.presence;
        o
    }

    fn raw(&self) -> Box<dyn redis::ConnectionLike> {
        if self.cluster {
            let c = redis::cluster::ClusterClient::new(
                self.seeds.iter().map(|s| format!("redis://{s}")),
            )
            .unwrap();
            Box::new(c.get_connection().unwrap())
        } else {
            let c = redis::Client::open(format!("redis://{}", self.seeds[0])).unwrap();
            Box::new(c.get_connection().unwrap())
        }
    }
}

#[async_trait]
impl Harness for RedisHarness {
    type Backend = RedisStorage;

    async fn open(&self, _capacity: Option<u64>) -> Result<Arc<RedisStorage>> {
        Ok(Arc::new(
            RedisStorage::open(self.options())
                .await
                .map_err(StorageError::from)?,
        ))
    }

    async fn corrupt(&self, backend: &RedisStorage, key: &PageKey) -> Result<bool> {
        let name = backend.redis_key(key);
        let mut conn = self.raw();
        let len: usize = redis::cmd("STRLEN").arg(&name).query(&mut *conn).unwrap();
        if len == 0 {
            return Ok(false);
        }
        let at = HEADER_LEN + (len - HEADER_LEN) / 2;
        let byte: Vec<u8> = redis::cmd("GETRANGE")
            .arg(&name)
            .arg(at)
            .arg(at)
            .query(&mut *conn)
            .unwrap();
        let _: i64 = redis::cmd("SETRANGE")
            .arg(&name)
            .arg(at)
            .arg(vec![byte[0] ^ 0x5a])
            .query(&mut *conn)
            .unwrap();
        Ok(true)
    }
}

fn run_suite(h: RedisHarness) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    for case in Case::ALL {
        if case == Case::CapacityEviction {
            continue;
        }
        rt.block_on(case_async(&h, case));
    }
}

#[test]
fn conformance_on_a_three_shard_cluster_with_replicas() {
    if !redis_available("conformance_on_a_three_shard_cluster_with_replicas") {
        return;
    }
    let cluster = RedisCluster::start(3, 1, &[]);
    run_suite(RedisHarness::new(cluster.seeds(), true));
    // The reverse mismatch: a cluster node configured as a standalone server.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut o = RedisOptions::new(cluster.seeds());
    o.cluster = false;
    let e = rt.block_on(RedisStorage::open(o)).unwrap_err().to_string();
    assert!(e.contains("cluster_enabled:1"), "{e}");
}

#[test]
fn conformance_on_a_standalone_server() {
    if !redis_available("conformance_on_a_standalone_server") {
        return;
    }
    let server = RedisServer::start(&[]);
    run_suite(RedisHarness::new(vec![server.addr()], false));
}

/// The suite again with every page above 4 KiB read in ranges (`MULTI`, `STRLEN`,
/// `GETRANGE`s, `EXEC`), where the default reads only values above 1 MiB so.
#[test]
fn conformance_with_ranged_reads_on_a_cluster() {
    if !redis_available("conformance_with_ranged_reads_on_a_cluster") {
        return;
    }
    let cluster = RedisCluster::start(3, 0, &[]);
    run_suite(RedisHarness {
        read_chunk: Some(4096),
        ..RedisHarness::new(cluster.seeds(), true)
    });
}

/// The suite again with the presence cache of `batch_exists` on (a small one, so that it
/// also empties itself when full).
#[test]
fn conformance_with_the_presence_cache_on_a_cluster() {
    if !redis_available("conformance_with_the_presence_cache_on_a_cluster") {
        return;
    }
    let cluster = RedisCluster::start(3, 0, &[]);
    run_suite(RedisHarness {
        presence: 64,
        ..RedisHarness::new(cluster.seeds(), true)
    });
}
