//! SGLang's KV-event wire format (`sglang/srt/disaggregation/kv_events.py`, 0.5.23), which
//! SGLang's and Dynamo's routers decode.
//!
//! One ZMQ message per batch, three frames: `topic`, the batch's sequence number as 8 bytes
//! big-endian, and the msgpack payload. The payload is a `KVEventBatch`, a positional array
//! `[ts, events, attn_dp_rank]` (`ts` in seconds since the epoch as a float). Each event is a
//! msgpack map tagged by its class name under `type` (msgspec's `tag=True`), with optional
//! fields left at `None` omitted (`omit_defaults=True`):
//!
//! - `BlockStored`: `block_hashes` (int64 each), `parent_block_hash` (int64 or nil),
//!   `token_ids`, `block_size`, `lora_id` (nil), `medium`;
//! - `BlockRemoved`: `block_hashes`, `medium`;
//! - `AllBlocksCleared`: no field.
//!
//! With `kv_events_config`'s `component_events` (our extension, hybrid models only), a
//! hybrid cache also publishes its sliding-window pages and Mamba states as `BlockStored` /
//! `BlockRemoved` followed by vLLM 0.33's fields `group_idx` (Full attention is group 0, then
//! SWA, then Mamba), `kv_cache_spec_kind` (`sliding_window`, `mamba`) and, for SWA stores,
//! `kv_cache_spec_sliding_window` (tokens); removals carry the kind too. Full-attention events
//! never carry those fields: with the option off or on, they are byte for byte the same.
//!
//! A block hash on the wire is the first 8 bytes of the page hash read as a big-endian two's
//! complement integer (SGLang: "the first 16 hex digits, as int64"). The medium is `GPU`
//! (L1), `CPU_PINNED` (L2), `DISK` (L3 on a local disk) or `EXTERNAL` (L3 elsewhere).

use hicache_core::{ComponentKvEvent, KvEvent, Medium, PageHash};
use serde::Serialize;

/// Where an L3 backend keeps pages, as the wire names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum L3Medium {
    /// A local disk (`file`, `uring`): `DISK`.
    Disk,
    /// Anything else (remote memory, a shared cluster, a plugin): `EXTERNAL`.
    External,
}

impl L3Medium {
    /// The medium of an L3 backend by its registry name: `file` and `uring` write local disks,
    /// every other backend (rdma, redis, plugin, memory) keeps pages outside this process's
    /// disks.
    pub fn of_backend(name: &str) -> Self {
        match name {
            "file" | "uring" => L3Medium::Disk,
            _ => L3Medium::External,
        }
    }

    /// The medium of a cache's L3 stores: that of its attached backend, named by `name`;
    /// `External` when none is attached (no L3 event is published then).
    pub fn of_attached(name: Option<&str>) -> Self {
        name.map_or(L3Medium::External, Self::of_backend)
    }
}

/// The wire's int64 for a page hash: its first 8 bytes, big-endian, two's complement.
pub fn wire_hash(h: &PageHash) -> i64 {
    let b = h.as_bytes();
    i64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

fn medium_name(m: Medium, l3: L3Medium) -> &'static str {
    match (m, l3) {
        (Medium::Gpu, _) => "GPU",
        (Medium::CpuPinned, _) => "CPU_PINNED",
        (Medium::Storage, L3Medium::Disk) => "DISK",
        (Medium::Storage, L3Medium::External) => "EXTERNAL",
    }
}

/// One event as SGLang encodes it (field order and names are SGLang's).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum WireEvent {
    /// Pages became resident in `medium`.
    BlockStored {
        /// One int64 per page.
        block_hashes: Vec<i64>,
        /// The page before the first one, or nil.
        parent_block_hash: Option<i64>,
        /// The tokens of the pages.
        token_ids: Vec<u32>,
        /// Tokens per page.
        block_size: u32,
        /// Always nil: LoRA adapters are part of the tenant, hence of the hashes.
        lora_id: Option<i64>,
        /// `GPU`, `CPU_PINNED`, `DISK` or `EXTERNAL`.
        medium: &'static str,
    },
    /// Pages left `medium`.
    BlockRemoved {
        /// One int64 per page.
        block_hashes: Vec<i64>,
        /// `GPU`, `CPU_PINNED`, `DISK` or `EXTERNAL`.
        medium: &'static str,
    },
    /// Everything was dropped.
    AllBlocksCleared,
    /// A hybrid model's SWA pages or Mamba state became resident in `medium` (our opt-in
    /// extension, `component_events`): SGLang's `BlockStored` fields, then vLLM's
    /// `group_idx`, `kv_cache_spec_kind` and (SWA only) `kv_cache_spec_sliding_window`.
    #[serde(rename = "BlockStored")]
    ComponentStored {
        /// One int64 per page (a Mamba state: the hash of the last page it covers).
        block_hashes: Vec<i64>,
        /// The page before the first one, or nil.
        parent_block_hash: Option<i64>,
        /// The tokens of the pages.
        token_ids: Vec<u32>,
        /// Tokens per page.
        block_size: u32,
        /// Always nil.
        lora_id: Option<i64>,
        /// `GPU`, `CPU_PINNED`, `DISK` or `EXTERNAL`.
        medium: &'static str,
        /// The KV-cache group (Full attention is group 0).
        group_idx: u32,
        /// `sliding_window` or `mamba`.
        kv_cache_spec_kind: &'static str,
        /// The window in tokens (SWA only; omitted for Mamba).
        #[serde(skip_serializing_if = "Option::is_none")]
        kv_cache_spec_sliding_window: Option<u32>,
    },
    /// A hybrid model's SWA pages or Mamba state left `medium` (the extension): SGLang's
    /// `BlockRemoved` fields, then `group_idx` (as vLLM's) and `kv_cache_spec_kind` (ours:
    /// vLLM leaves it to the group's stores), so each event says what it removes.
    #[serde(rename = "BlockRemoved")]
    ComponentRemoved {
        /// One int64 per page.
        block_hashes: Vec<i64>,
        /// `GPU`, `CPU_PINNED`, `DISK` or `EXTERNAL`.
        medium: &'static str,
        /// The KV-cache group.
        group_idx: u32,
        /// `sliding_window` or `mamba`.
        kv_cache_spec_kind: &'static str,
    },
}

impl WireEvent {
    /// The wire form of a cache event; `l3` names the medium of `Medium::Storage` events.
    pub fn from_event(e: &KvEvent, l3: L3Medium) -> Self {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                ..
            } => WireEvent::BlockStored {
                block_hashes: block_hashes.iter().map(wire_hash).collect(),
                parent_block_hash: parent_block_hash.as_ref().map(wire_hash),
                token_ids: token_ids.clone(),
                block_size: *block_size,
                lora_id: None,
                medium: medium_name(*medium, l3),
            },
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => WireEvent::BlockRemoved {
                block_hashes: block_hashes.iter().map(wire_hash).collect(),
                medium: medium_name(*medium, l3),
            },
            KvEvent::AllBlocksCleared => WireEvent::AllBlocksCleared,
        }
    }
}

impl WireEvent {
    /// The wire form of a hybrid cache's event: a Full event exactly as
    /// [`from_event`](Self::from_event) writes it, an SWA or Mamba one with its component's
    /// fields.
    pub fn from_component_event(e: &ComponentKvEvent, l3: L3Medium) -> Self {
        let Some(c) = e.component else {
            return Self::from_event(&e.event, l3);
        };
        match Self::from_event(&e.event, l3) {
            WireEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
            } => WireEvent::ComponentStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                group_idx: c.group(),
                kv_cache_spec_kind: c.spec_kind(),
                kv_cache_spec_sliding_window: c.window(),
            },
            WireEvent::BlockRemoved {
                block_hashes,
                medium,
            } => WireEvent::ComponentRemoved {
                block_hashes,
                medium,
                group_idx: c.group(),
                kv_cache_spec_kind: c.spec_kind(),
            },
            other => other,
        }
    }
}

/// Encodes one `KVEventBatch` payload: `[ts, events, attn_dp_rank]` with events as tagged maps.
pub fn encode_batch(
    ts: f64,
    events: &[WireEvent],
    attn_dp_rank: Option<i64>,
) -> Result<Vec<u8>, rmp_serde::encode::Error> {
    rmp_serde::to_vec_named(&(ts, events, attn_dp_rank))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_the_first_eight_bytes_big_endian_signed() {
        let mut b = [0u8; 32];
        b[0] = 0xff;
        b[7] = 0xfe;
        b[8] = 0x11; // beyond the 8 bytes: ignored
        assert_eq!(
            wire_hash(&PageHash(b)),
            i64::from_be_bytes([0xff, 0, 0, 0, 0, 0, 0, 0xfe])
        );
        assert!(wire_hash(&PageHash(b)) < 0);
    }

    #[test]
    fn a_batch_is_a_positional_array_of_tagged_maps() {
        let events = [
            WireEvent::BlockStored {
                block_hashes: vec![1, -2],
                parent_block_hash: None,
                token_ids: vec![7, 8, 9, 10],
                block_size: 2,
                lora_id: None,
                medium: "DISK",
            },
            WireEvent::AllBlocksCleared,
        ];
        let bytes = encode_batch(1.5, &events, None).unwrap();
        let v: rmpv::Value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let top = v.as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0].as_f64(), Some(1.5));
        assert!(top[2].is_nil());
        let evs = top[1].as_array().unwrap();
        let stored = evs[0].as_map().unwrap();
        let keys: Vec<&str> = stored.iter().map(|(k, _)| k.as_str().unwrap()).collect();
        assert_eq!(
            keys,
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium"
            ]
        );
        assert_eq!(stored[0].1.as_str(), Some("BlockStored"));
        assert_eq!(stored[1].1.as_array().unwrap()[1].as_i64(), Some(-2));
        assert!(stored[2].1.is_nil());
        assert_eq!(stored[6].1.as_str(), Some("DISK"));
        let cleared = evs[1].as_map().unwrap();
        assert_eq!(cleared.len(), 1);
        assert_eq!(cleared[0].1.as_str(), Some("AllBlocksCleared"));
    }

    #[test]
    fn component_events_carry_vllms_fields_and_full_ones_stay_as_they_were() {
        use hicache_core::{EventComponent, TenantId};
        let stored = KvEvent::BlockStored {
            tenant: TenantId::DEFAULT,
            block_hashes: vec![PageHash([1; 32])],
            parent_block_hash: None,
            token_ids: vec![5, 6],
            block_size: 2,
            medium: Medium::Gpu,
        };
        let removed = KvEvent::BlockRemoved {
            tenant: TenantId::DEFAULT,
            block_hashes: vec![PageHash([1; 32])],
            medium: Medium::Storage,
        };
        let tag = |component, event: &KvEvent| ComponentKvEvent {
            component,
            event: event.clone(),
        };
        let keys = |w: &WireEvent| -> Vec<String> {
            let bytes = encode_batch(0.0, std::slice::from_ref(w), None).unwrap();
            let v: rmpv::Value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
            v[1][0]
                .as_map()
                .unwrap()
                .iter()
                .map(|(k, _)| k.as_str().unwrap().to_string())
                .collect()
        };
        // Full: the dense wire form, byte for byte.
        for e in [&stored, &removed] {
            let l3 = L3Medium::Disk;
            let a = encode_batch(1.0, &[WireEvent::from_event(e, l3)], None).unwrap();
            let b = encode_batch(
                1.0,
                &[WireEvent::from_component_event(&tag(None, e), l3)],
                None,
            )
            .unwrap();
            assert_eq!(a, b);
        }
        let swa = Some(EventComponent::SlidingWindow {
            window: 8,
            group: 1,
        });
        let w = WireEvent::from_component_event(&tag(swa, &stored), L3Medium::Disk);
        assert_eq!(
            keys(&w),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "group_idx",
                "kv_cache_spec_kind",
                "kv_cache_spec_sliding_window"
            ]
        );
        let mamba = Some(EventComponent::Mamba { group: 2 });
        let w = WireEvent::from_component_event(&tag(mamba, &stored), L3Medium::Disk);
        assert_eq!(keys(&w).len(), 9, "no window for Mamba");
        let w = WireEvent::from_component_event(&tag(mamba, &removed), L3Medium::Disk);
        assert_eq!(
            w,
            WireEvent::ComponentRemoved {
                block_hashes: vec![wire_hash(&PageHash([1; 32]))],
                medium: "DISK",
                group_idx: 2,
                kv_cache_spec_kind: "mamba",
            }
        );
        assert_eq!(
            keys(&w),
            [
                "type",
                "block_hashes",
                "medium",
                "group_idx",
                "kv_cache_spec_kind"
            ]
        );
    }

    #[test]
    fn l3_medium_follows_the_backend() {
        assert_eq!(L3Medium::of_backend("file"), L3Medium::Disk);
        assert_eq!(L3Medium::of_backend("uring"), L3Medium::Disk);
        assert_eq!(L3Medium::of_backend("rdma"), L3Medium::External);
        assert_eq!(L3Medium::of_backend("redis"), L3Medium::External);
    }
}
