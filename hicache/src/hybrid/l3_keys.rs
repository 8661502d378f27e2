//! [`HybridL3Layout`]: where the pages of a hybrid model (Full-attention KV, sliding-window KV,
//! Mamba state) live in L3, shared with our Python package so that an engine on our core and
//! SGLang on the package read each other's pages for the same model; and [`restorable`], the
//! hit policy of a prefetch.
//!
//! Rules (SGLang 0.5.23: `unified_cache/components/{full,swa,mamba}.py`,
//! `hybrid_cache/hybrid_cache_controller.py`; the package: `hicache_rs.sglang`,
//! `hicache_rs.hit_policy`):
//! 1. **Keys.** A page of component `c` is stored under `PageKey::new(namespace(c), hash)`.
//!    The KV namespace is the dense cache's (the rank's [`Namespace`] and the tenant as cache
//!    salt); the SWA and Mamba namespaces are the Python package's sidecar namespaces
//!    ([`pool_namespace_id`] of the host group's fingerprint, the same model, TP/PP and
//!    tenant). Sidecar pages are stored with their fingerprint's namespace layout (what the
//!    package names to the store), KV pages with the KV pool's layout.
//! 2. **Hashes.** Every component uses the page hashes of the tokens' chain
//!    ([`HybridL3Layout::chain`]): in [`HashMode::Sglang`] SGLang's own hashes (no seed), in
//!    [`HashMode::Namespaced`] the chain seeded by the namespace and tenant.
//! 3. **Backup** (`BACKUP_STORAGE`): KV writes every page of the node; SWA writes the node's
//!    `n` host SWA pages keyed by the node's last `n` page hashes; Mamba writes the node's one
//!    state keyed by the node's last page hash ([`HybridL3Layout::backup_keys`]).
//! 4. **Prefetch** (`PREFETCH`): over a span of `s` pages, SWA stages `min(s, window pages)`
//!    pages when `s` reaches the window, or the whole span when it starts at the root, and
//!    nothing otherwise; Mamba stages one state. Once the hit `p` is known, a trailing pool
//!    reads the keys of pages `p - n .. p` (`_sync_trailing_keys`), KV reads `0 .. p`
//!    ([`HybridL3Layout::prefetch_policies`], [`HybridL3Layout::read_keys`]).
//! 5. **Hit** ([`restorable`]): KV's leading run `k`; every length `1..=k` starts restorable;
//!    pools are walked in order until nothing is restorable; `all_pages` keeps lengths up to
//!    the pool's own leading run, `trailing_pages` with window `w` keeps `p` when the pool has
//!    pages `max(0, p - w) .. p`; the hit is the largest length every pool keeps.

// The facade drives this module; a few accessors and summaries (`restorable`, the layout's
// `page_size` / `deployment` / `components`, `PageResults::misses` …) serve its tests only.
#![allow(dead_code)]

use hicache_core::{
    HashMode, KvKind, LayoutKind, Namespace, NamespaceId, PageHash, PageHasher, PageKey,
    PoolDeployment, pool_namespace_id,
};
use hicache_host::{HostComponent, HostPoolGroup};

use crate::error::{HiCacheError, Result};

/// Where one component's pages are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ComponentSpace {
    /// The namespace half of every key of the component.
    pub namespace: NamespaceId,
    /// The layout its pages are stored with (the storage compares it on read).
    pub layout: LayoutKind,
    /// Bytes of one page (one host slot).
    pub page_bytes: usize,
}

/// What [`HybridL3Layout::new`] needs besides the host group.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HybridL3Spec<'a> {
    /// The rank's KV namespace (model, dtype, KV layout, shape, page size, TP/PP).
    pub namespace: &'a Namespace,
    /// How page hashes are chained.
    pub hash_mode: HashMode,
    /// The tenant (the package's `tenant`, our cache salt); salts every namespace.
    pub tenant: Option<&'a str>,
    /// The sliding window in tokens; required exactly when the group has an SWA pool.
    pub swa_window: Option<u32>,
}

/// A pool's hit policy in a prefetch's lookup (SGLang's `PoolHitPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HitPolicy {
    /// The pool must have every page of the prefix.
    AllPages,
    /// The pool must have the last `window` pages of the prefix (all of a shorter one); a
    /// window of 0 counts as 1, as SGLang's `max(1, len(keys))`.
    TrailingPages {
        /// Pages the pool reads for a prefix.
        window: usize,
    },
}

/// The L3 layout of one hybrid model on one rank (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct HybridL3Layout {
    page_size: usize,
    hasher: PageHasher,
    /// Prior of the chain's first page (the seed in namespaced mode).
    prior: Option<PageHash>,
    deployment: PoolDeployment,
    kv: ComponentSpace,
    swa: Option<ComponentSpace>,
    mamba: Option<ComponentSpace>,
    /// The sliding window in pages (SGLang's `full_window_pages`), 0 without SWA.
    window_pages: usize,
}

fn bad(what: String) -> HiCacheError {
    HiCacheError::BadArgument(what)
}

impl HybridL3Layout {
    /// The layout of `group`'s components under `spec` (rule 1). Errors: a KV pool whose
    /// geometry or layout is not the namespace's, an SWA pool without a window or a window
    /// without an SWA pool, a sidecar whose fingerprint does not describe its slots.
    pub fn new(spec: HybridL3Spec<'_>, group: &HostPoolGroup) -> Result<Self> {
        let ns = spec.namespace;
        let kv_pool = group.kv();
        let shape = kv_pool.shape();
        let pool_is = (shape.kind, shape.layers, shape.dtype, shape.page_size);
        let ns_names = (ns.kv, ns.layers, ns.dtype, ns.page_size);
        if pool_is != ns_names || kv_pool.layout_kind() != ns.layout {
            return Err(bad(format!(
                "the KV host pool ({pool_is:?}, {:?}) is not the namespace's ({ns_names:?}, {:?})",
                kv_pool.layout_kind(),
                ns.layout
            )));
        }
        let hasher = PageHasher::new(spec.hash_mode, ns)?;
        let start = hasher.chain_start(None, spec.tenant);
        let deployment = PoolDeployment {
            model: ns.model.clone(),
            is_mla_model: matches!(ns.kv, KvKind::Mla { .. }),
            tp: (ns.tp_rank, ns.tp_size),
            pp: (ns.pp_rank, ns.pp_size),
            cp: (0, 1),
            tenant: spec.tenant.map(str::to_owned),
        };
        let kv = ComponentSpace {
            namespace: start.namespace_id,
            layout: kv_pool.layout_kind(),
            page_bytes: kv_pool.page_bytes(),
        };
        let window_pages = match (group.has(HostComponent::Swa), spec.swa_window) {
            (true, Some(w)) if w > 0 => (w as usize).div_ceil(ns.page_size as usize),
            (false, None) => 0,
            (has, w) => {
                return Err(bad(format!(
                    "sliding window {w:?} with{} an SWA host pool",
                    if has { "" } else { "out" }
                )));
            }
        };
        let sidecar = |c| sidecar_space(group, c, &deployment, ns.page_size);
        Ok(Self {
            page_size: ns.page_size as usize,
            prior: start.prior,
            swa: sidecar(HostComponent::Swa)?,
            mamba: sidecar(HostComponent::Mamba)?,
            hasher,
            deployment,
            kv,
            window_pages,
        })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The sidecar deployment fields (model, MLA, TP/PP, tenant) the namespaces were built from.
    pub fn deployment(&self) -> &PoolDeployment {
        &self.deployment
    }

    /// The sliding window in pages (0 without SWA).
    pub fn window_pages(&self) -> usize {
        self.window_pages
    }

    /// The configured components, in group order.
    pub fn components(&self) -> Vec<HostComponent> {
        HostComponent::ALL
            .into_iter()
            .filter(|&c| self.space(c).is_ok())
            .collect()
    }

    /// Where `component`'s pages are stored; an error for a component the group lacks.
    pub fn space(&self, component: HostComponent) -> Result<&ComponentSpace> {
        match component {
            HostComponent::Kv => Some(&self.kv),
            HostComponent::Swa => self.swa.as_ref(),
            HostComponent::Mamba => self.mamba.as_ref(),
        }
        .ok_or_else(|| bad(format!("the model has no {component} component")))
    }

    /// The page hashes of `tokens`' whole pages (a trailing partial page is not hashed),
    /// chained after the page `after` (its hash), or from the root when `None` (rule 2).
    pub fn chain(&self, after: Option<&PageHash>, tokens: &[u32]) -> Vec<PageHash> {
        let prior = after.copied().or(self.prior);
        self.hasher.hash_pages(prior, tokens)
    }

    /// The keys of `component` for pages `hashes`.
    pub fn keys(&self, component: HostComponent, hashes: &[PageHash]) -> Result<Vec<PageKey>> {
        let ns = self.space(component)?.namespace;
        Ok(hashes.iter().map(|h| PageKey::new(ns, *h)).collect())
    }

    /// The keys a backup of a node writes for `component` (rule 3): `node_hashes` are the
    /// node's page hashes, `host_slots` the component's host slots of the node (KV: one per
    /// page; SWA: its host pages, at most the node's pages; Mamba: 0 or 1 state). Keys pair
    /// with the slots in order; a node without hashes writes nothing.
    pub fn backup_keys(
        &self,
        component: HostComponent,
        node_hashes: &[PageHash],
        host_slots: usize,
    ) -> Result<Vec<PageKey>> {
        let pages = node_hashes.len();
        let from = match component {
            HostComponent::Kv if host_slots == pages => 0,
            HostComponent::Swa if host_slots <= pages => pages - host_slots,
            HostComponent::Mamba if host_slots <= 1 => pages - host_slots.min(pages),
            _ => {
                return Err(bad(format!(
                    "a node of {pages} pages cannot back up {host_slots} {component} slots"
                )));
            }
        };
        self.keys(component, &node_hashes[from..])
    }

    /// Pages the SWA pool stages for a prefetch of `span_pages` pages (rule 4; SGLang's
    /// `prepare_prefetch`): the window when the span reaches it, the whole span when it
    /// starts at the root, else 0 (SWA is then not fetched and does not gate the hit).
    pub fn swa_prefetch_pages(&self, span_pages: usize, at_root: bool) -> usize {
        if self.swa.is_none() || self.window_pages == 0 {
            0
        } else if span_pages >= self.window_pages {
            self.window_pages
        } else if at_root {
            span_pages
        } else {
            0
        }
    }

    /// The sidecar pools a prefetch of `span_pages` pages looks up, in SGLang's order (SWA,
    /// then Mamba), each with its policy (rule 4); KV is the leading run and is not listed.
    pub fn prefetch_policies(
        &self,
        span_pages: usize,
        at_root: bool,
    ) -> Vec<(HostComponent, HitPolicy)> {
        let mut v = Vec::new();
        let swa = self.swa_prefetch_pages(span_pages, at_root);
        if swa > 0 {
            v.push((HostComponent::Swa, HitPolicy::TrailingPages { window: swa }));
        }
        if self.mamba.is_some() && span_pages > 0 {
            v.push((HostComponent::Mamba, HitPolicy::TrailingPages { window: 1 }));
        }
        v
    }

    /// The keys `component` reads for a hit of `hit` pages of the span `hashes` under
    /// `policy`: pages `0..hit` for [`HitPolicy::AllPages`], the last `window` of them for a
    /// trailing pool (rule 4).
    pub fn read_keys(
        &self,
        component: HostComponent,
        policy: HitPolicy,
        hashes: &[PageHash],
        hit: usize,
    ) -> Result<Vec<PageKey>> {
        if hit > hashes.len() {
            return Err(bad(format!(
                "a hit of {hit} pages in a span of {}",
                hashes.len()
            )));
        }
        let from = match policy {
            HitPolicy::AllPages => 0,
            HitPolicy::TrailingPages { window } => hit - window.max(1).min(hit),
        };
        self.keys(component, &hashes[from..hit])
    }
}

/// The space of a sidecar component of `group`, if it has one, checked against its slots.
fn sidecar_space(
    group: &HostPoolGroup,
    component: HostComponent,
    deployment: &PoolDeployment,
    page_size: u32,
) -> Result<Option<ComponentSpace>> {
    if !group.has(component) {
        return Ok(None);
    }
    let fp = group
        .sidecar_fingerprint(component)?
        .ok_or_else(|| bad(format!("{component} is not a sidecar")))?;
    let slot_bytes = group.slot_bytes(component)?;
    if fp.page_bytes() != slot_bytes as u64 {
        return Err(bad(format!(
            "the {component} fingerprint names pages of {} bytes, its slots hold {slot_bytes}",
            fp.page_bytes()
        )));
    }
    if component == HostComponent::Swa && fp.page_size != page_size {
        return Err(bad(format!(
            "SWA pages of {} tokens beside KV pages of {page_size}",
            fp.page_size
        )));
    }
    Ok(Some(ComponentSpace {
        namespace: pool_namespace_id(&fp, deployment)?,
        layout: fp.namespace_layout(),
        page_bytes: slot_bytes,
    }))
}

/// What a prefetch's lookup found (the Python package's `evaluate` for `all_pages` and
/// `trailing_pages` pools).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct HitVerdict {
    /// The hit: the largest length every pool can restore (0 when none).
    pub hit_pages: usize,
    /// KV's leading run.
    pub kv_pages: usize,
    /// Each pool's largest restorable length, in the order given; 0 for a pool with none or
    /// one the walk did not reach (the package leaves both out).
    pub pool_hits: Vec<usize>,
    /// Every restorable length, ascending.
    pub restorable: Vec<usize>,
}

/// The walk of rule 5 one pool at a time, so that a pool's presence is only asked for once
/// the walk reaches it ([`HitWalk::exhausted`] says when no later pool matters).
#[derive(Clone, Debug)]
pub(crate) struct HitWalk {
    kv_pages: usize,
    /// `ok[p - 1]`: length `p` is still restorable.
    ok: Vec<bool>,
    pool_hits: Vec<usize>,
}

impl HitWalk {
    /// Every length `1..=kv_pages` restorable.
    pub fn new(kv_pages: usize) -> Self {
        Self {
            kv_pages,
            ok: vec![true; kv_pages],
            pool_hits: Vec::new(),
        }
    }

    /// No length is restorable any more: later pools have no verdict.
    pub fn exhausted(&self) -> bool {
        !self.ok.contains(&true)
    }

    /// Applies the next pool: `present[i]` says whether it has page `i` of the span (missing
    /// entries are absent). A pool reached after exhaustion gets no verdict (0).
    pub fn pool(&mut self, policy: HitPolicy, present: &[bool]) {
        if self.exhausted() {
            self.pool_hits.push(0);
            return;
        }
        let has = |i: usize| present.get(i).copied().unwrap_or(false);
        let allowed = |p: usize| match policy {
            HitPolicy::AllPages => (0..p).all(has),
            HitPolicy::TrailingPages { window } => (p.saturating_sub(window.max(1))..p).all(has),
        };
        let mut boundary = 0;
        for p in 1..=self.kv_pages {
            if allowed(p) {
                boundary = p;
            } else {
                self.ok[p - 1] = false;
            }
        }
        self.pool_hits.push(boundary);
    }

    /// The verdict.
    pub fn finish(self) -> HitVerdict {
        let restorable: Vec<usize> = (1..=self.kv_pages).filter(|&p| self.ok[p - 1]).collect();
        HitVerdict {
            hit_pages: restorable.last().copied().unwrap_or(0),
            kv_pages: self.kv_pages,
            pool_hits: self.pool_hits,
            restorable,
        }
    }
}

/// The hit of a prefetch (rule 5) from KV's leading run and each pool's per-page presence.
pub(crate) fn restorable(kv_pages: usize, pools: &[(HitPolicy, &[bool])]) -> HitVerdict {
    let mut walk = HitWalk::new(kv_pages);
    for (policy, present) in pools {
        walk.pool(*policy, present);
    }
    walk.finish()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use hicache_core::{DType, KvShape};
    use hicache_host::{
        HostPoolConfig, HostPoolGroupConfig, MambaPoolConfig, MambaShape, PoolSize,
    };
    use proptest::prelude::*;

    /// An MHA KV shape: `heads` × `head_dim`, bf16.
    fn mha(layers: u32, heads: u32, head_dim: u32, page_size: u32) -> KvShape {
        KvShape {
            kind: KvKind::Mha { heads, head_dim },
            layers,
            dtype: DType::Bf16,
            page_size,
        }
    }

    /// A Mamba shape: `layers`, `temporal` elements per layer of `temporal_dtype`, bf16 conv
    /// pieces of `convs` elements per layer.
    pub(crate) fn mamba_shape(
        layers: u32,
        temporal: u64,
        temporal_dtype: DType,
        convs: &[u64],
    ) -> MambaShape {
        MambaShape {
            layers,
            temporal_elems: temporal,
            temporal_dtype,
            conv_elems: convs.to_vec(),
            conv_dtype: DType::Bf16,
        }
    }

    /// KV: 3 layers of 1 × 16, page 4, `page_first`, 8 pages; SWA (the Python tests'
    /// `swa_pool(layout)`): 2 layers of 1 × 16, 8 pages; Mamba: [`mamba_shape`], 4 slots.
    pub(crate) fn group(swa_layout: LayoutKind, swa: bool, mamba: bool) -> HostPoolGroup {
        let kv = HostPoolConfig::new(mha(3, 1, 16, 4), LayoutKind::PageFirst, PoolSize::Pages(8));
        let mut cfg = HostPoolGroupConfig::new(kv).reserve_bytes(0);
        if swa {
            cfg = cfg.swa(HostPoolConfig::new(
                mha(2, 1, 16, 4),
                swa_layout,
                PoolSize::Pages(8),
            ));
        }
        if mamba {
            // The Python tests' `mamba_pool()`: temporal (4, 8) f32, convs (6, 3) and (5,).
            let shape = mamba_shape(2, 32, DType::F32, &[18, 5]);
            cfg = cfg.mamba(MambaPoolConfig::new(shape, PoolSize::Pages(4)));
        }
        HostPoolGroup::new(cfg).unwrap()
    }

    /// The KV namespace of [`group`]'s KV pool for `model`, TP `tp`.
    pub(crate) fn namespace(model: &str, tp: (u32, u32)) -> Namespace {
        let s = mha(3, 1, 16, 4);
        let mut ns = Namespace::single_rank(model, s.dtype, LayoutKind::PageFirst, s.kind, 3, 4);
        (ns.tp_rank, ns.tp_size) = tp;
        ns
    }

    /// The SGLang-mode layout of `group` for model `m` on one rank, without a tenant.
    pub(crate) fn sglang_layout(group: &HostPoolGroup, window: Option<u32>) -> HybridL3Layout {
        layout_of(
            &namespace("m", (0, 1)),
            HashMode::Sglang,
            None,
            group,
            window,
        )
        .unwrap()
    }

    pub(crate) fn layout_of(
        ns: &Namespace,
        mode: HashMode,
        tenant: Option<&str>,
        group: &HostPoolGroup,
        window: Option<u32>,
    ) -> Result<HybridL3Layout> {
        let spec = HybridL3Spec {
            namespace: ns,
            hash_mode: mode,
            tenant,
            swa_window: window,
        };
        HybridL3Layout::new(spec, group)
    }

    /// The namespace ids the Python package computes for the same pools and deployment:
    /// `_native.namespace_id` with the arguments of `HiCacheRsStorage._pool_namespace` over
    /// `PoolAdapter("swa", swa_pool(layout="layer_first"))` and `PoolAdapter("mamba",
    /// mamba_pool())` (SGLang 0.5.23's real host pools on CPU, tests/sglang_pools.py), model
    /// `Qwen/Qwen3.5-9B`, TP rank 1 of 2, tenant `acme`; and `_native.namespace_id` with the
    /// arguments of `HiCacheRsStorage._namespace` for the KV pool (`torch.bfloat16`,
    /// `page_first`, 1 head of 16, 3 layers, page 4).
    #[test]
    fn namespaces_match_the_python_package() {
        let g = group(LayoutKind::LayerFirst, true, true);
        let ns = namespace("Qwen/Qwen3.5-9B", (1, 2));
        for mode in [HashMode::Sglang, HashMode::Namespaced] {
            let l = layout_of(&ns, mode, Some("acme"), &g, Some(8)).unwrap();
            let hex = |c| l.space(c).unwrap().namespace.to_hex();
            assert_eq!(hex(HostComponent::Kv), "d418d5b0ffc2e83b1c0b2c20862a7954");
            assert_eq!(hex(HostComponent::Swa), "dde7e3b89038695b4901b90235b068f4");
            assert_eq!(
                hex(HostComponent::Mamba),
                "82c392ffd696994da8ce503c75a01b81"
            );
            let swa = l.space(HostComponent::Swa).unwrap();
            assert_eq!((swa.layout, swa.page_bytes), (LayoutKind::LayerFirst, 512));
            let m = l.space(HostComponent::Mamba).unwrap();
            assert_eq!((m.layout, m.page_bytes), (LayoutKind::PageFirst, 348));
            assert_eq!(l.deployment().tp, (1, 2));
            assert_eq!(l.components(), HostComponent::ALL.to_vec());
        }
    }

    /// hicache-core's fixed values (`key::tests::namespaces_match_the_python_package`) reached
    /// from a host group: Gemma 3's SWA pool and a 3-layer Mamba pool.
    #[test]
    fn group_fingerprints_give_core_fixed_namespaces() {
        let kv = HostPoolConfig::new(mha(1, 4, 64, 16), LayoutKind::PageFirst, PoolSize::Pages(2));
        let swa = HostPoolConfig::new(mha(5, 4, 64, 16), LayoutKind::PageFirst, PoolSize::Pages(2));
        let g = HostPoolGroup::new(HostPoolGroupConfig::new(kv).swa(swa).reserve_bytes(0)).unwrap();
        let s = mha(1, 4, 64, 16);
        let ns = Namespace::single_rank(
            "google/gemma-3",
            s.dtype,
            LayoutKind::PageFirst,
            s.kind,
            1,
            16,
        );
        let l = layout_of(&ns, HashMode::Sglang, Some("t1"), &g, Some(1024)).unwrap();
        assert_eq!(
            l.space(HostComponent::Swa).unwrap().namespace.to_hex(),
            "b773f53cd00cad85e0b9433e94ba607b"
        );
        assert_eq!(l.window_pages(), 64);
        let m = mamba_shape(3, 64, DType::Bf16, &[64]);
        let kv = HostPoolConfig::new(mha(3, 1, 16, 4), LayoutKind::PageFirst, PoolSize::Pages(2));
        let cfg = HostPoolGroupConfig::new(kv)
            .mamba(MambaPoolConfig::new(m, PoolSize::Pages(2)))
            .reserve_bytes(0);
        let g = HostPoolGroup::new(cfg).unwrap();
        let l = layout_of(
            &namespace("Qwen/Qwen3.5-9B", (1, 2)),
            HashMode::Sglang,
            None,
            &g,
            None,
        )
        .unwrap();
        assert_eq!(
            l.space(HostComponent::Mamba).unwrap().namespace.to_hex(),
            "704e48a0005a42adc8b8168fec6b76b2"
        );
        assert!(l.space(HostComponent::Swa).is_err());
        assert_eq!(
            l.components(),
            vec![HostComponent::Kv, HostComponent::Mamba]
        );
    }

    /// SGLang mode gives SGLang's own hashes (`_native.sglang_page_hashes` of tokens
    /// 100..112, page 4); namespaced mode seeds them; both continue a chain after a page.
    #[test]
    fn chains_are_sglang_hashes_or_seeded() {
        let g = group(LayoutKind::PageFirst, false, true);
        let ns = namespace("m", (0, 1));
        let tokens: Vec<u32> = (100..113).collect();
        let l = layout_of(&ns, HashMode::Sglang, None, &g, None).unwrap();
        let h = l.chain(None, &tokens);
        let hex: Vec<String> = h.iter().map(PageHash::to_hex).collect();
        assert_eq!(
            hex,
            [
                "9d373db168e3e6a03e12ea791ce33b00590b4652dd4618889639c8095ac017f7",
                "ba16f22309bf4813eb11f38cd4bbe8797d6020c94bedf8172295626dbe0105a2",
                "903f67facce6cd222fb4acf099f685a40ba6bce34dbc22faec4dbe2f56ed179b",
            ]
        );
        assert_eq!(l.chain(Some(&h[1]), &tokens[8..12]), h[2..]);
        let n = layout_of(&ns, HashMode::Namespaced, None, &g, None).unwrap();
        let seeded = n.chain(None, &tokens);
        assert_eq!(seeded.len(), 3);
        assert_ne!(seeded[0], h[0]);
        assert_eq!(n.chain(Some(&seeded[0]), &tokens[4..]), seeded[1..]);
        // Tenants salt the KV chain and every namespace.
        let t = layout_of(&ns, HashMode::Namespaced, Some("x"), &g, None).unwrap();
        assert_ne!(t.chain(None, &tokens)[0], seeded[0]);
        for c in [HostComponent::Kv, HostComponent::Mamba] {
            assert_ne!(t.space(c).unwrap().namespace, n.space(c).unwrap().namespace);
        }
    }

    #[test]
    fn inconsistent_setups_are_refused() {
        let ns = namespace("m", (0, 1));
        let swa = group(LayoutKind::PageFirst, true, false);
        assert!(layout_of(&ns, HashMode::Sglang, None, &swa, None).is_err());
        assert!(layout_of(&ns, HashMode::Sglang, None, &swa, Some(0)).is_err());
        let plain = group(LayoutKind::PageFirst, false, false);
        assert!(layout_of(&ns, HashMode::Sglang, None, &plain, Some(8)).is_err());
        let edits: [fn(&mut Namespace); 4] = [
            |n| n.page_size = 8,
            |n| n.layers = 2,
            |n| n.dtype = DType::F16,
            |n| n.layout = LayoutKind::LayerFirst,
        ];
        for edit in edits {
            let mut other = ns.clone();
            edit(&mut other);
            let e = layout_of(&other, HashMode::Sglang, None, &plain, None).unwrap_err();
            assert!(e.to_string().contains("is not the namespace's"), "{e}");
        }
        let l = layout_of(&ns, HashMode::Sglang, None, &plain, None).unwrap();
        assert!(l.keys(HostComponent::Mamba, &[]).is_err());
        assert_eq!(l.components(), vec![HostComponent::Kv]);
    }

    fn hashes(n: u8) -> Vec<PageHash> {
        (0..n).map(|i| PageHash([i; 32])).collect()
    }

    /// SGLang's `BACKUP_STORAGE` transfers: KV every page, SWA the last `n` hashes, Mamba the
    /// last hash.
    #[test]
    fn backups_key_components_as_sglang() {
        let g = group(LayoutKind::PageFirst, true, true);
        let l = sglang_layout(&g, Some(8));
        let h = hashes(5);
        let tail = |c, v: Vec<PageKey>| {
            v.iter().map(|k| k.hash).collect::<Vec<_>>() == h[h.len() - v.len()..]
                && v.iter()
                    .all(|k| k.namespace == l.space(c).unwrap().namespace)
        };
        let kv = l.backup_keys(HostComponent::Kv, &h, 5).unwrap();
        assert_eq!(kv.len(), 5);
        assert!(tail(HostComponent::Kv, kv));
        let swa = l.backup_keys(HostComponent::Swa, &h, 2).unwrap();
        assert_eq!(swa.len(), 2);
        assert!(tail(HostComponent::Swa, swa));
        let m = l.backup_keys(HostComponent::Mamba, &h, 1).unwrap();
        assert_eq!(m.len(), 1);
        assert!(tail(HostComponent::Mamba, m));
        assert!(
            l.backup_keys(HostComponent::Mamba, &h, 0)
                .unwrap()
                .is_empty()
        );
        assert!(
            l.backup_keys(HostComponent::Mamba, &[], 1)
                .unwrap()
                .is_empty()
        );
        assert!(l.backup_keys(HostComponent::Kv, &h, 4).is_err());
        assert!(l.backup_keys(HostComponent::Swa, &h, 6).is_err());
        assert!(l.backup_keys(HostComponent::Mamba, &h, 2).is_err());
    }

    /// SGLang's `prepare_prefetch` and `_sync_trailing_keys`.
    #[test]
    fn prefetches_stage_and_read_as_sglang() {
        let g = group(LayoutKind::PageFirst, true, true);
        // A window of 10 tokens is 3 pages of 4.
        let l = sglang_layout(&g, Some(10));
        assert_eq!(l.window_pages(), 3);
        assert_eq!(l.swa_prefetch_pages(5, false), 3);
        assert_eq!(l.swa_prefetch_pages(2, true), 2);
        assert_eq!(l.swa_prefetch_pages(2, false), 0);
        let trailing = |window| HitPolicy::TrailingPages { window };
        assert_eq!(
            l.prefetch_policies(5, false),
            vec![
                (HostComponent::Swa, trailing(3)),
                (HostComponent::Mamba, trailing(1))
            ]
        );
        assert_eq!(
            l.prefetch_policies(2, false),
            vec![(HostComponent::Mamba, trailing(1))]
        );
        assert!(l.prefetch_policies(0, true).is_empty());
        let h = hashes(6);
        let read = |c, p, hit| -> Vec<PageHash> {
            l.read_keys(c, p, &h, hit)
                .unwrap()
                .iter()
                .map(|k| k.hash)
                .collect()
        };
        assert_eq!(read(HostComponent::Kv, HitPolicy::AllPages, 4), h[..4]);
        assert_eq!(read(HostComponent::Swa, trailing(3), 5), h[2..5]);
        assert_eq!(read(HostComponent::Swa, trailing(3), 2), h[..2]);
        assert_eq!(read(HostComponent::Mamba, trailing(1), 5), h[4..5]);
        assert!(read(HostComponent::Mamba, trailing(1), 0).is_empty());
        assert!(
            l.read_keys(HostComponent::Kv, HitPolicy::AllPages, &h, 7)
                .is_err()
        );
    }

    fn trailing(window: usize) -> HitPolicy {
        HitPolicy::TrailingPages { window }
    }

    /// The verdicts of the Python package's `hit_policy.evaluate` (which its tests check
    /// against SGLang's HiCacheFile) for the patterns of its tests, computed by running it.
    #[test]
    fn verdicts_match_the_python_package() {
        let (f, t) = (false, true);
        // test_our_storage_answers_hit_policies_as_hicache_file: KV [t, t, t, t, t, f].
        let mamba = [f, t, f, t, t, f];
        let swa = [t, f, t, t, t, t];
        let v = restorable(5, &[(trailing(1), &mamba)]);
        assert_eq!(
            (v.hit_pages, v.pool_hits, v.restorable),
            (5, vec![5], vec![2, 4, 5])
        );
        let v = restorable(5, &[(trailing(2), &swa)]);
        assert_eq!((v.hit_pages, v.restorable), (5, vec![1, 4, 5]));
        let v = restorable(5, &[(trailing(2), &swa), (trailing(1), &mamba)]);
        assert_eq!(
            (v.hit_pages, v.pool_hits, v.restorable),
            (5, vec![5, 5], vec![4, 5])
        );
        let v = restorable(5, &[(trailing(3), &mamba)]);
        assert_eq!(
            (v.hit_pages, v.pool_hits, v.restorable),
            (0, vec![0], vec![])
        );
        // A window of 0 is 1.
        let v = restorable(5, &[(trailing(0), &swa)]);
        assert_eq!(v.restorable, vec![1, 3, 4, 5]);
        // all_pages then two trailing pools over 8 pages.
        let indexer = [t, t, t, t, t, f, t, t];
        let swa8 = [f, t, t, t, t, t, f, t];
        let mamba8 = [t, t, f, t, t, t, t, f];
        let v = restorable(
            8,
            &[
                (HitPolicy::AllPages, &indexer),
                (trailing(2), &swa8),
                (trailing(1), &mamba8),
            ],
        );
        assert_eq!((v.hit_pages, v.kv_pages), (5, 8));
        assert_eq!((v.pool_hits, v.restorable), (vec![5, 6, 7], vec![4, 5]));
        // Exhausted by the first pool: the next gets no verdict.
        let v = restorable(4, &[(HitPolicy::AllPages, &[f; 4]), (trailing(1), &[t; 4])]);
        assert_eq!(
            (v.hit_pages, v.pool_hits, v.restorable),
            (0, vec![0, 0], vec![])
        );
        assert_eq!(
            restorable(0, &[(trailing(1), &[t; 4])]),
            HitVerdict {
                pool_hits: vec![0],
                ..Default::default()
            }
        );
    }

    /// The naive model: the Python `evaluate` with sets, pool by pool.
    fn model(kv: usize, pools: &[(HitPolicy, Vec<bool>)]) -> (usize, Vec<usize>, Vec<usize>) {
        let has = |p: &[bool], i: usize| i < p.len() && p[i];
        let mut rest: Vec<usize> = (1..=kv).collect();
        let mut hits = Vec::new();
        for (policy, present) in pools {
            if rest.is_empty() {
                hits.push(0);
                continue;
            }
            let allowed: Vec<usize> = match *policy {
                HitPolicy::AllPages => {
                    let b = (0..kv).take_while(|&i| has(present, i)).count();
                    (1..=b).collect()
                }
                HitPolicy::TrailingPages { window } => {
                    let w = window.max(1);
                    (1..=kv)
                        .filter(|&p| (p.saturating_sub(w)..p).all(|i| has(present, i)))
                        .collect()
                }
            };
            hits.push(allowed.iter().copied().max().unwrap_or(0));
            rest.retain(|p| allowed.contains(p));
        }
        (rest.last().copied().unwrap_or(0), hits, rest)
    }

    fn pool() -> impl Strategy<Value = (HitPolicy, Vec<bool>)> {
        let policy = prop_oneof![
            Just(HitPolicy::AllPages),
            (0usize..5).prop_map(|window| HitPolicy::TrailingPages { window }),
        ];
        (
            policy,
            proptest::collection::vec(proptest::bool::weighted(0.75), 0..14),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// `restorable` gives the model's hit, per-pool verdicts and restorable lengths.
        #[test]
        fn restorable_matches_the_model(
            kv in 0usize..12,
            pools in proptest::collection::vec(pool(), 0..4),
        ) {
            let borrowed: Vec<(HitPolicy, &[bool])> =
                pools.iter().map(|(p, v)| (*p, v.as_slice())).collect();
            let got = restorable(kv, &borrowed);
            let (hit, hits, rest) = model(kv, &pools);
            prop_assert_eq!(got.hit_pages, hit);
            prop_assert_eq!(got.kv_pages, kv);
            prop_assert_eq!(got.pool_hits, hits);
            prop_assert_eq!(got.restorable, rest);
        }
    }
}
