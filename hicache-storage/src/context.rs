//! [`BatchContext`]: what the caller tells a backend about the request a batch belongs to,
//! and [`ContextLog`], a switchable record of the contexts a backend received (for tests and
//! debugging).
//!
//! SGLang passes, with `hicache_storage_pass_prefix_keys` on, the *prefix keys* of each batch:
//! the keys of the pages before the batch's first page in the same request, root first
//! (`HiCacheStorageExtraInfo.prefix_keys`), plus optional extra information. A backend may use
//! them to place a request's pages together (same shard, same file, same server) or to
//! prefetch ahead; it must not change what it answers because of them (contract rule 9 in
//! [`backend`](crate::backend)).

use hicache_core::PageKey;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// The context of one batch. Borrowed from the caller for the call only.
///
/// `prefix_keys` is `None` when the caller does not pass prefix keys
/// (`hicache_storage_pass_prefix_keys` off); `Some(&[])` when it does and the batch starts the
/// request (no page before it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchContext<'a> {
    /// Keys of the pages before the batch's first page in the same request, root first.
    pub prefix_keys: Option<&'a [PageKey]>,
    /// Opaque text from the engine (SGLang's `extra_info`), passed through unchanged.
    pub extra_info: Option<&'a str>,
}

impl<'a> BatchContext<'a> {
    /// No context: what the plain `batch_*` methods mean.
    pub const NONE: BatchContext<'static> = BatchContext {
        prefix_keys: None,
        extra_info: None,
    };

    /// A context carrying the prefix keys of the batch.
    pub fn with_prefix_keys(prefix_keys: &'a [PageKey]) -> Self {
        Self {
            prefix_keys: Some(prefix_keys),
            extra_info: None,
        }
    }

    /// The same context with `extra_info` set.
    pub fn extra_info(mut self, extra_info: &'a str) -> Self {
        self.extra_info = Some(extra_info);
        self
    }

    /// Whether the context carries nothing.
    pub fn is_empty(&self) -> bool {
        self.prefix_keys.is_none() && self.extra_info.is_none()
    }
}

/// An owned copy of the context of one call, as [`ContextLog`] keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeenContext {
    /// The operation: `batch_exists`, `batch_get` or `batch_set`.
    pub op: &'static str,
    /// The keys of the batch.
    pub keys: Vec<PageKey>,
    /// The context's prefix keys.
    pub prefix_keys: Option<Vec<PageKey>>,
    /// The context's extra info.
    pub extra_info: Option<String>,
}

/// A record of the contexts a backend received, off until [`enable`](Self::enable)d (then
/// every call with a non-empty context is kept, and logged at debug level under the target
/// `hicache_storage::context`). Backends embed one to let tests check what arrived.
#[derive(Debug, Default)]
pub struct ContextLog {
    on: AtomicBool,
    seen: Mutex<Vec<SeenContext>>,
}

impl ContextLog {
    /// Turns recording on or off.
    pub fn enable(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// Whether recording is on.
    pub fn is_enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Records the context of one call (nothing when off or when the context is empty).
    pub fn record(&self, op: &'static str, keys: &[PageKey], ctx: BatchContext<'_>) {
        if !self.is_enabled() || ctx.is_empty() {
            return;
        }
        tracing::debug!(
            target: "hicache_storage::context",
            op,
            keys = keys.len(),
            first_key = %keys.first().map(PageKey::to_hex).unwrap_or_default(),
            prefix_keys = ctx.prefix_keys.map_or(-1, |p| p.len() as i64),
            prefix_first = %ctx.prefix_keys.and_then(|p| p.first()).map(PageKey::to_hex).unwrap_or_default(),
            prefix_last = %ctx.prefix_keys.and_then(|p| p.last()).map(PageKey::to_hex).unwrap_or_default(),
            extra_info = ctx.extra_info.unwrap_or(""),
            "batch context"
        );
        self.seen.lock().push(SeenContext {
            op,
            keys: keys.to_vec(),
            prefix_keys: ctx.prefix_keys.map(<[PageKey]>::to_vec),
            extra_info: ctx.extra_info.map(str::to_owned),
        });
    }

    /// The contexts recorded so far, oldest first; the log is emptied.
    pub fn take(&self) -> Vec<SeenContext> {
        std::mem::take(&mut *self.seen.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pattern::{namespace, page_key};

    #[test]
    fn the_log_keeps_only_what_arrives_while_on() {
        let log = ContextLog::default();
        let k: Vec<PageKey> = (0..3).map(|i| page_key(namespace(1), 7, i)).collect();
        log.record(
            "batch_get",
            &k[2..],
            BatchContext::with_prefix_keys(&k[..2]),
        );
        assert!(log.take().is_empty(), "off by default");
        log.enable(true);
        log.record("batch_get", &k[2..], BatchContext::NONE);
        log.record(
            "batch_set",
            &k[2..],
            BatchContext::with_prefix_keys(&k[..2]).extra_info("x"),
        );
        let seen = log.take();
        assert_eq!(
            seen,
            vec![SeenContext {
                op: "batch_set",
                keys: k[2..].to_vec(),
                prefix_keys: Some(k[..2].to_vec()),
                extra_info: Some("x".into()),
            }]
        );
        assert!(log.take().is_empty());
    }
}
