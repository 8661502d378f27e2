//! Async L3 reads of a hybrid model's pages over any [`Storage`]: presence (leading run and
//! per-key), a prefetch's lookup under the hit policy, and reads of one component's pages
//! into the host pool group's slots, zero copy over the slots' iovecs — on the dense
//! controller's helpers ([`present_run`], [`get_batch`]). Writes go through the one backup
//! job (`l3::L3Part::spawn_backup`).
//!
//! Rules:
//! 1. **Presence.** [`leading_run`] asks `batch_exists` batch by batch and stops at the
//!    first absent key ([`present_run`]). [`exists_each`] gives every key's presence with one call per absent
//!    key plus one per batch (each call's leading run, then past the absent key).
//! 2. **Lookup.** [`HybridIo::lookup`] takes KV's leading run over the span, then each
//!    sidecar pool's presence over the pages of that run, only while some length is still
//!    restorable ([`HitWalk`]), and gives the verdict of
//!    [`crate::hybrid::l3_keys::restorable`].
//! 3. **Pages.** A slot's page is its iovecs in the group's flat order (SGLang's piece order),
//!    stored with the component's layout ([`ComponentSpace`]). Bad input (as many keys as
//!    slots, slots inside the pool, a slot of exactly the component's page size) is an error
//!    before any I/O.
//! 4. **Outcomes.** Every page read has its own [`PageOutcome`], in key order. A read is a hit
//!    only when the backend verified the page at the slot's exact length and layout: an
//!    absent, short, over-long, wrong-layout or damaged page is a `Miss` / `Corrupt`
//!    ([`PageResults::misses`]), never a wrong page. A batch call that fails whole fails each
//!    of its pages ([`PageResults::failures`]).

// The facade drives this module; a few accessors and summaries (`restorable`, the layout's
// `page_size` / `deployment` / `components`, `PageResults::misses` …) serve its tests only.
#![allow(dead_code)]

use hicache_core::{PageHash, PageKey};
use hicache_host::{HostComponent, HostPoolGroup, IoVec};
use hicache_storage::{PageError, PageOutcome, STORAGE_BATCH_SIZE, Storage, StorageError};

use super::l3::component_iovecs;
use super::l3_keys::{ComponentSpace, HitPolicy, HitVerdict, HitWalk, HybridL3Layout};
use crate::error::{HiCacheError, Result};
use crate::l3::{Chain, get_batch, present_run};

/// Per-page outcomes of one component's write or read, in key order (rule 4).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageResults {
    /// One outcome per key.
    pub outcomes: Vec<PageOutcome>,
}

impl PageResults {
    /// Pages that achieved their purpose (read: `Hit`; write: `Stored` or `Present`).
    pub fn ok(&self) -> usize {
        self.outcomes.iter().filter(|o| o.is_ok()).count()
    }

    /// Reads that missed: absent, wrong size or layout, or damaged (`Miss`, `Corrupt`).
    pub fn misses(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| matches!(o, PageOutcome::Miss | PageOutcome::Corrupt))
            .count()
    }

    /// Pages that failed (I/O or backend errors, a failed batch).
    pub fn failures(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| matches!(o, PageOutcome::Failed(_)))
            .count()
    }

    /// Appends a batch's outcomes; a batch that failed whole fails each of its `n` pages, and
    /// a backend answering the wrong number of outcomes fails the pages it left out.
    fn push_batch(&mut self, n: usize, r: std::result::Result<Vec<PageOutcome>, StorageError>) {
        match r {
            Ok(mut v) => {
                v.truncate(n);
                let missing = n - v.len();
                self.outcomes.extend(v);
                self.fail(missing, "the backend answered fewer outcomes than keys");
            }
            Err(e) => self.fail(n, &e.to_string()),
        }
    }

    fn fail(&mut self, n: usize, why: &str) {
        let o = PageOutcome::Failed(PageError::Backend(why.to_string()));
        self.outcomes.extend(std::iter::repeat_n(o, n));
    }
}

/// Keys per backend call: the backend's limit, at most SGLang's batch.
pub(crate) fn batch_len(storage: &dyn Storage) -> usize {
    storage.info().max_batch.clamp(1, STORAGE_BATCH_SIZE)
}

/// The number of leading `keys` present in L3 (rule 1); a failed call is an error.
pub(crate) async fn leading_run(storage: &dyn Storage, keys: &[PageKey]) -> Result<usize> {
    let chain = Chain::new(None, keys.iter().copied());
    match present_run(storage, &chain, batch_len(storage)).await {
        (hit, None) => Ok(hit),
        (_, Some((_, e))) => Err(e.into()),
    }
}

/// Whether each of `keys` is present in L3 (rule 1).
pub(crate) async fn exists_each(storage: &dyn Storage, keys: &[PageKey]) -> Result<Vec<bool>> {
    let batch = batch_len(storage);
    let mut present = Vec::with_capacity(keys.len());
    while present.len() < keys.len() {
        let at = present.len();
        let chunk = &keys[at..keys.len().min(at + batch)];
        let n = storage.batch_exists(chunk).await?.min(chunk.len());
        present.extend(std::iter::repeat_n(true, n));
        if n < chunk.len() {
            present.push(false);
        }
    }
    Ok(present)
}

/// The L3 side of one hybrid model: its storage, layout and host pool group (a few borrows,
/// copied into each operation's future).
#[derive(Clone, Copy)]
pub(crate) struct HybridIo<'a> {
    /// The L3 backend.
    pub storage: &'a dyn Storage,
    /// Where each component's pages live.
    pub layout: &'a HybridL3Layout,
    /// The host slots pages move from and to.
    pub group: &'a HostPoolGroup,
}

impl HybridIo<'_> {
    /// A prefetch's lookup over the span `hashes` (rule 2): KV's leading run, then the pools
    /// of `policies` (from [`HybridL3Layout::prefetch_policies`]), in order.
    pub async fn lookup(
        self,
        hashes: &[PageHash],
        policies: &[(HostComponent, HitPolicy)],
    ) -> Result<HitVerdict> {
        let (storage, layout) = (self.storage, self.layout);
        let kv = leading_run(storage, &layout.keys(HostComponent::Kv, hashes)?).await?;
        let mut walk = HitWalk::new(kv);
        for &(component, policy) in policies {
            let present = if walk.exhausted() {
                Vec::new()
            } else {
                exists_each(storage, &layout.keys(component, &hashes[..kv])?).await?
            };
            walk.pool(policy, &present);
        }
        Ok(walk.finish())
    }

    /// Reads the pages `keys` of `component` from L3 into host `slots` (paired in order;
    /// rule 3), batch by batch; one outcome per page (rule 4). A slot whose page missed or
    /// failed holds no usable bytes.
    ///
    /// # Safety
    /// The caller must be the only user of the slots (distinct slots, nobody reading or
    /// writing them) until the returned future completes or is dropped.
    pub async unsafe fn read_pages(self, pages: ComponentPages<'_>) -> Result<PageResults> {
        let (space, iovs) = slot_iovecs(self.layout, self.group, pages)?;
        let mut unique = pages.slots.to_vec();
        unique.sort_unstable();
        if unique.windows(2).any(|w| w[0] == w[1]) {
            return Err(HiCacheError::BadArgument(format!(
                "a read into {} slots {:?} names a slot twice",
                pages.component, pages.slots
            )));
        }
        let chain = Chain::new(None, pages.keys.iter().copied());
        let batch = batch_len(self.storage);
        let mut results = PageResults::default();
        for at in (0..iovs.len()).step_by(batch) {
            let end = (at + batch).min(iovs.len());
            // SAFETY: distinct checked slots inside the group's mappings, alive for the
            // borrow of the group; the caller is their only user (the contract).
            let got = unsafe { get_batch(self.storage, space.layout, &chain, at, &iovs[at..end]) };
            results.push_batch(end - at, got.await);
        }
        Ok(results)
    }
}

/// Pages of one component to move: `keys[i]` is the page of host slot `slots[i]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ComponentPages<'a> {
    /// The component.
    pub component: HostComponent,
    /// The pages' keys.
    pub keys: &'a [PageKey],
    /// The component's host slots, one per key.
    pub slots: &'a [u32],
}

/// The space of the pages' component and the iovecs of their slots, checked (rule 3).
fn slot_iovecs(
    layout: &HybridL3Layout,
    group: &HostPoolGroup,
    pages: ComponentPages<'_>,
) -> Result<(ComponentSpace, Vec<Vec<IoVec>>)> {
    let (component, slots) = (pages.component, pages.slots);
    let space = *layout.space(component)?;
    let keys = pages.keys.len();
    if keys != slots.len() {
        return Err(HiCacheError::BadArgument(format!(
            "{keys} {component} keys for {} slots",
            slots.len()
        )));
    }
    let iovs = slots
        .iter()
        .map(|&slot| component_iovecs(group, component, space.page_bytes, slot))
        .collect::<Result<_>>()?;
    Ok((space, iovs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hybrid::l3::ComponentSource;
    use crate::hybrid::l3_keys::restorable;
    use crate::hybrid::l3_keys::tests::{group, mamba_shape, sglang_layout};
    use crate::l3::L3Engine;
    use hicache_core::HostSlot;
    use hicache_core::{DType, LayoutKind};
    use hicache_storage::{
        BackendInfo, MemoryBackend, MemoryOptions, PageBuf, PageBufMut, StorageExt, StorageStats,
        async_trait,
    };
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    fn io<'a>(
        storage: &'a dyn Storage,
        layout: &'a HybridL3Layout,
        group: &'a HostPoolGroup,
    ) -> HybridIo<'a> {
        HybridIo {
            storage,
            layout,
            group,
        }
    }

    fn pages<'a>(
        component: HostComponent,
        keys: &'a [PageKey],
        slots: &'a [u32],
    ) -> ComponentPages<'a> {
        ComponentPages {
            component,
            keys,
            slots,
        }
    }

    const KV: HostComponent = HostComponent::Kv;
    const SWA: HostComponent = HostComponent::Swa;
    const MAMBA: HostComponent = HostComponent::Mamba;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A memory backend taking `max_batch` keys per call (to cross batch boundaries).
    fn memory(max_batch: usize) -> Arc<dyn Storage> {
        Arc::new(MemoryBackend::new(MemoryOptions {
            max_batch,
            ..MemoryOptions::default()
        }))
    }

    #[cfg(feature = "file")]
    fn file(dir: &std::path::Path) -> Arc<dyn Storage> {
        let mut o = hicache_backend_local::FileOptions::new(dir);
        o.capacity_bytes = Some(64 << 20);
        Arc::new(hicache_backend_local::FileBackend::open(o).unwrap())
    }

    /// The layout of a group with every component (SWA `layer_first`), window 2 pages.
    fn setup() -> (Arc<HostPoolGroup>, HybridL3Layout) {
        let g = Arc::new(group(LayoutKind::LayerFirst, true, true));
        let l = sglang_layout(&g, Some(8));
        (g, l)
    }

    /// Writes `p` to L3 through the backup engine (the controllers' one write path): the
    /// pages stored (or present) and the first error.
    fn store(
        storage: &Arc<dyn Storage>,
        g: &Arc<HostPoolGroup>,
        l: &HybridL3Layout,
        p: ComponentPages<'_>,
    ) -> (usize, Option<String>) {
        let space = *l.space(p.component).unwrap();
        let engine = L3Engine::new(storage.clone(), crate::l3::new_runtime().unwrap(), None);
        let source = ComponentSource {
            group: g.clone(),
            component: p.component,
            page_bytes: space.page_bytes,
        };
        let slots = p.slots.iter().map(|&s| HostSlot(s)).collect();
        let chain = Chain::new(None, p.keys.iter().copied());
        let shared = engine.backup(Arc::new(source), chain, slots, space.layout);
        engine.flush();
        shared.done.wait();
        engine.close();
        let stored = shared.stored_pages.load(Ordering::Relaxed) as usize;
        (stored, shared.error.lock().clone())
    }

    /// Fills `slot` of `c` with bytes derived from `seed`; returns them.
    fn fill(g: &HostPoolGroup, c: HostComponent, slot: u32, seed: u8) -> Vec<u8> {
        let data: Vec<u8> = (0..g.slot_bytes(c).unwrap())
            .map(|i| seed.wrapping_mul(31).wrapping_add((i % 251) as u8))
            .collect();
        g.set(c, slot, &data).unwrap();
        data
    }

    fn get(g: &HostPoolGroup, c: HostComponent, slot: u32) -> Vec<u8> {
        let mut v = vec![0; g.slot_bytes(c).unwrap()];
        g.get(c, slot, &mut v).unwrap();
        v
    }

    /// A node of 3 pages backed up per component as SGLang does (KV 3 pages, SWA its 2 host
    /// pages, Mamba its state), read back into other slots: every page a hit, byte for byte,
    /// stored in the group's flat (SGLang piece) order under the component's layout.
    #[cfg(feature = "file")]
    #[test]
    fn components_round_trip_through_the_file_backend() {
        let dir = tempfile::tempdir().unwrap();
        let storage = file(dir.path());
        let (g, l) = setup();
        let tokens: Vec<u32> = (0..12).collect();
        let hashes = l.chain(None, &tokens);
        let plan = [
            (KV, vec![0, 1, 2], vec![3, 4, 5]),
            (SWA, vec![0, 1], vec![5, 6]),
            (MAMBA, vec![0], vec![2]),
        ];
        for (c, src, dst) in &plan {
            let want: Vec<Vec<u8>> = src
                .iter()
                .map(|&s| fill(&g, *c, s, s as u8 + *c as u8 * 7))
                .collect();
            let keys = l.backup_keys(*c, &hashes, src.len()).unwrap();
            let rt = runtime();
            let w = store(&storage, &g, &l, pages(*c, &keys, src));
            assert_eq!(w, (src.len(), None), "{c}");
            let space = l.space(*c).unwrap();
            for (k, bytes) in keys.iter().zip(&want) {
                let raw = rt
                    .block_on(storage.get(space.layout, bytes.len(), *k))
                    .unwrap();
                assert_eq!(raw.as_deref(), Some(&bytes[..]), "{c}: stored bytes");
            }
            // SAFETY: as above.
            let r = rt
                .block_on(unsafe { io(&*storage, &l, &g).read_pages(pages(*c, &keys, dst)) })
                .unwrap();
            assert_eq!(
                (r.ok(), r.misses(), r.failures()),
                (dst.len(), 0, 0),
                "{c}: {r:?}"
            );
            for (&d, bytes) in dst.iter().zip(&want) {
                assert_eq!(&get(&g, *c, d), bytes, "{c} slot {d}");
            }
        }
    }

    /// Presence per key and in a leading run, across batch boundaries, with holes.
    #[test]
    fn presence_matches_what_was_written() {
        let storage = memory(3);
        let (g, l) = setup();
        let hashes = l.chain(None, &(0..40).collect::<Vec<u32>>());
        let present = [
            true, true, false, true, true, true, true, false, true, false,
        ];
        let written: Vec<PageKey> = l
            .keys(MAMBA, &hashes)
            .unwrap()
            .into_iter()
            .zip(present)
            .filter_map(|(k, p)| p.then_some(k))
            .collect();
        let rt = runtime();
        fill(&g, MAMBA, 0, 1);
        let slots = vec![0; written.len()];
        let w = store(&storage, &g, &l, pages(MAMBA, &written, &slots));
        assert_eq!(w, (written.len(), None));
        let keys = l.keys(MAMBA, &hashes).unwrap();
        assert_eq!(rt.block_on(exists_each(&*storage, &keys)).unwrap(), present);
        assert_eq!(rt.block_on(leading_run(&*storage, &keys)).unwrap(), 2);
        assert_eq!(rt.block_on(leading_run(&*storage, &keys[3..])).unwrap(), 4);
        assert_eq!(
            rt.block_on(exists_each(&*storage, &[])).unwrap(),
            Vec::<bool>::new()
        );
        // Other components' namespaces hold none of them.
        let kv = l.keys(KV, &hashes).unwrap();
        assert_eq!(
            rt.block_on(exists_each(&*storage, &kv)).unwrap(),
            [false; 10]
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Per-key presence and the leading run equal what was written, for any batch size.
        #[test]
        fn presence_matches_a_model(
            present in proptest::collection::vec(proptest::bool::weighted(0.7), 0..40),
            max_batch in 1usize..6,
        ) {
            let storage = memory(max_batch);
            let (g, l) = setup();
            let hashes = l.chain(None, &(0..4 * present.len() as u32).collect::<Vec<u32>>());
            let rt = runtime();
            write_pattern(&storage, &g, &l, KV, &hashes, &present);
            let keys = l.keys(KV, &hashes).unwrap();
            let lead = present.iter().take_while(|&&p| p).count();
            proptest::prop_assert_eq!(rt.block_on(exists_each(&*storage, &keys)).unwrap(), present);
            proptest::prop_assert_eq!(rt.block_on(leading_run(&*storage, &keys)).unwrap(), lead);
        }
    }

    /// Writes `present` pages of `c` over `hashes` from one slot.
    fn write_pattern(
        storage: &Arc<dyn Storage>,
        g: &Arc<HostPoolGroup>,
        l: &HybridL3Layout,
        c: HostComponent,
        hashes: &[PageHash],
        present: &[bool],
    ) {
        let keys: Vec<PageKey> = l
            .keys(c, hashes)
            .unwrap()
            .into_iter()
            .zip(present)
            .filter_map(|(k, &p)| p.then_some(k))
            .collect();
        fill(g, c, 7.min(g.capacity(c).unwrap() as u32 - 1), 3);
        let slots = vec![7.min(g.capacity(c).unwrap() as u32 - 1); keys.len()];
        assert_eq!(
            store(storage, g, l, pages(c, &keys, &slots)),
            (keys.len(), None)
        );
    }

    /// A lookup over storage gives the hit policy's verdict over the same presence, and
    /// asks a pool only while some length is restorable.
    #[test]
    fn lookup_applies_the_hit_policy() {
        let (f, t) = (false, true);
        let (g, l) = setup();
        let hashes = l.chain(None, &(0..32).collect::<Vec<u32>>());
        let kv = [t, t, t, t, t, t, f, t];
        let swa = [t, f, t, t, f, t, t, t];
        let mamba = [f, t, f, t, f, t, f, t];
        let rt = runtime();
        let storage = memory(2);
        write_pattern(&storage, &g, &l, KV, &hashes, &kv);
        write_pattern(&storage, &g, &l, SWA, &hashes, &swa);
        write_pattern(&storage, &g, &l, MAMBA, &hashes, &mamba);
        let policies = l.prefetch_policies(8, false);
        assert_eq!(
            policies,
            vec![
                (SWA, HitPolicy::TrailingPages { window: 2 }),
                (MAMBA, HitPolicy::TrailingPages { window: 1 })
            ]
        );
        let got = rt
            .block_on(io(&*storage, &l, &g).lookup(&hashes, &policies))
            .unwrap();
        let want = restorable(
            6,
            &[(policies[0].1, &swa[..6]), (policies[1].1, &mamba[..6])],
        );
        assert_eq!(got, want);
        // KV's run is 6; SWA (window 2) restores {1, 4}, Mamba {2, 4, 6}: the hit is 4.
        assert_eq!(
            (got.kv_pages, got.hit_pages, got.pool_hits.clone()),
            (6, 4, vec![4, 6])
        );
        assert_eq!(got.restorable, vec![4]);
        // Without the Mamba states at 4 and 6 nothing is restorable.
        let none = rt
            .block_on(io(&*storage, &l, &g).lookup(&hashes[..3], &policies))
            .unwrap();
        assert_eq!((none.kv_pages, none.hit_pages), (3, 0));
    }

    /// A page stored at another size or layout, or damaged, is a counted miss and never a
    /// hit; the other pages of the batch are unaffected.
    #[test]
    fn wrong_size_layout_or_damaged_pages_are_misses() {
        let memory = Arc::new(MemoryBackend::new(MemoryOptions::default()));
        let storage: Arc<dyn Storage> = memory.clone();
        let (g, l) = setup();
        let hashes = l.chain(None, &(0..20).collect::<Vec<u32>>());
        let keys = l.keys(MAMBA, &hashes).unwrap();
        let rt = runtime();
        let good = fill(&g, MAMBA, 0, 9);
        let layout = l.space(MAMBA).unwrap().layout;
        let short = vec![1u8; good.len() - 4];
        let long = vec![1u8; good.len() + 4];
        rt.block_on(async {
            storage.put(layout, keys[0], &short).await.unwrap();
            storage.put(layout, keys[1], &long).await.unwrap();
            storage
                .put(LayoutKind::LayerFirst, keys[2], &good)
                .await
                .unwrap();
            storage.put(layout, keys[3], &good).await.unwrap();
            storage.put(layout, keys[4], &good).await.unwrap();
        });
        assert!(memory.corrupt_page(&keys[4]));
        // SAFETY: the test is the slots' only user.
        let r = rt
            .block_on(unsafe {
                io(&*storage, &l, &g).read_pages(pages(MAMBA, &keys, &[0, 1, 2, 3]))
            })
            .unwrap_err();
        assert!(r.to_string().contains("5 mamba keys for 4 slots"), "{r}");
        // SAFETY: as above.
        let r = rt
            .block_on(unsafe {
                io(&*storage, &l, &g).read_pages(pages(MAMBA, &keys[..4], &[0, 1, 2, 3]))
            })
            .unwrap();
        assert_eq!(
            r.outcomes[..3],
            [PageOutcome::Miss, PageOutcome::Miss, PageOutcome::Miss]
        );
        assert_eq!(
            (r.outcomes[3].clone(), r.misses(), r.ok()),
            (PageOutcome::Hit, 3, 1)
        );
        assert_eq!(get(&g, MAMBA, 3), good);
        // SAFETY: as above.
        let r = rt
            .block_on(unsafe { io(&*storage, &l, &g).read_pages(pages(MAMBA, &keys[4..5], &[1])) })
            .unwrap();
        assert_eq!(
            (r.outcomes.clone(), r.misses()),
            (vec![PageOutcome::Corrupt], 1)
        );
    }

    /// A KV pool as [`group`]'s beside a Mamba pool of one more conv element per layer.
    fn other_mamba_group() -> HostPoolGroup {
        use hicache_host::{HostPoolConfig, HostPoolGroupConfig, MambaPoolConfig, PoolSize};
        let shape = mamba_shape(2, 32, DType::F32, &[18, 6]);
        let kv = group(LayoutKind::PageFirst, false, false).kv().shape();
        let cfg = HostPoolGroupConfig::new(HostPoolConfig::new(
            kv,
            LayoutKind::PageFirst,
            PoolSize::Pages(2),
        ))
        .mamba(MambaPoolConfig::new(shape, PoolSize::Pages(2)))
        .reserve_bytes(0);
        HostPoolGroup::new(cfg).unwrap()
    }

    #[test]
    fn bad_input_is_refused_before_any_io() {
        let storage = memory(4);
        let (g, l) = setup();
        let hashes = l.chain(None, &(0..8).collect::<Vec<u32>>());
        let keys = l.keys(SWA, &hashes).unwrap();
        let rt = runtime();
        let err = |r: Result<PageResults>| r.unwrap_err().to_string();
        // SAFETY: every read is refused before touching a slot.
        unsafe {
            assert!(
                err(rt.block_on(io(&*storage, &l, &g).read_pages(pages(SWA, &keys, &[0]))))
                    .contains("2 swa keys for 1 slots")
            );
            assert!(
                err(rt.block_on(io(&*storage, &l, &g).read_pages(pages(SWA, &keys, &[0, 8]))))
                    .contains("swa host pool")
            );
            assert!(
                err(rt.block_on(io(&*storage, &l, &g).read_pages(pages(SWA, &keys, &[3, 3]))))
                    .contains("names a slot twice")
            );
            let plain = group(LayoutKind::PageFirst, false, false);
            let kv_only = sglang_layout(&plain, None);
            assert!(
                err(
                    rt.block_on(io(&*storage, &kv_only, &plain).read_pages(pages(MAMBA, &[], &[])))
                )
                .contains("no mamba")
            );
        }
        // A backup of a slot outside the pool, or of a layout of another group (its Mamba
        // pages are not this group's slots), stores nothing and says why.
        let (stored, e) = store(&storage, &g, &l, pages(SWA, &keys, &[0, 8]));
        assert_eq!(stored, 0);
        assert!(e.unwrap().contains("swa host pool"));
        let ol = sglang_layout(&other_mamba_group(), None);
        let mk = ol.keys(MAMBA, &hashes[..1]).unwrap();
        let (stored, e) = store(&storage, &g, &ol, pages(MAMBA, &mk, &[0]));
        assert_eq!(stored, 0);
        assert!(e.unwrap().contains("holds 348 bytes, its pages 352"));
        assert_eq!(storage.stats().set_pages, 0);
    }

    /// A backend whose every call fails.
    struct Down;

    #[async_trait]
    impl Storage for Down {
        fn info(&self) -> BackendInfo {
            BackendInfo::new("down", 2)
        }
        async fn batch_exists(&self, _: &[PageKey]) -> hicache_storage::Result<usize> {
            Err(StorageError::backend("down", "unreachable"))
        }
        async fn batch_get(
            &self,
            _: &[PageKey],
            _: &mut [PageBufMut<'_>],
        ) -> hicache_storage::Result<Vec<PageOutcome>> {
            Err(StorageError::backend("down", "unreachable"))
        }
        async fn batch_set(
            &self,
            _: &[PageKey],
            _: &[PageBuf<'_>],
        ) -> hicache_storage::Result<Vec<PageOutcome>> {
            Err(StorageError::backend("down", "unreachable"))
        }
        async fn delete(&self, _: &[PageKey]) -> hicache_storage::Result<usize> {
            Ok(0)
        }
        fn stats(&self) -> StorageStats {
            StorageStats::default()
        }
    }

    /// A failed batch call fails each of its pages; presence errors are errors.
    #[test]
    fn a_failing_backend_fails_each_page() {
        let (g, l) = setup();
        let hashes = l.chain(None, &(0..12).collect::<Vec<u32>>());
        let keys = l.keys(KV, &hashes).unwrap();
        let rt = runtime();
        let down: Arc<dyn Storage> = Arc::new(Down);
        let (stored, e) = store(&down, &g, &l, pages(KV, &keys, &[0, 1, 2]));
        assert_eq!(stored, 0);
        assert!(e.unwrap().contains("unreachable"));
        // SAFETY: the test is the slots' only user.
        let r = rt
            .block_on(unsafe { io(&Down, &l, &g).read_pages(pages(KV, &keys, &[3, 4, 5])) })
            .unwrap();
        assert_eq!((r.failures(), r.misses()), (3, 0));
        assert!(rt.block_on(exists_each(&Down, &keys)).is_err());
        assert!(rt.block_on(leading_run(&Down, &keys)).is_err());
        assert!(rt.block_on(io(&Down, &l, &g).lookup(&hashes, &[])).is_err());
    }

    /// The helpers run as tasks of a multi-threaded runtime, owning `Arc`s of the storage,
    /// the layout and the group (as a controller spawns them).
    #[test]
    fn operations_run_as_spawned_tasks() {
        let (g, l) = setup();
        let (l, storage) = (Arc::new(l), memory(4));
        let want = fill(&g, SWA, 1, 5);
        let hashes = l.chain(None, &(0..8).collect::<Vec<u32>>());
        let keys = l.backup_keys(SWA, &hashes, 1).unwrap();
        assert_eq!(store(&storage, &g, &l, pages(SWA, &keys, &[1])), (1, None));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        let task = {
            let (g, l, storage) = (g.clone(), l.clone(), storage.clone());
            rt.spawn(async move {
                let io = io(&*storage, &l, &g);
                // SAFETY: this task is the only user of SWA slot 2.
                let r = unsafe { io.read_pages(pages(SWA, &keys, &[2])) }.await?;
                let policies = l.prefetch_policies(2, true);
                Ok::<_, HiCacheError>((r.ok(), io.lookup(&hashes, &policies).await?))
            })
        };
        let (read, verdict) = rt.block_on(task).unwrap().unwrap();
        assert_eq!(read, 1);
        assert_eq!(get(&g, SWA, 2), want);
        // No KV page was written: nothing is restorable.
        assert_eq!(verdict.hit_pages, 0);
    }
}
