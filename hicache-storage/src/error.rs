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
    #[error(
        "invalid storage config: {scope}: field `{field}` = {}: {}",
        cut(value),
        cut(reason)
    )]
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
    #[error("invalid storage extra-config ({}): {}", cut(source_name), cut(reason))]
    ConfigSyntax {
        /// `<inline>` or the file it was read from.
        source_name: String,
        /// The parser's message.
        reason: String,
    },
    /// No backend of that name is registered.
    #[error("unknown storage backend `{}`; known backends: {}", cut(name), known.join(", "))]
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
    #[error("{op} {}: {source}", cut(&path.display().to_string()))]
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
    #[error("storage backend `{backend}` unavailable: {}", cut(reason))]
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
        None => cut(reason),
        Some(cause) if reason.is_empty() => cut(&cause.to_string()),
        Some(cause) => format!("{}: {}", cut(reason), cut(&cause.to_string())),
    }
}

/// Longest text of one field an error message shows whole (a path, a value, a reason).
pub const MAX_SHOWN_CHARS: usize = 512;

/// `s` as an error message shows it: whole up to [`MAX_SHOWN_CHARS`] bytes, else its start
/// and end around a marker that says how much was left out, so a 10 MB value given by mistake
/// (a path, a JSON field) never makes a 10 MB log line.
pub fn cut(s: &str) -> String {
    if s.len() <= MAX_SHOWN_CHARS {
        return s.to_string();
    }
    let head = s.floor_char_boundary(MAX_SHOWN_CHARS * 3 / 4);
    let tail = s.ceil_char_boundary(s.len() - MAX_SHOWN_CHARS / 4);
    format!(
        "{}…[{} bytes left out]…{}",
        &s[..head],
        tail - head,
        &s[tail..]
    )
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

    /// Whether the error is the caller's configuration (a bad field, malformed extra-config
    /// JSON, a backend name not compiled in) rather than a failure of the backend: what a
    /// command line reports as bad input.
    pub fn is_bad_config(&self) -> bool {
        matches!(
            self,
            StorageError::Config { .. }
                | StorageError::ConfigSyntax { .. }
                | StorageError::UnknownBackend { .. }
        )
    }
}

/// Result alias of `hicache-storage`.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn only_configuration_errors_are_bad_config() {
        assert!(StorageError::config("file", "dir", "\"\"", "empty").is_bad_config());
        let unknown = StorageError::UnknownBackend {
            name: "nope".into(),
            known: vec!["file".into()],
        };
        assert!(unknown.is_bad_config());
        assert!(!StorageError::backend("file", "disk gone").is_bad_config());
    }

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
    fn long_values_are_cut_in_messages() {
        let huge = "d".repeat(10 << 20);
        for e in [
            StorageError::config("backend file", "dir", huge.clone(), "bad"),
            StorageError::io("create directory", &huge)(std::io::Error::other("too long")),
            StorageError::backend("file", huge.clone()),
            StorageError::backend_caused("file", "open", std::io::Error::other(huge.clone())),
            StorageError::ConfigSyntax {
                source_name: huge.clone(),
                reason: "x".into(),
            },
        ] {
            let m = e.to_string();
            assert!(m.len() < 4 * MAX_SHOWN_CHARS, "{} bytes", m.len());
            assert!(m.contains("bytes left out"), "{}", &m[..200]);
        }
        // Multi-byte characters are cut on their boundaries; short text is kept whole.
        let wide = "é".repeat(MAX_SHOWN_CHARS);
        assert!(cut(&wide).starts_with("éé"));
        assert_eq!(cut("short"), "short");
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
