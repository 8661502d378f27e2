//! What both server sockets do with one connection: admit it (evicting the stalest peer of a
//! full set), run it under the idle and stall deadlines, and write from a queue bounded in
//! messages and bytes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::ZmtpError;
use crate::codec::{self, Command};
use crate::conn::FrameLimits;
use crate::limits::ServerLimits;
use crate::registry::{Admitted, Liveness, Registry};
use crate::stats::{Counters, throttled};

/// Bytes a server asks of the kernel per read (peers send small messages).
const READ_CHUNK: usize = 4096;

/// The frame limits of a server's connections.
pub(crate) fn frame_limits(limits: &ServerLimits) -> FrameLimits {
    FrameLimits {
        max_frame: limits.max_frame,
        max_frames: limits.max_frames_per_message,
        max_message: limits
            .max_frame
            .saturating_mul(limits.max_frames_per_message),
        read_chunk: READ_CHUNK,
    }
}

/// One encoded message: frame headers and bodies, the bodies shared with whoever else holds
/// them (the replay buffer, other peers' queues).
#[derive(Clone, Debug, Default)]
pub(crate) struct Wire {
    parts: Vec<Bytes>,
    len: usize,
}

impl Wire {
    /// Encodes `frames` as one message without copying their bodies.
    pub(crate) fn message(frames: &[Bytes]) -> Self {
        let mut parts = Vec::with_capacity(frames.len() * 2);
        let mut len = 0;
        for (i, f) in frames.iter().enumerate() {
            let mut head = BytesMut::with_capacity(9);
            codec::encode_frame_header(i + 1 < frames.len(), f.len(), &mut head);
            len += head.len() + f.len();
            parts.push(head.freeze());
            if !f.is_empty() {
                parts.push(f.clone());
            }
        }
        Self { parts, len }
    }

    /// Already encoded bytes (a command).
    pub(crate) fn raw(bytes: Bytes) -> Self {
        let len = bytes.len();
        Self {
            parts: vec![bytes],
            len,
        }
    }

    /// Bytes on the wire.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// A message in a peer's queue, holding its share of the byte budgets until it is written or
/// the queue is dropped (the connection ended).
struct Queued {
    wire: Wire,
    _peer: OwnedSemaphorePermit,
    _socket: OwnedSemaphorePermit,
    counters: Arc<Counters>,
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.counters.dequeued(self.wire.len());
    }
}

/// The byte budget all the queues of one socket share.
#[derive(Clone, Debug)]
pub(crate) struct SocketBudget {
    bytes: Arc<Semaphore>,
    max: usize,
}

impl SocketBudget {
    pub(crate) fn new(limits: &ServerLimits) -> Self {
        Self {
            bytes: Arc::new(Semaphore::new(limits.max_queued_bytes)),
            max: limits.max_queued_bytes,
        }
    }
}

/// A peer's outgoing queue: bounded in messages and bytes, never awaited by the PUB, awaited
/// with a deadline by the ROUTER.
#[derive(Clone, Debug)]
pub(crate) struct Outbox {
    tx: mpsc::Sender<Queued>,
    peer_bytes: Arc<Semaphore>,
    peer_max: usize,
    socket: SocketBudget,
    counters: Arc<Counters>,
    live: Arc<Liveness>,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queued")
            .field("len", &self.wire.len())
            .finish()
    }
}

/// Why a message was not queued.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NotQueued {
    /// The peer's queue is full (the peer does not read fast enough).
    Full,
    /// The socket's byte budget is spent (other peers do not read).
    Budget,
    /// The connection is gone.
    Closed,
}

/// The receiving end of an [`Outbox`], drained by [`write_queue`].
pub(crate) struct Inbox(mpsc::Receiver<Queued>);

impl Outbox {
    /// A queue for one peer and the receiver its writer drains.
    pub(crate) fn new(
        limits: &ServerLimits,
        socket: SocketBudget,
        counters: Arc<Counters>,
        live: Arc<Liveness>,
    ) -> (Self, Inbox) {
        let (tx, rx) = mpsc::channel(limits.peer_queue);
        let outbox = Self {
            tx,
            peer_bytes: Arc::new(Semaphore::new(limits.peer_queue_bytes)),
            peer_max: limits.peer_queue_bytes,
            socket,
            counters,
            live,
        };
        (outbox, Inbox(rx))
    }

    /// What `wire` costs of the peer's and the socket's budgets: its length, or the whole
    /// budget for a bigger message (admitted only into an otherwise empty one).
    fn costs(&self, wire: &Wire) -> (u32, u32) {
        let clamp = |max: usize| u32::try_from(wire.len().min(max)).unwrap_or(u32::MAX);
        (clamp(self.peer_max), clamp(self.socket.max))
    }

    fn queued(
        &self,
        wire: Wire,
        peer: OwnedSemaphorePermit,
        socket: OwnedSemaphorePermit,
    ) -> Queued {
        self.counters.queued(wire.len());
        Queued {
            wire,
            _peer: peer,
            _socket: socket,
            counters: self.counters.clone(),
        }
    }

    /// Queues `wire` if there is room; never waits.
    pub(crate) fn try_send(&self, wire: Wire) -> Result<(), NotQueued> {
        if self.tx.is_closed() {
            return Err(NotQueued::Closed);
        }
        let (peer_cost, socket_cost) = self.costs(&wire);
        let peer = self
            .peer_bytes
            .clone()
            .try_acquire_many_owned(peer_cost)
            .map_err(|_| NotQueued::Full)?;
        let socket = self
            .socket
            .bytes
            .clone()
            .try_acquire_many_owned(socket_cost)
            .map_err(|_| NotQueued::Budget)?;
        let q = self.queued(wire, peer, socket);
        self.tx.try_send(q).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => NotQueued::Full,
            mpsc::error::TrySendError::Closed(_) => NotQueued::Closed,
        })
    }

    /// Queues `wire`, waiting at most `limit` for room in the peer's queue ([`NotQueued::Full`]
    /// then) and then at most `limit` again for the socket's byte budget ([`NotQueued::Budget`]:
    /// other peers hold it; they are closed within the stall timeout if they do not read).
    pub(crate) async fn send_timeout(&self, wire: Wire, limit: Duration) -> Result<(), NotQueued> {
        let (peer_cost, socket_cost) = self.costs(&wire);
        let peer_room = async {
            let permit = self.tx.reserve().await.map_err(|_| NotQueued::Closed)?;
            let peer = self
                .peer_bytes
                .clone()
                .acquire_many_owned(peer_cost)
                .await
                .map_err(|_| NotQueued::Closed)?;
            Ok::<_, NotQueued>((permit, peer))
        };
        let (permit, peer) = tokio::time::timeout(limit, peer_room)
            .await
            .map_err(|_| NotQueued::Full)??;
        let socket = tokio::time::timeout(
            limit,
            self.socket.bytes.clone().acquire_many_owned(socket_cost),
        )
        .await
        .map_err(|_| NotQueued::Budget)?
        .map_err(|_| NotQueued::Closed)?;
        permit.send(self.queued(wire, peer, socket));
        Ok(())
    }

    /// Whether everything queued was written to the kernel (or the connection is gone).
    pub(crate) fn is_flushed(&self) -> bool {
        // A message's budget is returned once it was written (or the queue was dropped).
        self.peer_bytes.available_permits() == self.peer_max || self.tx.is_closed()
    }

    /// Ends the connection.
    pub(crate) fn close(&self) {
        self.live.close();
    }
}

/// Writes the queue to the peer until the queue closes or a write fails. A write that makes
/// no progress for `stall` ends the connection with [`ZmtpError::Stalled`]; every write that
/// does is activity ([`Liveness::touch`]).
pub(crate) async fn write_queue(
    mut writer: OwnedWriteHalf,
    Inbox(mut rx): Inbox,
    live: Arc<Liveness>,
    stall: Duration,
) -> Result<(), ZmtpError> {
    while let Some(q) = rx.recv().await {
        for part in &q.wire.parts {
            let mut at = 0;
            while at < part.len() {
                let n = tokio::time::timeout(stall, writer.write(&part[at..]))
                    .await
                    .map_err(|_| ZmtpError::Stalled(stall))??;
                if n == 0 {
                    return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
                }
                at += n;
                live.touch();
            }
        }
        // `q` drops here: its budgets are returned.
    }
    Ok(())
}

/// Answers the commands both sockets treat alike; `Ok(Some(cmd))` hands back the ones the
/// socket handles itself (SUBSCRIBE, CANCEL).
pub(crate) fn common_command(cmd: Command, outbox: &Outbox) -> Result<Option<Command>, ZmtpError> {
    match cmd {
        Command::Ping(context) => {
            let mut out = BytesMut::new();
            codec::encode_pong(&context, &mut out);
            // A peer whose queue is full is not reading; its PONG can wait for the next PING.
            let _ = outbox.try_send(Wire::raw(out.freeze()));
            Ok(None)
        }
        Command::Pong | Command::Other(_) => Ok(None),
        Command::Error(reason) => Err(ZmtpError::PeerError(reason)),
        Command::Ready(_) => Err(ZmtpError::NotReady("a second READY")),
        c @ (Command::Subscribe(_) | Command::Cancel(_)) => Ok(Some(c)),
    }
}

/// Closes a peer that is not useful `idle` after it started (the handshake included).
pub(crate) async fn idle_deadline(live: &Liveness, idle: Duration) -> ZmtpError {
    tokio::time::sleep(idle).await;
    if live.is_useful() {
        std::future::pending::<()>().await;
    }
    ZmtpError::Idle(idle)
}

/// Accepts connections until the runtime ends, admitting each (the stalest peer of a full set
/// makes room) and handing it to `serve` (which runs it as a task of its own).
pub(crate) async fn accept_loop<F>(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    socket: &'static str,
    serve: F,
) where
    F: Fn(TcpStream, SocketAddr, Admitted),
{
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, or a connection reset before it was accepted: wait a
                // little rather than spin.
                tracing::warn!(socket, error = %e, "ZMTP: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let admitted = registry.admit(addr.ip());
        let _ = stream.set_nodelay(true);
        serve(stream, addr, admitted);
    }
}

/// Runs one connection until it ends or is closed (evicted, stalled ROUTER reply), then logs
/// and counts how it ended.
pub(crate) async fn run<F>(
    counters: &Counters,
    socket: &'static str,
    addr: SocketAddr,
    admitted: Admitted,
    connection: F,
) where
    F: Future<Output = Result<(), ZmtpError>>,
{
    let r = tokio::select! {
        r = connection => r,
        () = admitted.live.closed() => Err(if admitted.was_evicted() {
            ZmtpError::Evicted
        } else {
            ZmtpError::Closed
        }),
    };
    ended(counters, socket, addr, r);
    drop(admitted);
}

/// Logs and counts how a connection ended.
fn ended(counters: &Counters, socket: &'static str, addr: SocketAddr, r: Result<(), ZmtpError>) {
    match r {
        Ok(()) => tracing::debug!(socket, peer = %addr, "ZMTP: peer closed"),
        Err(e @ ZmtpError::Idle(_)) => {
            let n = counters.idle_closed.fetch_add(1, Ordering::Relaxed) + 1;
            if throttled(n) {
                tracing::warn!(socket, peer = %addr, error = %e, idle_closed = n, "ZMTP: idle peer closed");
            } else {
                tracing::debug!(socket, peer = %addr, error = %e, idle_closed = n, "ZMTP: idle peer closed");
            }
        }
        Err(e @ ZmtpError::Stalled(_)) => {
            let n = counters.stalled_peers.fetch_add(1, Ordering::Relaxed) + 1;
            if throttled(n) {
                tracing::warn!(socket, peer = %addr, error = %e, stalled = n, "ZMTP: a peer that does not read was closed");
            } else {
                tracing::debug!(socket, peer = %addr, error = %e, stalled = n, "ZMTP: a peer that does not read was closed");
            }
        }
        Err(e) if e.is_protocol() => {
            let n = counters.closed_for_errors.fetch_add(1, Ordering::Relaxed) + 1;
            if throttled(n) {
                tracing::warn!(socket, peer = %addr, error = %e, closed = n, "ZMTP: connection closed");
            } else {
                tracing::debug!(socket, peer = %addr, error = %e, closed = n, "ZMTP: connection closed");
            }
        }
        Err(e) => tracing::debug!(socket, peer = %addr, error = %e, "ZMTP: peer gone"),
    }
}
