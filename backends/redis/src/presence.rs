//! [`Presence`]: the client-side presence cache of `batch_exists` (opt-in,
//! [`RedisOptions::presence_cache_keys`](crate::config::RedisOptions)), kept true by the
//! servers' own invalidation messages (Redis 6+ client-side caching, `CLIENT TRACKING`).
//!
//! A prefetch asks `batch_exists` for the same prefix pages again and again (a system prompt,
//! the turns of one conversation); each ask is a round trip to every primary holding one of
//! the keys. With the cache, a key the cluster confirmed and nobody changed since is answered
//! here, in microseconds.
//!
//! **Per node** (primary, `host:port`):
//! - a *subscriber* connection, run by a background task: `CLIENT ID`, then `SUBSCRIBE
//!   __redis__:invalidate`. The server sends it the names of keys read on connections whose
//!   tracking redirects to it, whenever such a key is written, deleted, expired or evicted
//!   (and a nil for `FLUSHALL` / `FLUSHDB`, or when its tracking table overflows);
//! - a *tracking* connection (`CLIENT TRACKING ON REDIRECT <subscriber id>`), on which this
//!   module sends its `EXISTS` pipelines, one at a time (a second concurrent ask goes the
//!   uncached way);
//! - the map of keys: `Pending(token)` while an `EXISTS` is out, `Present` once it answered 1.
//!
//! **Invariants**, kept by [`NodeState`]:
//! 1. A key is `Present` only if an `EXISTS` on a tracking connection pointed at the live
//!    subscriber answered 1, and no invalidation of the key arrived between the moment the
//!    ask was registered (`Pending` with its token, before the command is written) and the
//!    moment its answer was taken in. An invalidation removes the key whatever its state, so
//!    an answer racing an invalidation (they travel on different connections) is dropped.
//! 2. When the subscriber connection ends (an error, `CLIENT KILL`, a restart, a failover) the
//!    node's map is emptied and the node answers nothing from the cache until a new
//!    subscriber is up; its `epoch` then changes and a tracking connection pointed at an older
//!    subscriber is never used again.
//! 3. At most `max_keys` keys per node: a full map is emptied.
//! 4. A subscriber task that ends for any reason, its runtime shut down included, leaves the
//!    node as in 2 (a guard owned by the task does it when dropped), and the next use of the
//!    node starts a new task.
//!
//! What a `Present` answer may still be: stale for the time an invalidation takes to arrive
//! (the window in which a page can also be evicted between `batch_exists` and `batch_get`
//! without any cache). A later read of such a page is a counted miss; reads verify every page,
//! so no wrong bytes are ever returned. Whatever this module cannot answer (a node without a
//! live subscriber, a busy or failed tracking connection, a redirection, any error) it leaves
//! to the uncached path, which handles redirections and retries.

use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::conn::{Conn, ConnError, Connector};
use crate::resp::{self, Frame, Limits};
use crate::topology::{Topology, slot};

/// The channel the servers send invalidations to in RESP2's redirect mode.
const INVALIDATE_CHANNEL: &[u8] = b"__redis__:invalidate";
/// First pause before a subscriber reconnects; doubled after each failure, up to
/// [`MAX_RECONNECT_PAUSE`].
const FIRST_RECONNECT_PAUSE: Duration = Duration::from_millis(50);
/// Longest pause between two subscriber connection attempts.
const MAX_RECONNECT_PAUSE: Duration = Duration::from_secs(2);
/// Time a subscriber's set-up (connect, `CLIENT ID`, `SUBSCRIBE`) may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(5);

/// The presence cache of one backend (see the [module docs](self)).
pub struct Presence {
    connector: Arc<Connector>,
    max_keys: usize,
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    /// Set at the first refusal of `CLIENT TRACKING` or `SUBSCRIBE` (ACL): the cache is off
    /// for the rest of the backend's life.
    refused: Arc<AtomicBool>,
    /// Keys answered from the cache.
    hits: AtomicU64,
    /// Dropped with `self`: every subscriber task ends.
    _stop: watch::Sender<bool>,
    stopped: watch::Receiver<bool>,
}

/// One node's part (see the module docs).
struct Node {
    addr: String,
    connector: Arc<Connector>,
    state: Mutex<NodeState>,
    /// The tracking connection and the epoch of the subscriber it redirects to.
    tracking: tokio::sync::Mutex<Option<(Conn, u64)>>,
}

/// A key's entry in a node's map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// An `EXISTS` registered with this token is out.
    Pending(u64),
    /// Confirmed present, and not invalidated since.
    Present,
}

/// A node's map and subscriber state. Its methods keep the invariants of the module docs.
#[derive(Debug, Default)]
struct NodeState {
    /// The live subscriber's client id; `None` while there is none.
    redirect: Option<i64>,
    /// Changes with every subscriber set up.
    epoch: u64,
    entries: HashMap<Vec<u8>, Entry>,
    next_token: u64,
    max_keys: usize,
    /// Whether a subscriber task runs for the node.
    task: bool,
}

impl NodeState {
    fn present(&self, key: &[u8]) -> bool {
        self.redirect.is_some() && self.entries.get(key) == Some(&Entry::Present)
    }

    /// Registers an ask of `key` (before its command is written): its token.
    fn pend(&mut self, key: &[u8]) -> u64 {
        if self.entries.len() >= self.max_keys {
            self.entries.clear();
        }
        self.next_token += 1;
        self.entries
            .insert(key.to_vec(), Entry::Pending(self.next_token));
        self.next_token
    }

    /// Takes in the answer to the ask `token` of `key`: present only if nothing invalidated
    /// the key since it was registered.
    fn answer(&mut self, key: &[u8], token: u64, exists: bool) {
        if let Some(e) = self.entries.get_mut(key)
            && *e == Entry::Pending(token)
        {
            if exists {
                *e = Entry::Present;
            } else {
                self.entries.remove(key);
            }
        }
    }

    /// Forgets an ask that got no answer.
    fn abandon(&mut self, key: &[u8], token: u64) {
        if self.entries.get(key) == Some(&Entry::Pending(token)) {
            self.entries.remove(key);
        }
    }

    /// A key changed on the server (or this client deleted it).
    fn invalidate(&mut self, key: &[u8]) {
        self.entries.remove(key);
    }

    /// The server flushed, or its tracking table overflowed: nothing is known any more
    /// (the subscriber stays).
    fn forget_all(&mut self) {
        self.entries.clear();
    }

    /// A new subscriber is up as client `id`: a new epoch with an empty map.
    fn subscribed(&mut self, id: i64) {
        self.entries.clear();
        self.epoch += 1;
        self.redirect = Some(id);
    }

    /// The subscriber is gone: nothing is known any more.
    fn lost(&mut self) {
        self.entries.clear();
        self.redirect = None;
    }
}

impl Presence {
    /// A cache of at most `max_keys` keys per node (at least 1), whose connections are opened
    /// by `connector`.
    pub fn new(connector: Arc<Connector>, max_keys: usize) -> Self {
        let (stop, stopped) = watch::channel(false);
        Self {
            connector,
            max_keys: max_keys.max(1),
            nodes: Mutex::new(HashMap::new()),
            refused: Arc::new(AtomicBool::new(false)),
            hits: AtomicU64::new(0),
            _stop: stop,
            stopped,
        }
    }

    /// Keys answered from the cache since open.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// The node part of `addr`, its subscriber task started on first use (on the runtime the
    /// caller runs on), and again where the last one ended (see invariant 4).
    fn node(&self, addr: &str) -> Arc<Node> {
        let mut nodes = self.nodes.lock();
        let node = match nodes.get(addr) {
            Some(n) => n.clone(),
            None => {
                let n = Arc::new(Node {
                    addr: addr.to_string(),
                    connector: self.connector.clone(),
                    state: Mutex::new(NodeState {
                        max_keys: self.max_keys,
                        ..NodeState::default()
                    }),
                    tracking: tokio::sync::Mutex::new(None),
                });
                nodes.insert(addr.to_string(), n.clone());
                n
            }
        };
        drop(nodes);
        let start = {
            let mut s = node.state.lock();
            !std::mem::replace(&mut s.task, true)
        };
        if start && !self.refused.load(Ordering::Relaxed) {
            tokio::spawn(subscribe(
                TaskGuard(node.clone()),
                self.stopped.clone(),
                self.refused.clone(),
            ));
        }
        node
    }

    /// The leading run of `keys` (Redis key names) present in the cluster whose slot map is
    /// `topology`, answered from the cache and, for the keys it does not know, by `EXISTS` on
    /// the tracking connections within `within`; `None` where it cannot answer (then the
    /// caller asks the uncached way).
    pub async fn exists(
        &self,
        keys: &[Vec<u8>],
        topology: &Topology,
        within: Duration,
    ) -> Option<usize> {
        if self.refused.load(Ordering::Relaxed) {
            return None;
        }
        // Each key's owner (an index into the slot map's primaries), each primary's part
        // resolved once per call.
        let mut nodes: Vec<Option<Arc<Node>>> = vec![None; topology.nodes.len()];
        let mut owners = Vec::with_capacity(keys.len());
        for k in keys {
            let o = topology.owner_index(slot(k))?;
            if nodes[o].is_none() {
                nodes[o] = Some(self.node(&topology.nodes[o]));
            }
            owners.push(o);
        }
        let node = |o: usize| nodes[o].as_ref().expect("every owner was resolved above");
        let known = keys
            .iter()
            .zip(&owners)
            .take_while(|&(k, &o)| node(o).state.lock().present(k))
            .count();
        if known == keys.len() {
            self.hits.fetch_add(known as u64, Ordering::Relaxed);
            return Some(known);
        }
        // Ask for every key after the known run, grouped by owner, all owners at once.
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        for (i, &o) in owners.iter().enumerate().skip(known) {
            groups[o].push(i);
        }
        let asked: Vec<(usize, &Vec<usize>)> = groups
            .iter()
            .enumerate()
            .filter(|(_, idx)| !idx.is_empty())
            .collect();
        let answers = join_all(
            asked
                .iter()
                .map(|&(o, idx)| node(o).ask(keys, idx, within, &self.refused)),
        )
        .await;
        let mut present = vec![false; keys.len()];
        for (&(_, idx), answer) in asked.iter().zip(answers) {
            for (&i, exists) in idx.iter().zip(answer?) {
                present[i] = exists;
            }
        }
        self.hits.fetch_add(known as u64, Ordering::Relaxed);
        Some(known + present[known..].iter().take_while(|&&p| p).count())
    }

    /// Forgets `keys` (this client deleted them, or found them missing or damaged), at once
    /// rather than when their invalidations arrive.
    pub fn forget<'k>(&self, keys: impl IntoIterator<Item = &'k [u8]>, topology: &Topology) {
        let nodes = self.nodes.lock();
        for k in keys {
            if let Some(n) = topology.owner(slot(k)).and_then(|a| nodes.get(a)) {
                n.state.lock().invalidate(k);
            }
        }
    }
}

impl Node {
    /// `EXISTS` of `keys[i]` for each `i` of `idx` on this node's tracking connection:
    /// whether each exists, or `None` where it cannot be asked or answered that way.
    async fn ask(
        &self,
        keys: &[Vec<u8>],
        idx: &[usize],
        within: Duration,
        refused: &AtomicBool,
    ) -> Option<Vec<bool>> {
        let (redirect, epoch) = {
            let s = self.state.lock();
            (s.redirect?, s.epoch)
        };
        let mut tracking = self.tracking.try_lock().ok()?;
        let tokens: Vec<u64> = {
            let mut s = self.state.lock();
            if s.epoch != epoch {
                return None;
            }
            idx.iter().map(|&i| s.pend(&keys[i])).collect()
        };
        let reused = match tracking.take() {
            Some((conn, e)) if e == epoch => Some(conn),
            _ => None,
        };
        let asked = tokio::time::timeout(within, async {
            let conn = match reused {
                Some(c) => c,
                None => self.track(redirect, refused).await.ok()?,
            };
            ask_exists(conn, keys, idx).await.ok()
        })
        .await
        .ok()
        .flatten();
        let mut s = self.state.lock();
        match asked {
            Some((conn, answers)) => {
                for ((&i, &token), &exists) in idx.iter().zip(&tokens).zip(&answers) {
                    s.answer(&keys[i], token, exists);
                }
                *tracking = Some((conn, epoch));
                Some(answers)
            }
            None => {
                for (&i, &token) in idx.iter().zip(&tokens) {
                    s.abandon(&keys[i], token);
                }
                None
            }
        }
    }

    /// A new tracking connection redirecting to subscriber `redirect`.
    async fn track(&self, redirect: i64, refused: &AtomicBool) -> Result<Conn, ConnError> {
        let mut conn = self.connector.connect(&self.addr).await?;
        let id = redirect.to_string();
        match command(
            &mut conn,
            &[b"CLIENT", b"TRACKING", b"ON", b"REDIRECT", id.as_bytes()],
        )
        .await?
        {
            Frame::Simple(ok) if ok == "OK" => Ok(conn),
            other => {
                refuse(refused, &self.addr, "CLIENT TRACKING", &other);
                Err(ConnError::Closed)
            }
        }
    }
}

/// Owned by a node's subscriber task: when the task ends, however it ends, the node forgets
/// everything and may start a new task (invariant 4).
struct TaskGuard(Arc<Node>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        let mut s = self.0.state.lock();
        s.lost();
        s.task = false;
    }
}

/// The subscriber task of `node`: keeps a subscriber connection up (reconnecting after a
/// pause that doubles up to [`MAX_RECONNECT_PAUSE`]) and applies its invalidations, until
/// the cache is dropped (`stopped` changes or closes) or a permission is refused.
async fn subscribe(guard: TaskGuard, mut stopped: watch::Receiver<bool>, refused: Arc<AtomicBool>) {
    let node = &guard.0;
    let mut pause = FIRST_RECONNECT_PAUSE;
    loop {
        let session = async {
            let (conn, id) = tokio::time::timeout(SETUP_TIMEOUT, subscriber(node, &refused))
                .await
                .map_err(|_| ConnError::Closed)??;
            node.state.lock().subscribed(id);
            Ok::<_, ConnError>(conn)
        };
        let outcome = tokio::select! {
            _ = stopped.changed() => return,
            s = session => s,
        };
        if let Ok(mut conn) = outcome {
            pause = FIRST_RECONNECT_PAUSE;
            tokio::select! {
                _ = stopped.changed() => return,
                e = listen(node, &mut conn) => {
                    tracing::debug!(node = %node.addr, error = %e, "redis presence cache: subscriber connection ended; the node's cache is emptied");
                }
            }
        }
        node.state.lock().lost();
        if refused.load(Ordering::Relaxed) {
            return;
        }
        tokio::select! {
            _ = stopped.changed() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(MAX_RECONNECT_PAUSE);
    }
}

/// Opens `node`'s subscriber connection: its client id, subscribed to the invalidations.
async fn subscriber(node: &Node, refused: &AtomicBool) -> Result<(Conn, i64), ConnError> {
    let mut conn = node.connector.connect(&node.addr).await?;
    let id = match command(&mut conn, &[b"CLIENT", b"ID"]).await? {
        Frame::Int(id) => id,
        other => {
            refuse(refused, &node.addr, "CLIENT ID", &other);
            return Err(ConnError::Closed);
        }
    };
    match command(&mut conn, &[b"SUBSCRIBE", INVALIDATE_CHANNEL]).await? {
        Frame::Array(a) if matches!(a.first(), Some(Frame::Bulk(b)) if b == b"subscribe") => {
            Ok((conn, id))
        }
        other => {
            refuse(refused, &node.addr, "SUBSCRIBE", &other);
            Err(ConnError::Closed)
        }
    }
}

/// Applies the invalidations arriving on `conn` until it fails: a `message` on the channel
/// names keys (each forgotten) or is nil (everything forgotten: a flush, or the server's
/// tracking table overflowed).
async fn listen(node: &Node, conn: &mut Conn) -> ConnError {
    loop {
        let frame = match conn.read_frame(&Limits::control()).await {
            Ok(f) => f,
            Err(e) => return e,
        };
        let Frame::Array(parts) = frame else { continue };
        let [Frame::Bulk(kind), Frame::Bulk(channel), payload] = parts.as_slice() else {
            continue;
        };
        if kind != b"message" || channel != INVALIDATE_CHANNEL {
            continue;
        }
        let mut s = node.state.lock();
        match payload {
            Frame::Array(keys) => {
                for k in keys {
                    if let Frame::Bulk(k) = k {
                        s.invalidate(k);
                    }
                }
            }
            // A nil, or anything this module does not understand: forget everything.
            _ => s.forget_all(),
        }
    }
}

/// Writes one pipeline of `EXISTS keys[i]` for `i` in `idx` and reads its answers (each must
/// be 0 or 1; anything else, e.g. a redirection, fails the ask).
async fn ask_exists(
    mut conn: Conn,
    keys: &[Vec<u8>],
    idx: &[usize],
) -> Result<(Conn, Vec<bool>), ConnError> {
    let mut cmds = Vec::with_capacity(idx.len() * 48);
    for &i in idx {
        resp::put_command(&mut cmds, &[b"EXISTS", &keys[i]]);
    }
    conn.write_all(&mut [IoSlice::new(&cmds)]).await?;
    let mut answers = Vec::with_capacity(idx.len());
    for _ in idx {
        match conn.read_frame(&Limits::reply()).await? {
            Frame::Int(0) => answers.push(false),
            Frame::Int(1) => answers.push(true),
            _ => return Err(ConnError::Closed),
        }
    }
    Ok((conn, answers))
}

/// Sends one command and reads its reply.
async fn command(conn: &mut Conn, args: &[&[u8]]) -> Result<Frame, ConnError> {
    let mut cmd = Vec::new();
    resp::put_command(&mut cmd, args);
    conn.write_all(&mut [IoSlice::new(&cmd)]).await?;
    conn.read_frame(&Limits::control()).await
}

/// Turns the cache off for good where the server refused one of its commands for
/// permissions (one warning); other answers are the connection's failure only.
fn refuse(refused: &AtomicBool, addr: &str, command: &str, answer: &Frame) {
    if let Frame::Error(e) = answer
        && e.starts_with("NOPERM")
        && !refused.swap(true, Ordering::Relaxed)
    {
        tracing::warn!(
            node = addr,
            error = %e,
            "redis presence cache off: the ACL user may not run {command}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(max_keys: usize) -> NodeState {
        let mut s = NodeState {
            max_keys,
            ..NodeState::default()
        };
        s.subscribed(7);
        s
    }

    #[test]
    fn an_answer_counts_only_if_nothing_invalidated_the_key_since_it_was_asked() {
        let mut s = state(16);
        let t = s.pend(b"a");
        assert!(!s.present(b"a"), "pending is not present");
        s.answer(b"a", t, true);
        assert!(s.present(b"a"));

        // An invalidation racing the answer wins.
        let t = s.pend(b"b");
        s.invalidate(b"b");
        s.answer(b"b", t, true);
        assert!(!s.present(b"b"));

        // A newer ask of the same key: the older answer is not taken in.
        let old = s.pend(b"c");
        let new = s.pend(b"c");
        s.answer(b"c", old, true);
        assert!(!s.present(b"c"));
        s.answer(b"c", new, true);
        assert!(s.present(b"c"));

        // Absent, or never answered: nothing is kept.
        let t = s.pend(b"d");
        s.answer(b"d", t, false);
        let t2 = s.pend(b"e");
        s.abandon(b"e", t2);
        assert!(!s.entries.contains_key(b"d".as_slice()));
        assert!(!s.entries.contains_key(b"e".as_slice()));

        // A later invalidation forgets a present key.
        s.invalidate(b"a");
        assert!(!s.present(b"a"));
    }

    #[test]
    fn losing_the_subscriber_forgets_everything_and_a_new_one_starts_a_new_epoch() {
        let mut s = state(16);
        let t = s.pend(b"a");
        s.answer(b"a", t, true);
        let pending = s.pend(b"b");
        let epoch = s.epoch;
        s.lost();
        assert!(!s.present(b"a"));
        assert_eq!(s.redirect, None);
        s.answer(b"b", pending, true);
        assert!(
            s.entries.is_empty(),
            "an answer asked before the loss is dropped"
        );
        s.subscribed(9);
        assert_eq!((s.redirect, s.epoch), (Some(9), epoch + 1));
        assert!(!s.present(b"a"));
        // A present key does not count while no subscriber is up.
        let t = s.pend(b"c");
        s.answer(b"c", t, true);
        s.redirect = None;
        assert!(!s.present(b"c"));
    }

    #[test]
    fn a_full_map_is_emptied_and_a_flush_forgets_everything() {
        let mut s = state(3);
        for k in [b"a", b"b", b"c"] {
            let t = s.pend(k);
            s.answer(k, t, true);
        }
        assert_eq!(s.entries.len(), 3);
        let t = s.pend(b"d");
        assert_eq!(s.entries.len(), 1, "full: emptied before the new ask");
        s.answer(b"d", t, true);
        assert!(s.present(b"d") && !s.present(b"a"));
        s.forget_all();
        assert!(s.entries.is_empty());
        assert_eq!(s.redirect, Some(7), "a flush keeps the subscriber");
    }
}
