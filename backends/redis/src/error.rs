//! The backend's own error type, [`RedisError`], and its mapping into the storage contract's
//! [`StorageError`] (whole calls) and [`PageError`] (single pages).

use hicache_storage::{PageError, StorageError};
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
    /// The TLS configuration could not be loaded.
    #[error("tls: {0}")]
    Tls(String),
    /// Any other error of the client or the server, with the node.
    #[error("{node}: {source}")]
    Client {
        /// The node.
        node: String,
        /// The client's error.
        #[source]
        source: redis::RedisError,
    },
}

impl RedisError {
    /// Classifies a client error from `node` (authentication errors get their own variant).
    pub fn client(node: &str, source: redis::RedisError) -> Self {
        let auth = matches!(source.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
            || source.to_string().contains("WRONGPASS")
            || source.kind() == redis::ErrorKind::AuthenticationFailed;
        if auth {
            RedisError::Auth {
                node: node.to_string(),
                detail: source.to_string(),
            }
        } else {
            RedisError::Client {
                node: node.to_string(),
                source,
            }
        }
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
