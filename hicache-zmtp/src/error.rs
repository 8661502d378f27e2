//! [`ZmtpError`]: why a connection (server or client side) ended or an operation failed.

use std::time::Duration;

/// Why a connection was closed or a client call failed.
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
    /// A frame longer than the socket accepts (for a frame of a multipart message: longer than
    /// what is left of the message's limit).
    #[error("a frame of {len} bytes is over this socket's limit of {max}")]
    TooLong {
        /// The length the header claims.
        len: u64,
        /// The limit it broke.
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
    /// More subscriptions than the socket's limit.
    #[error("more than {0} subscriptions")]
    TooManySubscriptions(usize),
    /// The peer sent an ERROR command.
    #[error("the peer sent ERROR: {0}")]
    PeerError(String),
    /// The handshake took longer than allowed.
    #[error("no handshake within {0:?}")]
    HandshakeTimeout(Duration),
    /// A server peer neither subscribed (PUB) nor sent a request (ROUTER) within the socket's
    /// idle deadline.
    #[error("neither a subscription nor a request within {0:?}")]
    Idle(Duration),
    /// A server peer did not read what was queued for it for this long.
    #[error("the peer read nothing for {0:?}")]
    Stalled(Duration),
    /// A server peer's place was given to a newer connection (the socket or its address was at
    /// its connection limit and this peer was the stalest).
    #[error("evicted for a newer connection")]
    Evicted,
    /// A client heard nothing from its server (not even a PONG to its PING) for this long: the
    /// server is dead or unreachable.
    #[error("the server answered nothing for {0:?}")]
    DeadPeer(Duration),
    /// A client call did not complete within its deadline (the connection is still usable).
    #[error("nothing within {0:?}")]
    Timeout(Duration),
    /// An endpoint that is not `tcp://HOST:PORT`.
    #[error("endpoint {0:?} is not tcp://HOST:PORT")]
    Endpoint(String),
    /// A client call on a connection that was already lost.
    #[error("the connection was lost earlier")]
    Closed,
    /// The connection failed or the peer closed it.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ZmtpError {
    /// Whether the peer broke the protocol or a limit (as opposed to closing or losing the
    /// connection, or being closed by a liveness rule).
    pub fn is_protocol(&self) -> bool {
        !matches!(
            self,
            ZmtpError::Io(_)
                | ZmtpError::Idle(_)
                | ZmtpError::Stalled(_)
                | ZmtpError::Evicted
                | ZmtpError::DeadPeer(_)
                | ZmtpError::Timeout(_)
                | ZmtpError::Closed
        )
    }
}
