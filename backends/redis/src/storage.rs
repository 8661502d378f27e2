//! [`RedisStorage`]: the [`Storage`] implementation.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::BufMut;
use hicache_core::PageKey;
use hicache_storage::backend::bump;
use hicache_storage::{
    BackendInfo, PageBuf, PageBufMut, PageError, PageOutcome, Result, StatsCounters, Storage,
    StorageStats, check_batch,
};
use redis::{RedisWrite, Value};
use tokio::time::Instant;

use crate::config::RedisOptions;
use crate::error::RedisError;
use crate::exec::{Inflight, Reply, Request, execute};
use crate::nodes::Nodes;
use crate::value::{self, HEADER_LEN};

/// Largest number of pages in one call.
pub const MAX_BATCH: usize = 1024;

/// An L3 backend on a Redis / Valkey Cluster (or one standalone server). See the
/// [crate documentation](crate).
pub struct RedisStorage {
    opts: Arc<RedisOptions>,
    nodes: Nodes,
    inflight: Inflight,
    stats: StatsCounters,
    /// Pages this process stored minus those it deleted (the cluster's own count is not
    /// tracked: other nodes of the fleet write and the cluster evicts).
    pages: AtomicU64,
    /// Page bytes likewise.
    bytes: AtomicU64,
}

impl std::fmt::Debug for RedisStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStorage")
            .field("opts", &self.opts)
            .finish()
    }
}

impl RedisStorage {
    /// Connects to the cluster (or standalone server) `opts` names.
    pub async fn open(opts: RedisOptions) -> std::result::Result<Self, RedisError> {
        let opts = Arc::new(opts);
        let nodes = Nodes::open(opts.clone()).await?;
        Ok(Self {
            inflight: Inflight::new(opts.max_inflight_bytes),
            opts,
            nodes,
            stats: StatsCounters::default(),
            pages: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        })
    }

    /// The options the backend was opened with.
    pub fn options(&self) -> &RedisOptions {
        &self.opts
    }

    /// The Redis key a page is stored under: `key_prefix` + the page key in hex.
    pub fn redis_key(&self, key: &PageKey) -> Vec<u8> {
        let mut k = self.opts.key_prefix.as_bytes().to_vec();
        k.extend_from_slice(key.to_hex().as_bytes());
        k
    }

    /// Pipelines of page commands sent per node (`host:port`) since open, each one network
    /// round trip (connection setup and slot-map reads not counted). A batch costs one per
    /// node it touches (two for `batch_set` of pages already present: `SET NX`, then their
    /// headers), more only when a node's share exceeds a quarter of `max_inflight_bytes` or a
    /// redirection or failure makes a request go again.
    pub fn round_trips(&self) -> std::collections::HashMap<String, u64> {
        self.nodes.round_trips()
    }

    /// Primaries of the current slot map (`host:port`).
    pub fn primaries(&self) -> Vec<String> {
        self.nodes.topology().nodes.clone()
    }

    fn max_page_bytes(&self) -> usize {
        (self.nodes.max_value_bytes as usize).saturating_sub(HEADER_LEN)
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.opts.timeout
    }

    fn wait(&self) -> Option<(u32, std::time::Duration)> {
        (self.opts.min_replicas_acked > 0)
            .then_some((self.opts.min_replicas_acked, self.opts.timeout))
    }

    fn set_request<'a, 'p: 'a>(
        &self,
        rkey: Vec<u8>,
        key: &'a PageKey,
        page: &'a PageBuf<'p>,
        nx: bool,
    ) -> Request<'a> {
        let ttl = self.opts.ttl_s;
        let len = HEADER_LEN + page.len();
        let k = rkey.clone();
        Request::new(&rkey, len, move || {
            let mut c = redis::cmd("SET");
            c.arg(&k);
            {
                let mut buf = c.bufmut_for_next_arg(len);
                buf.put_slice(&value::header(key, page));
                for part in page.parts() {
                    buf.put_slice(part);
                }
            }
            if nx {
                c.arg("NX");
            }
            if let Some(t) = ttl {
                c.arg("EX").arg(t);
            }
            c
        })
    }

    fn add_stored(&self, len: usize, replaced: Option<usize>) {
        match replaced {
            None => {
                self.pages.fetch_add(1, Ordering::Relaxed);
                self.bytes.fetch_add(len as u64, Ordering::Relaxed);
            }
            Some(old) => {
                self.bytes.fetch_add(len as u64, Ordering::Relaxed);
                sub(&self.bytes, old as u64);
            }
        }
    }

    /// Reads the headers of `keys` (`GETRANGE key 0 71`): `Some(header)` where a valid one is
    /// stored.
    async fn headers(&self, keys: &[(PageKey, Vec<u8>)]) -> Vec<Option<value::Header>> {
        let reqs: Vec<Request<'_>> = keys
            .iter()
            .map(|(_, rk)| {
                let k = rk.clone();
                Request::new(rk, 0, move || {
                    let mut c = redis::cmd("GETRANGE");
                    c.arg(&k).arg(0).arg(HEADER_LEN - 1);
                    c
                })
            })
            .collect();
        let replies = execute(&self.nodes, &self.inflight, &reqs, None, self.deadline()).await;
        keys.iter()
            .zip(replies)
            .map(|((key, _), r)| match r {
                Reply::Value(Value::BulkString(b)) => value::parse_header(key, &b).ok(),
                _ => None,
            })
            .collect()
    }
}

fn sub(c: &AtomicU64, n: u64) {
    let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

#[async_trait]
impl Storage for RedisStorage {
    fn info(&self) -> BackendInfo {
        let mut i = BackendInfo::new(crate::NAME, MAX_BATCH);
        i.shared = true;
        i.max_page_bytes = self.max_page_bytes();
        i
    }

    #[tracing::instrument(skip_all, fields(pages = keys.len()))]
    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch("batch_exists", MAX_BATCH, keys.len(), keys.len())?;
        let rkeys: Vec<Vec<u8>> = keys.iter().map(|k| self.redis_key(k)).collect();
        let reqs: Vec<Request<'_>> = rkeys.iter().map(|k| Request::simple("EXISTS", k)).collect();
        let replies = execute(&self.nodes, &self.inflight, &reqs, None, self.deadline()).await;
        let mut run = 0;
        for r in &replies {
            match r {
                Reply::Value(Value::Int(1)) => run += 1,
                Reply::Failed(e) => {
                    tracing::warn!(error = %e, "redis batch_exists: a key could not be checked; counted absent");
                    break;
                }
                _ => break,
            }
        }
        self.stats.record_exists((run + 1).min(keys.len()), run);
        Ok(run)
    }

    #[tracing::instrument(skip_all, fields(pages = keys.len()))]
    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>> {
        check_batch("batch_get", MAX_BATCH, keys.len(), dst.len())?;
        let rkeys: Vec<Vec<u8>> = keys.iter().map(|k| self.redis_key(k)).collect();
        let reqs: Vec<Request<'_>> = rkeys
            .iter()
            .zip(dst.iter())
            .map(|(k, d)| {
                let mut r = Request::simple("GET", k);
                r.bytes = HEADER_LEN + d.len();
                r
            })
            .collect();
        let replies = execute(&self.nodes, &self.inflight, &reqs, None, self.deadline()).await;
        drop(reqs);
        let mut outcomes = Vec::with_capacity(keys.len());
        let mut damaged = Vec::new();
        for (i, r) in replies.into_iter().enumerate() {
            let o = match r {
                Reply::Value(Value::Nil) => PageOutcome::Miss,
                Reply::Value(Value::BulkString(v)) => match value::verify(&keys[i], &v) {
                    Ok((h, body)) if h.meta == dst[i].meta() => {
                        dst[i].copy_from(body);
                        PageOutcome::Hit
                    }
                    Ok(_) => {
                        bump(&self.stats.meta_mismatches, 1);
                        PageOutcome::Miss
                    }
                    Err(damage) => {
                        tracing::warn!(key = %String::from_utf8_lossy(&rkeys[i]), ?damage, "redis: stored page failed verification; dropped");
                        damaged.push(i);
                        PageOutcome::Corrupt
                    }
                },
                Reply::Value(other) => {
                    tracing::warn!(key = %String::from_utf8_lossy(&rkeys[i]), reply = ?other, "redis: not a page value; dropped");
                    damaged.push(i);
                    PageOutcome::Corrupt
                }
                Reply::Failed(e) => PageOutcome::Failed(e),
            };
            outcomes.push(o);
        }
        if !damaged.is_empty() {
            // Drop bad copies so the next writer of the page stores a good one.
            let reqs: Vec<Request<'_>> = damaged
                .iter()
                .map(|i| Request::simple("DEL", &rkeys[*i]))
                .collect();
            let _ = execute(&self.nodes, &self.inflight, &reqs, None, self.deadline()).await;
        }
        for (o, d) in outcomes.iter().zip(dst.iter_mut()) {
            if !o.is_hit() && matches!(o, PageOutcome::Corrupt) {
                d.zero();
            }
        }
        self.stats
            .record_get(&outcomes, dst.iter().map(|d| d.len()));
        Ok(outcomes)
    }

    #[tracing::instrument(skip_all, fields(pages = keys.len()))]
    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", MAX_BATCH, keys.len(), src.len())?;
        let max = self.max_page_bytes();
        let mut outcomes: Vec<Option<PageOutcome>> = vec![None; keys.len()];
        let mut todo = Vec::new();
        for (i, page) in src.iter().enumerate() {
            if page.is_empty() {
                outcomes[i] = Some(PageOutcome::Failed(PageError::EmptyPage));
            } else if page.len() > max {
                outcomes[i] = Some(PageOutcome::Failed(PageError::TooLarge {
                    len: page.len(),
                    max,
                }));
            } else {
                todo.push(i);
            }
        }
        // Phase 1: SET NX. A new page is stored in one round trip.
        let reqs: Vec<Request<'_>> = todo
            .iter()
            .map(|&i| self.set_request(self.redis_key(&keys[i]), &keys[i], &src[i], true))
            .collect();
        let replies = execute(
            &self.nodes,
            &self.inflight,
            &reqs,
            self.wait(),
            self.deadline(),
        )
        .await;
        drop(reqs);
        let mut existing = Vec::new();
        for (&i, r) in todo.iter().zip(replies) {
            outcomes[i] = Some(match r {
                Reply::Value(Value::Okay) | Reply::Value(Value::SimpleString(_)) => {
                    self.add_stored(src[i].len(), None);
                    PageOutcome::Stored
                }
                Reply::Value(Value::Nil) => {
                    existing.push(i);
                    continue;
                }
                Reply::Value(other) => PageOutcome::Failed(PageError::Backend(format!(
                    "redis SET: unexpected reply {other:?}"
                ))),
                Reply::Failed(e) => PageOutcome::Failed(e),
            });
        }
        // Phase 2: the key exists. Same metadata: Present (keys name contents); other metadata
        // or a damaged header: overwrite.
        if !existing.is_empty() {
            let named: Vec<(PageKey, Vec<u8>)> = existing
                .iter()
                .map(|&i| (keys[i], self.redis_key(&keys[i])))
                .collect();
            let headers = self.headers(&named).await;
            let mut rewrite = Vec::new();
            for (&i, h) in existing.iter().zip(headers) {
                match h {
                    Some(h) if h.meta == src[i].meta() => outcomes[i] = Some(PageOutcome::Present),
                    other => rewrite.push((i, other.map(|h| h.meta.len))),
                }
            }
            let reqs: Vec<Request<'_>> = rewrite
                .iter()
                .map(|&(i, _)| self.set_request(self.redis_key(&keys[i]), &keys[i], &src[i], false))
                .collect();
            let replies = execute(
                &self.nodes,
                &self.inflight,
                &reqs,
                self.wait(),
                self.deadline(),
            )
            .await;
            drop(reqs);
            for (&(i, old), r) in rewrite.iter().zip(replies) {
                outcomes[i] = Some(match r {
                    Reply::Value(Value::Okay) | Reply::Value(Value::SimpleString(_)) => {
                        self.add_stored(src[i].len(), Some(old.unwrap_or(0)));
                        PageOutcome::Stored
                    }
                    Reply::Value(other) => PageOutcome::Failed(PageError::Backend(format!(
                        "redis SET: unexpected reply {other:?}"
                    ))),
                    Reply::Failed(e) => PageOutcome::Failed(e),
                });
            }
        }
        let outcomes: Vec<PageOutcome> = outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    PageOutcome::Failed(PageError::Backend("redis: no outcome".into()))
                })
            })
            .collect();
        self.stats
            .record_set(&outcomes, src.iter().map(|p| p.len()));
        Ok(outcomes)
    }

    #[tracing::instrument(skip_all, fields(pages = keys.len()))]
    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch("delete", MAX_BATCH, keys.len(), keys.len())?;
        let named: Vec<(PageKey, Vec<u8>)> = keys.iter().map(|k| (*k, self.redis_key(k))).collect();
        let headers = self.headers(&named).await;
        let reqs: Vec<Request<'_>> = named
            .iter()
            .map(|(_, rk)| Request::simple("DEL", rk))
            .collect();
        let replies = execute(&self.nodes, &self.inflight, &reqs, None, self.deadline()).await;
        let mut removed = 0;
        for (r, h) in replies.iter().zip(headers) {
            match r {
                Reply::Value(Value::Int(1)) => {
                    removed += 1;
                    sub(&self.pages, 1);
                    sub(&self.bytes, h.map(|h| h.meta.len as u64).unwrap_or(0));
                }
                Reply::Value(_) => {}
                Reply::Failed(e) => {
                    return Err(hicache_storage::StorageError::backend_caused(
                        crate::NAME,
                        "delete",
                        e.clone(),
                    ));
                }
            }
        }
        bump(&self.stats.deleted_pages, removed as u64);
        Ok(removed)
    }

    fn stats(&self) -> StorageStats {
        self.stats.snapshot(
            self.pages.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
            None,
        )
    }
}
