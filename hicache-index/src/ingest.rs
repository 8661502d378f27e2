//! Applying one engine's KV events to the index.
//!
//! Engines name blocks by their own hashes (SGLang's and ours: the first 8 bytes of a SHA-256
//! chain; vLLM's: its own); the index names them by its [`chain`](crate::chain) computed from
//! the tokens a `BlockStored` carries. An [`InstanceFeed`] keeps, per instance, the map from
//! the engine's hash of each block it reported to the index's hash, so that a `BlockRemoved`
//! (which carries no tokens) and a `BlockStored` whose parent is an earlier block can be
//! resolved.
//!
//! Invariants:
//! 1. An entry of the map lives exactly while the instance has reported the block stored in at
//!    least one tier and not removed from it (its tier mask is not empty); `clear` empties it.
//! 2. A `BlockStored` whose parent the instance never reported (or already removed from every
//!    tier) cannot be chained: it is dropped whole and counted (`unknown_parent`), never
//!    guessed. A `BlockRemoved` of a block never reported is counted (`unknown_block`).
//! 3. Malformed events (token count not `block_size` × blocks, a block size other than the
//!    model's page size, an unknown medium) are dropped whole and counted (`malformed`).
//! 4. L3 events go to the instance's L3 holder: the shared store it registered, or the
//!    instance itself when its L3 is its own.

use crate::chain::{BlockHash, ChainHasher};
use crate::error::Result;
use crate::table::{HolderId, Index, Tier};
use hashbrown::HashMap;

/// One KV event as engines publish it (SGLang's and vLLM's `KVEventBatch` events, ours).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    /// Blocks became resident in `medium`.
    BlockStored {
        /// The engine's hash of each block.
        block_hashes: Vec<i64>,
        /// The engine's hash of the block before the first, or none at a sequence's start.
        parent_block_hash: Option<i64>,
        /// The tokens of the blocks, `block_size` per block.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The LoRA adapter, if any.
        lora_id: Option<i64>,
        /// Where: `GPU`, `CPU_PINNED` / `CPU`, `DISK` / `EXTERNAL` / `STORAGE`.
        medium: Option<String>,
    },
    /// Blocks left `medium`.
    BlockRemoved {
        /// The engine's hash of each block.
        block_hashes: Vec<i64>,
        /// Where from (none: the engine's device pool, as vLLM's older events mean).
        medium: Option<String>,
    },
    /// The engine dropped everything.
    AllBlocksCleared,
}

/// The tier an event's medium names; `None` when the medium is unknown. A missing medium means
/// the device pool (engines that publish one tier only leave it out).
pub fn tier_of_medium(medium: Option<&str>) -> Option<Tier> {
    match medium {
        None | Some("GPU") => Some(Tier::L1),
        Some("CPU_PINNED") | Some("CPU") => Some(Tier::L2),
        Some("DISK") | Some("EXTERNAL") | Some("STORAGE") => Some(Tier::L3),
        Some(_) => None,
    }
}

/// What applying events did, counted.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct IngestCounts {
    /// Events applied.
    pub events: u64,
    /// Block residencies stored (one per block per event).
    pub stored_blocks: u64,
    /// Block residencies removed.
    pub removed_blocks: u64,
    /// `BlockStored` events dropped because their parent was unknown.
    pub unknown_parent: u64,
    /// Blocks of `BlockRemoved` events the instance never reported.
    pub unknown_block: u64,
    /// Events dropped as malformed.
    pub malformed: u64,
}

impl IngestCounts {
    /// Adds another tally to this one.
    pub fn add(&mut self, o: &IngestCounts) {
        self.events += o.events;
        self.stored_blocks += o.stored_blocks;
        self.removed_blocks += o.removed_blocks;
        self.unknown_parent += o.unknown_parent;
        self.unknown_block += o.unknown_block;
        self.malformed += o.malformed;
    }
}

/// One change [`InstanceFeed::apply_observed`] made in the index.
#[derive(Copy, Clone, Debug)]
pub struct Applied<'a> {
    /// The holder changed.
    pub holder: HolderId,
    /// The tier.
    pub tier: Tier,
    /// Stored (`true`) or removed.
    pub stored: bool,
    /// The index hashes stored or removed.
    pub hashes: &'a [BlockHash],
}

/// One instance's side of the index: its holders and its engine-hash map.
#[derive(Debug)]
pub struct InstanceFeed {
    instance: HolderId,
    l3: HolderId,
    page_size: u32,
    /// engine hash → (index hash, tiers the instance reported it in).
    map: HashMap<i64, (BlockHash, u8)>,
}

impl InstanceFeed {
    /// The feed of `instance`, whose L3 pages go to `l3` (a store it is attached to, or the
    /// instance itself), for a model of `page_size` tokens per page.
    pub fn new(instance: HolderId, l3: HolderId, page_size: u32) -> Self {
        Self {
            instance,
            l3,
            page_size,
            map: HashMap::new(),
        }
    }

    /// The instance's holder.
    pub fn instance(&self) -> HolderId {
        self.instance
    }

    /// The holder of the instance's L3 pages.
    pub fn l3_holder(&self) -> HolderId {
        self.l3
    }

    /// Tokens per page of the instance's model.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Blocks in the engine-hash map.
    pub fn mapped_blocks(&self) -> usize {
        self.map.len()
    }

    /// Bytes the engine-hash map holds (its allocated capacity).
    pub fn map_bytes(&self) -> u64 {
        (self.map.capacity() * (std::mem::size_of::<(i64, (BlockHash, u8))>() + 1)) as u64
    }

    /// The index hash of an engine hash the instance reported, if any.
    pub fn resolve(&self, engine_hash: i64) -> Option<BlockHash> {
        self.map.get(&engine_hash).map(|e| e.0)
    }

    fn holder_for(&self, tier: Tier) -> HolderId {
        if tier == Tier::L3 {
            self.l3
        } else {
            self.instance
        }
    }

    /// Applies one event to `index`, adding what it did to `counts`.
    pub fn apply(
        &mut self,
        index: &mut Index,
        event: &EngineEvent,
        counts: &mut IngestCounts,
    ) -> Result<()> {
        self.apply_observed(index, event, counts, &mut |_| {})
    }

    /// [`apply`](Self::apply), telling `observe` each store and removal it made in the index
    /// (a service mirrors a shared store's pages with it).
    pub fn apply_observed(
        &mut self,
        index: &mut Index,
        event: &EngineEvent,
        counts: &mut IngestCounts,
        observe: &mut dyn FnMut(Applied<'_>),
    ) -> Result<()> {
        match event {
            EngineEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
            } => {
                let Some(tier) = tier_of_medium(medium.as_deref()) else {
                    counts.malformed += 1;
                    return Ok(());
                };
                if *block_size != self.page_size
                    || token_ids.len() != block_hashes.len() * *block_size as usize
                {
                    counts.malformed += 1;
                    return Ok(());
                }
                let parent = match parent_block_hash {
                    None => None,
                    Some(p) => match self.map.get(p) {
                        Some(e) => Some(e.0),
                        None => {
                            counts.unknown_parent += 1;
                            return Ok(());
                        }
                    },
                };
                let hasher = ChainHasher::with_lora(self.page_size as usize, *lora_id);
                let mut hashes = Vec::with_capacity(block_hashes.len());
                hasher.extend(parent, token_ids, &mut hashes);
                for (e, h) in block_hashes.iter().zip(&hashes) {
                    let entry = self.map.entry(*e).or_insert((*h, 0));
                    // An engine hash reused for other tokens (a restart with another seed,
                    // a collision): the newest tokens win.
                    entry.0 = *h;
                    entry.1 |= tier.bit();
                }
                index.store(self.holder_for(tier), tier, &hashes)?;
                observe(Applied {
                    holder: self.holder_for(tier),
                    tier,
                    stored: true,
                    hashes: &hashes,
                });
                counts.stored_blocks += hashes.len() as u64;
            }
            EngineEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                let Some(tier) = tier_of_medium(medium.as_deref()) else {
                    counts.malformed += 1;
                    return Ok(());
                };
                let mut hashes = Vec::with_capacity(block_hashes.len());
                for e in block_hashes {
                    match self.map.get_mut(e) {
                        Some(entry) if entry.1 & tier.bit() != 0 => {
                            hashes.push(entry.0);
                            entry.1 &= !tier.bit();
                            if entry.1 == 0 {
                                self.map.remove(e);
                            }
                        }
                        _ => counts.unknown_block += 1,
                    }
                }
                index.remove(self.holder_for(tier), tier, &hashes)?;
                observe(Applied {
                    holder: self.holder_for(tier),
                    tier,
                    stored: false,
                    hashes: &hashes,
                });
                counts.removed_blocks += hashes.len() as u64;
            }
            EngineEvent::AllBlocksCleared => {
                self.clear(index)?;
            }
        }
        counts.events += 1;
        Ok(())
    }

    /// The engine-hash map's entries: (engine hash, index hash, tier mask), in no order.
    pub fn entries(&self) -> impl Iterator<Item = (i64, BlockHash, u8)> + '_ {
        self.map.iter().map(|(e, (h, m))| (*e, *h, *m))
    }

    /// Restores entries [`entries`](Self::entries) gave, and stores each in `index` for its
    /// tiers (L3 ones only when its L3 is its own), one `store` call per tier. For a restart
    /// from a snapshot: the map and the index end as they were (the ages of the holder-blocks
    /// excepted).
    pub fn restore(
        &mut self,
        index: &mut Index,
        entries: impl IntoIterator<Item = (i64, BlockHash, u8)>,
    ) -> Result<()> {
        let mut per_tier: [Vec<BlockHash>; 3] = Default::default();
        let entries = entries.into_iter();
        self.map.reserve(entries.size_hint().0);
        for (e, h, mask) in entries {
            if mask & 7 == 0 {
                continue;
            }
            self.map.insert(e, (h, mask & 7));
            for (i, tier) in [Tier::L1, Tier::L2, Tier::L3].into_iter().enumerate() {
                if mask & tier.bit() != 0 {
                    per_tier[i].push(h);
                }
            }
        }
        for (i, tier) in [Tier::L1, Tier::L2, Tier::L3].into_iter().enumerate() {
            // A shared store's pages are restored from the store's own record: what the
            // instance once wrote there may have left it since.
            if tier == Tier::L3 && self.l3 != self.instance {
                continue;
            }
            index.store(self.holder_for(tier), tier, &per_tier[i])?;
        }
        Ok(())
    }

    /// Drops everything the instance holds in L1 and L2 (and in L3 when its L3 is its own) and
    /// its engine-hash map: after an `AllBlocksCleared`, a restart, or its death. Pages it wrote
    /// to a shared store stay: the store still has them.
    pub fn clear(&mut self, index: &mut Index) -> Result<()> {
        index.clear(self.instance)?;
        self.map.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::{Answer, HolderKind};

    fn stored(hashes: &[i64], parent: Option<i64>, tokens: &[u32], medium: &str) -> EngineEvent {
        EngineEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 2,
            lora_id: None,
            medium: Some(medium.to_string()),
        }
    }

    #[test]
    fn events_chain_through_the_engines_parents_and_queries_need_only_tokens() {
        let mut idx = Index::new(None);
        let a = idx.add_holder(HolderKind::Instance).unwrap();
        let s = idx.add_holder(HolderKind::Store).unwrap();
        idx.attach(a, s).unwrap();
        let mut feed = InstanceFeed::new(a, s, 2);
        let mut c = IngestCounts::default();
        feed.apply(
            &mut idx,
            &stored(&[10, 11], None, &[1, 2, 3, 4], "GPU"),
            &mut c,
        )
        .unwrap();
        feed.apply(
            &mut idx,
            &stored(&[12], Some(11), &[5, 6], "CPU_PINNED"),
            &mut c,
        )
        .unwrap();
        feed.apply(
            &mut idx,
            &stored(&[13], Some(12), &[7, 8], "EXTERNAL"),
            &mut c,
        )
        .unwrap();
        let q = ChainHasher::new(2).hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 9]);
        let mut out = Answer::new();
        idx.query(&q, &mut out);
        let m = out.to_vec()[0];
        assert_eq!((m.l1, m.l2, m.l3), (2, 3, 4));
        assert_eq!(c.stored_blocks, 4);

        // Removal by engine hash; a removal of an unknown block is counted.
        feed.apply(
            &mut idx,
            &EngineEvent::BlockRemoved {
                block_hashes: vec![11, 99],
                medium: Some("GPU".into()),
            },
            &mut c,
        )
        .unwrap();
        idx.query(&q, &mut out);
        let m = out.to_vec()[0];
        assert_eq!((m.l1, m.l2, m.l3), (1, 1, 1));
        assert_eq!(c.unknown_block, 1);
    }

    #[test]
    fn unknown_parents_and_malformed_events_are_dropped_and_counted() {
        let mut idx = Index::new(None);
        let a = idx.add_holder(HolderKind::Instance).unwrap();
        let mut feed = InstanceFeed::new(a, a, 2);
        let mut c = IngestCounts::default();
        feed.apply(&mut idx, &stored(&[1], Some(77), &[1, 2], "GPU"), &mut c)
            .unwrap();
        feed.apply(&mut idx, &stored(&[1], None, &[1, 2, 3], "GPU"), &mut c)
            .unwrap();
        feed.apply(&mut idx, &stored(&[1], None, &[1, 2], "TAPE"), &mut c)
            .unwrap();
        assert_eq!((c.unknown_parent, c.malformed, c.events), (1, 2, 0));
        assert_eq!(idx.stats().holder_blocks, 0);
    }
}
