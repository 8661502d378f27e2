//! The error type of `hicache-backend-rdma`.

use hicache_storage::StorageError;
use thiserror::Error;

use crate::protocol::ProtocolError;

/// Everything that can fail in the client, the server or the transports. Each variant names
/// the peer or resource concerned.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// The peer broke the wire protocol.
    #[error("protocol error with {peer}: {source}")]
    Protocol {
        /// The peer's address.
        peer: String,
        /// What was wrong.
        #[source]
        source: ProtocolError,
    },
    /// A socket operation failed.
    #[error("{op} {peer}: {source}")]
    Io {
        /// What was being done (`connect`, `read reply`, …).
        op: &'static str,
        /// The peer's address.
        peer: String,
        /// The OS's error.
        #[source]
        source: std::io::Error,
    },
    /// A socket operation made no progress within its time limit.
    #[error("{op} {peer}: timed out after {ms} ms")]
    Timeout {
        /// What was being done.
        op: &'static str,
        /// The peer's address.
        peer: String,
        /// The limit.
        ms: u64,
    },
    /// The server answered with an `ERROR` frame.
    #[error("server {peer} refused the request (code {code}): {message}")]
    Refused {
        /// The server's address.
        peer: String,
        /// Error code ([`crate::protocol::code`]).
        code: u16,
        /// The server's message.
        message: String,
    },
    /// The handshake could not authenticate (client side: missing credentials, a server that
    /// does not require or cannot prove them).
    #[error("authentication with {peer}: {reason}")]
    Auth {
        /// The server's address.
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// The server was unreachable recently; calls fail fast until the back-off ends.
    #[error("server {peer} unreachable (retrying after {retry_ms} ms back-off): {last}")]
    Backoff {
        /// The server's address.
        peer: String,
        /// The back-off.
        retry_ms: u64,
        /// The last connection error.
        last: String,
    },
    /// No RDMA device is present (verbs transport).
    #[error("no RDMA device found: {0}")]
    NoDevice(String),
    /// A verbs call failed.
    #[error("verbs: {call} failed: {detail}")]
    Verbs {
        /// The libibverbs function.
        call: &'static str,
        /// errno or reason.
        detail: String,
    },
    /// The verbs transport was asked for but this build lacks it.
    #[error(
        "transport `verbs` needs hicache-backend-rdma built with the `verbs` cargo feature \
         (hicache feature `rdma-verbs`); this build has only `tcp`"
    )]
    VerbsNotBuilt,
    /// The server could not be set up (bind, mapping memory, bad options).
    #[error("rdma server setup: {0}")]
    Setup(String),
}

impl From<RdmaError> for StorageError {
    fn from(e: RdmaError) -> Self {
        StorageError::Unavailable {
            backend: crate::BACKEND_NAME.into(),
            reason: e.to_string(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = RdmaError> = std::result::Result<T, E>;
