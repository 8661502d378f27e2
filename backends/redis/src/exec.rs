//! Runs one command per page on the shards that own the pages: requests are grouped by the
//! primary that owns their slot, each group is sent as pipelines (one round trip each), and
//! all groups run at once. The bytes in flight are bounded by a semaphore shared by every call.
//!
//! Redirections and failures are handled per request, within the call's deadline:
//! - `MOVED`: the slot map is read again and the request goes to the new owner;
//! - `ASK`: the request is sent once to the named node behind `ASKING`;
//! - `TRYAGAIN`, `CLUSTERDOWN`, `LOADING`, `MASTERDOWN`, an unreachable or timed-out node:
//!   the request is retried after a pause (the slot map re-read), until the deadline;
//! - any other error reply is that request's final outcome.
//!
//! With `wait = Some(n)` every pipeline ends with `WAIT n timeout`: `WAIT` answers for the
//! writes made on the same connection before it, which include every write of the pipeline
//! that succeeded on that node, so a write is acknowledged only if the count it returns is at
//! least `n` (invariant: nothing is reported stored that the replicas have not confirmed).

use std::collections::HashMap;
use std::time::Duration;

use futures_util::future::join_all;
use hicache_storage::PageError;
use redis::{Cmd, Value};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::error::page_error;
use crate::nodes::Nodes;
use crate::topology::slot;

/// One command on one key. The command is built when sent (and again if it must be resent),
/// so a page's bytes are copied from the caller's buffer straight into the command.
pub struct Request<'a> {
    /// The key (for routing and messages).
    pub key: Vec<u8>,
    /// Bytes the command carries (for the in-flight bound).
    pub bytes: usize,
    build: Box<dyn Fn() -> Cmd + Send + Sync + 'a>,
}

impl<'a> Request<'a> {
    /// A request on `key` carrying `bytes`, whose command `build` makes.
    pub fn new(key: &[u8], bytes: usize, build: impl Fn() -> Cmd + Send + Sync + 'a) -> Self {
        Self {
            key: key.to_vec(),
            bytes,
            build: Box::new(build),
        }
    }

    /// A request whose command is `name key`.
    pub fn simple(name: &'static str, key: &[u8]) -> Self {
        let k = key.to_vec();
        Self::new(key, 0, move || {
            let mut c = redis::cmd(name);
            c.arg(&k);
            c
        })
    }
}

/// A request's final outcome.
#[derive(Debug)]
pub enum Reply {
    /// The server's reply.
    Value(Value),
    /// It failed; the error names the key.
    Failed(PageError),
}

/// Bounds the bytes in flight (permits are KiB).
pub struct Inflight {
    sem: Semaphore,
    total: u32,
}

impl Inflight {
    /// A bound of `bytes`.
    pub fn new(bytes: u64) -> Self {
        let total = (bytes / 1024).clamp(1, u32::MAX as u64 >> 4) as u32;
        Self {
            sem: Semaphore::new(total as usize),
            total,
        }
    }

    /// Largest pipeline in bytes: a quarter of the bound, so several shards are busy at once.
    fn chunk_bytes(&self) -> usize {
        (self.total as usize * 1024 / 4).max(1)
    }
}

enum Pending {
    /// Send to the slot's owner.
    Route,
    /// Send to this node behind ASKING.
    Ask(String),
}

/// Runs `reqs` and returns one reply per request, in order.
pub async fn execute(
    nodes: &Nodes,
    inflight: &Inflight,
    reqs: &[Request<'_>],
    wait: Option<(u32, Duration)>,
    deadline: Instant,
) -> Vec<Reply> {
    let mut out: Vec<Option<Reply>> = (0..reqs.len()).map(|_| None).collect();
    let mut pending: Vec<(usize, Pending)> = (0..reqs.len()).map(|i| (i, Pending::Route)).collect();
    let mut last_err: HashMap<usize, String> = HashMap::new();
    let mut attempt = 0u32;
    while !pending.is_empty() {
        let topology = nodes.topology();
        // Group by target node.
        let mut groups: HashMap<String, Vec<(usize, bool)>> = HashMap::new();
        let mut unrouted = Vec::new();
        for (i, p) in pending.drain(..) {
            let (addr, asking) = match p {
                Pending::Ask(a) => (a, true),
                Pending::Route => match topology.owner(slot(&reqs[i].key)) {
                    Some(a) => (a.to_string(), false),
                    None => {
                        last_err.insert(i, "no node serves the key's slot".into());
                        unrouted.push((i, Pending::Route));
                        continue;
                    }
                },
            };
            groups.entry(addr).or_default().push((i, asking));
        }
        // Cut groups into pipelines within the in-flight bound.
        let mut batches = Vec::new();
        for (addr, items) in groups {
            let mut cur = Vec::new();
            let mut cur_bytes = 0;
            for it in items {
                let b = reqs[it.0].bytes;
                if !cur.is_empty() && cur_bytes + b > inflight.chunk_bytes() {
                    batches.push((addr.clone(), std::mem::take(&mut cur), cur_bytes));
                    cur_bytes = 0;
                }
                cur_bytes += b;
                cur.push(it);
            }
            if !cur.is_empty() {
                batches.push((addr, cur, cur_bytes));
            }
        }
        let results = join_all(batches.into_iter().map(|(addr, items, bytes)| async move {
            let res = send(nodes, inflight, &addr, reqs, &items, bytes, wait).await;
            (addr, items, res)
        }))
        .await;
        let mut refresh = !unrouted.is_empty();
        let mut retry = unrouted;
        for (addr, items, res) in results {
            match res {
                Err(e) => {
                    nodes.forget(&addr);
                    refresh = true;
                    for (i, _) in items {
                        last_err.insert(i, format!("{addr}: {e}"));
                        retry.push((i, Pending::Route));
                    }
                }
                Ok((replies, acked)) => {
                    for ((i, _), r) in items.into_iter().zip(replies) {
                        let key = String::from_utf8_lossy(&reqs[i].key).into_owned();
                        match r {
                            Ok(v) => {
                                out[i] = Some(match acked {
                                    Some(Err(ref why)) => Reply::Failed(PageError::Backend(
                                        format!("redis {key}: {why}"),
                                    )),
                                    _ => Reply::Value(v),
                                });
                            }
                            Err(e) => match e.code() {
                                Some("MOVED") => {
                                    refresh = true;
                                    last_err.insert(i, format!("{addr}: {e}"));
                                    retry.push((i, Pending::Route));
                                }
                                Some("ASK") => match e.redirect_node() {
                                    Some((h, p)) => {
                                        let target = if h.contains(':') {
                                            format!("[{h}]:{p}")
                                        } else {
                                            format!("{h}:{p}")
                                        };
                                        retry.push((i, Pending::Ask(target)));
                                    }
                                    None => out[i] = Some(Reply::Failed(page_error(&key, &e))),
                                },
                                Some(
                                    "TRYAGAIN" | "CLUSTERDOWN" | "LOADING" | "MASTERDOWN"
                                    | "READONLY",
                                ) => {
                                    refresh = true;
                                    last_err.insert(i, format!("{addr}: {e}"));
                                    retry.push((i, Pending::Route));
                                }
                                _ => out[i] = Some(Reply::Failed(page_error(&key, &e))),
                            },
                        }
                    }
                }
            }
        }
        pending = retry;
        if pending.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            break;
        }
        attempt += 1;
        // Only redirections retry at once; failures pause first (bounded, within the deadline).
        let only_asks = pending.iter().all(|(_, p)| matches!(p, Pending::Ask(_)));
        if !only_asks && attempt > 1 {
            let pause = Duration::from_millis((25u64 << attempt.min(4)).min(250));
            tokio::time::sleep_until((Instant::now() + pause).min(deadline)).await;
        }
        if refresh {
            nodes.refresh().await;
        }
    }
    for (i, _) in pending {
        let why = last_err.remove(&i).unwrap_or_else(|| "no reply".into());
        out[i] = Some(Reply::Failed(PageError::Io {
            op: "redis",
            detail: format!(
                "{}: no answer within the timeout; last error: {why}",
                String::from_utf8_lossy(&reqs[i].key)
            ),
        }));
    }
    out.into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.unwrap_or_else(|| {
                Reply::Failed(PageError::Backend(format!(
                    "redis {}: no node serves the key's slot",
                    String::from_utf8_lossy(&reqs[i].key)
                )))
            })
        })
        .collect()
}

type PipelineResult = (Vec<redis::RedisResult<Value>>, Option<Result<(), String>>);

/// Sends one pipeline to `addr`. Returns the per-request replies and, with `wait`, whether
/// `WAIT` confirmed enough replicas.
async fn send(
    nodes: &Nodes,
    inflight: &Inflight,
    addr: &str,
    reqs: &[Request<'_>],
    items: &[(usize, bool)],
    bytes: usize,
    wait: Option<(u32, Duration)>,
) -> Result<PipelineResult, String> {
    let permits = ((bytes / 1024) as u32 + 1).min(inflight.total);
    let _permit = inflight
        .sem
        .acquire_many(permits)
        .await
        .map_err(|e| e.to_string())?;
    let mut conn = nodes.conn(addr).await.map_err(|e| e.to_string())?;
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    for (i, asking) in items {
        if *asking {
            pipe.cmd("ASKING").ignore();
        }
        pipe.add_command((reqs[*i].build)());
    }
    if let Some((n, t)) = wait {
        pipe.cmd("WAIT").arg(n).arg(t.as_millis() as u64);
    }
    nodes.count_round_trip(addr);
    let mut replies: Vec<redis::RedisResult<Value>> = pipe
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    let acked = wait.map(|(n, _)| match replies.pop() {
        Some(Ok(Value::Int(k))) if k >= n as i64 => Ok(()),
        Some(Ok(Value::Int(k))) => Err(format!(
            "WAIT: {k} of {n} replicas acknowledged the write in time (min_replicas_acked)"
        )),
        other => Err(format!("WAIT failed: {other:?}")),
    });
    if replies.len() != items.len() {
        return Err(format!(
            "{} replies to {} commands",
            replies.len(),
            items.len()
        ));
    }
    Ok((replies, acked))
}
