//! [`RedisStorage`]: the [`Storage`] implementation.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use hicache_core::PageKey;
use hicache_storage::backend::bump;
use hicache_storage::{
    BackendInfo, PageBuf, PageBufMut, PageError, PageOutcome, Result, StatsCounters, Storage,
    StorageStats, check_batch,
};
use tokio::sync::Mutex;

use crate::config::RedisOptions;
use crate::conn::PageRead;
use crate::deadline::Budget;
use crate::error::RedisError;
use crate::exec::{Inflight, Reply, Request, execute};
use crate::nodes::Nodes;
use crate::presence::Presence;
use crate::resp::{Frame, Limits};
use crate::value::{self, HEADER_LEN};

/// Largest number of pages in one call.
pub const MAX_BATCH: usize = 1024;

/// `SCAN` calls per node a `clear` makes at most (each asks for 1024 keys; a cursor that has
/// not come back to 0 by then means a node that never finishes). The call's budget bounds
/// its time first.
const CLEAR_MAX_SCAN_ROUNDS: u64 = 1 << 24;

/// Keys one `SCAN` round asks for.
const SCAN_COUNT: usize = 1024;

/// An L3 backend on a Redis / Valkey Cluster (or one standalone server). See the
/// [crate documentation](crate).
pub struct RedisStorage {
    opts: Arc<RedisOptions>,
    nodes: Nodes,
    /// The presence cache of `batch_exists` (`presence_cache_keys` > 0).
    presence: Option<Presence>,
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
        let presence = (opts.presence_cache_keys > 0).then(|| {
            Presence::new(
                nodes.connector(),
                usize::try_from(opts.presence_cache_keys).unwrap_or(usize::MAX),
            )
        });
        Ok(Self {
            presence,
            inflight: Inflight::new(opts.max_inflight_bytes),
            opts,
            nodes,
            stats: StatsCounters::default(),
            pages: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        })
    }

    /// Keys `batch_exists` answered from the presence cache since open (0 without one).
    pub fn presence_hits(&self) -> u64 {
        self.presence.as_ref().map_or(0, Presence::hits)
    }

    /// The options the backend was opened with.
    pub fn options(&self) -> &RedisOptions {
        &self.opts
    }

    /// The Redis key a page is stored under: `key_prefix` + the page key in hex.
    pub fn redis_key(&self, key: &PageKey) -> Vec<u8> {
        key_name(self.opts.key_prefix.as_bytes(), key)
    }

    /// Pipelines of page commands sent per node (`host:port`) since open, each one network
    /// round trip (connection setup and slot-map reads not counted). A batch costs one per
    /// node it touches (two for `batch_set` of pages already present: `SET NX`, then their
    /// headers), more only when a node's share exceeds [`PIPELINE_BYTES`](crate::exec::PIPELINE_BYTES)
    /// (or a quarter of `max_inflight_bytes` where that is less) or a redirection or failure
    /// makes a request go again.
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

    /// Connections closed since open because a node sent something that is not RESP or a
    /// reply over the bound of its command (each such reply closes its connection).
    pub fn protocol_errors(&self) -> u64 {
        self.nodes.protocol_errors()
    }

    /// The budget of one call `op`: `timeout_ms` from now.
    fn budget(&self, op: &'static str) -> Budget {
        Budget::new(op, self.opts.timeout)
    }

    fn wait(&self) -> Option<u32> {
        (self.opts.min_replicas_acked > 0).then_some(self.opts.min_replicas_acked)
    }

    /// `SET` of `page` under `key` (header and page bytes sent from their buffers).
    fn set_request<'a>(&self, key: &PageKey, page: &'a PageBuf<'_>, nx: bool) -> Request<'a> {
        let header = value::header(key, page);
        Request::set(
            &self.redis_key(key),
            &header,
            page.parts(),
            nx,
            self.opts.ttl_s,
        )
    }

    /// `SET` (`NX` where `nx`) of the pages `which` names: `(index, Some(bytes it replaces))`
    /// or `(index, None)` for a new page. Per page its outcome, or `None` where `NX` found
    /// the key present.
    async fn set_pages(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        which: &[(usize, Option<usize>)],
        nx: bool,
        budget: &Budget,
    ) -> Vec<(usize, Option<PageOutcome>)> {
        let reqs: Vec<Request<'_>> = which
            .iter()
            .map(|&(i, _)| self.set_request(&keys[i], &src[i], nx))
            .collect();
        let replies = self.run(&reqs, true, budget).await;
        which
            .iter()
            .zip(replies)
            .map(|(&(i, replaced), r)| {
                let o = match r {
                    Reply::Value(Frame::Simple(ref ok)) if ok == "OK" => {
                        self.add_stored(src[i].len(), replaced);
                        Some(PageOutcome::Stored)
                    }
                    Reply::Value(Frame::Nil) if nx => None,
                    Reply::Failed(e) => Some(PageOutcome::Failed(e)),
                    other => Some(PageOutcome::Failed(PageError::Backend(format!(
                        "redis SET: unexpected reply {other:?}"
                    )))),
                };
                (i, o)
            })
            .collect()
    }

    /// Runs `reqs` (no page reads) within the call's `budget`.
    async fn run(&self, reqs: &[Request<'_>], wait: bool, budget: &Budget) -> Vec<Reply> {
        let wait = if wait { self.wait() } else { None };
        execute(&self.nodes, &self.inflight, reqs, &[], wait, budget).await
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

    /// Removes `keys` (their headers read first, for the byte count) within `budget`: the
    /// number removed. Counted by the caller (`deleted_pages` or `cleared_pages`).
    async fn delete_within(&self, keys: &[PageKey], budget: &Budget) -> Result<usize> {
        let named: Vec<(PageKey, Vec<u8>)> = keys.iter().map(|k| (*k, self.redis_key(k))).collect();
        if let Some(p) = &self.presence {
            // Forgotten before the deletion: an `exists` from now on asks the servers.
            p.forget(
                named.iter().map(|(_, rk)| rk.as_slice()),
                &self.nodes.topology(),
            );
        }
        let headers = self.headers(&named, budget).await;
        let reqs: Vec<Request<'_>> = named
            .iter()
            .map(|(_, rk)| Request::simple("DEL", rk))
            .collect();
        let replies = self.run(&reqs, false, budget).await;
        let mut removed = 0;
        for (r, h) in replies.iter().zip(headers) {
            match r {
                Reply::Value(Frame::Int(1)) => {
                    removed += 1;
                    sub(&self.pages, 1);
                    sub(&self.bytes, h.map(|h| h.meta.len as u64).unwrap_or(0));
                }
                Reply::Value(_) | Reply::Page(_) => {}
                Reply::Failed(e) => {
                    return Err(hicache_storage::StorageError::backend_caused(
                        crate::NAME,
                        budget.op(),
                        e.clone(),
                    ));
                }
            }
        }
        Ok(removed)
    }

    /// Reads the headers of `keys` (`GETRANGE key 0 71`): `Some(header)` where a valid one is
    /// stored.
    async fn headers(
        &self,
        keys: &[(PageKey, Vec<u8>)],
        budget: &Budget,
    ) -> Vec<Option<value::Header>> {
        let last = (HEADER_LEN - 1).to_string();
        let reqs: Vec<Request<'_>> = keys
            .iter()
            .map(|(_, rk)| {
                Request::command("GETRANGE", rk, &[b"GETRANGE", rk, b"0", last.as_bytes()])
            })
            .collect();
        let replies = self.run(&reqs, false, budget).await;
        keys.iter()
            .zip(replies)
            .map(|((key, _), r)| match r {
                Reply::Value(Frame::Bulk(b)) => value::parse_header(key, &b).ok(),
                _ => None,
            })
            .collect()
    }
}

/// `prefix` + `key` in lowercase hex ([`PageKey::to_hex`]), written straight into one buffer
/// (a batch names up to 1024 keys per call).
fn key_name(prefix: &[u8], key: &PageKey) -> Vec<u8> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut k = Vec::with_capacity(prefix.len() + 2 * PageKey::LEN);
    k.extend_from_slice(prefix);
    for b in key.to_bytes() {
        k.push(HEX[usize::from(b >> 4)]);
        k.push(HEX[usize::from(b & 15)]);
    }
    k
}

/// The cursor and the keys of a `SCAN` reply from `addr`.
fn scan_reply(addr: &str, reply: Frame) -> std::result::Result<(u64, Vec<Vec<u8>>), RedisError> {
    let bad = |detail: String| RedisError::Protocol {
        node: addr.to_string(),
        command: "SCAN",
        detail,
    };
    let items = match reply {
        Frame::Array(items) if items.len() == 2 => items,
        Frame::Error(msg) => {
            return Err(RedisError::Server {
                node: addr.to_string(),
                command: "SCAN",
                msg,
            });
        }
        other => return Err(bad(format!("expected [cursor, keys], got {other:?}"))),
    };
    let mut it = items.into_iter();
    let (Some(cursor), Some(keys)) = (it.next(), it.next()) else {
        return Err(bad("expected [cursor, keys]".into()));
    };
    let cursor = match cursor {
        Frame::Bulk(b) => std::str::from_utf8(&b)
            .ok()
            .and_then(|s| s.parse::<u64>().ok()),
        Frame::Int(i) => u64::try_from(i).ok(),
        _ => None,
    }
    .ok_or_else(|| bad("the cursor is not a number".into()))?;
    let Frame::Array(keys) = keys else {
        return Err(bad(format!("expected an array of keys, got {keys:?}")));
    };
    let keys = keys
        .into_iter()
        .map(|k| match k {
            Frame::Bulk(b) => Ok(b),
            other => Err(bad(format!("a key that is not a string: {other:?}"))),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((cursor, keys))
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
        i.clear = true;
        i
    }

    #[tracing::instrument(skip_all, fields(pages = keys.len()))]
    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch("batch_exists", MAX_BATCH, keys.len(), keys.len())?;
        let budget = self.budget("batch_exists");
        let named: Vec<Vec<u8>> = keys.iter().map(|k| self.redis_key(k)).collect();
        if let Some(p) = &self.presence {
            // Half of what is left: the uncached path keeps the rest if the cache's ask fails.
            let within = budget
                .end()
                .saturating_duration_since(tokio::time::Instant::now())
                / 2;
            if let Some(run) = p.exists(&named, &self.nodes.topology(), within).await {
                self.stats.record_exists((run + 1).min(keys.len()), run);
                return Ok(run);
            }
        }
        let reqs: Vec<Request<'_>> = named
            .into_iter()
            .map(|rk| Request::simple_owned("EXISTS", rk))
            .collect();
        let replies = self.run(&reqs, false, &budget).await;
        let mut run = 0;
        for r in &replies {
            match r {
                Reply::Value(Frame::Int(1)) => run += 1,
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
        let budget = self.budget("batch_get");
        let chunk = usize::try_from(self.opts.read_chunk_bytes).unwrap_or(usize::MAX);
        let rkeys: Vec<Vec<u8>> = keys.iter().map(|k| self.redis_key(k)).collect();
        let reqs: Vec<Request<'_>> = rkeys
            .iter()
            .zip(keys)
            .zip(dst.iter())
            .enumerate()
            .map(|(i, ((rk, k), d))| Request::get_page(rk, *k, i, HEADER_LEN + d.len(), chunk))
            .collect();
        let replies = {
            let cells: Vec<Mutex<&mut PageBufMut<'_>>> = dst.iter_mut().map(Mutex::new).collect();
            execute(&self.nodes, &self.inflight, &reqs, &cells, None, &budget).await
        };
        drop(reqs);
        let mut outcomes = Vec::with_capacity(keys.len());
        let mut damaged = Vec::new();
        for (i, r) in replies.into_iter().enumerate() {
            let o = match r {
                Reply::Page(PageRead::Hit) => PageOutcome::Hit,
                Reply::Page(PageRead::Nil) => PageOutcome::Miss,
                Reply::Page(PageRead::OtherMeta) => {
                    bump(&self.stats.meta_mismatches, 1);
                    PageOutcome::Miss
                }
                Reply::Page(PageRead::Damaged(damage)) => {
                    tracing::warn!(key = %String::from_utf8_lossy(&rkeys[i]), ?damage, "redis: stored page failed verification; dropped");
                    damaged.push(i);
                    PageOutcome::Corrupt
                }
                Reply::Page(PageRead::Frame(other)) | Reply::Value(other) => {
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
            let _ = self.run(&reqs, false, &budget).await;
        }
        // A page not read whole and verified holds no bytes of what arrived.
        for (o, d) in outcomes.iter().zip(dst.iter_mut()) {
            if matches!(o, PageOutcome::Corrupt | PageOutcome::Failed(_)) {
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
        let budget = self.budget("batch_set");
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
        let new: Vec<(usize, Option<usize>)> = todo.iter().map(|&i| (i, None)).collect();
        let mut existing = Vec::new();
        for (i, o) in self.set_pages(keys, src, &new, true, &budget).await {
            match o {
                Some(o) => outcomes[i] = Some(o),
                None => existing.push(i),
            }
        }
        // Phase 2: the key exists. Same metadata: Present (keys name contents); other metadata
        // or a damaged header: overwrite.
        if !existing.is_empty() {
            let named: Vec<(PageKey, Vec<u8>)> = existing
                .iter()
                .map(|&i| (keys[i], self.redis_key(&keys[i])))
                .collect();
            let headers = self.headers(&named, &budget).await;
            let mut rewrite = Vec::new();
            for (&i, h) in existing.iter().zip(headers) {
                match h {
                    Some(h) if h.meta == src[i].meta() => outcomes[i] = Some(PageOutcome::Present),
                    other => rewrite.push((i, Some(other.map_or(0, |h| h.meta.len)))),
                }
            }
            for (i, o) in self.set_pages(keys, src, &rewrite, false, &budget).await {
                outcomes[i] = o;
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
        let removed = self.delete_within(keys, &self.budget("delete")).await?;
        bump(&self.stats.deleted_pages, removed as u64);
        Ok(removed)
    }

    /// `SCAN MATCH <key_prefix><namespace>*` on every primary of the slot map (a bounded
    /// number of rounds per node), each key found parsed back to a page key (anything else
    /// matching is left alone) and removed with the same per-node pipelines as `delete`.
    /// Pages written during the clear may survive it; a node that fails is an error naming it.
    /// Every round and every `DEL` pipeline runs under one `timeout_ms` budget: when it is
    /// spent the error names the round and the node.
    #[tracing::instrument(skip_all)]
    async fn clear(&self, namespace: hicache_core::NamespaceId) -> Result<u64> {
        let budget = self.budget("clear");
        let prefix = self.opts.key_prefix.as_bytes();
        let mut pattern = Vec::with_capacity(prefix.len() + 33);
        for &b in prefix {
            if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
                pattern.push(b'\\');
            }
            pattern.push(b);
        }
        pattern.extend_from_slice(namespace.to_hex().as_bytes());
        pattern.push(b'*');
        let count = SCAN_COUNT.to_string();
        let mut removed = 0u64;
        for addr in self.primaries() {
            let mut cursor = 0u64;
            let mut rounds = 0u64;
            loop {
                rounds += 1;
                let round = || format!("SCAN round {rounds} on node {addr}");
                if budget.spent() {
                    return Err(budget.timeout(round()).into());
                }
                let cur = cursor.to_string();
                let args: [&[u8]; 6] = [
                    b"SCAN",
                    cur.as_bytes(),
                    b"MATCH",
                    &pattern,
                    b"COUNT",
                    count.as_bytes(),
                ];
                let reply = self
                    .nodes
                    .control(&addr, "SCAN", &args, &Limits::scan(SCAN_COUNT), &budget)
                    .await
                    .map_err(|e| match e {
                        RedisError::Timeout { .. } => budget.timeout(round()),
                        other => other,
                    })?;
                let (next, found) = scan_reply(&addr, reply)?;
                let keys: Vec<PageKey> = found
                    .iter()
                    .filter_map(|k| k.strip_prefix(prefix))
                    .filter_map(|hex| std::str::from_utf8(hex).ok())
                    .filter_map(|hex| PageKey::from_hex(hex).ok())
                    .filter(|k| k.namespace == namespace)
                    .collect();
                for chunk in keys.chunks(MAX_BATCH) {
                    removed += self.delete_within(chunk, &budget).await? as u64;
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
                // SCAN ends in a bounded number of calls; a node that never does is an error.
                if rounds > CLEAR_MAX_SCAN_ROUNDS {
                    return Err(hicache_storage::StorageError::backend(
                        crate::NAME,
                        format!("clear: SCAN on {addr} did not finish in {rounds} rounds"),
                    ));
                }
            }
        }
        bump(&self.stats.cleared_pages, removed);
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

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_storage::pattern::{namespace, page_key};

    #[test]
    fn key_names_are_the_prefix_and_the_hex_page_key() {
        for i in 0..64 {
            let k = page_key(namespace(i), i * 7 + 1, i);
            assert_eq!(
                key_name(b"hicache:", &k),
                format!("hicache:{}", k.to_hex()).into_bytes()
            );
        }
    }
}
