//! [`Events`]: the KV events of the hybrid facade, for KV-aware routers.
//!
//! Full-attention pages: `BlockStored` / `BlockRemoved` per medium (GPU, CPU_PINNED, and
//! STORAGE once an L3 backup stored them), as the dense tree emits them: one event per run of
//! pages an operation stores or removes, hashes from the page-hash chain of the cache's
//! namespace. This is what SGLang 0.5.23's `UnifiedRadixCache` publishes (one store / remove
//! per node with the node's page hashes, GPU on insert and load-back, CPU_PINNED on backup
//! and host insert, removals on device and host eviction); its `BlockStored` names no
//! component.
//!
//! With component events on (`kv_events_config`'s `component_events`, or
//! [`HybridCacheBuilder::component_events`](super::HybridCacheBuilder::component_events)),
//! the SWA pages and the Mamba states get events of their own, tagged with their
//! [`EventComponent`]: SWA pages under the hashes of the pages they hold (the same chain as
//! the Full pages), a Mamba state under the hash of the last page of the node that holds it.
//! Full events are the same with the option on or off. Off, nothing of the two components
//! is kept or emitted.
//!
//! Invariant (for each component `c` the events follow, and each of device and host): a slot
//! of `c` has an identity in that medium's map exactly while the tree holds it there — set
//! when the tree adopts the slot (insert, load-back, backup to host, L3 prefetch insert),
//! removed when an eviction reports it (device eviction, SWA tombstoning, host eviction) or an
//! insert hands a tree page back; each change emits the matching event. L3 residency is not
//! mapped (the storage keeps pages the tree may drop): a finished L3 backup emits a STORAGE
//! store of the pages it wrote, per component.

use std::collections::HashMap;

use hicache_core::{
    Component, ComponentKvEvent, EventComponent, KvEvent, Medium, PageHash, PageHasher, TenantId,
};

use super::pools::COMPONENTS;

/// One page's identity in the events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PageInfo {
    hash: PageHash,
    parent: Option<PageHash>,
    tokens: Vec<u32>,
}

/// Which components of the model get events besides Full, and their tags.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Tags {
    /// The SWA component's tag, when the model has one and component events are on.
    pub swa: Option<EventComponent>,
    /// The Mamba component's tag, when the model has one and component events are on.
    pub mamba: Option<EventComponent>,
}

impl Tags {
    /// The tags of a model with an SWA window of `swa_window` tokens and/or Mamba, numbered
    /// as vLLM numbers KV-cache groups: Full is group 0, then SWA, then Mamba.
    pub fn of_model(swa_window: Option<u32>, mamba: bool) -> Self {
        let swa = swa_window.map(|window| EventComponent::SlidingWindow { window, group: 1 });
        let group = 1 + u32::from(swa.is_some());
        Self {
            swa,
            mamba: mamba.then_some(EventComponent::Mamba { group }),
        }
    }

    fn of(&self, c: Component) -> Option<EventComponent> {
        match c {
            Component::Full => None,
            Component::Swa => self.swa,
            Component::Mamba => self.mamba,
        }
    }
}

/// The events buffer and the page identity of every slot the tree holds, per component and
/// medium (device, host).
pub(crate) struct Events {
    hasher: PageHasher,
    prior: Option<PageHash>,
    page_size: u32,
    enabled: bool,
    tags: Tags,
    /// `[component][device, host]`: slot → identity (Full always; SWA and Mamba only with
    /// their tag).
    ids: [[HashMap<u32, PageInfo>; 2]; 3],
    out: Vec<ComponentKvEvent>,
}

impl Events {
    /// Events with `hasher`'s chain (started at `prior`); nothing is kept unless `enabled`;
    /// the components of `tags` get events of their own.
    pub fn new(hasher: PageHasher, prior: Option<PageHash>, enabled: bool, tags: Tags) -> Self {
        Self {
            page_size: hasher.page_size(),
            hasher,
            prior,
            enabled,
            tags: if enabled { tags } else { Tags::default() },
            ids: Default::default(),
            out: Vec::new(),
        }
    }

    /// Whether component `c`'s slots get events (Full: whenever events are on).
    pub fn follows(&self, c: Component) -> bool {
        self.enabled && (c == Component::Full || self.tags.of(c).is_some())
    }

    /// The identities of the whole pages of `tokens` (from the root).
    pub fn pages(&self, tokens: &[u32]) -> Vec<PageInfo> {
        if !self.enabled {
            return Vec::new();
        }
        let hashes = self.hasher.hash_pages(self.prior, tokens);
        let ps = self.page_size as usize;
        let mut parent = None;
        hashes
            .into_iter()
            .enumerate()
            .map(|(k, hash)| {
                let info = PageInfo {
                    hash,
                    parent,
                    tokens: tokens[k * ps..(k + 1) * ps].to_vec(),
                };
                parent = Some(hash);
                info
            })
            .collect()
    }

    /// The map of `c`'s slots in `medium`; `None` for STORAGE (not mapped).
    fn map(&mut self, c: Component, medium: Medium) -> Option<&mut HashMap<u32, PageInfo>> {
        let m = match (c, medium) {
            (_, Medium::Gpu) => 0,
            (_, Medium::CpuPinned) => 1,
            // Full keeps its historical entry: the host map, rewritten with the same
            // identity (the slot is the host slot the backup read).
            (Component::Full, Medium::Storage) => 1,
            (_, Medium::Storage) => return None,
        };
        Some(&mut self.ids[c as usize][m])
    }

    /// The tree now holds Full `slots` in `medium` with identities `infos` (paired in order).
    pub fn stored(&mut self, medium: Medium, slots: &[u32], infos: Vec<PageInfo>) {
        self.stored_of(Component::Full, medium, slots, infos);
    }

    /// The tree now holds `c`'s `slots` in `medium` with identities `infos` (paired in
    /// order): one event per run of consecutive pages, every component alike. Invariant: an
    /// event's pages form a chain from its parent (`parent_block_hash`, then each page the
    /// parent of the next), as SGLang's format and the fleet index read it; a page left out
    /// (already resident, e.g. beside pages an insert replaced) starts a new event.
    pub fn stored_of(&mut self, c: Component, medium: Medium, slots: &[u32], infos: Vec<PageInfo>) {
        if !self.follows(c) || infos.is_empty() {
            return;
        }
        let tag = self.tags.of(c);
        for run in infos.chunk_by(|a, b| b.parent == Some(a.hash)) {
            let event = KvEvent::BlockStored {
                tenant: TenantId::DEFAULT,
                block_hashes: run.iter().map(|i| i.hash).collect(),
                parent_block_hash: run[0].parent,
                token_ids: run.iter().flat_map(|i| i.tokens.iter().copied()).collect(),
                block_size: self.page_size,
                medium,
            };
            self.out.push(ComponentKvEvent {
                component: tag,
                event,
            });
        }
        if let Some(map) = self.map(c, medium) {
            for (&s, info) in slots.iter().zip(infos) {
                map.insert(s, info);
            }
        }
    }

    /// [`copied_of`](Self::copied_of) for every component: `from[k]` of `src` copied into
    /// `to[k]` of `dst`, per component in [`COMPONENTS`] order.
    pub fn copied_all(&mut self, src: Medium, from: [&[u32]; 3], dst: Medium, to: [&[u32]; 3]) {
        for ((c, from), to) in COMPONENTS.into_iter().zip(from).zip(to) {
            self.copied_of(c, src, from, dst, to);
        }
    }

    /// Copies the identities of `c`'s `from` slots (in `src`) to `to` slots (in `dst`): a
    /// backup, a load-back or an L3 backup; emits the stored event.
    pub fn copied_of(&mut self, c: Component, src: Medium, from: &[u32], dst: Medium, to: &[u32]) {
        if !self.follows(c) || from.is_empty() {
            return;
        }
        let Some(map) = self.map(c, src) else { return };
        let infos: Option<Vec<PageInfo>> = from.iter().map(|s| map.get(s).cloned()).collect();
        if let Some(infos) = infos {
            self.stored_of(c, dst, to, infos);
        }
    }

    /// Whether device slot `slot` of `c` has an identity (the tree held it before).
    pub fn on_device(&self, c: Component, slot: u32) -> bool {
        self.ids[c as usize][0].contains_key(&slot)
    }

    /// The tree released Full `slots` of `medium`.
    pub fn removed(&mut self, medium: Medium, slots: &[u32]) {
        self.removed_of(Component::Full, medium, slots);
    }

    /// The tree released `c`'s `slots` of `medium`.
    pub fn removed_of(&mut self, c: Component, medium: Medium, slots: &[u32]) {
        if !self.follows(c) || slots.is_empty() {
            return;
        }
        let tag = self.tags.of(c);
        let Some(map) = self.map(c, medium) else {
            return;
        };
        let hashes: Vec<PageHash> = slots
            .iter()
            .filter_map(|s| map.remove(s).map(|i| i.hash))
            .collect();
        if !hashes.is_empty() {
            self.out.push(ComponentKvEvent {
                component: tag,
                event: KvEvent::BlockRemoved {
                    tenant: TenantId::DEFAULT,
                    block_hashes: hashes,
                    medium,
                },
            });
        }
    }

    /// The Full events since the last call (component events are dropped: see
    /// [`drain_tagged`](Self::drain_tagged)).
    pub fn drain(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.out)
            .into_iter()
            .filter(|e| e.component.is_none())
            .map(|e| e.event)
            .collect()
    }

    /// Every event since the last call, Full and per component, in order.
    pub fn drain_tagged(&mut self) -> Vec<ComponentKvEvent> {
        std::mem::take(&mut self.out)
    }

    /// Whether component events are on.
    pub fn tagged(&self) -> bool {
        self.tags != Tags::default()
    }
}
