//! Snapshots: the service's whole state (registrations, stream positions, every instance's
//! engine-hash map with its tiers, every shared store's pages, the routers' state) in one
//! checksummed file, so a restarted index serves at once and catches up through replay.
//!
//! Format (little-endian): `b"HCIXSNAP"`, version `u32`, the JSON metadata's length `u64` and
//! the JSON (registrations with positions, stores), then per registration its map entries
//! (`u64` count, then `i64` engine hash, `u64` index hash, `u8` tier mask each), per store its
//! pages (`u64` count, `u64` hash each), then the CRC32C of everything before it (`u32`).
//!
//! Invariants:
//! 1. **Atomic.** The file is written to a temporary name, fsynced, renamed over the old one and
//!    the directory fsynced: a crash leaves the old snapshot or the new one, never a mix.
//! 2. **Refused, never loaded wrong.** A file with another magic (not ours), another version, a
//!    checksum that does not match (torn, corrupt), or a structure that does not add up is an
//!    error that says which; nothing of it is loaded.
//! 3. Restored from a snapshot, the service answers every query as the one that wrote it did
//!    (holder-blocks' ages for capacity eviction excepted; store pages are stamped with the
//!    restore time, so the store TTL runs again from there).
//! 4. A hybrid model stays hybrid: what its engines declared (Mamba, the window) is kept, its
//!    component residency is not (it is rebuilt from the events that follow). A restored
//!    hybrid model's instances are credited nothing until their engines report their
//!    components again: a miss, never a wrong hit.

use crate::chain::BlockHash;
use crate::registry::Registration;
use crate::service::{Service, ServiceError};
use crate::stream::StreamPosition;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"HCIXSNAP";
const VERSION: u32 = 1;
/// The snapshot's file name in the data directory.
pub const FILE_NAME: &str = "index.snapshot";

/// Why a snapshot could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// An I/O error on a path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Not a snapshot of ours.
    #[error("{0}: not a hicache-index snapshot (wrong magic)")]
    Foreign(PathBuf),
    /// A version this build does not read.
    #[error("{path}: snapshot version {version}, this build reads {VERSION}")]
    Version {
        /// The path.
        path: PathBuf,
        /// Its version.
        version: u32,
    },
    /// The checksum does not match: torn or corrupt.
    #[error("{0}: checksum mismatch (torn or corrupt file), refused")]
    Checksum(PathBuf),
    /// The contents do not add up.
    #[error("{path}: malformed snapshot: {problem}")]
    Malformed {
        /// The path.
        path: PathBuf,
        /// What.
        problem: String,
    },
    /// The service refused a restored registration.
    #[error("restoring the snapshot: {0}")]
    Service(#[from] ServiceError),
}

#[derive(Serialize, Deserialize)]
struct Meta {
    streams: Vec<(Registration, StreamPosition)>,
    /// (model, store) of each store section, in order.
    stores: Vec<(String, String)>,
    /// The routers' state (absent in snapshots written before routing was kept).
    #[serde(default)]
    routing: crate::routing::SavedRouting,
    /// What each hybrid model declared (invariant 4; absent in older snapshots).
    #[serde(default)]
    hybrid: Vec<(String, crate::router::HybridModel)>,
}

/// Serializes the service's state (under its lock: a copy of the maps, no I/O).
pub fn encode(svc: &Service) -> Vec<u8> {
    let meta = Meta {
        streams: svc
            .streams
            .values()
            .map(|s| (s.reg.clone(), s.state.position()))
            .collect(),
        stores: svc
            .models
            .iter()
            .flat_map(|(m, model)| model.stores.keys().map(move |s| (m.clone(), s.clone())))
            .collect(),
        routing: svc.routing_state(),
        hybrid: svc
            .models
            .iter()
            .filter(|(_, m)| m.components.is_hybrid())
            .map(|(name, m)| (name.clone(), m.components.model()))
            .collect(),
    };
    let json = serde_json::to_vec(&meta).expect("plain data serializes");
    let entries: usize = svc.streams.values().map(|s| s.feed.mapped_blocks()).sum();
    let mut out = Vec::with_capacity(32 + json.len() + entries * 17);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for s in svc.streams.values() {
        out.extend_from_slice(&(s.feed.mapped_blocks() as u64).to_le_bytes());
        for (e, h, mask) in s.feed.entries() {
            out.extend_from_slice(&e.to_le_bytes());
            out.extend_from_slice(&h.to_le_bytes());
            out.push(mask);
        }
    }
    for (m, name) in &meta.stores {
        let store = &svc.models[m].stores[name];
        out.extend_from_slice(&(store.pages.len() as u64).to_le_bytes());
        for h in store.pages.keys() {
            out.extend_from_slice(&h.to_le_bytes());
        }
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Writes `bytes` as the snapshot of `dir` (invariant 1).
pub fn write(dir: &Path, bytes: &[u8]) -> Result<(), SnapshotError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SnapshotError::Io { path, source }
    };
    let tmp = dir.join(format!("{FILE_NAME}.tmp"));
    let dst = dir.join(FILE_NAME);
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, &dst).map_err(io(&dst))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))?;
    Ok(())
}

struct Reader<'a> {
    buf: &'a [u8],
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        if self.buf.len() < n {
            return Err(SnapshotError::Malformed {
                path: self.path.to_path_buf(),
                problem: format!("ends {} bytes early", n - self.buf.len()),
            });
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }

    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn count(&mut self, each: usize) -> Result<usize, SnapshotError> {
        let n = self.u64()?;
        if n.saturating_mul(each as u64) > self.buf.len() as u64 {
            return Err(SnapshotError::Malformed {
                path: self.path.to_path_buf(),
                problem: format!("a section claims {n} entries, more than the file holds"),
            });
        }
        Ok(n as usize)
    }
}

/// Checks `bytes` (read from `path`) and restores them into `svc` (which must be empty) at
/// `now_ms`; returns the number of holder-block entries restored.
pub fn restore(
    svc: &mut Service,
    path: &Path,
    bytes: &[u8],
    now_ms: u64,
) -> Result<u64, SnapshotError> {
    if bytes.len() < 8 || &bytes[..8] != MAGIC {
        return Err(SnapshotError::Foreign(path.to_path_buf()));
    }
    if bytes.len() < 12 + 8 + 4 {
        return Err(SnapshotError::Checksum(path.to_path_buf()));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(SnapshotError::Version {
            path: path.to_path_buf(),
            version,
        });
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err(SnapshotError::Checksum(path.to_path_buf()));
    }
    let mut r = Reader {
        buf: &body[12..],
        path,
    };
    let json_len = r.count(1)?;
    let meta: Meta =
        serde_json::from_slice(r.take(json_len)?).map_err(|e| SnapshotError::Malformed {
            path: path.to_path_buf(),
            problem: format!("metadata: {e}"),
        })?;
    let mut restored = 0u64;
    let mut sections: Vec<Vec<(i64, BlockHash, u8)>> = Vec::with_capacity(meta.streams.len());
    for _ in &meta.streams {
        let n = r.count(17)?;
        let raw = r.take(n * 17)?;
        sections.push(
            raw.chunks_exact(17)
                .map(|c| {
                    (
                        i64::from_le_bytes(c[..8].try_into().expect("8 bytes")),
                        u64::from_le_bytes(c[8..16].try_into().expect("8 bytes")),
                        c[16],
                    )
                })
                .collect(),
        );
    }
    let mut store_sections = Vec::with_capacity(meta.stores.len());
    for _ in &meta.stores {
        let n = r.count(8)?;
        let raw = r.take(n * 8)?;
        store_sections.push(
            raw.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect::<Vec<_>>(),
        );
    }
    if !r.buf.is_empty() {
        return Err(SnapshotError::Malformed {
            path: path.to_path_buf(),
            problem: format!("{} bytes after the last section", r.buf.len()),
        });
    }
    for ((reg, pos), entries) in meta.streams.into_iter().zip(sections) {
        let (id, _) = svc.register_at(reg, pos, now_ms)?;
        restored += entries.len() as u64;
        let stream = svc.streams.get_mut(&id).expect("registered above");
        let model = svc
            .models
            .get_mut(&stream.reg.model)
            .expect("registered above");
        stream
            .feed
            .restore(&mut model.index, entries)
            .map_err(ServiceError::from)?;
    }
    for ((m, name), pages) in meta.stores.into_iter().zip(store_sections) {
        let Some(store) = svc.models.get_mut(&m).and_then(|model| {
            let st = model.stores.get_mut(&name)?;
            Some((st, &mut model.index))
        }) else {
            return Err(SnapshotError::Malformed {
                path: path.to_path_buf(),
                problem: format!("store {name:?} of model {m:?} has no instance"),
            });
        };
        let (st, index) = store;
        index
            .store(st.holder, crate::Tier::L3, &pages)
            .map_err(ServiceError::from)?;
        restored += pages.len() as u64;
        st.pages.extend(pages.into_iter().map(|h| (h, now_ms)));
    }
    for (m, declared) in meta.hybrid {
        if let Some(model) = svc.models.get_mut(&m) {
            model.components.declare(declared);
        }
    }
    svc.restore_routing(meta.routing);
    Ok(restored)
}

/// Reads and restores the snapshot of `dir`, if there is one.
pub fn load(svc: &mut Service, dir: &Path, now_ms: u64) -> Result<Option<u64>, SnapshotError> {
    let path = dir.join(FILE_NAME);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(SnapshotError::Io { path, source }),
    };
    restore(svc, &path, &bytes, now_ms).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::WireFormat;
    use crate::service::ServiceConfig;

    fn reg(i: usize, store: Option<&str>) -> Registration {
        Registration {
            instance: format!("i{i}"),
            endpoint: "tcp://127.0.0.1:1".into(),
            replay_endpoint: Some("tcp://127.0.0.1:2".into()),
            topic: None,
            format: WireFormat::Sglang,
            model: "m".into(),
            page_size: 16,
            dp_rank: None,
            l3_store: store.map(str::to_string),
            kv_capacity_tokens: None,
            l3_prefetch_threshold_tokens: None,
        }
    }

    /// A service of `instances` instances (half on a shared store) holding `per` blocks each,
    /// in chains of 64, spread over the tiers.
    fn filled(instances: usize, per: u64) -> Service {
        let mut svc = Service::new(ServiceConfig::default());
        for i in 0..instances {
            svc.register(reg(i, (i % 2 == 0).then_some("s")), 0)
                .unwrap();
        }
        let ids = svc.stream_ids();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for (n, id) in ids.iter().enumerate() {
            let stream = svc.streams.get_mut(id).unwrap();
            let model = svc.models.get_mut("m").unwrap();
            let entries = (0..per).map(|k| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Chains shared across instances at the head: block k of chain c.
                let shared = (k % 64) < 16;
                let h = if shared {
                    k.wrapping_mul(0x100_0000_01b3)
                } else {
                    x
                };
                let mask = [1u8, 2, 3, 4, 1][(k as usize + n) % 5];
                (k as i64 + ((n as i64) << 40), h, mask)
            });
            stream.feed.restore(&mut model.index, entries).unwrap();
        }
        svc
    }

    fn answers(svc: &mut Service) -> Vec<crate::service::QueryAnswer> {
        (0..50u32)
            .map(|c| {
                let tokens: Vec<u32> = (0..64 * 16).map(|t| t + c * 7).collect();
                svc.query("m", &tokens).unwrap()
            })
            .collect()
    }

    #[test]
    fn a_snapshot_restores_the_same_answers_and_refuses_damage() {
        let mut a = filled(6, 2000);
        let dir = tempfile::tempdir().unwrap();
        let bytes = encode(&a);
        write(dir.path(), &bytes).unwrap();
        let mut b = Service::new(ServiceConfig::default());
        assert!(load(&mut b, dir.path(), 0).unwrap().unwrap() > 0);
        assert_eq!(answers(&mut a), answers(&mut b));
        let (sa, sb) = (a.models["m"].index.stats(), b.models["m"].index.stats());
        assert_eq!((sa.holder_blocks, sa.blocks), (sb.holder_blocks, sb.blocks));
        let p = dir.path().join(FILE_NAME);
        for bad in [
            bytes[..bytes.len() / 2].to_vec(),
            [&bytes[..100], b"x", &bytes[101..]].concat(),
            b"HCIXSNAP".to_vec(),
        ] {
            std::fs::write(&p, &bad).unwrap();
            let mut c = Service::new(ServiceConfig::default());
            assert!(load(&mut c, dir.path(), 0).is_err());
            assert!(
                c.stream_ids().is_empty(),
                "nothing of a refused file is loaded"
            );
        }
    }

    /// The restart figure: a snapshot of 10M holder-blocks loaded into a fresh service.
    /// `cargo test --release -p hicache-index --lib ten_million -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, run by hand in release"]
    fn ten_million_holder_blocks_restart() {
        let t = std::time::Instant::now();
        let svc = filled(16, 10_000_000 / 16);
        let hb = svc.models["m"].index.stats().holder_blocks;
        println!("built {hb} holder-blocks in {:?}", t.elapsed());
        let dir = tempfile::tempdir().unwrap();
        let t = std::time::Instant::now();
        let bytes = encode(&svc);
        write(dir.path(), &bytes).unwrap();
        println!(
            "snapshot of {} MB written in {:?}",
            bytes.len() >> 20,
            t.elapsed()
        );
        drop(svc);
        let t = std::time::Instant::now();
        let mut fresh = Service::new(ServiceConfig::default());
        load(&mut fresh, dir.path(), 0).unwrap();
        let took = t.elapsed();
        let hb2 = fresh.models["m"].index.stats().holder_blocks;
        println!("RESTART: {hb2} holder-blocks loaded and serving in {took:?}");
        assert_eq!(hb, hb2);
    }
}
