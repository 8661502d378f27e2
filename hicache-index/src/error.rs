//! Errors of the index.

/// What went wrong, and where.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// A holder id that was never added, or was removed.
    #[error("unknown holder {0}")]
    UnknownHolder(u32),
    /// An operation that needs an instance got a store, or the other way round.
    #[error("holder {holder} is a {actual}, this operation needs a {expected}")]
    WrongHolderKind {
        /// The holder named.
        holder: u32,
        /// What it is.
        actual: &'static str,
        /// What the operation needs.
        expected: &'static str,
    },
    /// A store holder holds L3 pages only.
    #[error("store holder {0} holds L3 pages only, not {1:?}")]
    StoreTier(u32, crate::Tier),
    /// More holders than the index can name.
    #[error("too many holders (at most {0})")]
    TooManyHolders(usize),
}

/// The index's result type.
pub type Result<T> = std::result::Result<T, IndexError>;
