//! KV events, as SGLang publishes them for KV-aware routers: what a router needs to track which
//! pages an instance holds in which tier. The tree appends events to a buffer when events are
//! enabled; the consumer drains it with the tree's `HiRadixTree::drain_events`.
//!
//! One event covers one node (a run of consecutive pages of one sequence): SGLang emits one
//! `BlockStored` per page and coalesces consecutive ones in its queue, which yields the same
//! run. Hashes are the tree's page hashes; [`PageHash::event_id`] gives the signed 64-bit id
//! SGLang's events carry.

use serde::{Deserialize, Serialize};

use crate::key::{PageHash, TenantId};

/// The tier an event is about.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Medium {
    /// Device (L1) memory.
    #[serde(rename = "GPU")]
    Gpu,
    /// Pinned host (L2) memory.
    #[serde(rename = "CPU_PINNED")]
    CpuPinned,
    /// L3 storage (emitted by the controller, never by the tree).
    #[serde(rename = "STORAGE")]
    Storage,
}

/// One KV event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    /// Pages became resident in `medium`.
    BlockStored {
        /// The tenant (extra key, cache salt) the pages belong to.
        tenant: TenantId,
        /// One hash per page, in sequence order.
        block_hashes: Vec<PageHash>,
        /// The hash of the page before the first one; `None` at the start of a sequence.
        parent_block_hash: Option<PageHash>,
        /// The tokens of the pages.
        token_ids: Vec<u32>,
        /// Tokens per page.
        block_size: u32,
        /// Where the pages now live.
        medium: Medium,
    },
    /// Pages stopped being resident in `medium`.
    BlockRemoved {
        /// The tenant the pages belong to.
        tenant: TenantId,
        /// One hash per page.
        block_hashes: Vec<PageHash>,
        /// The tier they left.
        medium: Medium,
    },
    /// Everything was dropped (reset).
    AllBlocksCleared,
}

impl KvEvent {
    /// The medium of a stored/removed event.
    pub fn medium(&self) -> Option<Medium> {
        match self {
            KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. } => {
                Some(*medium)
            }
            KvEvent::AllBlocksCleared => None,
        }
    }
}

/// The part of a hybrid model's cache an event is about, besides its Full-attention pages
/// (vLLM's `kv_cache_spec_kind`): a hybrid cache with component events on publishes these
/// for its sliding-window pages and Mamba states, under the page hashes of the same chain as
/// the Full pages. SGLang's format has no field for it: on the wire it is an opt-in extension
/// (`kv_events_config`'s `component_events`) carrying vLLM's field names.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EventComponent {
    /// Sliding-window attention KV pages (`kv_cache_spec_kind: "sliding_window"`).
    SlidingWindow {
        /// The window in tokens (`kv_cache_spec_sliding_window`).
        window: u32,
        /// The KV-cache group (`group_idx`; Full attention is group 0).
        group: u32,
    },
    /// A Mamba state, stored under the hash of the last page it covers
    /// (`kv_cache_spec_kind: "mamba"`).
    Mamba {
        /// The KV-cache group (`group_idx`).
        group: u32,
    },
}

impl EventComponent {
    /// vLLM's `kv_cache_spec_kind` of the component.
    pub fn spec_kind(self) -> &'static str {
        match self {
            EventComponent::SlidingWindow { .. } => "sliding_window",
            EventComponent::Mamba { .. } => "mamba",
        }
    }

    /// vLLM's `group_idx` of the component.
    pub fn group(self) -> u32 {
        match self {
            EventComponent::SlidingWindow { group, .. } | EventComponent::Mamba { group } => group,
        }
    }

    /// The window in tokens of a sliding-window component.
    pub fn window(self) -> Option<u32> {
        match self {
            EventComponent::SlidingWindow { window, .. } => Some(window),
            EventComponent::Mamba { .. } => None,
        }
    }
}

/// A KV event of a hybrid cache: `component` is `None` for a Full-attention event (exactly
/// the dense event) and names the SWA or Mamba part otherwise.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComponentKvEvent {
    /// The part of the cache the event is about; `None`: Full attention.
    pub component: Option<EventComponent>,
    /// The event.
    pub event: KvEvent,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialise_with_sglang_medium_names() {
        let e = KvEvent::BlockRemoved {
            tenant: TenantId::DEFAULT,
            block_hashes: vec![PageHash([1; 32])],
            medium: Medium::CpuPinned,
        };
        let v: serde_json::Value = serde_json::to_value(&e).unwrap();
        assert_eq!(v["type"], "BlockRemoved");
        assert_eq!(v["medium"], "CPU_PINNED");
        assert_eq!(e.medium(), Some(Medium::CpuPinned));
        let back: KvEvent = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
    }
}
