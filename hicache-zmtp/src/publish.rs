//! The PUB socket: fans each message out to the subscribers whose topic prefixes match its
//! first frame, through each one's bounded queue, never waiting on any.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;

use super::codec::{self, Command};
use super::peer::{self, FrameReader, Input, NotQueued, Outbox, PeerSlot};
use super::{Counters, MAX_SUBSCRIPTIONS, PEER_QUEUE, StatsHandle, ZmtpError};

const SOCKET: &str = "PUB";

/// One subscriber: its queue and its topic prefixes (a multiset: each SUBSCRIBE adds one,
/// each CANCEL removes one).
struct Subscriber {
    outbox: Outbox,
    topics: Arc<Mutex<Vec<Bytes>>>,
}

/// What the accept loop, the connections and the sender share.
#[derive(Default)]
struct Shared {
    subscribers: Mutex<HashMap<u64, Subscriber>>,
    next_id: AtomicU64,
    counters: Arc<Counters>,
}

/// A ZMQ PUB socket bound to one TCP listener.
pub struct PubSocket {
    shared: Arc<Shared>,
}

impl PubSocket {
    /// Starts accepting on `listener` in the current tokio runtime (call it from inside one).
    pub fn bind(listener: std::net::TcpListener) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        tokio::spawn(peer::accept_loop(
            listener,
            shared.counters.clone(),
            SOCKET,
            move |stream, addr, slot| {
                tokio::spawn(serve(stream, addr, slot, s.clone()));
            },
        ));
        Ok(Self { shared })
    }

    /// Queues `frames` as one message for every subscriber whose topic prefix matches the first
    /// frame; a subscriber whose queue is full misses it (counted). Never waits.
    pub fn send(&self, frames: &[Bytes]) {
        let topic = frames.first().map_or(&[][..], |f| &f[..]);
        let mut wire = BytesMut::new();
        codec::encode_message(frames, &mut wire);
        let wire = wire.freeze();
        let subscribers = self.shared.subscribers.lock();
        for sub in subscribers.values() {
            if !sub.topics.lock().iter().any(|t| topic.starts_with(t)) {
                continue;
            }
            if sub.outbox.try_send(wire.clone()) == Err(NotQueued::Full) {
                let n = self
                    .shared
                    .counters
                    .dropped_messages
                    .fetch_add(1, Ordering::Relaxed)
                    + 1;
                if n.is_power_of_two() {
                    tracing::warn!(
                        dropped = n,
                        "KV events: a subscriber's queue is full, messages dropped for it"
                    );
                }
            }
        }
    }

    /// Waits until every subscriber's queue was written to the kernel, or `limit` passed.
    pub async fn flush(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let done = self
                .shared
                .subscribers
                .lock()
                .values()
                .all(|s| s.outbox.is_flushed());
            if done {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A view of the counters that outlives the socket's thread.
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(self.shared.counters.clone())
    }
}

/// Removes a subscriber from the fan-out when its connection ends.
struct Registered(u64, Arc<Shared>);

impl Drop for Registered {
    fn drop(&mut self) {
        self.1.subscribers.lock().remove(&self.0);
    }
}

async fn serve(stream: TcpStream, addr: SocketAddr, slot: PeerSlot, shared: Arc<Shared>) {
    let r = connection(stream, shared.clone()).await;
    peer::ended(&shared.counters, SOCKET, addr, r);
    drop(slot);
}

async fn connection(stream: TcpStream, shared: Arc<Shared>) -> Result<(), ZmtpError> {
    let c = peer::handshake(stream, SOCKET, &["SUB", "XSUB"], None).await?;
    let (outbox, rx, pending) = Outbox::new(PEER_QUEUE);
    let topics = Arc::new(Mutex::new(Vec::new()));
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    shared.subscribers.lock().insert(
        id,
        Subscriber {
            outbox: outbox.clone(),
            topics: topics.clone(),
        },
    );
    let _registered = Registered(id, shared);
    tokio::select! {
        r = read_subscriptions(c.reader, &topics, &outbox) => r,
        r = peer::write_queue(c.writer, rx, pending) => r,
        () = outbox.closed() => Ok(()),
    }
}

/// Reads the subscriber's subscriptions (and heartbeats) until it closes or errs.
async fn read_subscriptions(
    mut reader: FrameReader<OwnedReadHalf>,
    topics: &Mutex<Vec<Bytes>>,
    outbox: &Outbox,
) -> Result<(), ZmtpError> {
    loop {
        let cmd = match reader.input().await? {
            Input::Command(cmd) => peer::common_command(cmd, outbox)?,
            // ZMTP 3.0 subscriptions: a one-frame message starting with 1 (subscribe) or
            // 0 (cancel). Other messages to a PUB are ignored, as libzmq does.
            Input::Message(frames) => match frames.as_slice() {
                [f] if f.first() == Some(&1) => Some(Command::Subscribe(f.slice(1..))),
                [f] if f.first() == Some(&0) => Some(Command::Cancel(f.slice(1..))),
                _ => None,
            },
        };
        match cmd {
            Some(Command::Subscribe(t)) => {
                let mut topics = topics.lock();
                if topics.len() == MAX_SUBSCRIPTIONS {
                    return Err(ZmtpError::TooManySubscriptions(MAX_SUBSCRIPTIONS));
                }
                topics.push(t);
            }
            Some(Command::Cancel(t)) => {
                let mut topics = topics.lock();
                if let Some(i) = topics.iter().position(|x| *x == t) {
                    topics.swap_remove(i);
                }
            }
            _ => {}
        }
    }
}
