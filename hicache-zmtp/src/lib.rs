//! ZMTP 3.0 / 3.1 (rfc.zeromq.org specs 23 and 37, ZeroMQ's wire protocol) over TCP with the
//! NULL security mechanism, every frame, peer and queue bounded: the PUB ([`PubSocket`]) and
//! ROUTER ([`RouterSocket`]) servers of hicache's KV-event publisher. Their clients are any ZMQ
//! implementation (libzmq through pyzmq, the `zeromq` crate).
//!
//! It exists because a server facing the network must bound what a peer can make it do, and
//! the `zeromq` crate cannot: its codec reserves whatever length a frame header claims (one
//! 73-byte packet aborted the process), and its sends wait on the slowest peer.
//!
//! Invariants (per socket):
//! 1. Nothing a peer sends can make the process panic or reserve more than [`MAX_FRAME`] (plus
//!    a header and a read chunk) per connection: a frame's claimed length is checked against
//!    [`MAX_FRAME`] from its header alone, before any byte of its body is buffered; a message
//!    has at most [`MAX_FRAMES_PER_MESSAGE`] frames, a subscriber at most
//!    [`MAX_SUBSCRIPTIONS`] subscriptions.
//! 2. A bad greeting, another mechanism than NULL, an incompatible socket type, a too-long
//!    frame, malformed commands, or a handshake not done within [`HANDSHAKE_TIMEOUT`] close
//!    *that* connection only, logged with the peer's address (every one at `debug`, the 1st,
//!    2nd, 4th... of a socket at `warn`) and counted ([`SocketStats::closed_for_errors`]).
//! 3. At most [`MAX_PEERS`] connections (handshaking ones included) are served; the ones beyond
//!    are closed as soon as they are accepted, and counted ([`SocketStats::refused_peers`]).
//! 4. Sending never waits on a peer: each has a queue of [`PEER_QUEUE`] messages. The PUB
//!    drops a message for a subscriber whose queue is full (libzmq's SNDHWM behaviour) and
//!    counts it ([`SocketStats::dropped_messages`]); a ROUTER reply waits at most
//!    [`REPLY_STALL_TIMEOUT`] for room, then that peer is disconnected and counted
//!    ([`SocketStats::stalled_peers`]).
//! 5. A ROUTER peer has at most [`MAX_OUTSTANDING_REQUESTS`] request being answered; until it
//!    is answered the peer's next bytes are not read (they wait in the kernel, and TCP flow
//!    control stops the peer), so a peer flooding requests costs a bounded amount of memory.
//! 6. Every connection is a task of the runtime the socket was bound in; dropping that runtime
//!    ends them all without waiting on any peer.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod codec;
mod peer;
mod publish;
mod router;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

pub use publish::PubSocket;
pub use router::{Request, RouterSocket};

/// The longest frame a peer may send us. Subscriptions and replay requests are a few bytes;
/// READY carries a socket type and a routing id (at most 255 bytes).
pub const MAX_FRAME: usize = 4096;
/// The most frames one incoming message may have (a replay request has 2).
pub const MAX_FRAMES_PER_MESSAGE: usize = 8;
/// The most connections one socket serves at a time, handshaking ones included.
pub const MAX_PEERS: usize = 256;
/// How long a peer has to finish the handshake (greeting and READY) after it connects.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Messages queued for one peer before the PUB drops new ones for it (libzmq's default SNDHWM).
pub const PEER_QUEUE: usize = 1000;
/// The most topic subscriptions one subscriber may hold; one more closes its connection.
pub const MAX_SUBSCRIPTIONS: usize = 64;
/// How long a ROUTER reply waits for room in a peer's full queue before that peer is
/// disconnected.
pub const REPLY_STALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Requests of one ROUTER peer being answered at a time (1: in order, one after the other).
pub const MAX_OUTSTANDING_REQUESTS: usize = 1;

/// Why a connection was closed.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The first bytes are not a ZMTP 3 signature.
    #[error("not a ZMTP 3 greeting")]
    BadSignature,
    /// ZMTP before 3.0.
    #[error("ZMTP {0}.{1} is not supported (3.0 or later is)")]
    Version(u8, u8),
    /// Another security mechanism than NULL.
    #[error("security mechanism {0:?} is not supported (NULL is)")]
    Mechanism(String),
    /// Reserved flag bits set in a frame header.
    #[error("reserved frame flags set: {0:#04x}")]
    Flags(u8),
    /// A command frame with the MORE flag.
    #[error("a command frame with the MORE flag")]
    CommandWithMore,
    /// A frame longer than the socket accepts.
    #[error("a frame of {len} bytes is over this socket's limit of {max}")]
    TooLong {
        /// The length the header claims.
        len: u64,
        /// The socket's limit.
        max: usize,
    },
    /// A message with too many frames.
    #[error("a message of more than {0} frames")]
    TooManyFrames(usize),
    /// A malformed command.
    #[error("malformed command: {0}")]
    Command(&'static str),
    /// Something else than READY where the handshake expects it.
    #[error("expected READY, got {0}")]
    NotReady(&'static str),
    /// A socket type this socket cannot talk to.
    #[error("a {0:?} peer cannot talk to a {1}")]
    SocketType(String, &'static str),
    /// A routing id over 255 bytes.
    #[error("a routing id of {0} bytes (at most 255)")]
    Identity(usize),
    /// More subscriptions than [`MAX_SUBSCRIPTIONS`].
    #[error("more than {0} subscriptions")]
    TooManySubscriptions(usize),
    /// The peer sent an ERROR command.
    #[error("the peer sent ERROR: {0}")]
    PeerError(String),
    /// The handshake took longer than [`HANDSHAKE_TIMEOUT`].
    #[error("no handshake within {0:?}")]
    HandshakeTimeout(Duration),
    /// The connection failed or the peer closed it.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ZmtpError {
    /// Whether the peer broke the protocol (as opposed to closing or losing the connection).
    fn is_protocol(&self) -> bool {
        !matches!(self, ZmtpError::Io(_))
    }
}

/// A socket's counters, as [`StatsHandle::snapshot`] reads them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SocketStats {
    /// Connections served now (handshaking ones included).
    pub peers: usize,
    /// Connections closed at accept because the most were served
    /// (`KvEventPublisher::MAX_PEERS`).
    pub refused_peers: u64,
    /// Connections closed for breaking the protocol or the limits (invariant 2).
    pub closed_for_errors: u64,
    /// Messages not queued for a subscriber whose queue was full (PUB).
    pub dropped_messages: u64,
    /// Peers disconnected because they did not read their replies (ROUTER).
    pub stalled_peers: u64,
}

/// The live counters behind [`SocketStats`].
#[derive(Debug, Default)]
struct Counters {
    peers: AtomicUsize,
    refused_peers: AtomicU64,
    closed_for_errors: AtomicU64,
    dropped_messages: AtomicU64,
    stalled_peers: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> SocketStats {
        SocketStats {
            peers: self.peers.load(Ordering::Relaxed),
            refused_peers: self.refused_peers.load(Ordering::Relaxed),
            closed_for_errors: self.closed_for_errors.load(Ordering::Relaxed),
            dropped_messages: self.dropped_messages.load(Ordering::Relaxed),
            stalled_peers: self.stalled_peers.load(Ordering::Relaxed),
        }
    }
}

/// A live view of one socket's counters, readable from any thread.
#[derive(Clone, Debug)]
pub struct StatsHandle(std::sync::Arc<Counters>);

impl StatsHandle {
    /// The counters now.
    pub fn snapshot(&self) -> SocketStats {
        self.0.snapshot()
    }
}
