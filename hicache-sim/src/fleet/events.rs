//! The facade's KV events as the index's feed reads them: `hicache_core::KvEvent` (what
//! `HiCache::drain_events` returns, the same events the ZMQ publisher sends) converted to
//! [`hicache_index::EngineEvent`], hashes as the wire carries them (`PageHash::event_id`).

use hicache_core::{KvEvent, Medium};
use hicache_index::EngineEvent;

fn medium_name(m: Medium) -> &'static str {
    match m {
        Medium::Gpu => "GPU",
        Medium::CpuPinned => "CPU_PINNED",
        Medium::Storage => "STORAGE",
    }
}

/// The index's form of one facade event.
pub fn engine_event(e: &KvEvent) -> EngineEvent {
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            ..
        } => EngineEvent::BlockStored {
            block_hashes: block_hashes.iter().map(|h| h.event_id()).collect(),
            parent_block_hash: parent_block_hash.as_ref().map(|h| h.event_id()),
            token_ids: token_ids.clone(),
            block_size: *block_size,
            lora_id: None,
            medium: Some(medium_name(*medium).into()),
        },
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            ..
        } => EngineEvent::BlockRemoved {
            block_hashes: block_hashes.iter().map(|h| h.event_id()).collect(),
            medium: Some(medium_name(*medium).into()),
        },
        KvEvent::AllBlocksCleared => EngineEvent::AllBlocksCleared,
    }
}
