//! The on-disk format, version 1.
//!
//! ```text
//! DIR/lock                    flock held exclusively by the owning process (its pid inside)
//! DIR/index.log               the index log: fixed 128-byte records, appended
//! DIR/index.log.tmp           a compaction in progress (deleted at open)
//! DIR/index.log.damaged-<n>   damaged log bytes copied aside before recovery cut them
//! DIR/slab-<S>.dat            slab of page size class S: slot i holds bytes [i·S, (i+1)·S)
//! ```
//!
//! **Slabs.** A page of `len` bytes lives in one slot of the slab whose slot size is
//! `S = len` rounded up to 4096 (the O_DIRECT granularity), at offset `slot · S`. Slots hold
//! page bytes only (zero-padded to `S`), so a 4096-aligned page of the host pool moves
//! between memory and disk in one direct transfer, without a header to splice in. Slab files
//! grow by `fallocate` in steps and are never shrunk; a slot freed to make room for another
//! size class is punched out (`FALLOC_FL_PUNCH_HOLE`), so the disk use stays within the
//! capacity.
//!
//! **Index log.** Every record is 128 bytes, little-endian, the last 8 bytes an XXH3-64 of the
//! first 120. Record 0 is the header; the rest are `put` and `del` records in commit order.
//!
//! | offset | size | header | put | del |
//! |---|---|---|---|---|
//! | 0 | 8 | magic `HCURING1` | magic | magic |
//! | 8 | 1 | kind 0 | kind 1 | kind 2 |
//! | 9 | 1 | | layout tag | |
//! | 10 | 6 | reserved | reserved | reserved |
//! | 16 | 8 | format version (1) | sequence number | sequence number |
//! | 24 | 48 | | page key (namespace, hash) | page key |
//! | 72 | 8 | | page length | |
//! | 80 | 8 | | slot size `S` | |
//! | 88 | 8 | | slot index | |
//! | 96 | 8 | | XXH3-64 of the page's bytes | |
//! | 104 | 8 | reserved | write time | reserved |
//! | 112 | 8 | reserved | reserved | reserved |
//! | 120 | 8 | XXH3-64 of bytes 0..120 | same | same |
//!
//! The `put` write time is when the page was written, in Unix seconds of the backend's clock
//! (what `ttl_s` expiry counts from). `0` means unknown: records written by builds before it
//! existed, whose bytes there are zeros. Such a page counts from the time the directory is
//! opened (and a compaction then records that time for it).
//!
//! Replay applies records in order: a `put` maps its key to its slot (dropping the key's
//! previous slot, and any other key the slot was mapped to), a `del` unmaps its key. A record
//! that is short or fails its checksum is skipped and counted; invalid records after the last
//! valid one are a torn tail. Both are copied to `index.log.damaged-<n>` before the log is cut
//! (torn tail) or rewritten (damage inside).

use hicache_storage::{LayoutKind, PageKey, PageMeta};

/// The O_DIRECT alignment of addresses, lengths and offsets (and the slot granularity).
pub const ALIGN: usize = 4096;
/// Bytes of one index-log record.
pub const RECORD_LEN: usize = 128;
/// Magic at the start of every record.
pub const MAGIC: &[u8; 8] = b"HCURING1";
/// Format version written in the header and accepted.
pub const VERSION: u64 = 1;
/// Name of the index log.
pub const INDEX_FILE: &str = "index.log";
/// Name of a compacted index log being written.
pub const INDEX_TMP_FILE: &str = "index.log.tmp";
/// Prefix of the copies of damaged index-log regions made before recovery cuts or rewrites
/// the log (`index.log.damaged-<unix nanoseconds>`).
pub const DAMAGED_PREFIX: &str = "index.log.damaged-";
/// Name of the lock file.
pub const LOCK_FILE: &str = "lock";

const KIND_HEADER: u8 = 0;
const KIND_PUT: u8 = 1;
const KIND_DEL: u8 = 2;
const SUM_AT: usize = RECORD_LEN - 8;

/// Rounds `n` up to a multiple of [`ALIGN`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// The slot size of a page of `len` bytes.
pub fn slot_bytes(len: usize) -> u64 {
    align_up(len as u64).max(ALIGN as u64)
}

/// The file name of the slab of slot size `slot_bytes`.
pub fn slab_file_name(slot_bytes: u64) -> String {
    format!("slab-{slot_bytes}.dat")
}

/// The slot size a slab file name stands for, if it is one.
pub fn parse_slab_file_name(name: &str) -> Option<u64> {
    let s: u64 = name
        .strip_prefix("slab-")?
        .strip_suffix(".dat")?
        .parse()
        .ok()?;
    (s > 0 && s.is_multiple_of(ALIGN as u64) && name == slab_file_name(s)).then_some(s)
}

/// A committed page as the log records it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Put {
    /// Commit sequence number (increasing over the life of the directory).
    pub seq: u64,
    /// The page's key.
    pub key: PageKey,
    /// Layout and length.
    pub meta: PageMeta,
    /// Slot size of its slab.
    pub slot_bytes: u64,
    /// Slot index in that slab.
    pub slot: u64,
    /// XXH3-64 of the page's bytes.
    pub sum: u64,
    /// When the page was written, Unix seconds; 0: unknown (an earlier build's record).
    pub written: u64,
}

/// One index-log record.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// Record 0: the format version.
    Header {
        /// Format version.
        version: u64,
    },
    /// A page committed.
    Put(Put),
    /// A page removed (deleted, evicted, or dropped as corrupt).
    Del {
        /// Sequence number.
        seq: u64,
        /// The page's key.
        key: PageKey,
    },
}

/// Why a record did not decode.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BadRecord {
    /// The record checksum or magic does not match (torn or damaged).
    Checksum,
    /// The checksum matches but a field is invalid (unknown kind or layout, bad slot size).
    Field(&'static str),
}

impl Record {
    /// The 128-byte encoding.
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[..8].copy_from_slice(MAGIC);
        match self {
            Record::Header { version } => {
                b[8] = KIND_HEADER;
                b[16..24].copy_from_slice(&version.to_le_bytes());
            }
            Record::Put(p) => {
                b[8] = KIND_PUT;
                b[9] = p.meta.layout.tag();
                b[16..24].copy_from_slice(&p.seq.to_le_bytes());
                b[24..72].copy_from_slice(&p.key.to_bytes());
                b[72..80].copy_from_slice(&(p.meta.len as u64).to_le_bytes());
                b[80..88].copy_from_slice(&p.slot_bytes.to_le_bytes());
                b[88..96].copy_from_slice(&p.slot.to_le_bytes());
                b[96..104].copy_from_slice(&p.sum.to_le_bytes());
                b[104..112].copy_from_slice(&p.written.to_le_bytes());
            }
            Record::Del { seq, key } => {
                b[8] = KIND_DEL;
                b[16..24].copy_from_slice(&seq.to_le_bytes());
                b[24..72].copy_from_slice(&key.to_bytes());
            }
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&b[..SUM_AT]);
        b[SUM_AT..].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decodes one record.
    pub fn decode(b: &[u8; RECORD_LEN]) -> Result<Record, BadRecord> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if &b[..8] != MAGIC || xxhash_rust::xxh3::xxh3_64(&b[..SUM_AT]) != u64_at(SUM_AT) {
            return Err(BadRecord::Checksum);
        }
        let key = || PageKey::from_bytes(b[24..72].try_into().expect("48 bytes"));
        match b[8] {
            KIND_HEADER => Ok(Record::Header {
                version: u64_at(16),
            }),
            KIND_PUT => {
                let layout = LayoutKind::ALL
                    .into_iter()
                    .find(|l| l.tag() == b[9])
                    .ok_or(BadRecord::Field("layout tag"))?;
                let len = usize::try_from(u64_at(72)).map_err(|_| BadRecord::Field("length"))?;
                let slot_bytes = u64_at(80);
                if len == 0 || slot_bytes != self::slot_bytes(len) {
                    return Err(BadRecord::Field("length or slot size"));
                }
                Ok(Record::Put(Put {
                    seq: u64_at(16),
                    key: key(),
                    meta: PageMeta { layout, len },
                    slot_bytes,
                    slot: u64_at(88),
                    sum: u64_at(96),
                    written: u64_at(104),
                }))
            }
            KIND_DEL => Ok(Record::Del {
                seq: u64_at(16),
                key: key(),
            }),
            _ => Err(BadRecord::Field("record kind")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_storage::pattern::{namespace, page_key};

    #[test]
    fn records_round_trip_and_detect_damage() {
        let key = page_key(namespace(3), 1, 2);
        let recs = [
            Record::Header { version: VERSION },
            Record::Put(Put {
                seq: 7,
                key,
                meta: PageMeta {
                    layout: LayoutKind::LayerFirst,
                    len: 65_543,
                },
                slot_bytes: slot_bytes(65_543),
                slot: 12,
                sum: 0xdead_beef,
                written: 1_790_000_000,
            }),
            Record::Del { seq: 8, key },
        ];
        for r in recs {
            let mut b = r.encode();
            assert_eq!(Record::decode(&b), Ok(r));
            for i in [0, 9, 30, 100, 127] {
                b[i] ^= 1;
                assert_eq!(Record::decode(&b), Err(BadRecord::Checksum), "byte {i}");
                b[i] ^= 1;
            }
        }
    }

    #[test]
    fn slot_sizes_and_file_names() {
        assert_eq!(slot_bytes(1), 4096);
        assert_eq!(slot_bytes(4096), 4096);
        assert_eq!(slot_bytes(4097), 8192);
        assert_eq!(parse_slab_file_name(&slab_file_name(8192)), Some(8192));
        assert_eq!(parse_slab_file_name("slab-100.dat"), None);
        assert_eq!(parse_slab_file_name("slab-08192.dat"), None);
        assert_eq!(parse_slab_file_name("slab-0.dat"), None);
        assert_eq!(parse_slab_file_name("index.log"), None);
    }
}
