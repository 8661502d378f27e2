//! SGLang 0.5.23's insert lengths of a finished request in a hybrid model (what
//! `hicache-bench tree --components` replays and the `hicache` hybrid facade inserts): SWA
//! inserts up to its branching length when that lies past the match, else the whole
//! sequence; Mamba inserts up to the checkpoint the request tracked
//! (`_mamba_radix_cache_v2_req_prepare_for_extend`).

use super::UnifiedConfig;

impl UnifiedConfig {
    /// Tokens of a finished sequence of `len` tokens to insert, before page alignment.
    ///
    /// `matched` is the prefix the request reused; `swa_branching` / `mamba_branching` are the
    /// match's branching lengths. With Mamba the tracked checkpoint decides
    /// ([`mamba_checkpoint`](Self::mamba_checkpoint)).
    pub fn insert_len(
        &self,
        len: usize,
        matched: usize,
        swa_branching: Option<usize>,
        mamba_branching: Option<usize>,
    ) -> usize {
        if self.mamba_chunk.is_some() {
            return self.mamba_checkpoint(matched, len.saturating_sub(matched), mamba_branching);
        }
        if self.swa_window.is_some() {
            return swa_branching
                .filter(|&b| b > matched && b <= len)
                .unwrap_or(len);
        }
        len
    }

    /// The Mamba checkpoint a request of `extend` new tokens after `matched` tracked: the
    /// last multiple of the checkpoint grid inside the extend, moved back to the branching
    /// length when that lies on the chunk grid before the tracked end; 0 when the extend is
    /// shorter than one grid step or Mamba is not configured.
    pub fn mamba_checkpoint(
        &self,
        matched: usize,
        extend: usize,
        branching: Option<usize>,
    ) -> usize {
        let (Some(grid), Some(chunk)) = (self.mamba_grid(), self.mamba_chunk) else {
            return 0;
        };
        if extend < grid {
            return 0;
        }
        let chunk = chunk as usize;
        let step = chunk.max(self.page_size as usize);
        let on_grid = matched + extend - extend % grid;
        let on_chunk = matched + extend - extend % chunk;
        // Where the state is tracked up to: the whole extend, or just past the grid point
        // when the chunk and grid ends differ.
        let tracked_end = if on_chunk == on_grid {
            matched + extend
        } else {
            on_grid + 1
        };
        match branching {
            Some(b) if b > matched && b < tracked_end && (b - matched).is_multiple_of(step) => b,
            _ => on_grid,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::UnifiedConfig;

    fn cfg(swa: Option<u32>, mamba: Option<u32>) -> UnifiedConfig {
        UnifiedConfig {
            page_size: 16,
            swa_window: swa,
            mamba_chunk: mamba,
        }
    }

    #[test]
    fn full_only_inserts_everything() {
        assert_eq!(cfg(None, None).insert_len(100, 32, None, None), 100);
    }

    #[test]
    fn swa_stops_at_a_branching_length_past_the_match() {
        let c = cfg(Some(32), None);
        assert_eq!(c.insert_len(200, 64, Some(96), None), 96);
        assert_eq!(c.insert_len(200, 96, Some(96), None), 200);
        assert_eq!(c.insert_len(200, 64, Some(300), None), 200);
    }

    #[test]
    fn mamba_tracks_the_last_grid_checkpoint() {
        let c = cfg(None, Some(64));
        // 100 tokens from scratch: the checkpoint at 64 (as the bench's replay inserts).
        assert_eq!(c.insert_len(100, 0, None, None), 64);
        // 200 tokens after a 64-token match: 64 + 128.
        assert_eq!(c.insert_len(200, 64, None, None), 192);
        // Shorter than one grid step: nothing.
        assert_eq!(c.insert_len(100, 64, None, None), 0);
        // A branching length on the chunk grid inside the extend wins.
        assert_eq!(c.insert_len(300, 0, None, Some(128)), 128);
    }
}
