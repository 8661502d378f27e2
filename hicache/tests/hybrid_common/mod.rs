//! A small engine for the hybrid facade's tests: it writes a deterministic pattern into
//! every page (per component) and state it computes, and checks every prefix it is handed
//! against the same pattern, so a page or state served from the wrong place fails.
#![allow(dead_code)]

use hicache::{
    Component, DType, DeviceSlot, HybridAdmission, HybridCache, HybridCacheBuilder, HybridConfig,
    HybridDemand, HybridExtent, HybridSlots, KvKind, KvShape, MambaShape,
};
use hicache_core::PageHasher;

/// A small MHA shape (`layers` layers).
pub fn kv_shape(page_size: u32, layers: u32) -> KvShape {
    KvShape {
        kind: KvKind::Mha {
            heads: 2,
            head_dim: 16,
        },
        layers,
        dtype: DType::Bf16,
        page_size,
    }
}

/// A small Mamba state: 3 layers, a temporal piece and two conv pieces.
pub fn mamba_shape() -> MambaShape {
    MambaShape {
        layers: 3,
        temporal_elems: 64,
        temporal_dtype: DType::F32,
        conv_elems: vec![48, 16],
        conv_dtype: DType::Bf16,
    }
}

/// A builder of the test shapes for `cfg`'s components: `device` pages per KV component and
/// 8 device states, 64 host pages per KV component and 16 host states, on the test device.
pub fn builder(cfg: HybridConfig, device: usize) -> HybridCacheBuilder {
    let ps = cfg.page_size;
    let swa = cfg.swa_window.is_some();
    let mamba = cfg.mamba_chunk.is_some();
    let mut b = HybridCache::builder(cfg)
        .device(crate::common::test_device())
        .full_shape(kv_shape(ps, 4))
        .device_pages(device, if swa { device } else { 0 })
        .host_pages(64, 64)
        .host_reserve_bytes(0);
    if swa {
        b = b.swa_shape(kv_shape(ps, 2));
    }
    if mamba {
        b = b
            .mamba_shape(mamba_shape())
            .mamba_slots(8)
            .host_mamba_slots(16);
    }
    b
}

/// `tokens` and then `extra` more tokens (a second turn of a conversation).
pub fn extended(tokens: &[u32], seed: u32, extra: usize) -> Vec<u32> {
    let mut v = tokens.to_vec();
    v.extend(prompt(seed, extra));
    v
}

/// `len` bytes derived from `salt` and the tokens `tokens`.
pub fn pattern(salt: u64, tokens: &[u32], len: usize) -> Vec<u8> {
    let h = PageHasher::hash_page(None, tokens);
    let mut x = u64::from_le_bytes(h.0[..8].try_into().unwrap()) ^ salt;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Deterministic tokens.
pub fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 100_000 + i).collect()
}

/// What one request saw.
#[derive(Debug)]
pub struct Run {
    /// The admission.
    pub admission: HybridAdmission,
    /// Prefix pages whose bytes were checked, per component (Full, SWA); states checked.
    pub checked: [usize; 3],
}

/// The engine: runs requests one at a time to completion.
pub struct Engine {
    /// The cache under test.
    pub cache: HybridCache,
    next: u64,
}

impl Engine {
    /// An engine over `cache`.
    pub fn new(cache: HybridCache) -> Self {
        Self { cache, next: 1 }
    }

    fn ps(&self) -> usize {
        self.cache.config().page_size as usize
    }

    fn has(&self, c: Component) -> bool {
        self.cache.tree().has(c)
    }

    fn write_page(&self, c: Component, slot: DeviceSlot, tokens: &[u32], page: usize) {
        let pool = self.cache.device_pool(c).unwrap();
        let end = ((page + 1) * self.ps()).min(tokens.len());
        let bytes = pattern(c as u64, &tokens[..end], pool.page_bytes());
        pool.write_page(slot, &bytes).unwrap();
    }

    fn page_ok(&self, c: Component, slot: DeviceSlot, tokens: &[u32], page: usize) -> bool {
        let pool = self.cache.device_pool(c).unwrap();
        let end = ((page + 1) * self.ps()).min(tokens.len());
        let mut got = vec![0u8; pool.page_bytes()];
        pool.read_page(slot, &mut got).unwrap();
        got == pattern(c as u64, &tokens[..end], pool.page_bytes())
    }

    /// Checks the admission's prefix bytes per component; the counts checked.
    fn check_prefix(&self, tokens: &[u32], a: &HybridAdmission) -> [usize; 3] {
        let mut n = [0; 3];
        for (p, &s) in a.slots.full.iter().enumerate() {
            assert!(self.page_ok(Component::Full, s, tokens, p), "Full page {p}");
            n[0] += 1;
        }
        for (p, s) in a.slots.swa.iter().enumerate() {
            if let Some(s) = *s {
                assert!(self.page_ok(Component::Swa, s, tokens, p), "SWA page {p}");
                n[1] += 1;
            }
        }
        if let Some(&s) = a.slots.mamba.first() {
            let want = pattern(2, &tokens[..a.cached_tokens()], self.cache.state_bytes());
            assert_eq!(self.cache.read_state(s).unwrap(), want, "Mamba state");
            n[2] += 1;
        }
        n
    }

    /// Runs `tokens` as one request: arrive, admit (prefix bytes checked), compute the rest
    /// (patterns written), finish, poll.
    pub fn run(&mut self, tokens: &[u32]) -> Run {
        let req = self.arrive(tokens);
        let c = &mut self.cache;
        c.poll().unwrap();
        if !c.prefetch_ready(req).unwrap() {
            // An L3 prefetch runs in the background: wait for it to end.
            c.flush().unwrap();
        }
        assert!(c.prefetch_ready(req).unwrap());
        self.finish(req, tokens)
    }

    /// A new request arrives (its L3 prefetch, if any, starts); its id.
    pub fn arrive(&mut self, tokens: &[u32]) -> u64 {
        let req = self.next;
        self.next += 1;
        self.cache.arrive(req, tokens).unwrap();
        req
    }

    /// The rest of [`run`](Self::run) for an arrived request whose prefetch has ended:
    /// admit, compute, finish, poll.
    pub fn finish(&mut self, req: u64, tokens: &[u32]) -> Run {
        let c = &mut self.cache;
        let admission = c.admit(req, tokens).unwrap();
        if let Some(b) = c.start_loading().unwrap() {
            c.wait_loaded(b).unwrap();
        }
        let checked = self.check_prefix(tokens, &admission);
        let pages = tokens.len().div_ceil(self.ps());
        let have = admission.slots.full.len();
        let swa = self.has(Component::Swa);
        let mamba = self.has(Component::Mamba);
        let own_state = admission.slots.mamba.first().copied();
        let demand = HybridDemand {
            full_pages: pages - have,
            swa_pages: if swa { pages - have } else { 0 },
            mamba_slots: usize::from(mamba && own_state.is_none()),
        };
        // Nodes whose copies are in flight stay locked: when they hold the room, wait for
        // the copies (every rank decides alike, so every rank flushes here).
        let new = match self.cache.alloc(demand).unwrap() {
            Some(new) => new,
            None => {
                self.cache.flush().unwrap();
                let again = self.cache.alloc(demand).unwrap();
                again.expect("room once the copies finished")
            }
        };
        self.write_new(tokens, have, &new);
        let mut slots = admission.slots.clone();
        slots.extend(new);
        if swa {
            // The prefix's SWA pages outside the window stay `None`: the request has none.
            assert_eq!(slots.swa.len(), pages);
        }
        if let Some(&state) = slots.mamba.first() {
            let at = self.cache.insert_len(req, tokens.len()).unwrap();
            let bytes = pattern(2, &tokens[..at], self.cache.state_bytes());
            self.cache.write_state(state, &bytes).unwrap();
        }
        self.cache.cache_finished(req, tokens, slots).unwrap();
        self.cache.poll().unwrap();
        Run { admission, checked }
    }

    /// Admits an arrived request all or nothing ([`HybridCache::try_admit`]) for its
    /// prompt's pages and a state slot (with Mamba); `None` when it does not fit (the
    /// request stays arrived).
    pub fn try_admit(
        &mut self,
        req: u64,
        tokens: &[u32],
    ) -> Option<(HybridAdmission, HybridSlots)> {
        let extent = HybridExtent {
            pages: tokens.len().div_ceil(self.ps()),
            mamba_slots: usize::from(self.has(Component::Mamba)),
        };
        self.cache.try_admit(req, tokens, extent).unwrap()
    }

    /// Computes and finishes a request [`try_admit`](Self::try_admit) admitted: waits for
    /// its loads, checks its prefix bytes, writes its new pages and state, finishes it and
    /// polls.
    pub fn complete(
        &mut self,
        req: u64,
        tokens: &[u32],
        admission: HybridAdmission,
        new: HybridSlots,
    ) -> Run {
        if let Some(b) = self.cache.start_loading().unwrap() {
            self.cache.wait_loaded(b).unwrap();
        }
        let checked = self.check_prefix(tokens, &admission);
        let have = admission.slots.full.len();
        self.write_new(tokens, have, &new);
        let mut slots = admission.slots.clone();
        slots.extend(new);
        if let Some(&state) = slots.mamba.first() {
            let at = self.cache.insert_len(req, tokens.len()).unwrap();
            let bytes = pattern(2, &tokens[..at], self.cache.state_bytes());
            self.cache.write_state(state, &bytes).unwrap();
        }
        self.cache.cache_finished(req, tokens, slots).unwrap();
        self.cache.poll().unwrap();
        Run { admission, checked }
    }

    /// Computes a request's pages past its `have`-page prefix: writes `tokens`' patterns
    /// into its newly allocated Full and SWA slots `new`.
    pub fn write_new(&self, tokens: &[u32], have: usize, new: &HybridSlots) {
        for (k, &s) in new.full.iter().enumerate() {
            self.write_page(Component::Full, s, tokens, have + k);
        }
        for (k, s) in new.swa.iter().enumerate() {
            self.write_page(Component::Swa, s.unwrap(), tokens, have + k);
        }
    }

    /// [`run`](Self::run), then [`settle`](Self::settle).
    pub fn turn(&mut self, tokens: &[u32]) -> Run {
        let r = self.run(tokens);
        self.settle();
        r
    }

    /// Waits for every copy and finishes it.
    pub fn settle(&mut self) {
        self.cache.flush().unwrap();
        assert_eq!(self.cache.copies_in_flight(), 0);
        self.cache.tree().check_invariants().unwrap();
        self.assert_no_leaks();
    }

    /// With no request running: every device page and state is the tree's or free.
    pub fn assert_no_leaks(&self) {
        let tree = self.cache.tree();
        let ps = self.ps() as u64;
        for c in [Component::Full, Component::Swa] {
            if tree.has(c) {
                let pool = self.cache.device_pool(c).unwrap();
                let held = (tree.size(c) / ps) as usize;
                assert_eq!(
                    pool.available() + held,
                    pool.num_pages(),
                    "{c:?} pages leaked"
                );
            }
        }
        if tree.has(Component::Mamba) {
            let pool = self.cache.state_pool().unwrap();
            let held = tree.size(Component::Mamba) as usize;
            assert_eq!(pool.available() + held, pool.num_slots(), "states leaked");
        }
    }
}

/// Free slots the engine would hand back: none (a helper for tests that abort).
pub fn no_slots() -> HybridSlots {
    HybridSlots::default()
}
