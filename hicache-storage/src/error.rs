//! The error type of `hicache-storage` and of every backend built on it.
//!
//! Batch-level failures (bad arguments, a backend that cannot be opened or reached) are
//! [`StorageError`]s; failures of single pages inside a batch are
//! [`PageOutcome::Failed`](crate::PageOutcome::Failed) with a [`PageError`](crate::PageError),
//! so one bad page never hides the outcome of the others.

use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong at the level of a whole call. Each variant names what was wrong
/// and where, so a log line alone finds the cause.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StorageError {
    /// A configuration field is unknown, has the wrong type or is out of range.
    #[error("invalid storage config: {scope}: field `{field}` = {value}: {reason}")]
    Config {
        /// Where the field was read: `extra-config` for HiCache-level fields, `backend <name>`
        /// for a backend's own fields.
        scope: String,
        /// The field name as spelled in the configuration.
        field: String,
        /// The offending value, rendered as JSON (or `<missing>`).
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// The extra-config document is not valid JSON or not an object.
    #[error("invalid storage extra-config ({source_name}): {reason}")]
    ConfigSyntax {
        /// `<inline>` or the file it was read from.
        source_name: String,
        /// The parser's message.
        reason: String,
    },
    /// No backend of that name is registered.
    #[error("unknown storage backend `{name}`; known backends: {}", known.join(", "))]
    UnknownBackend {
        /// The name asked for.
        name: String,
        /// Every registered name.
        known: Vec<String>,
    },
    /// A backend of that name is already registered.
    #[error("a storage backend named `{0}` is already registered")]
    DuplicateBackend(String),
    /// A batch has more pages than the backend's `max_batch`. Split it (the
    /// [`StorageExt`](crate::StorageExt) helpers do) or ask the backend for a larger limit.
    #[error("batch of {len} pages exceeds the backend's max_batch of {max}")]
    BatchTooLarge {
        /// Pages in the batch.
        len: usize,
        /// The backend's limit ([`BackendInfo::max_batch`](crate::BackendInfo::max_batch)).
        max: usize,
    },
    /// The key list and the buffer list of one call differ in length.
    #[error("{op}: {keys} keys but {buffers} page buffers")]
    LengthMismatch {
        /// Which call (`batch_get`, `batch_set`).
        op: &'static str,
        /// Number of keys.
        keys: usize,
        /// Number of buffers.
        buffers: usize,
    },
    /// An I/O error on a named path that concerns the backend as a whole (opening its
    /// directory, its lock files).
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`create directory`, `lock`, …).
        op: &'static str,
        /// The path concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The backend cannot serve calls any more (closed, its server gone, a worker died).
    #[error("storage backend `{backend}` unavailable: {reason}")]
    Unavailable {
        /// The backend's name.
        backend: String,
        /// Why.
        reason: String,
    },
    /// The backend does not offer this operation (an honest capability answer, see
    /// [`BackendInfo`](crate::BackendInfo)'s capability fields), not a failure of the storage.
    #[error("{op} is not supported by storage backend `{backend}`")]
    Unsupported {
        /// The backend's name.
        backend: String,
        /// The operation asked for (`clear`, …).
        op: &'static str,
    },
    /// Any other backend-specific failure, with the backend's name. Build it with
    /// [`StorageError::backend`] or, when an underlying error caused it,
    /// [`StorageError::backend_caused`], which keeps that error as the
    /// [`source`](std::error::Error::source) (and appends its text to the message, so a log line
    /// that prints only this error still shows the cause).
    #[error("storage backend `{backend}`: {}", backend_detail(reason, source.as_deref()))]
    Backend {
        /// The backend's name.
        backend: String,
        /// What went wrong (the context; the cause's own text is in `source`).
        reason: String,
        /// The underlying error, when there is one.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
}

/// The message of a [`StorageError::Backend`]: its reason, then its cause's text after `: `
/// (either may be empty).
fn backend_detail(
    reason: &str,
    source: Option<&(dyn std::error::Error + Send + Sync + 'static)>,
) -> String {
    match source {
        None => reason.to_string(),
        Some(cause) if reason.is_empty() => cause.to_string(),
        Some(cause) => format!("{reason}: {cause}"),
    }
}

impl StorageError {
    /// A [`StorageError::Config`] error.
    pub fn config(
        scope: impl Into<String>,
        field: impl Into<String>,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        StorageError::Config {
            scope: scope.into(),
            field: field.into(),
            value: value.into(),
            reason: reason.into(),
        }
    }

    /// A [`StorageError::Backend`] error without an underlying cause.
    pub fn backend(backend: impl Into<String>, reason: impl Into<String>) -> Self {
        StorageError::Backend {
            backend: backend.into(),
            reason: reason.into(),
            source: None,
        }
    }

    /// A [`StorageError::Backend`] error caused by `source`: `reason` says what was being done
    /// (it may be empty), `source` is kept as the error's
    /// [`source`](std::error::Error::source).
    pub fn backend_caused(
        backend: impl Into<String>,
        reason: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        StorageError::Backend {
            backend: backend.into(),
            reason: reason.into(),
            source: Some(source.into()),
        }
    }

    /// Wraps an I/O error with the operation and the path it concerns.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| StorageError::Io { op, path, source }
    }
}

/// Result alias of `hicache-storage`.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn a_backend_error_keeps_its_cause_as_source() {
        let cause = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "no entry");
        let e = StorageError::backend_caused("file", "open index", cause);
        assert_eq!(
            e.to_string(),
            "storage backend `file`: open index: no entry"
        );
        let src = e.source().expect("the cause is the source");
        let io = src
            .downcast_ref::<std::io::Error>()
            .expect("the source is the original io::Error");
        assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
    }

    #[test]
    fn a_backend_error_without_cause_has_no_source() {
        let e = StorageError::backend("uring", "too many page size classes");
        assert!(e.source().is_none());
        assert_eq!(
            e.to_string(),
            "storage backend `uring`: too many page size classes"
        );
        let bare = StorageError::backend_caused("x", "", std::io::Error::other("gone"));
        assert_eq!(bare.to_string(), "storage backend `x`: gone");
    }
}
