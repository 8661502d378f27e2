//! A KV-event publisher on ZMQ that speaks SGLang's protocol (see [`super::wire`]), so the
//! routers that consume SGLang's events (SGLang's own, Dynamo's) consume ours.
//!
//! Configured with the JSON of SGLang's `--kv-events-config` ([`KvEventsConfig`]). A PUB socket
//! sends each batch as `[topic, seq (8 bytes big-endian), payload]`; with `replay_endpoint`, a
//! ROUTER socket answers a DEALER's `[b"", start_seq]` with every buffered batch from
//! `start_seq` on, in the same three frames, then `[b"", -1 as 8 bytes, b""]`.
//!
//! Invariants:
//! 1. Sockets are bound when the cache is built: a bad endpoint or a port in use is a build
//!    error, never an error at the first event.
//! 2. The engine thread never blocks on the publisher: batches go through a bounded queue
//!    (`max_queue_size` batches); when it is full the batch is dropped and counted
//!    ([`KvEventPublisher::dropped_batches`]), and the sequence numbers of later batches stay
//!    consecutive (a gap is never silent: the subscriber sees every sequence number it missed
//!    through replay, and the dropped count says what was lost before numbering).
//! 3. Sequence numbers start at 0 and grow by one per published batch; the replay buffer holds
//!    the last `buffer_steps` batches.
//! 4. No peer can stop the process, the publishing, or other peers (the sockets are our own
//!    ZMTP server, [`hicache_zmtp`], whose invariants say what is bounded): frames a peer sends
//!    are at most [`KvEventPublisher::MAX_FRAME`] bytes, at most
//!    [`KvEventPublisher::MAX_PEERS`] connections per socket are served (the stalest peer makes
//!    room for a new one, idle ones first), a handshake must end within 5 s, a peer that neither
//!    subscribes nor asks for a replay within 30 s is closed; a subscriber that does not read
//!    misses batches (counted in [`KvEventPublisher::pub_stats`]) instead of slowing the
//!    others, and a peer that reads nothing for 5 s is disconnected (counted in its socket's
//!    stats). What is queued for the peers is bounded in bytes
//!    ([`KvEventPublisher::PEER_QUEUE_BYTES`] each, [`KvEventPublisher::MAX_QUEUED_BYTES`] per
//!    socket) and shares the batches' bytes (a replay copies nothing).
//! 7. A malformed replay request is answered with the end-of-replay marker alone, counted
//!    ([`KvEventPublisher::malformed_replay_requests`]) and logged at `warn` the 1st, 2nd,
//!    4th... time only.
//! 5. Replays are tasks of their own: answering one never delays a live batch, and each reads
//!    the replay buffer under a lock held for one batch's lookup.
//! 6. Dropping the publisher returns within a bounded time whatever the peers do: the queued
//!    batches are published, subscribers get at most [`SHUTDOWN_FLUSH`] to take them, then
//!    every connection is closed.
//! 8. [`KvEventPublisher::progress`] says how far a subscriber could have got: batches queued
//!    by `publish`, batches numbered and sent, and how far a finished replay reached (one past
//!    the last batch a replay answered before its end marker), so that a caller can keep the
//!    publisher open until a late subscriber has replayed everything
//!    ([`PublisherProgress::replayed_everything`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use bytes::Bytes;
use parking_lot::Mutex;

use super::wire::{WireEvent, encode_batch};
use crate::error::{HiCacheError, Result};
pub use crate::kv_events_config::KvEventsConfig;
use crate::kv_events_config::bind_address;
use hicache_zmtp::{self as zmtp, PubSocket, Request, RouterSocket, SocketStats, StatsHandle};

/// SGLang's end-of-replay sequence number (-1 as 8 bytes big-endian).
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// How long dropping the publisher lets subscribers take the last batches before it closes
/// their connections.
pub const SHUTDOWN_FLUSH: std::time::Duration = std::time::Duration::from_secs(1);

/// One queued batch.
struct Batch {
    ts: f64,
    events: Vec<WireEvent>,
}

/// The running publisher: a thread with its own small runtime owning the sockets.
pub struct KvEventPublisher {
    tx: Option<tokio::sync::mpsc::Sender<Batch>>,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
    replay_endpoint: Option<String>,
    dropped: Arc<AtomicU64>,
    queued: AtomicU64,
    published: Arc<AtomicU64>,
    replayed_through: Arc<AtomicU64>,
    malformed_replays: Arc<AtomicU64>,
    pub_stats: StatsHandle,
    replay_stats: Option<StatsHandle>,
}

/// Where a publisher stands (invariant 8), as [`KvEventPublisher::progress`] reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherProgress {
    /// Batches `publish` queued (dropped and empty ones not counted).
    pub queued: u64,
    /// Batches numbered and sent on the PUB socket: sequence numbers `0..published`.
    pub published: u64,
    /// One past the last sequence number a finished replay answered (0: none yet).
    pub replayed_through: u64,
    /// Bytes still queued for the replay socket's peers.
    pub replay_queued_bytes: u64,
}

impl PublisherProgress {
    /// Whether every batch queued so far was published and a replay has sent some subscriber
    /// every one of them up to the last, with nothing left in the replay socket's queues
    /// (true at once when nothing was published).
    pub fn replayed_everything(&self) -> bool {
        self.queued == self.published
            && self.replayed_through >= self.published
            && self.replay_queued_bytes == 0
    }
}

/// What the publisher thread hands back once its sockets listen: their counters.
type Ready = std::result::Result<(StatsHandle, Option<StatsHandle>), String>;

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish_non_exhaustive()
    }
}

impl KvEventPublisher {
    /// Binds the sockets and starts the publisher thread; `None` for the `null` publisher.
    pub fn start(cfg: &KvEventsConfig) -> Result<Option<Self>> {
        cfg.validate()?;
        if cfg.publisher == "null" {
            return Ok(None);
        }
        let pub_addr = bind_address(&cfg.endpoint).expect("validated");
        let replay_addr = cfg
            .replay_endpoint
            .as_deref()
            .map(|r| bind_address(r).expect("validated"));
        // Bind here, on the caller's thread, so that errors are build errors (invariant 1).
        let pub_listener = bind(&cfg.endpoint, pub_addr)?;
        let replay_listener = match (&cfg.replay_endpoint, replay_addr) {
            (Some(r), Some(a)) => Some(bind(r, a)?),
            _ => None,
        };
        let endpoint = local_endpoint(&pub_listener)?;
        let replay_endpoint = replay_listener.as_ref().map(local_endpoint).transpose()?;
        let (tx, rx) = tokio::sync::mpsc::channel(cfg.max_queue_size);
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let published = Arc::new(AtomicU64::new(0));
        let replayed_through = Arc::new(AtomicU64::new(0));
        let malformed_replays = Arc::new(AtomicU64::new(0));
        let worker = Worker {
            topic: Bytes::from(cfg.topic.clone().into_bytes()),
            buffer: Arc::new(Mutex::new(ReplayBuffer {
                batches: VecDeque::new(),
                capacity: cfg.buffer_steps,
                next_seq: 0,
            })),
            published: published.clone(),
            replayed_through: replayed_through.clone(),
            malformed_replays: malformed_replays.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("hicache-kv-events".into())
            .spawn(move || worker.run(pub_listener, replay_listener, rx, ready_tx))
            .map_err(|e| HiCacheError::config("kv_events_config", "thread", e.to_string()))?;
        let (pub_stats, replay_stats) = match ready_rx.recv() {
            Ok(Ok(handles)) => handles,
            Ok(Err(why)) => {
                let _ = thread.join();
                return Err(HiCacheError::config(
                    "kv_events_config.endpoint",
                    &cfg.endpoint,
                    why,
                ));
            }
            Err(_) => {
                let _ = thread.join();
                return Err(HiCacheError::config(
                    "kv_events_config",
                    &cfg.endpoint,
                    "the publisher thread stopped while starting".to_string(),
                ));
            }
        };
        tracing::info!(%endpoint, replay = ?replay_endpoint, "publishing KV events");
        Ok(Some(Self {
            tx: Some(tx),
            thread: Some(thread),
            endpoint,
            replay_endpoint,
            dropped: Arc::new(AtomicU64::new(0)),
            queued: AtomicU64::new(0),
            published,
            replayed_through,
            malformed_replays,
            pub_stats,
            replay_stats,
        }))
    }

    /// The bound PUB endpoint (`tcp://IP:PORT`, the port resolved when 0 was asked for).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound replay endpoint, if configured.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Batches dropped because the queue was full (invariant 2).
    pub fn dropped_batches(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The most bytes a frame sent to either socket may claim; a longer one closes that
    /// connection.
    pub const MAX_FRAME: usize = zmtp::MAX_FRAME;
    /// The most connections each socket serves at a time; the ones beyond are closed at once.
    pub const MAX_PEERS: usize = zmtp::MAX_PEERS;
    /// Batches queued for one subscriber (or replies for one replay client) before it misses
    /// them (or is disconnected).
    pub const PEER_QUEUE: usize = zmtp::PEER_QUEUE;
    /// Bytes queued for one peer (a batch bigger than this only into an empty queue).
    pub const PEER_QUEUE_BYTES: usize = zmtp::PEER_QUEUE_BYTES;
    /// Bytes queued for all the peers of one socket together.
    pub const MAX_QUEUED_BYTES: usize = zmtp::MAX_QUEUED_BYTES;

    /// Replay requests that were not `[b"", 8-byte sequence number]` (each answered with the
    /// end-of-replay marker alone).
    pub fn malformed_replay_requests(&self) -> u64 {
        self.malformed_replays.load(Ordering::Relaxed)
    }

    /// The PUB socket's counters: peers served, refused, closed for errors, and messages a
    /// full subscriber missed.
    pub fn pub_stats(&self) -> SocketStats {
        self.pub_stats.snapshot()
    }

    /// The replay socket's counters (all zero without `replay_endpoint`): peers served,
    /// refused, closed for errors, and clients disconnected for not reading.
    pub fn replay_stats(&self) -> SocketStats {
        self.replay_stats
            .as_ref()
            .map(StatsHandle::snapshot)
            .unwrap_or_default()
    }

    /// Batches handed to the PUB socket so far.
    pub fn published_batches(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    /// Where the publisher stands: batches queued, published, and replayed (invariant 8).
    pub fn progress(&self) -> PublisherProgress {
        // `queued` first: a batch counted as published was counted as queued before.
        let queued = self.queued.load(Ordering::Acquire);
        PublisherProgress {
            queued,
            published: self.published.load(Ordering::Acquire),
            replayed_through: self.replayed_through.load(Ordering::Acquire),
            replay_queued_bytes: self.replay_stats().queued_bytes,
        }
    }

    /// Queues one batch (stamped now); never blocks (invariant 2). Empty batches are skipped.
    pub fn publish(&self, events: Vec<WireEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let Some(tx) = &self.tx else { return };
        // Counted before the send: the worker may publish it at once (invariant 8).
        self.queued.fetch_add(1, Ordering::AcqRel);
        if tx.try_send(Batch { ts, events }).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(dropped = n, "KV event queue full: batches dropped");
            }
        }
    }
}

impl Drop for KvEventPublisher {
    /// Closes the queue; the thread publishes what is queued, gives subscribers at most
    /// [`SHUTDOWN_FLUSH`], closes every connection and stops (invariant 6).
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn bind(endpoint: &str, addr: std::net::SocketAddr) -> Result<std::net::TcpListener> {
    std::net::TcpListener::bind(addr).map_err(|e| {
        HiCacheError::config("kv_events_config", endpoint, format!("cannot bind: {e}"))
    })
}

fn local_endpoint(l: &std::net::TcpListener) -> Result<String> {
    let a = l
        .local_addr()
        .map_err(|e| HiCacheError::config("kv_events_config", "socket", e.to_string()))?;
    Ok(format!("tcp://{a}"))
}

/// The last `capacity` batches, for replay, and the next sequence number.
struct ReplayBuffer {
    batches: VecDeque<(u64, Bytes)>,
    capacity: usize,
    next_seq: u64,
}

impl ReplayBuffer {
    /// The first buffered batch numbered `seq` or later, below `end`.
    fn at_or_after(&self, seq: u64, end: u64) -> Option<(u64, Bytes)> {
        let first = self.batches.front()?.0;
        let seq = seq.max(first);
        if seq >= end {
            return None;
        }
        // Buffered sequence numbers are consecutive.
        let i = usize::try_from(seq - first).ok()?;
        self.batches.get(i).cloned()
    }
}

/// The publisher thread's state.
struct Worker {
    topic: Bytes,
    buffer: Arc<Mutex<ReplayBuffer>>,
    published: Arc<AtomicU64>,
    replayed_through: Arc<AtomicU64>,
    malformed_replays: Arc<AtomicU64>,
}

impl Worker {
    fn run(
        self,
        pub_listener: std::net::TcpListener,
        replay_listener: Option<std::net::TcpListener>,
        mut rx: tokio::sync::mpsc::Receiver<Batch>,
        ready: std::sync::mpsc::SyncSender<Ready>,
    ) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready.send(Err(format!("cannot start the publisher runtime: {e}")));
                return;
            }
        };
        rt.block_on(async move {
            let publisher = match PubSocket::bind(pub_listener) {
                Ok(p) => p,
                Err(e) => {
                    let _ = ready.send(Err(format!("cannot listen: {e}")));
                    return;
                }
            };
            let mut replay_stats = None;
            if let Some(l) = replay_listener {
                let router = match RouterSocket::bind(l) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready.send(Err(format!("cannot listen for replay: {e}")));
                        return;
                    }
                };
                let shared = Arc::new(ReplayShared {
                    topic: self.topic.clone(),
                    buffer: self.buffer.clone(),
                    malformed: self.malformed_replays.clone(),
                    replayed_through: self.replayed_through.clone(),
                });
                replay_stats = Some(router.stats_handle());
                tokio::spawn(serve_replays(router, shared));
            }
            let _ = ready.send(Ok((publisher.stats_handle(), replay_stats)));
            while let Some(b) = rx.recv().await {
                self.send(&publisher, b);
            }
            publisher.flush(SHUTDOWN_FLUSH).await;
        });
        // Ends every connection and replay task; none of them is waited on.
        rt.shutdown_timeout(std::time::Duration::from_millis(100));
    }

    fn send(&self, publisher: &PubSocket, batch: Batch) {
        let payload = match encode_batch(batch.ts, &batch.events, None) {
            Ok(p) => Bytes::from(p),
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a KV event batch");
                return;
            }
        };
        let seq = {
            let mut b = self.buffer.lock();
            let seq = b.next_seq;
            b.next_seq += 1;
            b.batches.push_back((seq, payload.clone()));
            while b.batches.len() > b.capacity {
                b.batches.pop_front();
            }
            seq
        };
        publisher.send(&[
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ]);
        self.published.fetch_add(1, Ordering::Release);
    }
}

/// What every replay task reads.
struct ReplayShared {
    topic: Bytes,
    buffer: Arc<Mutex<ReplayBuffer>>,
    malformed: Arc<AtomicU64>,
    /// One past the last batch a finished replay answered (invariant 8).
    replayed_through: Arc<AtomicU64>,
}

/// Answers each replay request in a task of its own, so a slow client never delays the
/// live batches or the other clients.
async fn serve_replays(mut router: RouterSocket, shared: Arc<ReplayShared>) {
    while let Some(req) = router.recv().await {
        let shared = shared.clone();
        tokio::spawn(async move { replay(&shared, &req).await });
    }
}

/// Answers `[b"", start_seq]` with every batch buffered when it arrived, from `start_seq` on,
/// then the end marker; anything else with the end marker alone (invariant 7). The batches'
/// bytes are queued as they are in the buffer (shared, never copied).
async fn replay(shared: &ReplayShared, req: &Request) {
    let end_marker = [
        Bytes::new(),
        Bytes::new(),
        Bytes::from_static(&END_SEQ),
        Bytes::new(),
    ];
    let start = match req.frames.as_slice() {
        [empty, seq] if empty.is_empty() && seq.len() == 8 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(seq);
            u64::from_be_bytes(b)
        }
        _ => {
            let n = shared.malformed.fetch_add(1, Ordering::Relaxed) + 1;
            // Every one at debug, the 1st, 2nd, 4th... at warn: a peer must not flood the log.
            if n.is_power_of_two() {
                tracing::warn!(
                    frames = req.frames.len(),
                    malformed = n,
                    "invalid KV event replay request (answered with the end marker)"
                );
            } else {
                tracing::debug!(
                    frames = req.frames.len(),
                    malformed = n,
                    "invalid KV event replay request (answered with the end marker)"
                );
            }
            let _ = req.reply(&end_marker).await;
            return;
        }
    };
    let end = shared.buffer.lock().next_seq;
    let mut next = start;
    loop {
        let found = shared.buffer.lock().at_or_after(next, end);
        let Some((seq, payload)) = found else { break };
        let frames = [
            Bytes::new(),
            shared.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if req.reply(&frames).await.is_err() {
            return;
        }
        next = seq + 1;
    }
    if req.reply(&end_marker).await.is_ok() && next > start {
        shared.replayed_through.fetch_max(next, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_configs_name_the_field() {
        let e = KvEventsConfig::from_json(r#"{"publisher": "kafka"}"#).unwrap_err();
        assert!(
            e.to_string().contains("publisher") && e.to_string().contains("kafka"),
            "{e}"
        );
        let e = KvEventsConfig::from_json(r#"{"publisher": "zmq", "endpoint": "ipc:///x"}"#)
            .unwrap_err();
        assert!(e.to_string().contains("endpoint"), "{e}");
        let e = KvEventsConfig::from_json(r#"{"publisher": "zmq", "hwm": 5}"#).unwrap_err();
        assert!(e.to_string().contains("hwm"), "{e}");
        let e = KvEventsConfig::from_json(r#"{"buffer_steps": 0}"#).unwrap_err();
        assert!(e.to_string().contains("buffer_steps"), "{e}");
        let e = KvEventsConfig::from_json(r#"{"format": "dynamo"}"#).unwrap_err();
        assert!(e.to_string().contains("format"), "{e}");
    }

    #[test]
    fn wildcard_hosts_bind_every_interface() {
        assert_eq!(
            bind_address("tcp://*:5557").unwrap(),
            "0.0.0.0:5557".parse().unwrap()
        );
        assert!(bind_address("tcp://localhost:1").is_err());
    }

    #[test]
    fn a_port_in_use_is_an_error_at_start() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let cfg = KvEventsConfig {
            publisher: "zmq".into(),
            endpoint: format!("tcp://{}", taken.local_addr().unwrap()),
            ..Default::default()
        };
        let e = KvEventPublisher::start(&cfg).unwrap_err();
        assert!(e.to_string().contains("cannot bind"), "{e}");
    }

    #[test]
    fn the_replay_buffer_finds_the_first_batch_at_or_after_a_sequence_number() {
        let b = ReplayBuffer {
            batches: (5..10).map(|s| (s, Bytes::from(vec![s as u8]))).collect(),
            capacity: 5,
            next_seq: 10,
        };
        assert_eq!(
            b.at_or_after(0, 10).unwrap().0,
            5,
            "evicted ones are skipped"
        );
        assert_eq!(b.at_or_after(7, 10).unwrap().0, 7);
        assert_eq!(b.at_or_after(9, 10).unwrap().0, 9);
        assert!(b.at_or_after(8, 8).is_none(), "nothing at or past the end");
        assert!(b.at_or_after(10, 12).is_none());
        assert!(b.at_or_after(u64::MAX, u64::MAX).is_none());
        let empty = ReplayBuffer {
            batches: VecDeque::new(),
            capacity: 5,
            next_seq: 0,
        };
        assert!(empty.at_or_after(0, 0).is_none());
    }

    #[test]
    fn the_null_publisher_starts_nothing() {
        assert!(
            KvEventPublisher::start(&KvEventsConfig::default())
                .unwrap()
                .is_none()
        );
    }
}
