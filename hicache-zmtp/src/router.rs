//! The ROUTER socket: each peer has a routing id (its own, or one generated); each message it
//! sends becomes a [`Request`] that carries the way back to it, answered through that peer's
//! bounded queue.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::ZmtpError;
use crate::conn::{self, Input, Role};
use crate::limits::{MAX_OUTSTANDING_REQUESTS, ServerLimits};
use crate::peer::{self, NotQueued, Outbox, SocketBudget, Wire};
use crate::registry::{Admitted, Liveness, Registry};
use crate::stats::{Counters, StatsHandle, throttled};

const SOCKET: &str = "ROUTER";

/// What the accept loop and the connections share.
struct Shared {
    ids: Mutex<HashSet<Bytes>>,
    next_id: AtomicU32,
    counters: Arc<Counters>,
    requests: mpsc::Sender<Request>,
    limits: ServerLimits,
    budget: SocketBudget,
}

/// A ZMQ ROUTER socket bound to one TCP listener.
pub struct RouterSocket {
    shared: Arc<Shared>,
    requests: mpsc::Receiver<Request>,
}

/// One message a peer sent, with the way to answer it. While it lives, that peer's next
/// message is not read ([`MAX_OUTSTANDING_REQUESTS`]).
#[derive(Debug)]
pub struct Request {
    /// The peer's routing id.
    pub identity: Bytes,
    /// The message's frames (the routing id not included).
    pub frames: Vec<Bytes>,
    outbox: Outbox,
    counters: Arc<Counters>,
    stall: std::time::Duration,
    _permit: OwnedSemaphorePermit,
}

/// Why a reply was not sent.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    /// The peer did not read for the stall timeout; it was disconnected.
    #[error("the peer did not read its replies; disconnected")]
    Stalled,
    /// The socket's byte budget stayed spent by other peers for the stall timeout.
    #[error("the socket's queues are full")]
    Busy,
    /// The peer is gone.
    #[error("the peer is gone")]
    Closed,
}

impl Request {
    /// Sends `frames` as one message to the peer, waiting at most the stall timeout for room in
    /// its queue (a peer that stays full is disconnected). The frames' bytes are queued as they
    /// are (shared, never copied).
    pub async fn reply(&self, frames: &[Bytes]) -> Result<(), ReplyError> {
        match self
            .outbox
            .send_timeout(Wire::message(frames), self.stall)
            .await
        {
            Ok(()) => Ok(()),
            Err(NotQueued::Closed) => Err(ReplyError::Closed),
            Err(NotQueued::Budget) => Err(ReplyError::Busy),
            Err(NotQueued::Full) => {
                let n = self.counters.stalled_peers.fetch_add(1, Ordering::Relaxed) + 1;
                if throttled(n) {
                    tracing::warn!(
                        identity = ?self.identity, stalled = n,
                        "ZMTP ROUTER: a client does not read its replies; disconnected"
                    );
                }
                self.outbox.close();
                Err(ReplyError::Stalled)
            }
        }
    }
}

impl RouterSocket {
    /// Starts accepting on `listener` in the current tokio runtime (call it from inside one),
    /// with the default [`ServerLimits`].
    pub fn bind(listener: std::net::TcpListener) -> std::io::Result<Self> {
        Self::bind_with(listener, ServerLimits::default())
    }

    /// [`RouterSocket::bind`] with other limits.
    pub fn bind_with(
        listener: std::net::TcpListener,
        limits: ServerLimits,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let limits = limits.sane();
        // Each peer has at most one request in flight, so this never holds more than that.
        let (tx, requests) = mpsc::channel(limits.max_peers * MAX_OUTSTANDING_REQUESTS);
        let counters = Arc::new(Counters::default());
        let registry = Registry::new(&limits, counters.clone(), SOCKET);
        let shared = Arc::new(Shared {
            ids: Mutex::new(HashSet::new()),
            next_id: AtomicU32::new(1),
            counters,
            requests: tx,
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
        Ok(Self { shared, requests })
    }

    /// The next request of any peer.
    pub async fn recv(&mut self) -> Option<Request> {
        self.requests.recv().await
    }

    /// A view of the counters that outlives the socket's thread.
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(self.shared.counters.clone())
    }
}

/// Frees a routing id when its connection ends.
struct IdInUse(Bytes, Arc<Shared>);

impl Drop for IdInUse {
    fn drop(&mut self) {
        self.1.ids.lock().remove(&self.0);
    }
}

impl Shared {
    /// The peer's own routing id when it gave a free one (not starting with 0, which libzmq
    /// reserves for generated ids), else a generated `[0, n as 4 bytes]`.
    fn claim_id(self: &Arc<Self>, asked: Option<Bytes>) -> IdInUse {
        let mut ids = self.ids.lock();
        if let Some(id) = asked
            && !id.is_empty()
            && id[0] != 0
            && ids.insert(id.clone())
        {
            return IdInUse(id, self.clone());
        }
        loop {
            let n = self.next_id.fetch_add(1, Ordering::Relaxed);
            let mut id = vec![0u8];
            id.extend_from_slice(&n.to_be_bytes());
            let id = Bytes::from(id);
            if ids.insert(id.clone()) {
                return IdInUse(id, self.clone());
            }
        }
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
            accepts: &["DEALER", "REQ", "ROUTER"],
            identity: Some(b""),
        };
        let c = conn::handshake(
            stream,
            role,
            peer::frame_limits(limits),
            limits.handshake_timeout,
        )
        .await?;
        live.touch();
        let id = shared.claim_id(c.meta.identity.clone());
        let (outbox, inbox) = Outbox::new(
            limits,
            shared.budget.clone(),
            shared.counters.clone(),
            live.clone(),
        );
        let in_flight = Arc::new(Semaphore::new(MAX_OUTSTANDING_REQUESTS));
        let mut reader = c.reader;
        let read = async {
            loop {
                // Not one byte more is read from this peer until its last request was answered.
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    return Ok::<(), ZmtpError>(());
                };
                let frames = loop {
                    let input = reader.input().await?;
                    live.touch();
                    match input {
                        Input::Message(frames) => break frames,
                        Input::Command(cmd) => {
                            // SUBSCRIBE/CANCEL mean nothing to a ROUTER.
                            let _ = peer::common_command(cmd, &outbox)?;
                        }
                    }
                };
                live.mark_useful();
                let request = Request {
                    identity: id.0.clone(),
                    frames,
                    outbox: outbox.clone(),
                    counters: shared.counters.clone(),
                    stall: limits.stall_timeout,
                    _permit: permit,
                };
                if shared.requests.send(request).await.is_err() {
                    return Ok(());
                }
            }
        };
        tokio::select! {
            r = read => r,
            r = peer::write_queue(c.writer, inbox, live.clone(), limits.stall_timeout) => r,
        }
    };
    tokio::select! {
        r = work => r,
        e = idle => Err(e),
    }
}
