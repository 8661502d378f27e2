//! The PUB socket: fans each message out to the subscribers whose topic prefixes match its
//! first frame, through each one's bounded queue, never waiting on any.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;

use crate::ZmtpError;
use crate::codec::Command;
use crate::conn::{self, FrameReader, Input, Role};
use crate::limits::ServerLimits;
use crate::peer::{self, NotQueued, Outbox, SocketBudget, Wire};
use crate::registry::{Admitted, Liveness, Registry};
use crate::stats::{Counters, StatsHandle, throttled};

const SOCKET: &str = "PUB";

/// One subscriber: its queue and its topic prefixes (a multiset: each SUBSCRIBE adds one,
/// each CANCEL removes one).
struct Subscriber {
    outbox: Outbox,
    topics: Arc<Mutex<Vec<Bytes>>>,
}

/// What the accept loop, the connections and the sender share.
struct Shared {
    subscribers: Mutex<HashMap<u64, Subscriber>>,
    next_id: AtomicU64,
    counters: Arc<Counters>,
    limits: ServerLimits,
    budget: SocketBudget,
}

/// A ZMQ PUB socket bound to one TCP listener.
pub struct PubSocket {
    shared: Arc<Shared>,
}

impl PubSocket {
    /// Starts accepting on `listener` in the current tokio runtime (call it from inside one),
    /// with the default [`ServerLimits`].
    pub fn bind(listener: std::net::TcpListener) -> std::io::Result<Self> {
        Self::bind_with(listener, ServerLimits::default())
    }

    /// [`PubSocket::bind`] with other limits.
    pub fn bind_with(
        listener: std::net::TcpListener,
        limits: ServerLimits,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let limits = limits.sane();
        let counters = Arc::new(Counters::default());
        let registry = Registry::new(&limits, counters.clone(), SOCKET);
        let shared = Arc::new(Shared {
            subscribers: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            counters,
            budget: SocketBudget::new(&limits),
            limits,
        });
        let s = shared.clone();
        tokio::spawn(peer::accept_loop(
            listener,
            registry,
            SOCKET,
            move |stream, addr, admitted| {
                tokio::spawn(serve(stream, addr, admitted, s.clone()));
            },
        ));
        Ok(Self { shared })
    }

    /// Queues `frames` as one message for every subscriber whose topic prefix matches the first
    /// frame; a subscriber without room misses it (counted). Never waits. The frames' bytes are
    /// shared by every queue, never copied.
    pub fn send(&self, frames: &[Bytes]) {
        let topic = frames.first().map_or(&[][..], |f| &f[..]);
        let wire = Wire::message(frames);
        let subscribers = self.shared.subscribers.lock();
        for sub in subscribers.values() {
            if !sub.topics.lock().iter().any(|t| topic.starts_with(t)) {
                continue;
            }
            if let Err(NotQueued::Full | NotQueued::Budget) = sub.outbox.try_send(wire.clone()) {
                let n = self
                    .shared
                    .counters
                    .dropped_messages
                    .fetch_add(1, Ordering::Relaxed)
                    + 1;
                if throttled(n) {
                    tracing::warn!(
                        dropped = n,
                        "ZMTP PUB: a subscriber's queue is full, messages dropped for it"
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

async fn serve(stream: TcpStream, addr: SocketAddr, admitted: Admitted, shared: Arc<Shared>) {
    let live = admitted.live.clone();
    let counters = shared.counters.clone();
    peer::run(
        &counters,
        SOCKET,
        addr,
        admitted,
        connection(stream, shared, live),
    )
    .await;
}

async fn connection(
    stream: TcpStream,
    shared: Arc<Shared>,
    live: Arc<Liveness>,
) -> Result<(), ZmtpError> {
    let limits = &shared.limits;
    let idle = peer::idle_deadline(&live, limits.idle_timeout);
    let work = async {
        let role = Role {
            our_type: SOCKET,
            accepts: &["SUB", "XSUB"],
            identity: None,
        };
        let c = conn::handshake(
            stream,
            role,
            peer::frame_limits(limits),
            limits.handshake_timeout,
        )
        .await?;
        live.touch();
        let (outbox, inbox) = Outbox::new(
            limits,
            shared.budget.clone(),
            shared.counters.clone(),
            live.clone(),
        );
        let topics = Arc::new(Mutex::new(Vec::new()));
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        shared.subscribers.lock().insert(
            id,
            Subscriber {
                outbox: outbox.clone(),
                topics: topics.clone(),
            },
        );
        let _registered = Registered(id, shared.clone());
        tokio::select! {
            r = read_subscriptions(c.reader, &topics, &outbox, &live, limits.max_subscriptions) => r,
            r = peer::write_queue(c.writer, inbox, live.clone(), limits.stall_timeout) => r,
        }
    };
    tokio::select! {
        r = work => r,
        e = idle => Err(e),
    }
}

/// Reads the subscriber's subscriptions (and heartbeats) until it closes or errs.
async fn read_subscriptions(
    mut reader: FrameReader<OwnedReadHalf>,
    topics: &Mutex<Vec<Bytes>>,
    outbox: &Outbox,
    live: &Liveness,
    max_subscriptions: usize,
) -> Result<(), ZmtpError> {
    loop {
        let input = reader.input().await?;
        live.touch();
        let cmd = match input {
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
                if topics.len() >= max_subscriptions {
                    return Err(ZmtpError::TooManySubscriptions(max_subscriptions));
                }
                topics.push(t);
                live.mark_useful();
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
