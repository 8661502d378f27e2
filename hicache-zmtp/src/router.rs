//! The ROUTER socket: each peer has a routing id (its own, or one generated); each message it
//! sends becomes a [`Request`] that carries the way back to it, answered through that peer's
//! bounded queue.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::codec;
use super::peer::{self, Input, NotQueued, Outbox, PeerSlot};
use super::{
    Counters, MAX_OUTSTANDING_REQUESTS, MAX_PEERS, PEER_QUEUE, REPLY_STALL_TIMEOUT, StatsHandle,
    ZmtpError,
};

const SOCKET: &str = "ROUTER";

/// What the accept loop and the connections share.
struct Shared {
    ids: Mutex<HashSet<Bytes>>,
    next_id: AtomicU32,
    counters: Arc<Counters>,
    requests: mpsc::Sender<Request>,
}

/// A ZMQ ROUTER socket bound to one TCP listener.
pub struct RouterSocket {
    shared: Arc<Shared>,
    requests: mpsc::Receiver<Request>,
}

/// One message a peer sent, with the way to answer it. While it lives, that peer's next
/// message is not read ([`super::MAX_OUTSTANDING_REQUESTS`]).
#[derive(Debug)]
pub struct Request {
    /// The peer's routing id.
    pub identity: Bytes,
    /// The message's frames (the routing id not included).
    pub frames: Vec<Bytes>,
    outbox: Outbox,
    counters: Arc<Counters>,
    _permit: OwnedSemaphorePermit,
}

/// Why a reply was not sent.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    /// The peer did not read for [`REPLY_STALL_TIMEOUT`]; it was disconnected.
    #[error("the peer did not read its replies; disconnected")]
    Stalled,
    /// The peer is gone.
    #[error("the peer is gone")]
    Closed,
}

impl Request {
    /// Sends `frames` as one message to the peer, waiting at most [`REPLY_STALL_TIMEOUT`] for
    /// room in its queue; a peer that stays full is disconnected.
    pub async fn reply<B: AsRef<[u8]>>(&self, frames: &[B]) -> Result<(), ReplyError> {
        let mut wire = BytesMut::new();
        codec::encode_message(frames, &mut wire);
        match self
            .outbox
            .send_timeout(wire.freeze(), REPLY_STALL_TIMEOUT)
            .await
        {
            Ok(()) => Ok(()),
            Err(NotQueued::Closed) => Err(ReplyError::Closed),
            Err(NotQueued::Full) => {
                self.counters.stalled_peers.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    identity = ?self.identity,
                    "KV events: a replay client does not read its replies; disconnected"
                );
                self.outbox.close();
                Err(ReplyError::Stalled)
            }
        }
    }
}

impl RouterSocket {
    /// Starts accepting on `listener` in the current tokio runtime (call it from inside one).
    pub fn bind(listener: std::net::TcpListener) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        // Each peer has at most one request in flight, so this never holds more than that.
        let (tx, requests) = mpsc::channel(MAX_PEERS * MAX_OUTSTANDING_REQUESTS);
        let shared = Arc::new(Shared {
            ids: Mutex::new(HashSet::new()),
            next_id: AtomicU32::new(1),
            counters: Arc::new(Counters::default()),
            requests: tx,
        });
        let s = shared.clone();
        tokio::spawn(peer::accept_loop(
            listener,
            shared.counters.clone(),
            SOCKET,
            move |stream, addr, slot| {
                tokio::spawn(serve(stream, addr, slot, s.clone()));
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

async fn serve(stream: TcpStream, addr: SocketAddr, slot: PeerSlot, shared: Arc<Shared>) {
    let r = connection(stream, shared.clone()).await;
    peer::ended(&shared.counters, SOCKET, addr, r);
    drop(slot);
}

async fn connection(stream: TcpStream, shared: Arc<Shared>) -> Result<(), ZmtpError> {
    let c = peer::handshake(stream, SOCKET, &["DEALER", "REQ", "ROUTER"], Some(b"")).await?;
    let id = shared.claim_id(c.meta.identity.clone());
    let (outbox, rx, pending) = Outbox::new(PEER_QUEUE);
    let in_flight = Arc::new(Semaphore::new(MAX_OUTSTANDING_REQUESTS));
    let mut reader = c.reader;
    let read = async {
        loop {
            // Not one byte more is read from this peer until its last request was answered.
            let Ok(permit) = in_flight.clone().acquire_owned().await else {
                return Ok::<(), ZmtpError>(());
            };
            let frames = loop {
                match reader.input().await? {
                    Input::Message(frames) => break frames,
                    Input::Command(cmd) => {
                        // SUBSCRIBE/CANCEL mean nothing to a ROUTER.
                        let _ = peer::common_command(cmd, &outbox)?;
                    }
                }
            };
            let request = Request {
                identity: id.0.clone(),
                frames,
                outbox: outbox.clone(),
                counters: shared.counters.clone(),
                _permit: permit,
            };
            if shared.requests.send(request).await.is_err() {
                return Ok(());
            }
        }
    };
    tokio::select! {
        r = read => r,
        r = peer::write_queue(c.writer, rx, pending) => r,
        () = outbox.closed() => Ok(()),
    }
}
