//! [`Tiering`]: how L2 and L3 share the pages (`hicache_host_memory_mode`,
//! `storage_write_mode`) and the record of pages known to be in L3 both modes decide by.
//!
//! - **cache + inclusive** (default, SGLang's): L2 caches; L3 is written at L2 admission.
//! - **buffer_only**: L2 only stages. A host copy is released once its pages are in L3 (their
//!   backup acknowledged) or back on device (a load-back of pages known to be in L3); the tree
//!   keeps host copies transient ([`hicache_core::HiRadixTree::set_transient_host`]).
//! - **exclusive** (cold-L2-first): L3 is not written at admission. When the agreed free host
//!   pages, plus the coldest host-only leaves already in L3, fall below [`Tiering::headroom`]
//!   (plus what write-throughs and prefetches lacked, [`Tiering::shortfall`]), the coldest
//!   host-only leaves L3 lacks are written to L3 ahead of their eviction. Host eviction drops
//!   leaves, in eviction order, only while they are known to be in L3: a page leaves L2 only
//!   once L3 acknowledged it (kept otherwise), and the tiers share only that clean band.
//!   Write-throughs and prefetches that find no room wait for it (bounded).
//!
//! Invariants:
//! 1. A page hash enters [`KnownInL3`] only from a backup every rank acknowledged as wholly
//!    stored, or from a prefetch insert at the agreed count: the record, and every decision
//!    taken from it, is the same on every rank.
//! 2. The record is a belief, not a lookup: L3 may evict a page after it entered. A page
//!    believed stored but gone is a later miss (recomputed), never wrong data. The record is
//!    bounded ([`KNOWN_PAGES_MAX`]) and forgets everything when full (then pages are written
//!    again: L3 sets are idempotent).
//! 3. Only the modes that read the record keep it (`buffer_only`, `exclusive`); in the default
//!    mode nothing decides by it, so recording every stored page would be work on every
//!    poll for nothing.

use hashbrown::HashSet;

use hicache_core::PageHash;

use crate::config::{HiCacheConfig, HostMemoryMode, StorageWriteMode};

/// Most page hashes [`KnownInL3`] holds before it forgets them all (invariant 2).
pub(crate) const KNOWN_PAGES_MAX: usize = 1 << 20;

/// Share of the host pool exclusive tiering keeps free by writing cold pages to L3 ahead of
/// their eviction.
const EXCLUSIVE_HEADROOM: f64 = 0.125;

/// Page hashes believed to be in L3 (see the module invariants). The keys are SHA-256
/// digests, so the set hashes them with hashbrown's fast default hasher rather than SipHash.
#[derive(Debug, Default)]
pub(crate) struct KnownInL3 {
    pages: HashSet<PageHash>,
    /// Whether pages are recorded at all (invariant 3).
    kept: bool,
}

impl KnownInL3 {
    /// A record that keeps pages (`kept`) or ignores them (invariant 3).
    pub fn new(kept: bool) -> Self {
        Self {
            pages: HashSet::default(),
            kept,
        }
    }

    /// Records pages as stored (nothing when the record is not kept).
    pub fn insert_all(&mut self, hashes: &[PageHash]) {
        if !self.kept {
            return;
        }
        if self.pages.len() + hashes.len() > KNOWN_PAGES_MAX {
            self.pages.clear();
        }
        self.pages.extend(hashes.iter().copied());
    }

    /// Forgets every page (L3 was cleared).
    pub fn forget_all(&mut self) {
        self.pages.clear();
    }

    /// Whether every page is believed stored (false for an empty list: nothing to trust).
    pub fn contains_all(&self, hashes: &[PageHash]) -> bool {
        !hashes.is_empty() && hashes.iter().all(|h| self.pages.contains(h))
    }

    /// Whether one page is believed stored.
    pub fn contains(&self, hash: &PageHash) -> bool {
        self.pages.contains(hash)
    }
}

/// The tiering mode of a cache and its record of L3 pages.
#[derive(Debug)]
pub(crate) struct Tiering {
    /// Host memory only stages (`buffer_only`).
    pub buffer_only: bool,
    /// L3 is written from cold L2 pages (`exclusive`).
    pub exclusive: bool,
    /// Pages believed to be in L3.
    pub known: KnownInL3,
    /// Free host pages exclusive tiering keeps (0 in the other modes).
    headroom: usize,
    /// Exclusive: host pages write-throughs wanted and could not get since the last
    /// demotion (the next demotion makes room for them too).
    pub shortfall: usize,
}

impl Tiering {
    /// The mode `cfg` asks for, over a host pool of `host_pages`.
    pub fn new(cfg: &HiCacheConfig, host_pages: usize) -> Self {
        let exclusive = cfg.storage_write_mode == StorageWriteMode::Exclusive;
        let buffer_only = cfg.hicache_host_memory_mode == HostMemoryMode::BufferOnly;
        Self {
            buffer_only,
            exclusive,
            known: KnownInL3::new(buffer_only || exclusive),
            headroom: if exclusive {
                ((host_pages as f64 * EXCLUSIVE_HEADROOM) as usize).max(1)
            } else {
                0
            },
            shortfall: 0,
        }
    }

    /// Whether L3 is written at L2 admission (every mode but exclusive).
    pub fn writes_at_admission(&self) -> bool {
        !self.exclusive
    }

    /// Whether an admission backup skips pages already believed stored (buffer_only, like
    /// SGLang's buffer mode; the default mode writes every admitted page as SGLang does).
    pub fn dedups_admission(&self) -> bool {
        self.buffer_only
    }

    /// Free host pages exclusive tiering keeps by demoting cold pages to L3.
    pub fn headroom(&self) -> usize {
        self.headroom
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> PageHash {
        PageHash([i; 32])
    }

    #[test]
    fn known_pages_are_bounded_and_empty_lists_are_not_trusted() {
        let mut k = KnownInL3::new(true);
        assert!(!k.contains_all(&[]));
        k.insert_all(&[h(1), h(2)]);
        assert!(k.contains_all(&[h(1), h(2)]));
        assert!(!k.contains_all(&[h(1), h(3)]));
        assert!(k.contains(&h(2)));
        k.forget_all();
        assert!(!k.contains(&h(2)));
    }

    #[test]
    fn modes_from_the_config() {
        let cfg = HiCacheConfig {
            storage_write_mode: StorageWriteMode::Exclusive,
            ..Default::default()
        };
        let t = Tiering::new(&cfg, 80);
        assert!(t.exclusive && !t.buffer_only && !t.writes_at_admission());
        assert_eq!(t.headroom(), 10);
        let mut t = Tiering::new(&HiCacheConfig::default(), 80);
        assert!(t.writes_at_admission() && !t.dedups_admission());
        assert_eq!(t.headroom(), 0);
        // The default mode reads no record, so it keeps none (invariant 3).
        t.known.insert_all(&[h(1)]);
        assert!(!t.known.contains(&h(1)));
        let cfg = HiCacheConfig {
            hicache_host_memory_mode: HostMemoryMode::BufferOnly,
            ..Default::default()
        };
        let mut t = Tiering::new(&cfg, 80);
        t.known.insert_all(&[h(1)]);
        assert!(t.known.contains(&h(1)));
    }
}
