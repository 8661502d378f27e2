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
