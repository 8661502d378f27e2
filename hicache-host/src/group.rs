//! [`HostPoolGroup`]: the host pools of a hybrid model: the KV pool of the full-attention
//! layers plus sidecar pools of their own geometry: the sliding-window KV pool (a
//! [`HostPool`] of the SWA layers, its own layer count and page count) and the Mamba state
//! pool ([`MambaPool`], one state per slot), as SGLang's `HostPoolGroup` holds them.
//!
//! Rules:
//! 1. Each component owns its pool, its allocator and its mapping (one region each, to
//!    register once with CUDA / io_uring / RDMA: [`HostPoolGroup::regions`]). A slot index
//!    means a page of the KV or SWA pool, or a state slot of the Mamba pool.
//! 2. The RAM check covers the whole group: the sum of every component's bytes must fit in
//!    the available memory once the reserve is kept free, before anything is mapped.
//! 3. The flat bytes of a slot, and the order of its iovecs, are what SGLang's host pool of
//!    that component stores, so pages can be exchanged with SGLang byte for byte: the KV
//!    pool's flat page ([`HostPool::get_page`]); the SWA pool's pieces in SGLang's order (for
//!    `layer_first`, `K_l, V_l` for each layer `l`: SGLang's `get_page_buffer_meta` for a
//!    sidecar pool); the Mamba slot's pieces (temporal, then each conv).
//! 4. Errors of a component's pool name the component ([`HostError::Component`]) and, through
//!    their source, the slot.

use std::sync::Arc;

use hicache_core::{HostSlot, KvKind, LayoutKind, MemoryRegion, PoolFingerprint};

use crate::component::HostComponent;
use crate::error::{HostError, Result};
use crate::mamba::{MambaPool, MambaPoolConfig, MambaSlot};
use crate::pool::{self, HostPool, HostPoolConfig, IoVec};

/// Everything needed to build a [`HostPoolGroup`].
#[derive(Clone, Debug, PartialEq)]
pub struct HostPoolGroupConfig {
    /// The full-attention KV pool (its own reserve is ignored: the group's applies).
    pub kv: HostPoolConfig,
    /// The sliding-window KV pool, if the model has SWA layers.
    pub swa: Option<HostPoolConfig>,
    /// The Mamba state pool, if the model has linear-attention layers.
    pub mamba: Option<MambaPoolConfig>,
    /// Bytes of RAM that must stay available once the whole group is mapped; `None` for
    /// `min(DEFAULT_RESERVE_BYTES, MemTotal / 4)`.
    pub reserve_bytes: Option<u64>,
    /// When every pool of the group is populated; `None`: as each component's config says.
    pub populate: Option<crate::Populate>,
}

impl HostPoolGroupConfig {
    /// A group of the KV pool alone, with the default reserve.
    pub fn new(kv: HostPoolConfig) -> Self {
        Self {
            kv,
            swa: None,
            mamba: None,
            reserve_bytes: None,
            populate: None,
        }
    }

    /// Adds the sliding-window KV pool.
    pub fn swa(mut self, swa: HostPoolConfig) -> Self {
        self.swa = Some(swa);
        self
    }

    /// Adds the Mamba state pool.
    pub fn mamba(mut self, mamba: MambaPoolConfig) -> Self {
        self.mamba = Some(mamba);
        self
    }

    /// Sets when every pool of the group is populated (overriding the components' own
    /// setting, whenever they are added).
    pub fn populate(mut self, populate: crate::Populate) -> Self {
        self.populate = Some(populate);
        self
    }

    /// Sets the RAM reserve of the group.
    pub fn reserve_bytes(mut self, bytes: u64) -> Self {
        self.reserve_bytes = Some(bytes);
        self
    }

    /// Bytes the group maps (rule 2), checked for every component.
    pub fn total_bytes(&self) -> Result<u64> {
        let kv_like = |c: HostComponent, cfg: &HostPoolConfig| {
            let pages = cfg.size.pages(&cfg.shape).map_err(|e| wrap(c, e))?;
            let layout = crate::HostLayout::new(cfg.shape, cfg.layout, pages);
            Ok::<_, HostError>(layout.map_err(|e| wrap(c, e))?.total_bytes() as u64)
        };
        let mut total = kv_like(HostComponent::Kv, &self.kv)?;
        if let Some(swa) = &self.swa {
            total += kv_like(HostComponent::Swa, swa)?;
        }
        if let Some(m) = &self.mamba {
            let slots = m.slots().map_err(|e| wrap(HostComponent::Mamba, e))?;
            let bytes = m.mapped_bytes(slots).ok_or_else(|| {
                wrap(
                    HostComponent::Mamba,
                    HostError::BadSize(format!("{slots} slots overflow")),
                )
            })?;
            total += bytes as u64;
        }
        Ok(total)
    }
}

fn wrap(component: HostComponent, source: HostError) -> HostError {
    HostError::Component {
        component,
        source: Box::new(source),
    }
}

/// The host pools of one model (see the module docs).
#[derive(Debug)]
pub struct HostPoolGroup {
    kv: Arc<HostPool>,
    swa: Option<Arc<HostPool>>,
    mamba: Option<Arc<MambaPool>>,
}

impl HostPoolGroup {
    /// Sizes every component, checks the whole group against the RAM (rule 2), then maps
    /// each pool.
    pub fn new(config: HostPoolGroupConfig) -> Result<Self> {
        pool::check_ram(config.total_bytes()?, config.reserve_bytes)?;
        // The group's check covers the pools: each one's own check only needs to pass.
        let populate = config.populate;
        let kv_like = |c: HostComponent, cfg: HostPoolConfig| {
            let populate = populate.unwrap_or(cfg.populate);
            HostPool::new(cfg.reserve_bytes(0).populate(populate))
                .map(Arc::new)
                .map_err(|e| wrap(c, e))
        };
        let kv = kv_like(HostComponent::Kv, config.kv)?;
        let swa = config
            .swa
            .map(|cfg| kv_like(HostComponent::Swa, cfg))
            .transpose()?;
        let mamba = config
            .mamba
            .map(|cfg| {
                let populate = populate.unwrap_or(cfg.populate);
                MambaPool::new(cfg.populate(populate))
                    .map(Arc::new)
                    .map_err(|e| wrap(HostComponent::Mamba, e))
            })
            .transpose()?;
        Ok(Self { kv, swa, mamba })
    }

    /// The full-attention KV pool.
    pub fn kv(&self) -> &HostPool {
        &self.kv
    }

    /// The sliding-window KV pool, if configured.
    pub fn swa(&self) -> Option<&HostPool> {
        self.swa.as_deref()
    }

    /// The Mamba state pool, if configured.
    pub fn mamba(&self) -> Option<&MambaPool> {
        self.mamba.as_deref()
    }

    /// The full-attention KV pool as a shared handle (e.g. for a `TransferEngine`'s host
    /// registration); the group keeps its own handle.
    pub fn kv_shared(&self) -> &Arc<HostPool> {
        &self.kv
    }

    /// The sliding-window KV pool as a shared handle, if configured.
    pub fn swa_shared(&self) -> Option<&Arc<HostPool>> {
        self.swa.as_ref()
    }

    /// The Mamba state pool as a shared handle (e.g. for a `StateTransfer`), if configured.
    pub fn mamba_shared(&self) -> Option<&Arc<MambaPool>> {
        self.mamba.as_ref()
    }

    /// The configured components, in group order.
    pub fn components(&self) -> Vec<HostComponent> {
        HostComponent::ALL
            .into_iter()
            .filter(|&c| self.has(c))
            .collect()
    }

    /// Whether the group has `component`.
    pub fn has(&self, component: HostComponent) -> bool {
        match component {
            HostComponent::Kv => true,
            HostComponent::Swa => self.swa.is_some(),
            HostComponent::Mamba => self.mamba.is_some(),
        }
    }

    fn kv_like(&self, c: HostComponent) -> Result<&HostPool> {
        match c {
            HostComponent::Kv => Ok(&self.kv),
            HostComponent::Swa => self.swa.as_deref().ok_or(HostError::NoComponent(c)),
            HostComponent::Mamba => Err(HostError::NoComponent(c)),
        }
    }

    fn mamba_pool(&self) -> Result<&MambaPool> {
        self.mamba
            .as_deref()
            .ok_or(HostError::NoComponent(HostComponent::Mamba))
    }

    /// Slots (pages or states) of `component`.
    pub fn capacity(&self, component: HostComponent) -> Result<usize> {
        match component {
            HostComponent::Mamba => Ok(self.mamba_pool()?.num_slots()),
            c => Ok(self.kv_like(c)?.num_pages()),
        }
    }

    /// Bytes of one slot of `component` (its flat page or state).
    pub fn slot_bytes(&self, component: HostComponent) -> Result<usize> {
        match component {
            HostComponent::Mamba => Ok(self.mamba_pool()?.slot_bytes()),
            c => Ok(self.kv_like(c)?.page_bytes()),
        }
    }

    /// Free slots of `component` now.
    pub fn available(&self, component: HostComponent) -> Result<usize> {
        match component {
            HostComponent::Mamba => Ok(self.mamba_pool()?.available()),
            c => Ok(self.kv_like(c)?.available()),
        }
    }

    /// `n` free slots of `component` (slot indices), or `Ok(None)` when fewer are free.
    pub fn alloc(&self, component: HostComponent, n: usize) -> Result<Option<Vec<u32>>> {
        Ok(match component {
            HostComponent::Mamba => self
                .mamba_pool()?
                .alloc(n)
                .map(|v| v.into_iter().map(|s| s.0).collect()),
            c => self
                .kv_like(c)?
                .alloc(n)
                .map(|v| v.into_iter().map(|s| s.0).collect()),
        })
    }

    /// Frees slots of `component`; all-or-nothing, a double free is an error naming the
    /// component and the slot.
    pub fn free(&self, component: HostComponent, slots: &[u32]) -> Result<()> {
        let r = match component {
            HostComponent::Mamba => {
                let s: Vec<MambaSlot> = slots.iter().map(|&i| MambaSlot(i)).collect();
                self.mamba_pool()?.free(&s)
            }
            c => {
                let s: Vec<HostSlot> = slots.iter().map(|&i| HostSlot(i)).collect();
                self.kv_like(c)?.free(&s)
            }
        };
        r.map_err(|e| wrap(component, e))
    }

    /// Whether slot `slot` of `component` is allocated now.
    pub fn is_allocated(&self, component: HostComponent, slot: u32) -> Result<bool> {
        Ok(match component {
            HostComponent::Mamba => self.mamba_pool()?.is_allocated(MambaSlot(slot)),
            c => self.kv_like(c)?.is_allocated(HostSlot(slot)),
        })
    }

    /// The iovecs of slot `slot` of `component`, in the order of its flat bytes (rule 3).
    pub fn iovecs(&self, component: HostComponent, slot: u32) -> Result<Vec<IoVec>> {
        let r = match component {
            HostComponent::Mamba => self.mamba_pool()?.slot_iovecs(MambaSlot(slot)),
            HostComponent::Kv => self.kv.page_iovecs(HostSlot(slot)),
            HostComponent::Swa => {
                let swa = self.kv_like(HostComponent::Swa)?;
                swa.page_iovecs(HostSlot(slot))
                    .map(|v| sglang_sidecar_order(swa, v))
            }
        };
        r.map_err(|e| wrap(component, e))
    }

    /// Copies slot `slot` of `component` in flat order (rule 3) into `dst` (one slot long).
    pub fn get(&self, component: HostComponent, slot: u32, dst: &mut [u8]) -> Result<()> {
        let iovs = self.iovecs(component, slot)?;
        pool::check_buffer("get", dst.len(), self.slot_bytes(component)?)
            .map_err(|e| wrap(component, e))?;
        // SAFETY: the iovecs are the slot's, inside the component's mapping (checked slot);
        // dst is a distinct buffer of the slot's length; the slot has one user (rule 1 of
        // `pool`).
        unsafe { pool::gather(&iovs, dst) };
        Ok(())
    }

    /// Writes slot `slot` of `component` from `src` in flat order (one slot long).
    pub fn set(&self, component: HostComponent, slot: u32, src: &[u8]) -> Result<()> {
        let iovs = self.iovecs(component, slot)?;
        pool::check_buffer("set", src.len(), self.slot_bytes(component)?)
            .map_err(|e| wrap(component, e))?;
        // SAFETY: as in get, with the copy reversed.
        unsafe { pool::scatter(&iovs, src) };
        Ok(())
    }

    /// The region of every component's mapping, to register once each (rule 1).
    pub fn regions(&self) -> Vec<(HostComponent, MemoryRegion)> {
        let mut v = vec![(HostComponent::Kv, self.kv.region())];
        v.extend(self.swa.iter().map(|p| (HostComponent::Swa, p.region())));
        v.extend(
            self.mamba
                .iter()
                .map(|p| (HostComponent::Mamba, p.region())),
        );
        v
    }

    /// Records whether `component`'s region is page-locked with CUDA.
    pub fn set_cuda_registered(&self, component: HostComponent, registered: bool) -> Result<()> {
        match component {
            HostComponent::Mamba => self.mamba_pool()?.set_cuda_registered(registered),
            c => self.kv_like(c)?.set_cuda_registered(registered),
        }
        Ok(())
    }

    /// The storage fingerprint of a sidecar component's pool (SGLang's pool as the Python
    /// package names it), for its L3 namespace with [`hicache_core::pool_namespace_id`];
    /// `None` for the KV pool, whose pages live in the model's KV namespace. The SWA pool must
    /// be MHA (SGLang's `MHATokenToKVPoolHost`); its piece sizes are this group's iovecs.
    pub fn sidecar_fingerprint(&self, component: HostComponent) -> Result<Option<PoolFingerprint>> {
        match component {
            HostComponent::Kv => Ok(None),
            HostComponent::Mamba => {
                let m = self.mamba_pool()?;
                Ok(Some(m.shape().fingerprint(m.layout_kind())))
            }
            HostComponent::Swa => {
                let swa = self.kv_like(component)?;
                let shape = swa.shape();
                let KvKind::Mha { heads, head_dim } = shape.kind else {
                    return Err(wrap(
                        component,
                        HostError::BadSize(
                            "an MLA sliding-window pool has no SGLang sidecar geometry".into(),
                        ),
                    ));
                };
                Ok(Some(PoolFingerprint::swa_mha(
                    swa.layout_kind(),
                    shape.page_size,
                    shape.layers,
                    heads,
                    head_dim,
                    head_dim,
                    shape.dtype,
                )))
            }
        }
    }

    /// Bytes mapped by the whole group.
    pub fn mapped_bytes(&self) -> usize {
        self.regions().iter().map(|(_, r)| r.len).sum()
    }
}

/// A sidecar KV page's parts in SGLang's piece order: `layer_first` pages are `K_l, V_l` per
/// layer there (ours list every K then every V); other layouts are already in order.
fn sglang_sidecar_order(pool: &HostPool, parts: Vec<IoVec>) -> Vec<IoVec> {
    let halves = pool.shape().halves();
    if pool.layout_kind() != LayoutKind::LayerFirst || halves == 1 {
        return parts;
    }
    let layers = parts.len() / halves;
    (0..layers)
        .flat_map(|l| (0..halves).map(move |h| h * layers + l))
        .map(|i| parts[i])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolSize;
    use hicache_core::{DType, KvShape, PoolPieces};
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn kv_shape(layers: u32, page_size: u32) -> KvShape {
        KvShape {
            kind: KvKind::Mha {
                heads: 1,
                head_dim: 16,
            },
            layers,
            dtype: DType::Bf16,
            page_size,
        }
    }

    /// KV: 3 layers, 6 pages; SWA: 2 layers, 4 pages, `swa_layout`; Mamba: 5 slots.
    fn config(swa_layout: LayoutKind) -> HostPoolGroupConfig {
        let kv = HostPoolConfig::new(kv_shape(3, 4), LayoutKind::PageFirst, PoolSize::Pages(6));
        let swa = HostPoolConfig::new(kv_shape(2, 4), swa_layout, PoolSize::Pages(4));
        HostPoolGroupConfig::new(kv)
            .swa(swa)
            .mamba(MambaPoolConfig::new(
                crate::mamba::tests::shape(),
                PoolSize::Pages(5),
            ))
            .reserve_bytes(0)
    }

    #[test]
    fn the_group_populate_setting_reaches_every_pool() {
        use crate::memory::{Backing, Populate};
        let g =
            HostPoolGroup::new(config(LayoutKind::PageFirst).populate(Populate::OnTouch)).unwrap();
        assert_eq!(g.kv().memory().backing(), Backing::OnTouch);
        assert_eq!(g.swa().unwrap().memory().backing(), Backing::OnTouch);
        assert_eq!(g.mamba().unwrap().memory().backing(), Backing::OnTouch);
        let g = HostPoolGroup::new(config(LayoutKind::PageFirst)).unwrap();
        assert_ne!(g.kv().memory().backing(), Backing::OnTouch);
        assert_ne!(g.mamba().unwrap().memory().backing(), Backing::OnTouch);
    }

    #[test]
    fn components_have_their_own_geometry() {
        let g = HostPoolGroup::new(config(LayoutKind::PageFirst)).unwrap();
        assert_eq!(g.components(), HostComponent::ALL.to_vec());
        assert_eq!(g.capacity(HostComponent::Kv).unwrap(), 6);
        assert_eq!(g.capacity(HostComponent::Swa).unwrap(), 4);
        assert_eq!(g.capacity(HostComponent::Mamba).unwrap(), 5);
        // bf16, 16 wide, 4 tokens: 128 bytes per layer and half.
        assert_eq!(g.slot_bytes(HostComponent::Kv).unwrap(), 3 * 2 * 128);
        assert_eq!(g.slot_bytes(HostComponent::Swa).unwrap(), 2 * 2 * 128);
        assert_eq!(g.slot_bytes(HostComponent::Mamba).unwrap(), 348);
        let regions = g.regions();
        assert_eq!(regions.len(), 3);
        for (i, (_, a)) in regions.iter().enumerate() {
            for (_, b) in &regions[i + 1..] {
                assert!(a.addr + a.len <= b.addr || b.addr + b.len <= a.addr);
            }
        }
        g.set_cuda_registered(HostComponent::Mamba, true).unwrap();
        assert!(g.regions()[2].1.cuda_registered);
        assert!(!g.regions()[1].1.cuda_registered);
    }

    /// The shared handles are the group's own pools, and outlive the group.
    #[test]
    fn shared_handles_are_the_groups_pools() {
        let g = HostPoolGroup::new(config(LayoutKind::PageFirst)).unwrap();
        assert!(std::ptr::eq(&**g.kv_shared(), g.kv()));
        assert!(std::ptr::eq(&**g.swa_shared().unwrap(), g.swa().unwrap()));
        let mamba = g.mamba_shared().unwrap().clone();
        assert!(std::ptr::eq(&*mamba, g.mamba().unwrap()));
        let s = g.alloc(HostComponent::Mamba, 1).unwrap().unwrap()[0];
        let data: Vec<u8> = (0..348).map(|i| i as u8).collect();
        g.set(HostComponent::Mamba, s, &data).unwrap();
        drop(g);
        let mut back = vec![0; 348];
        mamba.get_slot(MambaSlot(s), &mut back).unwrap();
        assert_eq!(back, data);
        let kv_only =
            HostPoolGroup::new(HostPoolGroupConfig::new(config(LayoutKind::PageFirst).kv)).unwrap();
        assert!(kv_only.swa_shared().is_none() && kv_only.mamba_shared().is_none());
    }

    #[test]
    fn ram_check_covers_the_whole_group() {
        let cfg = config(LayoutKind::PageFirst);
        let total = cfg.total_bytes().unwrap();
        let kv_only = HostPoolGroupConfig::new(cfg.kv.clone())
            .total_bytes()
            .unwrap();
        assert!(total > kv_only);
        let e = HostPoolGroup::new(cfg.reserve_bytes(u64::MAX / 2)).unwrap_err();
        match e {
            HostError::InsufficientMemory { requested, .. } => assert_eq!(requested, total),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn errors_name_the_component_and_slot() {
        let g = HostPoolGroup::new(config(LayoutKind::PageFirst)).unwrap();
        let s = g.alloc(HostComponent::Mamba, 2).unwrap().unwrap();
        g.free(HostComponent::Mamba, &s).unwrap();
        let e = g.free(HostComponent::Mamba, &s[1..]).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "mamba host pool: double free of page {} (it is not allocated)",
                s[1]
            )
        );
        let e = g.iovecs(HostComponent::Swa, 4).unwrap_err();
        assert!(e.to_string().starts_with("swa host pool: page 4"), "{e}");
        let kv_only =
            HostPoolGroup::new(HostPoolGroupConfig::new(config(LayoutKind::PageFirst).kv)).unwrap();
        assert!(matches!(
            kv_only.alloc(HostComponent::Swa, 1),
            Err(HostError::NoComponent(HostComponent::Swa))
        ));
        assert_eq!(kv_only.components(), vec![HostComponent::Kv]);
        let mut bad = config(LayoutKind::PageFirst);
        bad.mamba.as_mut().unwrap().shape.conv_elems.clear();
        let e = HostPoolGroup::new(bad).unwrap_err();
        assert!(
            e.to_string().starts_with("mamba host pool: invalid Mamba"),
            "{e}"
        );
        let mut buf = vec![0; 10];
        assert!(matches!(
            g.get(HostComponent::Kv, 0, &mut buf),
            Err(HostError::Component {
                component: HostComponent::Kv,
                ..
            })
        ));
    }

    /// SGLang's sidecar pieces of a `layer_first` page are `K_l, V_l` per layer.
    #[test]
    fn layer_first_sidecar_pages_are_in_sglang_piece_order() {
        let g = HostPoolGroup::new(config(LayoutKind::LayerFirst)).unwrap();
        let swa = g.swa().unwrap();
        let base = swa.base_ptr() as usize;
        let lay = swa.layout();
        let got: Vec<usize> = g
            .iovecs(HostComponent::Swa, 3)
            .unwrap()
            .iter()
            .map(|v| v.addr - base)
            .collect();
        let want: Vec<usize> = (0..2)
            .flat_map(|l| (0..2).map(move |h| (h, l)))
            .map(|(h, l)| lay.offset(h, 3, l, 0))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn group_is_shared_across_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<HostPoolGroup>();
        shared::<MambaPool>();
    }

    /// The fingerprint a sidecar is stored under describes exactly its iovecs.
    #[test]
    fn sidecar_fingerprints_describe_the_iovecs() {
        for lay in [LayoutKind::LayerFirst, LayoutKind::PageFirst] {
            let g = HostPoolGroup::new(config(lay)).unwrap();
            assert_eq!(g.sidecar_fingerprint(HostComponent::Kv).unwrap(), None);
            for c in [HostComponent::Swa, HostComponent::Mamba] {
                let fp = g.sidecar_fingerprint(c).unwrap().unwrap();
                let lens: Vec<u64> = g
                    .iovecs(c, 1)
                    .unwrap()
                    .iter()
                    .map(|v| v.len as u64)
                    .collect();
                assert_eq!(fp.pieces, PoolPieces::Pieces(lens), "{c} {lay:?}");
                assert_eq!(fp.pool, c.as_str());
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize, usize),
        Free(usize, usize, bool),
        Write(usize, usize, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..3, 0usize..4).prop_map(|(c, n)| Op::Alloc(c, n)),
            (0usize..3, any::<usize>(), any::<bool>()).prop_map(|(c, i, d)| Op::Free(c, i, d)),
            (0usize..3, any::<usize>(), any::<u8>()).prop_map(|(c, i, b)| Op::Write(c, i, b)),
        ]
    }

    fn check_iovecs(g: &HostPoolGroup, live: &[BTreeSet<u32>]) -> Result<(), TestCaseError> {
        let regions = g.regions();
        let mut spans = Vec::new();
        for (ci, c) in HostComponent::ALL.into_iter().enumerate() {
            let region = regions[ci].1;
            for &s in &live[ci] {
                let iovs = g.iovecs(c, s).unwrap();
                prop_assert_eq!(
                    iovs.iter().map(|v| v.len).sum::<usize>(),
                    g.slot_bytes(c).unwrap()
                );
                for v in iovs {
                    prop_assert!(region.contains(v.addr, v.len), "{} slot {} outside", c, s);
                    spans.push((v.addr, v.addr + v.len));
                }
            }
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "iovecs of distinct slots overlap");
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Per component: alloc never hands a live slot twice, double frees fail and change
        /// nothing, iovecs of distinct slots never overlap and stay in their region, and what
        /// is set is what is got, without touching any other slot.
        #[test]
        fn group_matches_a_model(
            layer_first in any::<bool>(),
            ops in proptest::collection::vec(op(), 1..40),
        ) {
            let lay = if layer_first { LayoutKind::LayerFirst } else { LayoutKind::PageFirst };
            let g = HostPoolGroup::new(config(lay)).unwrap();
            let mut live: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); 3];
            let mut content: Vec<std::collections::BTreeMap<u32, Vec<u8>>> = vec![Default::default(); 3];
            for op in ops {
                match op {
                    Op::Alloc(ci, n) => {
                        let c = HostComponent::ALL[ci];
                        let cap = g.capacity(c).unwrap();
                        match g.alloc(c, n).unwrap() {
                            None => prop_assert!(n > cap - live[ci].len()),
                            Some(got) => {
                                prop_assert_eq!(got.len(), n);
                                for s in got {
                                    prop_assert!((s as usize) < cap);
                                    prop_assert!(live[ci].insert(s), "{} slot {} handed out twice", c, s);
                                }
                            }
                        }
                    }
                    Op::Free(ci, i, twice) => {
                        let c = HostComponent::ALL[ci];
                        let Some(&s) = live[ci].iter().nth(i % live[ci].len().max(1)) else { continue };
                        if twice {
                            let e = g.free(c, &[s, s]).unwrap_err();
                            let prefix = format!("{} host pool", c);
                            prop_assert!(e.to_string().starts_with(&prefix), "{}", e);
                            prop_assert!(g.is_allocated(c, s).unwrap());
                        } else {
                            g.free(c, &[s]).unwrap();
                            live[ci].remove(&s);
                            content[ci].remove(&s);
                        }
                    }
                    Op::Write(ci, i, b) => {
                        let c = HostComponent::ALL[ci];
                        let Some(&s) = live[ci].iter().nth(i % live[ci].len().max(1)) else { continue };
                        let data: Vec<u8> = (0..g.slot_bytes(c).unwrap())
                            .map(|k| b.wrapping_add((k % 251) as u8))
                            .collect();
                        g.set(c, s, &data).unwrap();
                        content[ci].insert(s, data);
                    }
                }
                for (ci, c) in HostComponent::ALL.into_iter().enumerate() {
                    prop_assert_eq!(g.available(c).unwrap(), g.capacity(c).unwrap() - live[ci].len());
                    for (&s, want) in &content[ci] {
                        let mut back = vec![0; want.len()];
                        g.get(c, s, &mut back).unwrap();
                        prop_assert_eq!(&back, want, "{} slot {}", c, s);
                    }
                }
                check_iovecs(&g, &live)?;
            }
        }
    }
}
