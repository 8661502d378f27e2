//! The error type of `hicache-core`.

use thiserror::Error;

/// Everything that can go wrong in `hicache-core`: bad keys, bad arguments to tree operations,
/// invalid policies. Each variant names the offending value so that a log line alone is enough
/// to find the cause.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A token id does not fit the 32-bit serialisation used by page hashes and the tree.
    #[error("token id {value} at position {position} does not fit in u32 (ids must be < 2^32)")]
    TokenOutOfRange {
        /// Index of the token in the input.
        position: usize,
        /// The offending value.
        value: u64,
    },
    /// A string that should be lowercase hex of a given length is not.
    #[error("invalid hex for {what}: expected {expected_len} hex characters, got {got:?}")]
    BadHex {
        /// What was being parsed (e.g. "page hash").
        what: &'static str,
        /// Number of hex characters expected.
        expected_len: usize,
        /// The input (truncated to 128 characters).
        got: String,
    },
    /// A page size of zero or one too large to be useful.
    #[error("invalid page size {0}: must be between 1 and 65536 tokens")]
    BadPageSize(u32),
    /// A key or value whose length is not a whole number of pages.
    #[error("{what} has {len} tokens, which is not a multiple of the page size {page_size}")]
    Unaligned {
        /// Which argument was unaligned.
        what: &'static str,
        /// Its length in tokens.
        len: usize,
        /// The page size of the tree.
        page_size: u32,
    },
    /// Two arguments that must have the same length do not.
    #[error("length mismatch: {what}: {left} vs {right}")]
    LengthMismatch {
        /// What was compared.
        what: &'static str,
        /// Length of the first argument.
        left: usize,
        /// Length of the second argument.
        right: usize,
    },
    /// A policy or configuration value out of its allowed range.
    #[error("invalid value for {field}: {value} ({reason})")]
    InvalidPolicy {
        /// The field name, as spelled in configuration.
        field: &'static str,
        /// The value given, rendered.
        value: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A node id that does not (or no longer) refer to a live node.
    #[error("stale or unknown node id {0}")]
    StaleNode(String),
    /// A lock, host-protect or pin operation that would drive a counter below zero, or an
    /// operation that is not allowed in the node's current state.
    #[error("invalid state for node {node}: {reason}")]
    InvalidState {
        /// The node, rendered.
        node: String,
        /// What was wrong.
        reason: String,
    },
    /// A tenant id that was never issued by this tree.
    #[error("unknown tenant id {0}")]
    UnknownTenant(u32),
    /// A node of one tenant used where another tenant's key or node was expected.
    #[error("node {node} belongs to tenant {node_tenant}, not to tenant {tenant}")]
    WrongTenant {
        /// The node, rendered.
        node: String,
        /// Its tenant.
        node_tenant: u32,
        /// The tenant of the operation.
        tenant: u32,
    },
    /// A write or load id that is not (or no longer) pending.
    #[error("unknown {kind} id {id}: not pending (already finished, or issued before a reset)")]
    UnknownTransfer {
        /// "write" or "load".
        kind: &'static str,
        /// The id.
        id: u64,
    },
}

/// Result alias of `hicache-core`.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;
