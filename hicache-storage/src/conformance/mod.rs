//! The public conformance suite: every rule of the [`Storage`] contract, as test cases any
//! backend crate runs against itself.
//!
//! The [`Harness`] trait is always compiled (a backend crate may ship its harness in its
//! library); the cases, `run_case` / `run_all` and `conformance_tests!` need the feature
//! `testing`, which only test builds enable.
//!
//! A backend provides a [`Harness`] (how to open a fresh, empty instance, how to damage a stored
//! page behind the backend's back, and for persistent backends how to reopen one) and invokes
//! `conformance_tests!` in a test file, which expands to one
//! `#[test]` per `Case`:
//!
//! ```text
//! // tests/conformance.rs of a backend crate
//! hicache_storage::conformance_tests!(my_backend::tests::Harness::new());
//! ```
//!
//! A backend that does not persist declares it (`conformance_tests!(MyHarness, not_persistent)`):
//! its `restart` test is then not generated (it does not apply) rather than passing without
//! checking anything, and a `not_persistent_as_declared` test checks the declaration.
//!
//! Or drive cases directly with `run_case` / `run_all`, which say for each case whether it
//! was checked or did not apply. Cases panic with a message naming the rule broken; they never
//! depend on timing. See `docs/backend-authors.md` for a worked
//! example.

use std::sync::Arc;

use async_trait::async_trait;
use hicache_core::PageKey;

use crate::backend::Storage;
use crate::context::SeenContext;
use crate::error::Result;

#[cfg(feature = "testing")]
mod suite;
#[cfg(feature = "testing")]
pub use suite::*;

/// How the suite opens and damages instances of a backend.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The backend type (`dyn Storage` works for backends loaded at run time).
    type Backend: Storage + ?Sized;

    /// Opens a fresh, empty instance. `capacity_bytes` is the capacity to configure; `None`
    /// asks for room for at least 256 MiB of pages.
    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<Self::Backend>>;

    /// Damages the stored data of `key` (flips a byte of the page's bytes) behind the backend's
    /// back, as a disk or memory fault would. Returns `Ok(false)` if the page is absent.
    async fn corrupt(&self, backend: &Self::Backend, key: &PageKey) -> Result<bool>;

    /// For persistent backends: drops `backend` and opens the same storage again, as after a
    /// restart. `Ok(None)` (the default) means the backend does not persist.
    async fn reopen(&self, backend: Arc<Self::Backend>) -> Result<Option<Arc<Self::Backend>>> {
        drop(backend);
        Ok(None)
    }

    /// For backends that record the [`BatchContext`](crate::BatchContext)s they receive (rule 9): the contexts
    /// received since the last call, oldest first (the record is emptied). `None` (the
    /// default) means the backend does not record them; the batch-context case then checks
    /// only that a context changes no answer.
    async fn contexts_seen(&self, backend: &Self::Backend) -> Option<Vec<SeenContext>> {
        let _ = backend;
        None
    }
}
