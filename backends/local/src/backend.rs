//! The one generic backend: [`LocalBackend`] implements the storage contract once over any
//! [`Layout`] (batch limits, the read-only guard, blocking work moved off the async
//! runtime, counters, stats), and [`Factory`] registers any layout under its name. A layout
//! supplies only what lies on disk: how it opens, finds, reads, writes and forgets pages.

use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;

use async_trait::async_trait;
use hicache_storage::backend::bump;
use hicache_storage::lifecycle::Clock;
use hicache_storage::{
    BackendContext, BackendFactory, BackendInfo, CommonConfig, ConfigFields, MemoryRegion,
    NamespaceId, Outcomes, PageBuf, PageBufMut, PageKey, PageOutcome, Registry, Result, Storage,
    StorageStats, check_batch,
};
use tracing::instrument;

use crate::common::{Core, PageCount, open_in_background};
use crate::io::par;

/// What a layout tells [`Storage::info`] beyond its name and capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Largest batch accepted.
    pub max_batch: usize,
    /// Whether pages move without a copy (O_DIRECT from the caller's memory).
    pub zero_copy: bool,
    /// Whether several processes may share the directory.
    pub shared: bool,
    /// Largest page it can hold.
    pub max_page_bytes: usize,
}

/// How pages lie on disk; the generic [`LocalBackend`] drives it. Every method but
/// [`open_with_clock`](Layout::open_with_clock) runs on a thread that may block.
pub trait Layout: Send + Sync + Sized + 'static {
    /// The registry name (`file`, `uring`).
    const NAME: &'static str;
    /// The layout's options (extra-config fields).
    type Options: Send + 'static;

    /// Reads the options from the common config and the backend's fields; `ctx` gives the
    /// engine's page size.
    fn options(
        common: &CommonConfig,
        fields: ConfigFields,
        ctx: &BackendContext,
    ) -> Result<Self::Options>;

    /// Opens (creating if needed) the storage directory, recovering what a previous run
    /// committed, with the clock page expiry (`ttl_s`) is measured with. Blocking.
    fn open_with_clock(opts: Self::Options, clock: Clock) -> Result<Self>;

    /// Limits and properties for [`Storage::info`].
    fn shape(&self) -> Shape;

    /// The layout's page index.
    type Index: PageCount;

    /// The read-only guard, the counters, the capacity and the index.
    fn core(&self) -> &Core<Self::Index>;

    /// The length of the leading run of `keys` present (and not expired).
    fn exists(&self, keys: &[PageKey]) -> usize;

    /// Reads `keys` into `dst`, setting each page's outcome in `out`.
    fn get(&self, keys: &[PageKey], dst: &mut [PageBufMut<'_>], out: &mut Outcomes);

    /// Writes `src` as `keys`; `Stored` means committed.
    fn set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Vec<PageOutcome>;

    /// Deletes `keys`; returns how many were present.
    fn delete(&self, keys: &[PageKey]) -> usize;

    /// Deletes every page of `namespace`; returns how many.
    fn clear(&self, namespace: NamespaceId) -> Result<u64>;

    /// Takes the caller's long-lived memory region (the host pool) once.
    fn register_memory(&self, region: MemoryRegion) -> Result<()> {
        let _ = region;
        Ok(())
    }
}

/// A local-disk backend over the layout `L` ([`FileBackend`](crate::FileBackend),
/// [`UringBackend`](crate::UringBackend)). It dereferences to the layout for its own
/// accessors (open report, paths, I/O counters).
pub struct LocalBackend<L>(pub(crate) L);

impl<L: Layout> std::fmt::Debug for LocalBackend<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let core = self.0.core();
        f.debug_struct("LocalBackend")
            .field("layout", &L::NAME)
            .field("dir", &core.guard.dir())
            .field("capacity", &core.capacity)
            .finish_non_exhaustive()
    }
}

impl<L: Layout> LocalBackend<L> {
    /// Opens (creating if needed) the storage directory of `opts`, recovering what a
    /// previous run committed. Blocking: it scans the directory or replays the index log.
    pub fn open(opts: L::Options) -> Result<Self> {
        Self::open_with_clock(opts, Clock::system())
    }

    /// [`open`](Self::open) with the clock page expiry (`ttl_s`) is measured with: tests
    /// pass a [`Clock::manual`] and age pages by advancing it, without sleeping.
    pub fn open_with_clock(opts: L::Options, clock: Clock) -> Result<Self> {
        L::open_with_clock(opts, clock).map(Self)
    }
}

impl<L> Deref for LocalBackend<L> {
    type Target = L;

    fn deref(&self) -> &L {
        &self.0
    }
}

#[async_trait]
impl<L: Layout> Storage for LocalBackend<L> {
    fn info(&self) -> BackendInfo {
        let s = self.0.shape();
        let mut i = BackendInfo::new(L::NAME, s.max_batch);
        i.zero_copy = s.zero_copy;
        i.persistent = true;
        i.shared = s.shared;
        i.capacity_bytes = Some(self.0.core().capacity);
        i.max_page_bytes = s.max_page_bytes;
        i.clear = !self.0.core().guard.read_only();
        i
    }

    #[instrument(name = "local.batch_exists", skip_all, fields(backend = L::NAME, pages = keys.len()))]
    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch(
            "batch_exists",
            self.0.shape().max_batch,
            keys.len(),
            keys.len(),
        )?;
        let hits = self.0.exists(keys);
        self.0
            .core()
            .counters
            .record_exists((hits + 1).min(keys.len()), hits);
        Ok(hits)
    }

    #[instrument(name = "local.batch_get", skip_all, fields(backend = L::NAME, pages = keys.len()))]
    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>> {
        check_batch("batch_get", self.0.shape().max_batch, keys.len(), dst.len())?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let out = par::blocking(|| {
            let mut out = Outcomes::new(keys.len());
            self.0.get(keys, dst, &mut out);
            out.finish()
        });
        self.0
            .core()
            .counters
            .record_get(&out, dst.iter().map(|d| d.len()));
        Ok(out)
    }

    #[instrument(name = "local.batch_set", skip_all, fields(backend = L::NAME, pages = keys.len()))]
    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", self.0.shape().max_batch, keys.len(), src.len())?;
        self.0.core().guard.check("batch_set")?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let out = par::blocking(|| self.0.set(keys, src));
        self.0
            .core()
            .counters
            .record_set(&out, src.iter().map(|p| p.len()));
        Ok(out)
    }

    fn register_memory(&self, region: MemoryRegion) -> Result<()> {
        self.0.register_memory(region)
    }

    #[instrument(name = "local.delete", skip_all, fields(backend = L::NAME, pages = keys.len()))]
    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        self.0.core().guard.check("delete")?;
        let n = par::blocking(|| self.0.delete(keys));
        bump(&self.0.core().counters.deleted_pages, n as u64);
        Ok(n)
    }

    #[instrument(name = "local.clear", skip_all, fields(backend = L::NAME))]
    async fn clear(&self, namespace: NamespaceId) -> Result<u64> {
        self.0.core().guard.check("clear")?;
        let n = par::blocking(|| self.0.clear(namespace))?;
        bump(&self.0.core().counters.cleared_pages, n);
        Ok(n)
    }

    fn stats(&self) -> StorageStats {
        let core = self.0.core();
        let (pages, bytes) = {
            let ix = core.index.lock();
            (ix.pages(), ix.bytes())
        };
        core.counters.snapshot(pages, bytes, Some(core.capacity))
    }
}

/// Registers the layout `L` under its name ([`Layout::NAME`]).
pub struct Factory<L>(PhantomData<fn() -> L>);

impl<L: Layout> std::fmt::Debug for Factory<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Factory").field(&L::NAME).finish()
    }
}

impl<L> Default for Factory<L> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<L: Layout> Factory<L> {
    /// Adds the layout to `registry` (one call, as any third-party backend would).
    pub fn register(registry: &Registry) -> Result<()> {
        registry.register(Self::default())
    }
}

#[async_trait]
impl<L: Layout> BackendFactory for Factory<L> {
    fn name(&self) -> &str {
        L::NAME
    }

    async fn open(
        &self,
        common: &CommonConfig,
        fields: ConfigFields,
        ctx: &BackendContext,
    ) -> Result<Arc<dyn Storage>> {
        let opts = L::options(common, fields, ctx)?;
        open_in_background(L::NAME, move || LocalBackend::<L>::open(opts)).await
    }
}
