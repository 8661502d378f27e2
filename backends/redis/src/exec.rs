//! Runs one command per page on the shards that own the pages: requests are grouped by the
//! primary that owns their slot, each group is sent as pipelines (one round trip each), and
//! all groups run at once. The bytes in flight are bounded by a semaphore shared by every call.
//!
//! Redirections and failures are handled per request, within the call's [`Budget`]:
//! - `MOVED`: the slot map is read again and the request goes to the new owner;
//! - `ASK`: the request is sent once to the named node behind `ASKING`;
//! - more than [`MAX_REDIRECTIONS`] `MOVED`/`ASK` for one request is a redirection loop: the
//!   request fails with an error naming its slot and the nodes it was sent to;
//! - `TRYAGAIN`, `CLUSTERDOWN`, `LOADING`, `MASTERDOWN`, an unreachable or timed-out node:
//!   the request is retried after a pause (the slot map re-read), until the budget is spent;
//! - a ranged page read refused for permissions (`NOPERM` to `MULTI`, `STRLEN`, `GETRANGE` or
//!   `EXEC`): ranged reads are turned off for the backend's life
//!   ([`Nodes::refuse_ranged_reads`]) and the request is sent again at once as one `GET`
//!   (where the refusal left the transaction open, as its pipeline's failure);
//! - any other error reply is that request's final outcome.
//!
//! Invariant: everything [`execute`] awaits — the in-flight bound, a connection, its writes
//! and replies, the pauses, the slot-map refreshes — ends by the budget's end: a request still
//! pending then fails with a timeout error saying what it was waiting for and its last error.
//! A failed pipeline's error keeps its cause: a dropped connection, a reply that is not RESP or
//! over its bound (the connection is closed and counted), or the budget.
//!
//! A pipeline holds its data connection alone ([`Lease`](crate::nodes::Lease)) from its
//! first byte written to its last reply read. With `wait = Some(n)` every pipeline ends with
//! `WAIT n t` (`t` the part of the budget left, so `WAIT` too ends within it): `WAIT`
//! answers for the writes made on the same connection before it,
//! which include every write of the pipeline that succeeded on that node, so a write is acknowledged only if the count it returns is at
//! least `n` (invariant: nothing is reported stored that the replicas have not confirmed).

use std::collections::HashMap;
use std::io::IoSlice;
use std::time::Duration;

use futures_util::future::join_all;
use hicache_core::PageKey;
use hicache_storage::{PageBufMut, PageError};
use tokio::sync::{Mutex, Semaphore};
use tokio::time::Instant;

use crate::conn::{Conn, ConnError, PageRead};
use crate::deadline::Budget;
use crate::error::page_error;
use crate::nodes::{BIG_VALUE, Nodes};
use crate::resp::{self, Frame, Limits};
use crate::topology::{Topology, slot};
use crate::value;

/// `ASKING`, sent in front of a request redirected by `ASK` (in front of its `MULTI` for a
/// ranged page read: the flag lasts through the transaction).
const ASKING: &[u8] = b"*1\r\n$6\r\nASKING\r\n";
/// `MULTI` and `EXEC` around the commands of a ranged page read.
const MULTI: &[u8] = b"*1\r\n$5\r\nMULTI\r\n";
const EXEC: &[u8] = b"*1\r\n$4\r\nEXEC\r\n";

/// `MOVED`/`ASK` redirections one request follows at most; more is a redirection loop.
pub const MAX_REDIRECTIONS: usize = 16;

/// One command on one key, RESP-encoded once and sent as often as it must be (redirections,
/// retries). A page's bytes are not copied into the command: they go to the socket from the
/// caller's buffer, between `head` and `tail`.
pub struct Request<'a> {
    /// The command's name (for messages).
    pub name: &'static str,
    /// The key (for routing and messages).
    pub key: Vec<u8>,
    /// Bytes the command carries or fetches (for the in-flight bound).
    pub bytes: usize,
    /// The command up to the page's bytes (all of it when it carries none).
    head: Vec<u8>,
    /// The parts of the page the command carries (none: empty).
    page: &'a [&'a [u8]],
    /// The rest of the command after the page's bytes.
    tail: Vec<u8>,
    /// Read the reply as this page into destination slot `.1` (see [`execute`]).
    read_into: Option<(PageKey, usize)>,
    /// A page read made in ranges of at most this many bytes (`MULTI`, `STRLEN`,
    /// `GETRANGE`s, `EXEC`, sent as `ranged` instead of `head`); `0`: one `GET`.
    chunk: usize,
    /// The ranged form of a page read (empty where `chunk` is `0`); `head` is its one `GET`,
    /// sent instead once ranged reads were refused ([`Nodes::ranged_reads`]).
    ranged: Vec<u8>,
}

impl<'a> Request<'a> {
    /// A request `name` whose command is `args` (the key among them), carrying no page.
    pub fn command(name: &'static str, key: &[u8], args: &[&[u8]]) -> Self {
        let mut head = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
        resp::put_command(&mut head, args);
        Self::whole(name, key.to_vec(), head)
    }

    /// A request `name` on `key` whose command is `head` whole: no page carried or read.
    fn whole(name: &'static str, key: Vec<u8>, head: Vec<u8>) -> Self {
        Self {
            name,
            key,
            bytes: 0,
            head,
            page: &[],
            tail: Vec::new(),
            read_into: None,
            chunk: 0,
            ranged: Vec::new(),
        }
    }

    /// A request whose command is `name key`.
    pub fn simple(name: &'static str, key: &[u8]) -> Self {
        Self::command(name, key, &[name.as_bytes(), key])
    }

    /// [`simple`](Self::simple), keeping `key` (no copy of it).
    pub fn simple_owned(name: &'static str, key: Vec<u8>) -> Self {
        let mut head = Vec::with_capacity(32 + name.len() + key.len());
        resp::put_command(&mut head, &[name.as_bytes(), &key]);
        Self::whole(name, key, head)
    }

    /// `SET key <header><page> [NX] [EX ttl]`.
    pub fn set(
        key: &[u8],
        header: &[u8],
        page: &'a [&'a [u8]],
        nx: bool,
        ttl_s: Option<u64>,
    ) -> Self {
        let page_len: usize = page.iter().map(|p| p.len()).sum();
        let ttl = ttl_s.map(|t| t.to_string());
        let args = 3 + usize::from(nx) + if ttl.is_some() { 2 } else { 0 };
        let mut head = Vec::with_capacity(64 + key.len() + header.len());
        resp::put_array_head(&mut head, args);
        resp::put_bulk(&mut head, b"SET");
        resp::put_bulk(&mut head, key);
        resp::put_bulk_head(&mut head, header.len() + page_len);
        head.extend_from_slice(header);
        let mut tail = b"\r\n".to_vec();
        if nx {
            resp::put_bulk(&mut tail, b"NX");
        }
        if let Some(t) = &ttl {
            resp::put_bulk(&mut tail, b"EX");
            resp::put_bulk(&mut tail, t.as_bytes());
        }
        Self {
            bytes: header.len() + page_len,
            page,
            tail,
            ..Self::whole("SET", key.to_vec(), head)
        }
    }

    /// `GET key`, whose reply is read as `page`'s value straight into destination `slot`
    /// (of `bytes` bytes with the value's header). A value longer than `chunk` (`≠ 0`) is
    /// read in ranges of at most `chunk` bytes ([`value::read_ranges`]) in one transaction
    /// instead: `MULTI`, `STRLEN key`, `GETRANGE key start end` per range, `EXEC` (see
    /// [`RedisOptions::read_chunk_bytes`](crate::RedisOptions::read_chunk_bytes)), or one
    /// `GET` after all once a node refused ranged reads for permissions.
    pub fn get_page(key: &[u8], page: PageKey, slot: usize, bytes: usize, chunk: usize) -> Self {
        let mut r = Self::simple("GET", key);
        r.bytes = bytes;
        r.read_into = Some((page, slot));
        if chunk > 0 && bytes > chunk {
            let mut head = Vec::with_capacity(64 + bytes.div_ceil(chunk) * (key.len() + 48));
            head.extend_from_slice(MULTI);
            resp::put_command(&mut head, &[b"STRLEN", key]);
            for (start, len) in value::read_ranges(bytes, chunk) {
                let (a, b) = (start.to_string(), (start + len - 1).to_string());
                resp::put_command(&mut head, &[b"GETRANGE", key, a.as_bytes(), b.as_bytes()]);
            }
            head.extend_from_slice(EXEC);
            r.ranged = head;
            r.chunk = chunk;
        }
        r
    }
}

/// A request's final outcome. Error replies are never here: they are redirections, retries
/// or a [`Reply::Failed`].
#[derive(Debug)]
pub enum Reply {
    /// The server's reply.
    Value(Frame),
    /// What a page read found (requests made by [`Request::get_page`]).
    Page(PageRead),
    /// It failed; the error names the key.
    Failed(PageError),
}

/// Destinations of page reads, by slot; each is locked only while its reply is read.
pub type Dst<'d, 'b> = [Mutex<&'d mut PageBufMut<'b>>];

/// Page bytes one pipeline carries at most (one page more where a page is larger). A node's
/// share of a batch of large pages is cut into pipelines of this size that run on separate
/// connections at once, so the node reads one while it answers another and this side reads
/// replies while others are still being written (one 11 MiB pipeline per node halved the
/// throughput of 256 KiB pages on loopback); a batch of small pages (128 of 16 KiB: about
/// 700 KiB per node of 3) is still one pipeline, one round trip, per node.
pub const PIPELINE_BYTES: usize = 1 << 20;

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

    /// Largest pipeline in bytes: [`PIPELINE_BYTES`], or a quarter of the bound where that is
    /// less, so several shards are busy at once.
    fn chunk_bytes(&self) -> usize {
        (self.total as usize * 1024 / 4).clamp(1, PIPELINE_BYTES)
    }
}

enum Pending {
    /// Send to the slot's owner.
    Route,
    /// Send to this node behind ASKING.
    Ask(String),
}

/// The node an `ASK` or `MOVED` error names (`ASK 3999 10.0.0.1:7001`), as `host:port`
/// (IPv6 hosts bracketed).
fn redirect_target(msg: &str) -> Option<String> {
    let addr = msg.split_whitespace().nth(2)?;
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    port.parse::<u16>().ok()?;
    Some(if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

/// Runs `reqs` within `budget` and returns one reply per request, in order. Requests made by
/// [`Request::get_page`] read their page into `dst[slot]`; page values longer than
/// `max_value` bytes are refused unread. With `wait = Some(n)` every pipeline ends with
/// `WAIT n` (see the [module docs](self)).
pub async fn execute(
    nodes: &Nodes,
    inflight: &Inflight,
    reqs: &[Request<'_>],
    dst: &Dst<'_, '_>,
    wait: Option<u32>,
    budget: &Budget,
) -> Vec<Reply> {
    let deadline = budget.end();
    let max_value = usize::try_from(nodes.max_value_bytes).unwrap_or(usize::MAX);
    let mut run = Run::new(reqs);
    let mut attempt = 0u32;
    while !run.pending.is_empty() {
        let pipelines = run.route(&nodes.topology(), inflight.chunk_bytes());
        let results = join_all(pipelines.into_iter().map(|(addr, items, bytes)| async move {
            let sent = send(
                nodes, inflight, &addr, reqs, &items, bytes, dst, wait, max_value, deadline,
            );
            let res = match tokio::time::timeout_at(deadline, sent).await {
                Ok(r) => r.map_err(|e| (e, false)),
                Err(_) => Err((
                    format!(
                        "a pipeline of {} {} to node {addr} was cut by the end of the budget",
                        items.len(),
                        reqs[items[0].0].name
                    ),
                    true,
                )),
            };
            (addr, items, res)
        }))
        .await;
        for (addr, items, res) in results {
            run.settle(nodes, &addr, items, res);
        }
        if run.pending.is_empty() || Instant::now() >= deadline {
            break;
        }
        attempt += 1;
        // Only redirections retry at once; failures pause first (bounded, within the deadline).
        let only_asks = run
            .pending
            .iter()
            .all(|(_, p)| matches!(p, Pending::Ask(_)));
        if !only_asks && attempt > 1 {
            let pause = Duration::from_millis((25u64 << attempt.min(4)).min(250));
            tokio::time::sleep_until((Instant::now() + pause).min(deadline)).await;
        }
        if std::mem::take(&mut run.refresh) {
            nodes.refresh(budget).await;
        }
    }
    run.finish(budget)
}

/// One pipeline: its node, its requests (index, sent behind `ASKING`) and the page bytes
/// they carry.
type Pipeline = (String, Vec<(usize, bool)>, usize);

/// What a pipeline came to: its replies, or why it failed and whether the budget's end cut it.
type Sent = Result<PipelineResult, (String, bool)>;

/// The state of one [`execute`] call: each request's outcome once it has one, the requests
/// still to send, and what the pending ones last ran into.
struct Run<'r, 'a> {
    reqs: &'r [Request<'a>],
    out: Vec<Option<Reply>>,
    pending: Vec<(usize, Pending)>,
    last_err: HashMap<usize, String>,
    /// Per request: the redirections it followed (`MOVED 3999 host:port`), in order.
    redirected: HashMap<usize, Vec<String>>,
    /// Whether the slot map must be read again before the next round.
    refresh: bool,
}

impl<'r, 'a> Run<'r, 'a> {
    fn new(reqs: &'r [Request<'a>]) -> Self {
        Self {
            reqs,
            out: (0..reqs.len()).map(|_| None).collect(),
            pending: (0..reqs.len()).map(|i| (i, Pending::Route)).collect(),
            last_err: HashMap::new(),
            redirected: HashMap::new(),
            refresh: false,
        }
    }

    fn key(&self, i: usize) -> String {
        String::from_utf8_lossy(&self.reqs[i].key).into_owned()
    }

    /// Takes the pending requests, groups them by target node and cuts each group into
    /// pipelines of at most `chunk_bytes` (one request more where it is larger). A request
    /// whose slot no node serves stays pending, and the slot map is to be read again.
    fn route(&mut self, topology: &Topology, chunk_bytes: usize) -> Vec<Pipeline> {
        // Grouped by the owner's index in the slot map (no address copied per request);
        // `ASK` targets, rare, by address.
        let mut by_owner: Vec<Vec<(usize, bool)>> = vec![Vec::new(); topology.nodes.len()];
        let mut asked: HashMap<String, Vec<(usize, bool)>> = HashMap::new();
        for (i, p) in std::mem::take(&mut self.pending) {
            match p {
                Pending::Ask(a) => asked.entry(a).or_default().push((i, true)),
                Pending::Route => match topology.owner_index(slot(&self.reqs[i].key)) {
                    Some(o) => by_owner[o].push((i, false)),
                    None => {
                        self.last_err
                            .insert(i, "no node serves the key's slot".into());
                        self.pending.push((i, Pending::Route));
                        self.refresh = true;
                    }
                },
            }
        }
        let groups = by_owner
            .into_iter()
            .enumerate()
            .filter(|(_, items)| !items.is_empty())
            .map(|(o, items)| (topology.nodes[o].clone(), items))
            .chain(asked);
        let mut pipelines = Vec::new();
        for (addr, items) in groups {
            let mut cur = Vec::new();
            let mut cur_bytes = 0;
            for it in items {
                let b = self.reqs[it.0].bytes;
                if !cur.is_empty() && cur_bytes + b > chunk_bytes {
                    pipelines.push((addr.clone(), std::mem::take(&mut cur), cur_bytes));
                    cur_bytes = 0;
                }
                cur_bytes += b;
                cur.push(it);
            }
            if !cur.is_empty() {
                pipelines.push((addr, cur, cur_bytes));
            }
        }
        pipelines
    }

    /// Takes in what pipeline `items` to `addr` came to: a failed pipeline's requests are
    /// retried (the node's idle connections dropped, the slot map re-read); otherwise each
    /// reply is settled.
    fn settle(&mut self, nodes: &Nodes, addr: &str, items: Vec<(usize, bool)>, res: Sent) {
        let (replies, acked) = match res {
            Ok(r) => r,
            Err((e, timed_out)) => {
                nodes.forget(addr);
                self.refresh = true;
                for (i, _) in items {
                    // The end of the budget says less than an error before it.
                    if !(timed_out && self.last_err.contains_key(&i)) {
                        self.last_err.insert(i, e.clone());
                    }
                    self.pending.push((i, Pending::Route));
                }
                return;
            }
        };
        for ((i, asking), r) in items.into_iter().zip(replies) {
            match r {
                Answer::RangedRefused(msg) => {
                    // Sent again at once, as one GET, to the same node where ASK sent it.
                    self.last_err
                        .insert(i, format!("node {addr} refused a ranged read: {msg}"));
                    let to = if asking {
                        Pending::Ask(addr.to_string())
                    } else {
                        Pending::Route
                    };
                    self.pending.push((i, to));
                }
                Answer::Reply(reply) => {
                    self.out[i] = Some(match &acked {
                        Some(Err(why)) => Reply::Failed(PageError::Backend(format!(
                            "redis {}: {why}",
                            self.key(i)
                        ))),
                        _ => reply,
                    });
                }
                Answer::Error(msg) => self.error_reply(i, addr, msg),
            }
        }
    }

    /// Request `i` got error reply `msg` from `addr`: a redirection (up to
    /// [`MAX_REDIRECTIONS`]), a retry, or its final outcome.
    fn error_reply(&mut self, i: usize, addr: &str, msg: String) {
        let verb = msg.split_whitespace().next().unwrap_or("");
        if matches!(verb, "MOVED" | "ASK") {
            let seen = self.redirected.entry(i).or_default();
            seen.push(msg.clone());
            if seen.len() > MAX_REDIRECTIONS {
                let why = format!(
                    "redis {}: too many redirections ({} MOVED/ASK, a redirection loop) for slot {}: {}",
                    String::from_utf8_lossy(&self.reqs[i].key),
                    seen.len(),
                    slot(&self.reqs[i].key),
                    loop_summary(seen)
                );
                self.out[i] = Some(Reply::Failed(PageError::Backend(why)));
                return;
            }
        }
        match verb {
            "MOVED" | "TRYAGAIN" | "CLUSTERDOWN" | "LOADING" | "MASTERDOWN" | "READONLY" => {
                self.refresh = true;
                self.last_err
                    .insert(i, format!("node {addr} answered {msg}"));
                self.pending.push((i, Pending::Route));
            }
            "ASK" => match redirect_target(&msg) {
                Some(target) => self.pending.push((i, Pending::Ask(target))),
                None => self.out[i] = Some(Reply::Failed(page_error(&self.key(i), &msg))),
            },
            _ => self.out[i] = Some(Reply::Failed(page_error(&self.key(i), &msg))),
        }
    }

    /// The replies in request order: a request still pending failed by the budget's end
    /// (with its last error), one never routed failed for want of a node.
    fn finish(mut self, budget: &Budget) -> Vec<Reply> {
        for (i, _) in std::mem::take(&mut self.pending) {
            let why = self
                .last_err
                .remove(&i)
                .unwrap_or_else(|| "no reply".into());
            let doing = format!("{} {}", self.reqs[i].name, self.key(i));
            self.out[i] = Some(Reply::Failed(PageError::Io {
                op: "redis",
                detail: format!("{}; last error: {why}", budget.timeout(doing)),
            }));
        }
        let reqs = self.reqs;
        self.out
            .into_iter()
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
}

/// What one request of a pipeline came to.
enum Answer {
    /// Its reply.
    Reply(Reply),
    /// An error reply's text.
    Error(String),
    /// A ranged page read refused for permissions (`NOPERM`; ranged reads are now off): the
    /// request is sent again, as one `GET`.
    RangedRefused(String),
}

/// Per request: what it came to. With `wait`: whether `WAIT` confirmed enough replicas.
type PipelineResult = (Vec<Answer>, Option<Result<(), String>>);

/// Whether `msg`, a ranged page read's error, says the ACL user may not run one of its
/// commands: `NOPERM` (`MULTI`, `STRLEN` or `GETRANGE` refused), or `EXECABORT … because of:
/// NOPERM …` (`EXEC` refused, Redis 6.2 on).
fn refused_for_permissions(msg: &str) -> bool {
    msg.starts_with("NOPERM") || (msg.starts_with("EXECABORT") && msg.contains("NOPERM"))
}

/// The redirections of a loop, shortened: the first three and the last.
fn loop_summary(seen: &[String]) -> String {
    let mut parts: Vec<&str> = seen.iter().take(3).map(String::as_str).collect();
    if seen.len() > 3 {
        parts.push("…");
        parts.extend(seen.last().map(String::as_str));
    }
    parts.join(", ")
}

/// Sends one pipeline to `addr` on a leased connection (one vectored write of every command,
/// then every reply read in order) and returns the per-request replies. The caller bounds it
/// by the call's budget (`deadline`, of which `WAIT` is given what is left).
#[allow(clippy::too_many_arguments)]
async fn send(
    nodes: &Nodes,
    inflight: &Inflight,
    addr: &str,
    reqs: &[Request<'_>],
    items: &[(usize, bool)],
    bytes: usize,
    dst: &Dst<'_, '_>,
    wait: Option<u32>,
    max_value: usize,
    deadline: Instant,
) -> Result<PipelineResult, String> {
    let permits = ((bytes / 1024) as u32 + 1).min(inflight.total);
    let _permit = inflight
        .sem
        .acquire_many(permits)
        .await
        .map_err(|e| e.to_string())?;
    let mut lease = nodes
        .lease(addr)
        .await
        .map_err(|e| nodes.failed(addr, "connect", e).to_string())?;
    let wait_cmd = wait.map(|n| wait_command(n, deadline));
    // One answer for the whole pipeline: its replies are read as what was written.
    let ranged = nodes.ranged_reads();
    let conn = &mut lease.conn;
    nodes.count_round_trip(addr);
    write_pipeline(conn, reqs, items, wait_cmd.as_deref(), ranged)
        .await
        .map_err(|e| nodes.failed(addr, reqs[items[0].0].name, e).to_string())?;
    let mut replies = Vec::with_capacity(items.len());
    for &(i, asking) in items {
        let failed = |e| nodes.failed(addr, reqs[i].name, e).to_string();
        if asking {
            // +OK; an error here shows in the redirected command's own reply.
            conn.read_frame(&Limits::reply()).await.map_err(failed)?;
        }
        let answer = read_reply(conn, &reqs[i], dst, max_value, ranged)
            .await
            .map_err(|e| match e {
                ReplyError::Conn(e) => {
                    if let ConnError::ExecRefused(why) = &e {
                        // The pipeline fails (the connection is closed) and is sent again.
                        nodes.refuse_ranged_reads(addr, why);
                    }
                    failed(e)
                }
                ReplyError::NoSlot(why) => why,
            })?;
        replies.push(match answer {
            Err(msg) if ranged && reqs[i].chunk > 0 && refused_for_permissions(&msg) => {
                nodes.refuse_ranged_reads(addr, &msg);
                Answer::RangedRefused(msg)
            }
            Err(msg) => Answer::Error(msg),
            Ok(reply) => Answer::Reply(reply),
        });
    }
    let acked = match wait {
        None => None,
        Some(n) => Some(
            read_ack(conn, n)
                .await
                .map_err(|e| nodes.failed(addr, "WAIT", e).to_string())?,
        ),
    };
    let carried_big = items
        .iter()
        .any(|&(i, _)| reqs[i].page.iter().map(|p| p.len()).sum::<usize>() >= BIG_VALUE);
    lease.release(carried_big);
    Ok((replies, acked))
}

/// `WAIT n t`, `t` 9/10 of what is left until `deadline` (at least 1 ms: `WAIT n 0` would
/// block for ever), so its answer arrives within the budget.
fn wait_command(n: u32, deadline: Instant) -> Vec<u8> {
    let left = deadline.saturating_duration_since(Instant::now());
    let t = (left * 9 / 10).max(Duration::from_millis(1));
    let (n, t) = (n.to_string(), t.as_millis().max(1).to_string());
    let mut cmd = Vec::new();
    resp::put_command(&mut cmd, &[b"WAIT", n.as_bytes(), t.as_bytes()]);
    cmd
}

/// Writes every command of a pipeline (each behind `ASKING` where asked; page reads in their
/// ranged form where `ranged`), then `wait_cmd`, in one vectored write.
async fn write_pipeline(
    conn: &mut Conn,
    reqs: &[Request<'_>],
    items: &[(usize, bool)],
    wait_cmd: Option<&[u8]>,
    ranged: bool,
) -> Result<(), ConnError> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(items.len() * 4 + 1);
    for &(i, asking) in items {
        let r = &reqs[i];
        if asking {
            slices.push(IoSlice::new(ASKING));
        }
        slices.push(IoSlice::new(if ranged && r.chunk > 0 {
            &r.ranged
        } else {
            &r.head
        }));
        slices.extend(r.page.iter().map(|p| IoSlice::new(p)));
        if !r.tail.is_empty() {
            slices.push(IoSlice::new(&r.tail));
        }
    }
    if let Some(w) = wait_cmd {
        slices.push(IoSlice::new(w));
    }
    conn.write_all(&mut slices).await
}

/// Why a reply could not be read: the connection failed, or a page read names no
/// destination.
enum ReplyError {
    Conn(ConnError),
    NoSlot(String),
}

/// Reads `req`'s reply (a page read as ranged where `ranged`, as [`write_pipeline`] sent
/// it): an error reply's text, a page read into its destination, or a value.
async fn read_reply(
    conn: &mut Conn,
    req: &Request<'_>,
    dst: &Dst<'_, '_>,
    max_value: usize,
    ranged: bool,
) -> Result<Result<Reply, String>, ReplyError> {
    let Some((key, slot)) = req.read_into else {
        return Ok(
            match conn
                .read_frame(&Limits::reply())
                .await
                .map_err(ReplyError::Conn)?
            {
                Frame::Error(e) => Err(e),
                f => Ok(Reply::Value(f)),
            },
        );
    };
    let Some(cell) = dst.get(slot) else {
        return Err(ReplyError::NoSlot(format!(
            "no destination for page slot {slot}"
        )));
    };
    let mut d = cell.lock().await;
    let read = if ranged && req.chunk > 0 {
        conn.read_page_chunked(&key, &mut d, req.chunk).await
    } else {
        conn.read_page(&key, &mut d, max_value).await
    };
    Ok(match read.map_err(ReplyError::Conn)? {
        PageRead::Frame(Frame::Error(e)) => Err(e),
        p => Ok(Reply::Page(p)),
    })
}

/// Reads `WAIT`'s answer: whether at least `n` replicas acknowledged the pipeline's writes.
async fn read_ack(conn: &mut Conn, n: u32) -> Result<Result<(), String>, ConnError> {
    Ok(match conn.read_frame(&Limits::reply()).await? {
        Frame::Int(k) if k >= i64::from(n) => Ok(()),
        Frame::Int(k) => Err(format!(
            "WAIT: {k} of {n} replicas acknowledged the write in time (min_replicas_acked)"
        )),
        other => Err(format!("WAIT failed: {other:?}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_storage::PageBuf;

    #[test]
    fn redirections_name_their_node() {
        assert_eq!(
            redirect_target("ASK 3999 127.0.0.1:6381").as_deref(),
            Some("127.0.0.1:6381")
        );
        assert_eq!(
            redirect_target("MOVED 1 ::1:7000").as_deref(),
            Some("[::1]:7000")
        );
        assert_eq!(redirect_target("ASK 3999"), None);
        assert_eq!(redirect_target("ASK 1 host:notaport"), None);
    }

    #[test]
    fn permission_refusals_of_ranged_reads_are_told_from_other_errors() {
        for yes in [
            "NOPERM this user has no permissions to run the 'multi' command",
            "NOPERM User u has no permissions to run the 'getrange' command",
            "EXECABORT Transaction discarded because of: NOPERM this user has no permissions to run the 'exec' command",
        ] {
            assert!(refused_for_permissions(yes), "{yes}");
        }
        for no in [
            "MOVED 1 127.0.0.1:7000",
            "ASK 1 127.0.0.1:7000",
            "EXECABORT Transaction discarded because of previous errors.",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            "ERR EXEC without MULTI",
        ] {
            assert!(!refused_for_permissions(no), "{no}");
        }
    }

    #[test]
    fn a_page_read_keeps_its_get_for_when_ranges_are_refused() {
        let k = hicache_core::PageKey::default();
        let plain = Request::get_page(b"key", k, 0, 100, 4096);
        assert!(plain.ranged.is_empty() && plain.chunk == 0);
        let r = Request::get_page(b"key", k, 0, 10_000, 4096);
        assert_eq!(r.chunk, 4096);
        assert_eq!(r.head, plain.head, "one GET");
        assert!(r.ranged.starts_with(MULTI) && r.ranged.ends_with(EXEC));
    }

    #[test]
    fn a_set_request_is_one_resp_command_around_the_page() {
        let page_bytes = [7u8; 10];
        let page = PageBuf::from_parts(hicache_core::LayoutKind::PageFirst, page_bytes.chunks(3));
        let r = Request::set(b"k", b"HDR", page.parts(), true, Some(60));
        let mut wire = r.head.clone();
        for p in page.parts() {
            wire.extend_from_slice(p);
        }
        wire.extend_from_slice(&r.tail);
        let (f, n) = resp::parse(&wire, &resp::Limits::default())
            .unwrap()
            .unwrap();
        assert_eq!(n, wire.len());
        let mut value = b"HDR".to_vec();
        value.extend_from_slice(&page_bytes);
        let args: Vec<Frame> = [&b"SET"[..], b"k", &value, b"NX", b"EX", b"60"]
            .iter()
            .map(|a| Frame::Bulk(a.to_vec()))
            .collect();
        assert_eq!(f, Frame::Array(args));
    }
}
