//! The admission budget of SGLang 0.5.23's scheduler for a unified tree
//! (`PrefillAdder.add_one_req` → `_select_prefill_admission` → the allocator's prefill
//! budget, `PrefillBudget` / `SWAPrefillBudget.check_prefill`), the one decision both
//! `hicache`'s `HybridCache::try_admit` and `hicache-bench tree --host-capacity-pages`'s
//! replay make before a load-back.
//!
//! Rules (token counts; `P` the page size, `W` the SWA window):
//!
//! - The request's device prefix is locked while the budget is read, so its Full pages (and
//!   its SWA window) count as neither free nor evictable.
//! - **Full**: `total = (prompt − device prefix) + max_new + P` must be strictly below the
//!   Full room, `free + evictable`. The host hit is counted: it is part of what lies past
//!   the device prefix (its load-back takes device pages as recomputing it would).
//! - **SWA**: with `ext = ⌈(prompt − device prefix − host hit) / P⌉·P` (the part computed
//!   after the load-back), `max(ext − W, 0) + min(ext + max_new, W) + P` plus the SWA host
//!   hit rounded up to pages must be strictly below the SWA room.
//! - **Mamba**: no state budget (the state slots are checked when they are allocated).
//! - **Fallback**: when a load-back with a Full host hit loaded nothing (no room for a state,
//!   say), the check is made again with no host hit, and the hit is recomputed only if that
//!   passes ([`AdmissionAsk::without_host`]).

use super::{Component, UnifiedMatch, UnifiedTree};

/// What an admission asks of the device, in the scheduler's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionAsk {
    /// Prompt tokens.
    pub prompt: usize,
    /// Tokens the request may still decode (the scheduler's `max_new_tokens`, clipped).
    pub max_new: usize,
    /// Full tokens of the match's device prefix.
    pub device_prefix: usize,
    /// Full tokens of the host hit to load back (0: recompute it).
    pub host_hit: usize,
    /// SWA tokens of the host hit held on host only.
    pub swa_host_hit: usize,
}

impl AdmissionAsk {
    /// The ask of a request of `prompt` tokens that may decode `max_new` more, on match `m`
    /// (its host hit counted).
    pub fn new(m: &UnifiedMatch, prompt: usize, max_new: usize) -> Self {
        Self {
            prompt,
            max_new,
            device_prefix: m.device_prefix_len,
            host_hit: m.host_hit_len,
            swa_host_hit: m.swa_host_hit_len,
        }
    }

    /// The same ask with the host hit recomputed instead of loaded (the fallback).
    pub fn without_host(self) -> Self {
        Self {
            host_hit: 0,
            swa_host_hit: 0,
            ..self
        }
    }
}

/// Free device room beside what the tree holds, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceFree {
    /// Free Full token slots.
    pub full: u64,
    /// Free SWA token slots (ignored without SWA).
    pub swa: u64,
}

impl UnifiedTree {
    /// Whether the scheduler's budget admits `ask` with `free` device room beside the tree's
    /// evictable sizes (module documentation). The caller holds the lock of the match's
    /// device node, as the scheduler does while it checks.
    pub fn admission_fits(&self, ask: AdmissionAsk, free: DeviceFree) -> bool {
        let ps = self.ps();
        let past = ask.prompt.saturating_sub(ask.device_prefix) as u64;
        // Saturating: a caller's `max_new` may be any size (it is refused, never a panic).
        let total = past
            .saturating_add(ask.max_new as u64)
            .saturating_add(ps as u64);
        if total >= free.full + self.evictable_size(Component::Full) {
            return false;
        }
        let Some(window) = self
            .config()
            .swa_window
            .filter(|_| self.has(Component::Swa))
        else {
            return true;
        };
        let page_up = |t: usize| t.div_ceil(ps) * ps;
        let window = window as usize;
        let ext = page_up(
            ask.prompt
                .saturating_sub(ask.device_prefix)
                .saturating_sub(ask.host_hit),
        );
        let needed = ext.saturating_sub(window)
            + ext.saturating_add(ask.max_new).min(window)
            + ps
            + page_up(ask.swa_host_hit);
        (needed as u64) < free.swa + self.evictable_size(Component::Swa)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::UnifiedConfig;

    fn tree(swa_window: Option<u32>) -> UnifiedTree {
        UnifiedTree::new(UnifiedConfig {
            page_size: 16,
            swa_window,
            mamba_chunk: None,
        })
        .unwrap()
    }

    fn ask(
        prompt: usize,
        device_prefix: usize,
        host_hit: usize,
        swa_host_hit: usize,
    ) -> AdmissionAsk {
        AdmissionAsk {
            prompt,
            max_new: 1,
            device_prefix,
            host_hit,
            swa_host_hit,
        }
    }

    #[test]
    fn full_budget_counts_the_host_hit_a_spare_page_and_is_strict() {
        let t = tree(None);
        let free = |full| DeviceFree { full, swa: 0 };
        // 100 past the device prefix (the host hit included) + 1 + 16 = 117.
        let a = ask(132, 32, 64, 0);
        assert!(!t.admission_fits(a, free(117)));
        assert!(t.admission_fits(a, free(118)));
        assert_eq!(
            t.admission_fits(a.without_host(), free(118)),
            t.admission_fits(a, free(118)),
            "recomputing the hit takes the same Full budget"
        );
    }

    #[test]
    fn swa_budget_charges_the_window_of_what_is_computed_and_the_host_window() {
        let t = tree(Some(64));
        let free = |swa| DeviceFree { full: 10_000, swa };
        // Loaded: ext 80 → 16 + 64 + 16 + 64 (the host SWA) = 160.
        let a = ask(200, 0, 128, 64);
        assert!(!t.admission_fits(a, free(160)));
        assert!(t.admission_fits(a, free(161)));
        // Recomputed: ext 208 → 144 + 64 + 16 = 224.
        assert!(!t.admission_fits(a.without_host(), free(224)));
        assert!(t.admission_fits(a.without_host(), free(225)));
    }

    #[test]
    fn an_ask_of_any_size_is_refused_never_a_panic() {
        let huge = AdmissionAsk {
            max_new: usize::MAX,
            ..ask(200, 0, 128, 64)
        };
        for t in [tree(None), tree(Some(64))] {
            let all = DeviceFree {
                full: u64::MAX - 1,
                swa: u64::MAX - 1,
            };
            assert!(!t.admission_fits(huge, all));
        }
    }
}
