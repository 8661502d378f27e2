//! Decoding `KVEventBatch` msgpack payloads into [`EngineEvent`]s.
//!
//! Three publishers, two formats (every one a positional array `[ts, events, dp_rank]` of
//! msgspec-tagged maps, `type` naming the event class, optional fields left at `None` omitted):
//!
//! - [`WireFormat::Sglang`]: SGLang 0.5.23's `sglang/srt/disaggregation/kv_events.py` and
//!   hicache-rs's own publisher (which writes SGLang's format). Block hashes are int64; media
//!   `GPU`, `CPU_PINNED`, `DISK`, `EXTERNAL`. `BlockStored` may also carry `cache_salt`,
//!   `session_id`, `lora_name` (attribution; ignored).
//! - [`WireFormat::Vllm`]: vLLM 0.33's `vllm/distributed/kv_events.py`. Block hashes are
//!   `bytes` (the SHA-256 digest, vLLM's default) or an unsigned 64-bit integer
//!   (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`); media `GPU`, `CPU`, `STORAGE`; `BlockStored`
//!   carries `lora_name`, `extra_keys`, `group_idx`, `kv_cache_spec_*`, `locality`,
//!   `ownership`, `session_id`, `lookahead_token_ids`, all optional.
//!
//! Rules:
//! 1. **Tolerant of unknown fields** (a newer engine adds optional fields) and of unknown event
//!    types (skipped and counted in [`DecodedBatch::skipped`]).
//! 2. **Strict about types**: a field this module reads that has the wrong msgpack type (a
//!    string where an int is due, a hash out of range, a token beyond `u32`) rejects the whole
//!    batch with a [`DecodeError`] that names the event and field; nothing of it is applied.
//! 3. A vLLM event of a KV-cache group other than 0 (hybrid models publish one stream of
//!    events per group) is skipped and counted: the index follows the first group only for
//!    its Full-attention table.
//! 6. **Components of hybrid models** ([`ComponentEvent`]): an event whose
//!    `kv_cache_spec_kind` is `sliding_window` / `sliding_window_mla` (window from
//!    `kv_cache_spec_sliding_window`) or `mamba` — vLLM's fields, which hicache-rs's publisher
//!    writes too when its `component_events` option is on — goes to
//!    [`DecodedBatch::components`], never to the Full table, in either format and whatever
//!    its group. A `BlockRemoved` without a kind (vLLM's) takes the kind its group's stores
//!    declared ([`GroupKinds`], kept per stream). Other kinds (`chunked_local_attention`,
//!    `unknown` …) are skipped and counted; `full_attention` / `mla_attention` (or no kind)
//!    is a Full event. `AllBlocksCleared` is mirrored into the components as
//!    [`ComponentEvent::Cleared`].
//! 5. What else a block's KV depends on keeps it apart from plain token queries: SGLang's
//!    `cache_salt` and vLLM's `extra_keys` of a sequence's first block (its cache salt, LoRA
//!    name) root the chain elsewhere, like a LoRA adapter; a vLLM event with extra keys on a
//!    later block (multimodal inputs) is skipped and counted, so its blocks and their children
//!    are misses, never wrong hits.
//! 4. An engine hash is reduced to the index's `i64` key of the engine-hash map: an int64 as
//!    is, a uint64 by its two's complement, a byte string by its last 8 bytes big-endian (what
//!    vLLM's integer mode keeps of the same digest).

use crate::ingest::EngineEvent;
use rmpv::Value;
use xxhash_rust::xxh3::xxh3_64;

/// Which engine's `KVEventBatch` format a stream carries.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireFormat {
    /// SGLang's (and hicache-rs's own publisher's).
    Sglang,
    /// vLLM's.
    Vllm,
}

/// One decoded batch.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedBatch {
    /// The publisher's timestamp (seconds since the epoch).
    pub ts: f64,
    /// The events the index applies, in order.
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank the publisher stamped, if any.
    pub dp_rank: Option<i64>,
    /// Events skipped: unknown types, vLLM groups other than 0.
    pub skipped: u32,
    /// The hybrid components' events (rule 6), in order.
    pub components: Vec<ComponentEvent>,
}

/// A hybrid model's part an event is about, besides its Full-attention pages.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ComponentKind {
    /// Sliding-window attention pages; the window in tokens.
    SlidingWindow {
        /// The window in tokens (0 when a removal did not say and no store declared it).
        window: u32,
    },
    /// A Mamba state, named by the hash of the last page it covers.
    Mamba,
}

/// One event about a hybrid model's SWA pages or Mamba states (rule 6).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ComponentEvent {
    /// The component became resident at these blocks in `medium`.
    Stored {
        /// The component.
        kind: ComponentKind,
        /// The engine's hash of each block.
        block_hashes: Vec<i64>,
        /// Tokens per block.
        block_size: u32,
        /// Where (as [`EngineEvent::BlockStored`]'s medium).
        medium: Option<String>,
    },
    /// The component left these blocks in `medium`.
    Removed {
        /// The component.
        kind: ComponentKind,
        /// The engine's hash of each block.
        block_hashes: Vec<i64>,
        /// Where from.
        medium: Option<String>,
    },
    /// The engine dropped everything.
    Cleared,
}

/// What one stream's stores said each KV-cache group is (vLLM's removals name the group
/// only): group → kind, `None` for a Full-attention group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupKinds {
    kinds: std::collections::BTreeMap<i64, Option<ComponentKind>>,
}

impl GroupKinds {
    /// None learned yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// What group `g` was declared as, if any store declared it.
    pub fn get(&self, g: i64) -> Option<Option<ComponentKind>> {
        self.kinds.get(&g).copied()
    }
}

/// How one event is classified by its component fields.
enum Part {
    Full,
    Component(ComponentKind),
    Skip,
}

/// Why a payload was rejected, and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are not one msgpack value.
    #[error("not msgpack: {0}")]
    Msgpack(String),
    /// The batch's outer shape is wrong.
    #[error("batch: {0}")]
    Batch(String),
    /// One event is wrong.
    #[error("event {index} ({kind}): field `{field}`: {problem}")]
    Event {
        /// The event's position in the batch.
        index: usize,
        /// Its `type` (or `?`).
        kind: String,
        /// The field.
        field: &'static str,
        /// What is wrong.
        problem: String,
    },
}

/// Largest payload decoded; larger ones are rejected without being parsed.
pub const MAX_PAYLOAD_BYTES: usize = 64 << 20;

/// Decodes one `KVEventBatch` payload of `format` on its own (no group learned from earlier
/// batches; see [`decode_batch_with`]).
pub fn decode_batch(format: WireFormat, payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    decode_batch_with(format, payload, &mut GroupKinds::new())
}

/// Decodes one `KVEventBatch` payload of `format`, with the group kinds its stream declared so
/// far (updated with this batch's stores).
pub fn decode_batch_with(
    format: WireFormat,
    payload: &[u8],
    groups: &mut GroupKinds,
) -> Result<DecodedBatch, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::Batch(format!(
            "{} bytes, more than the {MAX_PAYLOAD_BYTES} accepted",
            payload.len()
        )));
    }
    let mut rd = payload;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, 16)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::Msgpack(format!(
            "{} trailing bytes after the batch",
            rd.len()
        )));
    }
    let Value::Array(top) = v else {
        return Err(DecodeError::Batch(format!(
            "expected an array [ts, events, dp_rank], got {}",
            type_name(&v)
        )));
    };
    if top.len() < 2 {
        return Err(DecodeError::Batch(format!(
            "expected [ts, events, dp_rank?], got {} elements",
            top.len()
        )));
    }
    let ts = match &top[0] {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        Value::Integer(i) => i.as_f64().unwrap_or(0.0),
        other => {
            return Err(DecodeError::Batch(format!(
                "ts: expected a number, got {}",
                type_name(other)
            )));
        }
    };
    let Value::Array(raw_events) = &top[1] else {
        return Err(DecodeError::Batch(format!(
            "events: expected an array, got {}",
            type_name(&top[1])
        )));
    };
    let dp_rank = match top.get(2) {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(i)) => Some(
            i.as_i64()
                .ok_or_else(|| DecodeError::Batch("dp_rank: out of the int64 range".to_string()))?,
        ),
        Some(other) => {
            return Err(DecodeError::Batch(format!(
                "dp_rank: expected an int or nil, got {}",
                type_name(other)
            )));
        }
    };
    let mut out = DecodedBatch {
        ts,
        events: Vec::with_capacity(raw_events.len()),
        dp_rank,
        skipped: 0,
        components: Vec::new(),
    };
    // Group kinds take effect once the whole batch decoded (a rejected batch teaches nothing).
    let mut learned = groups.clone();
    for (index, raw) in raw_events.iter().enumerate() {
        match decode_event(format, index, raw, &mut learned)? {
            Some(Decoded::Full(e)) => {
                if matches!(e, EngineEvent::AllBlocksCleared) {
                    out.components.push(ComponentEvent::Cleared);
                }
                out.events.push(e);
            }
            Some(Decoded::Component(c)) => out.components.push(c),
            None => out.skipped += 1,
        }
    }
    *groups = learned;
    Ok(out)
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a bool",
        Value::Integer(_) => "an int",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension",
    }
}

/// The fields of one event map, by name (unknown ones kept but never read).
struct Fields<'a> {
    index: usize,
    kind: &'a str,
    map: &'a [(Value, Value)],
}

impl<'a> Fields<'a> {
    fn err(&self, field: &'static str, problem: impl Into<String>) -> DecodeError {
        DecodeError::Event {
            index: self.index,
            kind: self.kind.to_string(),
            field,
            problem: problem.into(),
        }
    }

    /// The field's value; `None` when absent or nil (msgspec omits `None` defaults).
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.map
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v)
            .filter(|v| !v.is_nil())
    }

    fn required(&self, name: &'static str) -> Result<&'a Value, DecodeError> {
        self.get(name).ok_or_else(|| self.err(name, "missing"))
    }

    fn int(&self, name: &'static str, v: &Value) -> Result<i64, DecodeError> {
        match v {
            Value::Integer(i) => i
                .as_i64()
                .ok_or_else(|| self.err(name, "out of the int64 range")),
            other => Err(self.err(name, format!("expected an int, got {}", type_name(other)))),
        }
    }

    fn opt_int(&self, name: &'static str) -> Result<Option<i64>, DecodeError> {
        self.get(name).map(|v| self.int(name, v)).transpose()
    }

    fn opt_str(&self, name: &'static str) -> Result<Option<&'a str>, DecodeError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => s
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(name, "not UTF-8")),
            Some(other) => {
                Err(self.err(name, format!("expected a string, got {}", type_name(other))))
            }
        }
    }

    fn array(&self, name: &'static str) -> Result<&'a [Value], DecodeError> {
        match self.required(name)? {
            Value::Array(a) => Ok(a),
            other => Err(self.err(name, format!("expected an array, got {}", type_name(other)))),
        }
    }

    /// An engine block hash reduced to the map's `i64` key (rule 4).
    fn hash(&self, format: WireFormat, name: &'static str, v: &Value) -> Result<i64, DecodeError> {
        match (format, v) {
            (WireFormat::Sglang, Value::Integer(i)) => i
                .as_i64()
                .ok_or_else(|| self.err(name, "out of the int64 range")),
            (WireFormat::Vllm, Value::Integer(i)) => match (i.as_i64(), i.as_u64()) {
                (Some(s), _) => Ok(s),
                (None, Some(u)) => Ok(u as i64),
                _ => Err(self.err(name, "out of the 64-bit range")),
            },
            (WireFormat::Vllm, Value::Binary(b)) if !b.is_empty() => {
                let mut last = [0u8; 8];
                let n = b.len().min(8);
                last[8 - n..].copy_from_slice(&b[b.len() - n..]);
                Ok(i64::from_be_bytes(last))
            }
            (_, other) => Err(self.err(
                name,
                format!("expected a block hash, got {}", type_name(other)),
            )),
        }
    }

    fn hashes(&self, format: WireFormat, name: &'static str) -> Result<Vec<i64>, DecodeError> {
        self.array(name)?
            .iter()
            .map(|v| self.hash(format, name, v))
            .collect()
    }
}

/// One decoded event: for the Full table, or about a hybrid component.
enum Decoded {
    Full(EngineEvent),
    Component(ComponentEvent),
}

/// Rule 6: what the event's `group_idx` / `kv_cache_spec_kind` make of it (a store declares
/// its group's kind in `groups`).
fn classify(
    f: &Fields<'_>,
    format: WireFormat,
    groups: &mut GroupKinds,
) -> Result<Part, DecodeError> {
    let group = f.opt_int("group_idx")?;
    let declared = match f.opt_str("kv_cache_spec_kind")? {
        None => None,
        Some("full_attention" | "mla_attention") => Some(None),
        Some("sliding_window" | "sliding_window_mla") => {
            let window = f.opt_int("kv_cache_spec_sliding_window")?;
            let window = match window.map(u32::try_from) {
                Some(Ok(w)) if w > 0 => w,
                // A removal may leave the window to the group's stores.
                None if f.kind == "BlockRemoved" => 0,
                // A store that does not say its window cannot be checked: skipped.
                None => return Ok(Part::Skip),
                _ => {
                    return Err(f.err(
                        "kv_cache_spec_sliding_window",
                        format!("{window:?} is not a window in tokens"),
                    ));
                }
            };
            Some(Some(ComponentKind::SlidingWindow { window }))
        }
        Some("mamba") => Some(Some(ComponentKind::Mamba)),
        Some(_) => return Ok(Part::Skip),
    };
    let kind = match (declared, group) {
        (Some(k), Some(g)) if f.kind == "BlockStored" => {
            groups.kinds.insert(g, k);
            k
        }
        (Some(Some(ComponentKind::SlidingWindow { window: 0 })), Some(g)) => match groups.get(g) {
            Some(Some(k @ ComponentKind::SlidingWindow { .. })) => Some(k),
            _ => Some(ComponentKind::SlidingWindow { window: 0 }),
        },
        (Some(k), _) => k,
        (None, Some(g)) => groups.get(g).flatten(),
        (None, None) => None,
    };
    Ok(match kind {
        Some(k) => Part::Component(k),
        None if format == WireFormat::Vllm && group.unwrap_or(0) != 0 => Part::Skip,
        None => Part::Full,
    })
}

fn decode_event(
    format: WireFormat,
    index: usize,
    raw: &Value,
    groups: &mut GroupKinds,
) -> Result<Option<Decoded>, DecodeError> {
    let bad = |problem: String| DecodeError::Event {
        index,
        kind: "?".into(),
        field: "type",
        problem,
    };
    let Value::Map(map) = raw else {
        return Err(bad(format!(
            "expected a tagged map, got {}",
            type_name(raw)
        )));
    };
    let kind = match map.iter().find(|(k, _)| k.as_str() == Some("type")) {
        Some((_, Value::String(s))) => s
            .as_str()
            .ok_or_else(|| bad("the tag is not UTF-8".into()))?,
        Some((_, other)) => {
            return Err(bad(format!("expected a string, got {}", type_name(other))));
        }
        None => return Err(bad("missing".into())),
    };
    let f = Fields { index, kind, map };
    if matches!(kind, "BlockStored" | "BlockRemoved") {
        match classify(&f, format, groups)? {
            Part::Full => {}
            Part::Skip => return Ok(None),
            Part::Component(c) => return decode_component(format, &f, c).map(Some),
        }
    }
    Ok(decode_full(format, &f)?.map(Decoded::Full))
}

/// A component's `BlockStored` / `BlockRemoved` (rule 6): the fields the index reads of it.
fn decode_component(
    format: WireFormat,
    f: &Fields<'_>,
    kind: ComponentKind,
) -> Result<Decoded, DecodeError> {
    let block_hashes = f.hashes(format, "block_hashes")?;
    let medium = f.opt_str("medium")?.map(str::to_string);
    Ok(Decoded::Component(if f.kind == "BlockStored" {
        let block_size = f.int("block_size", f.required("block_size")?)?;
        let block_size = u32::try_from(block_size)
            .ok()
            .filter(|b| *b > 0)
            .ok_or_else(|| f.err("block_size", format!("{block_size} is not a page size")))?;
        ComponentEvent::Stored {
            kind,
            block_hashes,
            block_size,
            medium,
        }
    } else {
        ComponentEvent::Removed {
            kind,
            block_hashes,
            medium,
        }
    }))
}

/// A Full-attention event (or `AllBlocksCleared`); `None` for an unknown type.
fn decode_full(format: WireFormat, f: &Fields<'_>) -> Result<Option<EngineEvent>, DecodeError> {
    match f.kind {
        "BlockStored" => {
            let block_hashes = f.hashes(format, "block_hashes")?;
            let parent_block_hash = f
                .get("parent_block_hash")
                .map(|v| f.hash(format, "parent_block_hash", v))
                .transpose()?;
            let token_ids = f
                .array("token_ids")?
                .iter()
                .map(|v| {
                    let t = f.int("token_ids", v)?;
                    u32::try_from(t).map_err(|_| f.err("token_ids", format!("{t} is not a u32")))
                })
                .collect::<Result<Vec<u32>, _>>()?;
            let block_size = f.int("block_size", f.required("block_size")?)?;
            let block_size = u32::try_from(block_size)
                .ok()
                .filter(|b| *b > 0)
                .ok_or_else(|| f.err("block_size", format!("{block_size} is not a page size")))?;
            let mut lora_id = f.opt_int("lora_id")?;
            if lora_id.is_none()
                && let Some(name) = f.opt_str("lora_name")?
            {
                // vLLM names adapters; the chain is rooted by an id, so the name is hashed.
                lora_id = Some(xxh3_64(name.as_bytes()) as i64);
            }
            // Rule 5: what else the KV depends on roots the chain apart, or drops the event.
            let mut salt = f.opt_str("cache_salt")?.map(|s| xxh3_64(s.as_bytes()));
            if let Some(Value::Array(extra)) = f.get("extra_keys") {
                for (i, k) in extra.iter().enumerate() {
                    if k.is_nil() {
                        continue;
                    }
                    if i > 0 || parent_block_hash.is_some() {
                        return Ok(None);
                    }
                    let mut bytes = Vec::new();
                    rmpv::encode::write_value(&mut bytes, k)
                        .map_err(|e| f.err("extra_keys", e.to_string()))?;
                    salt = Some(xxh3_64(&bytes) ^ salt.unwrap_or(0));
                }
            }
            if let Some(salt) = salt {
                let mut key = [0u8; 16];
                key[..8].copy_from_slice(&lora_id.unwrap_or(0).to_le_bytes());
                key[8..].copy_from_slice(&salt.to_le_bytes());
                lora_id = Some(xxh3_64(&key) as i64);
            }
            let medium = f.opt_str("medium")?.map(str::to_string);
            Ok(Some(EngineEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
            }))
        }
        "BlockRemoved" => Ok(Some(EngineEvent::BlockRemoved {
            block_hashes: f.hashes(format, "block_hashes")?,
            medium: f.opt_str("medium")?.map(str::to_string),
        })),
        "AllBlocksCleared" => Ok(Some(EngineEvent::AllBlocksCleared)),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn map(pairs: Vec<(&str, Value)>) -> Value {
        Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn batch(events: Vec<Value>) -> Vec<u8> {
        encode(&Value::Array(vec![
            Value::F64(1.7e9),
            Value::Array(events),
            Value::Nil,
        ]))
    }

    fn stored_sglang() -> Value {
        map(vec![
            ("type", s("BlockStored")),
            (
                "block_hashes",
                Value::Array(vec![Value::from(-5i64), Value::from(7i64)]),
            ),
            ("parent_block_hash", Value::from(3i64)),
            (
                "token_ids",
                Value::Array((1..=4u32).map(Value::from).collect()),
            ),
            ("block_size", Value::from(2)),
            ("medium", s("CPU_PINNED")),
            ("session_id", s("attribution only")),
            ("some_future_field", Value::Array(vec![])),
        ])
    }

    #[test]
    fn sglang_batches_decode_with_unknown_fields_and_types_skipped() {
        let payload = batch(vec![
            stored_sglang(),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", Value::Array(vec![Value::from(7)])),
            ]),
            map(vec![("type", s("AllBlocksCleared"))]),
            map(vec![("type", s("SomethingNew")), ("x", Value::from(1))]),
        ]);
        let b = decode_batch(WireFormat::Sglang, &payload).unwrap();
        assert_eq!(b.skipped, 1);
        assert_eq!(b.dp_rank, None);
        assert_eq!(
            b.events,
            vec![
                EngineEvent::BlockStored {
                    block_hashes: vec![-5, 7],
                    parent_block_hash: Some(3),
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora_id: None,
                    medium: Some("CPU_PINNED".into()),
                },
                EngineEvent::BlockRemoved {
                    block_hashes: vec![7],
                    medium: None
                },
                EngineEvent::AllBlocksCleared,
            ]
        );
    }

    #[test]
    fn vllm_hashes_are_bytes_or_unsigned_and_other_groups_are_skipped() {
        let mut digest = vec![0u8; 32];
        digest[31] = 9;
        digest[24] = 0x80;
        let payload = encode(&Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![
                map(vec![
                    ("type", s("BlockStored")),
                    (
                        "block_hashes",
                        Value::Array(vec![Value::Binary(digest), Value::from(u64::MAX)]),
                    ),
                    ("parent_block_hash", Value::Nil),
                    (
                        "token_ids",
                        Value::Array(vec![Value::from(1), Value::from(2)]),
                    ),
                    ("block_size", Value::from(1)),
                    ("lora_id", Value::Nil),
                    ("medium", s("GPU")),
                    ("lora_name", Value::Nil),
                    ("extra_keys", Value::Array(vec![Value::Nil, Value::Nil])),
                    ("group_idx", Value::from(0)),
                ]),
                map(vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", Value::Array(vec![Value::from(1)])),
                    ("medium", s("GPU")),
                    ("group_idx", Value::from(1)),
                ]),
            ]),
            Value::from(3),
        ]));
        let b = decode_batch(WireFormat::Vllm, &payload).unwrap();
        assert_eq!((b.skipped, b.dp_rank), (1, Some(3)));
        let EngineEvent::BlockStored { block_hashes, .. } = &b.events[0] else {
            panic!("{:?}", b.events)
        };
        assert_eq!(block_hashes, &vec![i64::MIN + 9, -1]);
        // The same payload is not SGLang's: bytes are no int64.
        assert!(matches!(
            decode_batch(WireFormat::Sglang, &payload),
            Err(DecodeError::Event {
                field: "block_hashes",
                ..
            })
        ));
    }

    #[test]
    fn salts_and_extra_keys_keep_blocks_apart_from_plain_queries() {
        let lora = |v: &Value, f| match decode_batch(f, &batch(vec![v.clone()]))
            .unwrap()
            .events
            .first()
        {
            Some(EngineEvent::BlockStored { lora_id, .. }) => Some(*lora_id),
            _ => None,
        };
        let plain = stored_sglang();
        let mut salted = stored_sglang();
        if let Value::Map(m) = &mut salted {
            m.push((s("cache_salt"), s("tenant-a")));
        }
        assert_eq!(lora(&plain, WireFormat::Sglang), Some(None));
        assert!(matches!(lora(&salted, WireFormat::Sglang), Some(Some(_))));
        let vllm = |extra: Value, parent: Value| {
            map(vec![
                ("type", s("BlockStored")),
                (
                    "block_hashes",
                    Value::Array(vec![Value::from(1), Value::from(2)]),
                ),
                ("parent_block_hash", parent),
                (
                    "token_ids",
                    Value::Array((1..=4u32).map(Value::from).collect()),
                ),
                ("block_size", Value::from(2)),
                ("extra_keys", extra),
            ])
        };
        let first = Value::Array(vec![Value::Array(vec![s("salt")]), Value::Nil]);
        assert!(matches!(
            lora(&vllm(first.clone(), Value::Nil), WireFormat::Vllm),
            Some(Some(_))
        ));
        assert_eq!(lora(&vllm(first, Value::from(7)), WireFormat::Vllm), None);
        let later = Value::Array(vec![
            Value::Nil,
            Value::Array(vec![s("mm"), Value::from(0)]),
        ]);
        assert_eq!(lora(&vllm(later, Value::Nil), WireFormat::Vllm), None);
        let none = Value::Array(vec![Value::Nil, Value::Nil]);
        assert_eq!(lora(&vllm(none, Value::Nil), WireFormat::Vllm), Some(None));
    }

    #[test]
    fn component_events_go_to_the_components_and_vllm_removals_take_their_groups_kind() {
        let stored = |group: i64, kind: &str, window: Option<i64>| {
            let mut pairs = vec![
                ("type", s("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(7)])),
                ("parent_block_hash", Value::Nil),
                (
                    "token_ids",
                    Value::Array(vec![Value::from(1), Value::from(2)]),
                ),
                ("block_size", Value::from(2)),
                ("medium", s("GPU")),
                ("group_idx", Value::from(group)),
                ("kv_cache_spec_kind", s(kind)),
            ];
            if let Some(w) = window {
                pairs.push(("kv_cache_spec_sliding_window", Value::from(w)));
            }
            map(pairs)
        };
        let removed = |group: i64, kind: Option<&str>| {
            let mut pairs = vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", Value::Array(vec![Value::from(7)])),
                ("medium", s("GPU")),
                ("group_idx", Value::from(group)),
            ];
            if let Some(k) = kind {
                pairs.push(("kv_cache_spec_kind", s(k)));
            }
            map(pairs)
        };
        let swa = ComponentKind::SlidingWindow { window: 8 };
        // Ours (SGLang's format with the extension): each event says its kind.
        let b = decode_batch(
            WireFormat::Sglang,
            &batch(vec![
                stored(1, "sliding_window", Some(8)),
                stored(2, "mamba", None),
                removed(2, Some("mamba")),
                map(vec![("type", s("AllBlocksCleared"))]),
            ]),
        )
        .unwrap();
        assert_eq!(b.events, vec![EngineEvent::AllBlocksCleared]);
        assert_eq!(b.components.len(), 4);
        assert!(
            matches!(&b.components[0], ComponentEvent::Stored { kind, block_size: 2, .. } if *kind == swa)
        );
        assert!(matches!(
            &b.components[2],
            ComponentEvent::Removed {
                kind: ComponentKind::Mamba,
                ..
            }
        ));
        assert_eq!(b.components[3], ComponentEvent::Cleared);
        // vLLM: removals name the group only; its stores declared the kind, in an earlier
        // batch too. The Full group 0 feeds the table; an unknown kind is skipped.
        let mut groups = GroupKinds::new();
        let b = decode_batch_with(
            WireFormat::Vllm,
            &batch(vec![
                stored(0, "full_attention", None),
                stored(1, "sliding_window", Some(8)),
                stored(3, "chunked_local_attention", None),
            ]),
            &mut groups,
        )
        .unwrap();
        assert_eq!((b.events.len(), b.components.len(), b.skipped), (1, 1, 1));
        let b = decode_batch_with(
            WireFormat::Vllm,
            &batch(vec![removed(1, None), removed(0, None), removed(5, None)]),
            &mut groups,
        )
        .unwrap();
        assert_eq!(
            b.components,
            vec![ComponentEvent::Removed {
                kind: swa,
                block_hashes: vec![7],
                medium: Some("GPU".into())
            }]
        );
        assert_eq!((b.events.len(), b.skipped), (1, 1));
        // An SWA store without its window cannot be checked: skipped, the batch kept.
        let b = decode_batch(
            WireFormat::Vllm,
            &batch(vec![stored(1, "sliding_window", None)]),
        )
        .unwrap();
        assert_eq!((b.components.len(), b.skipped), (0, 1));
    }

    #[test]
    fn wrong_types_reject_the_batch_and_name_the_field() {
        let mut ev = stored_sglang();
        if let Value::Map(m) = &mut ev {
            m[4].1 = s("two");
        }
        let err = decode_batch(WireFormat::Sglang, &batch(vec![ev])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "event 0 (BlockStored): field `block_size`: expected an int, got a string"
        );
        let mut ev = stored_sglang();
        if let Value::Map(m) = &mut ev {
            m[3].1 = Value::Array(vec![Value::from(1u64 << 40)]);
        }
        assert!(decode_batch(WireFormat::Sglang, &batch(vec![ev])).is_err());
    }

    #[test]
    fn garbage_never_panics() {
        for payload in [
            &b""[..],
            b"\xc1",
            b"\x93\xcb",
            b"\x92\x01\x01",
            b"\x91\x01",
            b"\xdd\xff\xff\xff\xff",
            b"\x93\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x91\x01\xc0",
        ] {
            assert!(decode_batch(WireFormat::Sglang, payload).is_err());
        }
        // Deep nesting is refused, not recursed into.
        let deep: Vec<u8> = std::iter::repeat_n(0x91u8, 10_000).collect();
        assert!(decode_batch(WireFormat::Vllm, &deep).is_err());
        // Every truncation of a good payload is an error or a batch, never a panic.
        let good = batch(vec![stored_sglang()]);
        for n in 0..good.len() {
            let _ = decode_batch(WireFormat::Sglang, &good[..n]);
        }
    }
}
