//! The backend's own error type, [`RedisError`], and its mapping into the storage contract's
//! [`StorageError`] (whole calls) and [`PageError`] (single pages).

use hicache_storage::{PageError, StorageError};

use crate::conn::ConnError;
use crate::resp::RespError;
use thiserror::Error;

/// What can go wrong talking to the cluster. Every variant names the node or key concerned.
#[derive(Debug, Error)]
pub enum RedisError {
    /// No seed node answered.
    #[error("no seed node reachable ({tried}): {last}")]
    Unreachable {
        /// The addresses tried.
        tried: String,
        /// The last node's error.
        last: String,
    },
    /// The server refused the credentials.
    #[error("authentication failed at {node}: {detail} (check `username` / `password`)")]
    Auth {
        /// The node.
        node: String,
        /// The server's message.
        detail: String,
    },
    /// The server is not what the configuration says (cluster versus standalone).
    #[error("{node}: {detail}")]
    WrongMode {
        /// The node.
        node: String,
        /// What was expected and found.
        detail: String,
    },
    /// A reply that does not have the shape the command promises.
    #[error("{node}: unexpected reply to {command}: {detail}")]
    Protocol {
        /// The node.
        node: String,
        /// The command.
        command: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The node sent bytes that are not RESP (the connection was closed).
    #[error(
        "node {node} answered something that is not RESP (reading the reply to {command}): {detail}"
    )]
    NotResp {
        /// The node.
        node: String,
        /// The command whose reply was being read.
        command: &'static str,
        /// What byte, where.
        detail: String,
    },
    /// A reply over the bound of what its command can return, refused before it was buffered
    /// (the connection was closed).
    #[error("node {node}: reply to {command} refused: {detail}; connection closed")]
    ReplyTooLarge {
        /// The node.
        node: String,
        /// The command whose reply was being read.
        command: &'static str,
        /// The length claimed and the bound.
        detail: String,
    },
    /// The node closed the connection before a whole reply.
    #[error("node {node} closed the connection while we read the reply to {command}")]
    Closed {
        /// The node.
        node: String,
        /// The command whose reply was being read.
        command: &'static str,
    },
    /// The socket failed (refused, reset, unreachable).
    #[error("node {node}: i/o error during {command}: {detail}")]
    Io {
        /// The node.
        node: String,
        /// The command (or `connect`).
        command: &'static str,
        /// The system's error.
        detail: String,
    },
    /// The server answered the command with an error reply.
    #[error("node {node} answered {command} with an error: {msg}")]
    Server {
        /// The node.
        node: String,
        /// The command.
        command: &'static str,
        /// The error reply.
        msg: String,
    },
    /// The call's budget (`timeout_ms`) was spent; `doing` is what was pending.
    #[error("{op}: {doing} not answered within the {budget_ms} ms budget")]
    Timeout {
        /// The call (`open`, `clear`, …).
        op: &'static str,
        /// What was pending.
        doing: String,
        /// The budget.
        budget_ms: u128,
    },
    /// The TLS configuration could not be loaded, or a handshake failed.
    #[error("tls: {0}")]
    Tls(String),
}

impl RedisError {
    /// The error of `command` on `node` for a connection failure `e`.
    pub fn conn(node: &str, command: &'static str, e: ConnError) -> Self {
        let node = node.to_string();
        match e {
            ConnError::Closed => RedisError::Closed { node, command },
            ConnError::Io(e) => RedisError::Io {
                node,
                command,
                detail: e.to_string(),
            },
            ConnError::Resp(r @ (RespError::BadType { .. } | RespError::Malformed { .. })) => {
                RedisError::NotResp {
                    node,
                    command,
                    detail: r.to_string(),
                }
            }
            ConnError::Resp(r) => RedisError::ReplyTooLarge {
                node,
                command,
                detail: r.to_string(),
            },
            ConnError::Tls(d) => RedisError::Tls(format!("{node}: {d}")),
            ConnError::Auth(detail) => RedisError::Auth { node, detail },
            ConnError::ExecRefused(msg) => RedisError::Server {
                node,
                command,
                msg: format!("{msg} (EXEC of a ranged read; connection closed)"),
            },
            ConnError::Address => RedisError::Protocol {
                node,
                command: "connect",
                detail: "not a host:port address".into(),
            },
        }
    }

    /// Whether the node could not be reached at all (refused, reset, unreachable), as opposed
    /// to a node that answered something wrong.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, RedisError::Io { .. } | RedisError::Closed { .. })
    }
}

impl From<RedisError> for StorageError {
    fn from(e: RedisError) -> Self {
        match e {
            RedisError::Unreachable { .. } => StorageError::Unavailable {
                backend: crate::NAME.to_string(),
                reason: e.to_string(),
            },
            other => StorageError::backend_caused(crate::NAME, "", other),
        }
    }
}

/// The per-page failure for a server error reply `msg` to a command on one page's key.
pub fn page_error(key: &str, msg: &str) -> PageError {
    match msg.split_whitespace().next() {
        Some("OOM") => PageError::NoSpace,
        _ => PageError::Backend(format!("redis {key}: {msg}")),
    }
}
