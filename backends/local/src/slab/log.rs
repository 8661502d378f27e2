//! The index log (format in [`format`](crate::slab::format)): appending records, replaying them at
//! open with a torn tail cut off, and compacting the log to one `put` per live page.
//!
//! # Invariants
//! 1. **Nothing lost beyond the damage.** The file is a header followed by whole records;
//!    a crash may leave a torn tail after the last append, and a disk fault may damage any
//!    record. [`IndexLog::open`] skips every invalid record and keeps every valid one (a
//!    damaged `put` loses its own page only: pages are verified against their `put`'s
//!    checksum, so a skipped `del` or an older `put` never yields wrong bytes). Before the
//!    file is cut (torn tail) or rewritten (damage inside), the damaged region is copied to
//!    `index.log.damaged-<n>` and synced; what was skipped is counted and logged.
//! 2. **Atomic compaction.** A compacted log is written to `index.log.tmp`, synced, and renamed
//!    over `index.log` (then the directory is synced), so a crash leaves either log whole.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use crate::io::sys;

use hicache_storage::PageKey;

use crate::slab::format::{
    DAMAGED_PREFIX, INDEX_FILE, INDEX_TMP_FILE, MAGIC, Put, RECORD_LEN, Record, VERSION,
};

/// What replaying the log found.
#[derive(Debug, Default)]
pub struct Replay {
    /// Live pages, oldest commit first.
    pub puts: Vec<Put>,
    /// Records of the torn tail discarded (a partial record counts as one).
    pub discarded: u64,
    /// Damaged records skipped inside the log (later valid records were kept); a damaged
    /// header record counts as one.
    pub skipped: u64,
    /// Where the damaged region was copied before the log was cut or rewritten.
    pub preserved: Option<PathBuf>,
    /// Valid records read (header excluded).
    pub records: u64,
    /// Highest sequence number seen.
    pub max_seq: u64,
}

/// The open index log.
#[derive(Debug)]
pub struct IndexLog {
    dir: PathBuf,
    file: File,
    /// Records in the file (header excluded).
    records: u64,
}

/// A log file's error with the path it concerns.
fn at(path: &Path, what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

/// Syncs a directory (makes a rename in it durable).
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    sys::sync_dir(dir)
}

impl IndexLog {
    /// Opens (creating) the log of `dir` and replays it.
    pub fn open(dir: &Path) -> io::Result<(Self, Replay)> {
        let _ = fs::remove_file(dir.join(INDEX_TMP_FILE));
        let path = dir.join(INDEX_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(|e| at(&path, "open", e))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|e| at(&path, "read", e))?;
        if bytes.len() < RECORD_LEN {
            // New (or a creation torn before its header was whole): start afresh.
            file.set_len(0).map_err(|e| at(&path, "truncate", e))?;
            file.write_all(&Record::Header { version: VERSION }.encode())
                .and_then(|()| file.sync_all())
                .and_then(|()| sync_dir(dir))
                .map_err(|e| at(&path, "write header of", e))?;
            let replay = Replay {
                discarded: u64::from(!bytes.is_empty()),
                ..Replay::default()
            };
            let log = Self {
                dir: dir.to_path_buf(),
                file,
                records: 0,
            };
            return Ok((log, replay));
        }
        let (mut replay, first_bad, good_end) = Self::analyse(&path, &bytes)?;
        let mut log = Self {
            dir: dir.to_path_buf(),
            file,
            records: replay.records,
        };
        if let Some(from) = first_bad {
            // Recovery loses nothing extra: the damaged region is copied aside (durably)
            // before the log is cut or rewritten.
            let kept = Self::preserve(dir, &bytes[from..])?;
            tracing::warn!(
                path = %path.display(),
                skipped = replay.skipped,
                torn_tail = replay.discarded,
                kept_records = replay.records,
                preserved = %kept.display(),
                "uring backend: damaged index-log records discarded (bytes preserved)"
            );
            replay.preserved = Some(kept);
            if replay.skipped > 0 {
                // Damage inside the log: rewrite it as the live pages it names.
                log.compact(&replay.puts)?;
            } else {
                log.file
                    .set_len(good_end as u64)
                    .and_then(|()| log.file.sync_all())
                    .map_err(|e| at(&path, "truncate torn tail of", e))?;
            }
        }
        Ok((log, replay))
    }

    /// Replays the log of `dir` changing nothing (a read-only open): the replay is what
    /// [`open`](Self::open) would recover and its counts what open would discard, but no
    /// damaged region is preserved and nothing is cut, rewritten or created. The log is held
    /// open for reading only (the directory itself when there is no log), so an append fails.
    pub fn open_read_only(dir: &Path) -> io::Result<(Self, Replay)> {
        let path = dir.join(INDEX_FILE);
        let (file, bytes) = match File::open(&path) {
            Ok(mut f) => {
                let mut bytes = Vec::new();
                f.read_to_end(&mut bytes)
                    .map_err(|e| at(&path, "read", e))?;
                (f, bytes)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                (File::open(dir).map_err(|e| at(dir, "open", e))?, Vec::new())
            }
            Err(e) => return Err(at(&path, "open", e)),
        };
        let (replay, first_bad) = if bytes.len() < RECORD_LEN {
            let replay = Replay {
                discarded: u64::from(!bytes.is_empty()),
                ..Replay::default()
            };
            (replay, None)
        } else {
            let (replay, first_bad, _) = Self::analyse(&path, &bytes)?;
            (replay, first_bad)
        };
        if first_bad.is_some() {
            tracing::warn!(
                path = %path.display(),
                skipped = replay.skipped,
                torn_tail = replay.discarded,
                kept_records = replay.records,
                "uring backend: damaged index-log records a read-write open would discard \
                 (read-only: nothing changed)"
            );
        }
        let log = Self {
            dir: dir.to_path_buf(),
            file,
            records: replay.records,
        };
        Ok((log, replay))
    }

    /// The replay of a log's `bytes` (at least a record long), the offset of its first damaged
    /// record if any, and the end of its last whole valid record.
    fn analyse(path: &Path, bytes: &[u8]) -> io::Result<(Replay, Option<usize>, usize)> {
        let damaged_header = Self::check_header(path, bytes)?;
        let (mut replay, live, good_end, mut bad) = Self::scan_records(bytes);
        bad.retain(|&o| o < good_end);
        replay.skipped = bad.len() as u64 + u64::from(damaged_header);
        if good_end < bytes.len() {
            replay.discarded = (bytes.len() - good_end).div_ceil(RECORD_LEN) as u64;
        }
        replay.puts = live.into_values().collect();
        replay.puts.sort_by_key(|p| p.seq);
        let first_bad = if damaged_header {
            Some(0)
        } else {
            bad.first()
                .copied()
                .or((good_end < bytes.len()).then_some(good_end))
        };
        Ok((replay, first_bad, good_end))
    }

    /// Checks the log's header record: `Ok(false)` for ours, `Ok(true)` for a damaged header
    /// of a log that is recognisably ours; an error for another version or a foreign file.
    fn check_header(path: &Path, bytes: &[u8]) -> io::Result<bool> {
        let header: &[u8; RECORD_LEN] = bytes[..RECORD_LEN].try_into().expect("one record");
        match Record::decode(header) {
            Ok(Record::Header { version: VERSION }) => Ok(false),
            Ok(Record::Header { version }) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: index format version {version}, this build reads {VERSION}",
                    path.display()
                ),
            )),
            _ if Self::is_ours(bytes) => Ok(true),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: not a hicache-uring index log (bad header); refusing to overwrite it",
                    path.display()
                ),
            )),
        }
    }

    /// Replays the records after the header: the live `put` per key (a later record of a key
    /// or a slot replaces the earlier), the end of the last valid record and the offsets of
    /// the invalid ones.
    #[allow(clippy::type_complexity)]
    fn scan_records(bytes: &[u8]) -> (Replay, HashMap<PageKey, Put>, usize, Vec<usize>) {
        let mut replay = Replay::default();
        let mut live: HashMap<PageKey, Put> = HashMap::new();
        let mut owners: HashMap<(u64, u64), PageKey> = HashMap::new();
        // End of the last valid record, and offsets of the invalid ones before it.
        let mut good_end = RECORD_LEN;
        let mut bad: Vec<usize> = Vec::new();
        for (i, chunk) in bytes[RECORD_LEN..].chunks(RECORD_LEN).enumerate() {
            let offset = RECORD_LEN * (i + 1);
            let rec = <&[u8; RECORD_LEN]>::try_from(chunk)
                .ok()
                .and_then(|c| Record::decode(c).ok());
            match rec {
                None | Some(Record::Header { .. }) => {
                    bad.push(offset);
                    continue;
                }
                Some(Record::Put(p)) => {
                    replay.max_seq = replay.max_seq.max(p.seq);
                    if let Some(old) = live.remove(&p.key) {
                        owners.remove(&(old.slot_bytes, old.slot));
                    }
                    if let Some(other) = owners.insert((p.slot_bytes, p.slot), p.key) {
                        live.remove(&other);
                    }
                    live.insert(p.key, p);
                }
                Some(Record::Del { seq, key }) => {
                    replay.max_seq = replay.max_seq.max(seq);
                    if let Some(old) = live.remove(&key) {
                        owners.remove(&(old.slot_bytes, old.slot));
                    }
                }
            }
            replay.records += 1;
            good_end = offset + RECORD_LEN;
        }
        (replay, live, good_end, bad)
    }

    /// Checks, touching nothing, that an existing log in `dir` is this backend's: `Ok(true)`
    /// if one is there, `Ok(false)` if none (or a creation torn before its header), an
    /// `InvalidData` error naming the file if it is someone else's.
    pub fn check_owner(dir: &Path) -> io::Result<bool> {
        let path = dir.join(INDEX_FILE);
        let mut bytes = Vec::new();
        match File::open(&path) {
            Ok(mut f) => f
                .read_to_end(&mut bytes)
                .map_err(|e| at(&path, "read", e))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(at(&path, "open", e)),
        };
        if bytes.len() < RECORD_LEN {
            return Ok(false);
        }
        let header: &[u8; RECORD_LEN] = bytes[..RECORD_LEN].try_into().expect("one record");
        if matches!(Record::decode(header), Ok(Record::Header { .. })) || Self::is_ours(&bytes) {
            Ok(true)
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: not a hicache-uring index log (bad header); refusing to use {}",
                    path.display(),
                    dir.display()
                ),
            ))
        }
    }

    /// Whether a log with an invalid header record is still this backend's: its magic is
    /// intact, or a later record is valid (a foreign file holds no checksummed records).
    fn is_ours(bytes: &[u8]) -> bool {
        bytes[..MAGIC.len()] == MAGIC[..]
            || bytes[RECORD_LEN..]
                .chunks_exact(RECORD_LEN)
                .any(|c| Record::decode(c.try_into().expect("one record")).is_ok())
    }

    /// Copies `bytes` (a damaged region of the log) to a new `index.log.damaged-<n>` file,
    /// synced with its directory; returns its path.
    fn preserve(dir: &Path, bytes: &[u8]) -> io::Result<PathBuf> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = dir.join(format!("{DAMAGED_PREFIX}{stamp}"));
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| at(&path, "create", e))?;
        f.write_all(bytes)
            .and_then(|()| f.sync_all())
            .and_then(|()| sync_dir(dir))
            .map_err(|e| at(&path, "write", e))?;
        Ok(path)
    }

    /// Records in the file, header excluded.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Appends `records` (already encoded) in one write; syncs them if `sync`.
    pub fn append(&mut self, records: &[[u8; RECORD_LEN]], sync: bool) -> io::Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let buf: Vec<u8> = records.iter().flatten().copied().collect();
        sys::append(&mut self.file, &buf)?;
        self.records += records.len() as u64;
        if sync {
            sys::sync_data(&self.file)?;
        }
        Ok(())
    }

    /// Replaces the log by a header and one `put` per page of `live` (oldest first).
    pub fn compact(&mut self, live: &[Put]) -> io::Result<()> {
        let tmp = self.dir.join(INDEX_TMP_FILE);
        let path = self.dir.join(INDEX_FILE);
        let mut buf = Vec::with_capacity((live.len() + 1) * RECORD_LEN);
        buf.extend_from_slice(&Record::Header { version: VERSION }.encode());
        for p in live {
            buf.extend_from_slice(&Record::Put(*p).encode());
        }
        let _ = sys::remove_file(&tmp);
        let mut f = sys::create_new(&tmp, false).map_err(|e| at(&tmp, "create", e))?;
        sys::append(&mut f, &buf)
            .and_then(|()| sys::sync_data(&f))
            .map_err(|e| at(&tmp, "write", e))?;
        drop(f);
        sys::rename(&tmp, &path).map_err(|e| at(&path, "rename compacted log to", e))?;
        sync_dir(&self.dir).map_err(|e| at(&self.dir, "sync", e))?;
        self.file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&path)
            .map_err(|e| at(&path, "reopen", e))?;
        self.records = live.len() as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_storage::pattern::{namespace, page_key};
    use hicache_storage::{LayoutKind, PageMeta};

    fn put(i: u64, slot: u64, seq: u64) -> Put {
        Put {
            seq,
            key: page_key(namespace(1), 5, i),
            meta: PageMeta {
                layout: LayoutKind::PageFirst,
                len: 4096,
            },
            slot_bytes: 4096,
            slot,
            sum: i,
            written: 0,
        }
    }

    #[test]
    fn replay_applies_puts_dels_and_slot_reuse() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, r) = IndexLog::open(dir.path()).unwrap();
        assert!(r.puts.is_empty() && r.discarded == 0);
        let recs = [
            Record::Put(put(0, 0, 1)),
            Record::Put(put(1, 1, 2)),
            Record::Put(put(2, 2, 3)),
            Record::Del {
                seq: 4,
                key: put(1, 0, 0).key,
            },
            // Slot 0 reused by page 3 without a del of page 0 (lost in a crash).
            Record::Put(put(3, 0, 5)),
            // Page 2 moved to slot 1.
            Record::Put(put(2, 1, 6)),
        ];
        let enc: Vec<_> = recs.iter().map(Record::encode).collect();
        log.append(&enc, true).unwrap();
        drop(log);
        let (log, r) = IndexLog::open(dir.path()).unwrap();
        assert_eq!(r.puts, vec![put(3, 0, 5), put(2, 1, 6)]);
        assert_eq!((r.records, r.max_seq, r.discarded), (6, 6, 0));
        assert_eq!(log.records(), 6);
    }

    #[test]
    fn torn_tails_are_cut_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(INDEX_FILE);
        {
            let (mut log, _) = IndexLog::open(dir.path()).unwrap();
            let enc: Vec<_> = (0..4)
                .map(|i| Record::Put(put(i, i, i + 1)).encode())
                .collect();
            log.append(&enc, true).unwrap();
        }
        // Half a record.
        let full = fs::read(&path).unwrap();
        fs::write(&path, &full[..full.len() - 60]).unwrap();
        let (_, r) = IndexLog::open(dir.path()).unwrap();
        assert_eq!((r.puts.len(), r.discarded), (3, 1));
        assert_eq!(fs::metadata(&path).unwrap().len(), 4 * RECORD_LEN as u64);
        // Garbage after the valid records: two records' worth.
        let mut b = fs::read(&path).unwrap();
        b.extend(std::iter::repeat_n(0xa5u8, 2 * RECORD_LEN));
        fs::write(&path, &b).unwrap();
        let (_, r) = IndexLog::open(dir.path()).unwrap();
        assert_eq!((r.puts.len(), r.discarded), (3, 2));
        // A damaged record in the middle costs that record only; the log is rewritten
        // after the damaged bytes were preserved.
        let mut b = fs::read(&path).unwrap();
        b[2 * RECORD_LEN + 40] ^= 1;
        fs::write(&path, &b).unwrap();
        let (_, r) = IndexLog::open(dir.path()).unwrap();
        assert_eq!((r.puts.len(), r.discarded, r.skipped), (2, 0, 1));
        let kept = fs::read(r.preserved.as_ref().unwrap()).unwrap();
        assert_eq!(kept[..], b[2 * RECORD_LEN..]);
        let (_, r) = IndexLog::open(dir.path()).unwrap();
        assert_eq!((r.puts.len(), r.discarded, r.skipped), (2, 0, 0));
        assert!(r.preserved.is_none());
    }

    #[test]
    fn compaction_keeps_live_pages_and_a_foreign_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = IndexLog::open(dir.path()).unwrap();
        let enc: Vec<_> = (0..10)
            .map(|i| Record::Put(put(i % 3, i, i + 1)).encode())
            .collect();
        log.append(&enc, false).unwrap();
        log.compact(&[put(1, 7, 8), put(2, 8, 9)]).unwrap();
        log.append(&[Record::Put(put(5, 1, 10)).encode()], true)
            .unwrap();
        drop(log);
        let (log, r) = IndexLog::open(dir.path()).unwrap();
        assert_eq!(r.puts, vec![put(1, 7, 8), put(2, 8, 9), put(5, 1, 10)]);
        assert_eq!(log.records(), 3);
        fs::write(dir.path().join(INDEX_FILE), vec![7u8; 1000]).unwrap();
        let e = IndexLog::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a hicache-uring index log"), "{e}");
    }
}
