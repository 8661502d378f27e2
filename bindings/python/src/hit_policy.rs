//! The hit policies of SGLang's `batch_exists_v2`, evaluated natively: the same verdicts as
//! the package's `hicache_rs.hit_policy.evaluate` (its module doc states them; SGLang's own
//! HiCacheFile is the reference for `all_pages` and `trailing_pages`), for the storage class's
//! one-native-call path (`Store.pool_exists`).
//!
//! Invariants (as the Python module's points 1-6):
//! 1. The walk starts from the KV verdict `kv_pages`: every prefix length `1..=kv_pages` is
//!    restorable; the report holds `("kv", kv_pages)` only when `kv_pages > 0`.
//! 2. Pools are taken in the order given; the walk stops once no length is restorable
//!    ([`Walk::done`]), so later pools are neither asked nor reported.
//! 3. `AllPages`: restorable lengths are `1..=b`, `b` the pool's leading run below `kv_pages`.
//! 4. `TrailingPages { window }`: length `p` is restorable when the pool has pages
//!    `max(0, p - window) .. p`.
//! 5. A pool's report is its largest restorable length, left out when zero; the restorable
//!    set is intersected across pools; the KV hit is its largest length.
//! 6. `BlockGroups { block, group }`: `block × (leading run / group)` capped at `kv_pages`,
//!    reported when non-zero, never gating the restorable set.

/// One pool's hit policy (SGLang's `PoolHitPolicy` with its geometry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Every page below the KV hit must be present.
    AllPages,
    /// The `window` pages before a length must be present.
    TrailingPages {
        /// `max(1, len(transfer.keys))`.
        window: usize,
    },
    /// Complete groups of `group` keys cover `block` pages each.
    BlockGroups {
        /// FULL pages per block (>= 1).
        block: usize,
        /// Keys per group (>= 1).
        group: usize,
    },
}

impl Policy {
    /// The policy SGLang names `name` (`all_pages`, `trailing_pages`, `block_groups`), with
    /// the transfer's key count and block geometry; `None` for an unknown name or a
    /// `block_groups` geometry below 1 (the Python path then raises, naming it).
    pub fn parse(name: &str, keys: usize, block: i64, group: i64) -> Option<Self> {
        match name {
            "all_pages" => Some(Self::AllPages),
            "trailing_pages" => Some(Self::TrailingPages {
                window: keys.max(1),
            }),
            "block_groups" if block >= 1 && group >= 1 => Some(Self::BlockGroups {
                block: usize::try_from(block).ok()?,
                group: usize::try_from(group).ok()?,
            }),
            _ => None,
        }
    }

    /// How many keys decide this pool's verdict (from the first): `kv_pages`, or for
    /// `BlockGroups` the keys of the groups that can count (`ceil(kv_pages / block)` groups).
    pub fn keys_to_ask(&self, kv_pages: usize) -> usize {
        match *self {
            Self::BlockGroups { block, group } => kv_pages.div_ceil(block).saturating_mul(group),
            _ => kv_pages,
        }
    }
}

fn leading_run(flags: &[bool]) -> usize {
    flags.iter().take_while(|&&f| f).count()
}

/// The state of one `batch_exists_v2` walk (invariants 1-6).
#[derive(Debug)]
pub struct Walk {
    kv_pages: usize,
    /// `restorable[p - 1]`: whether prefix length `p` is still restorable.
    restorable: Vec<bool>,
    report: Vec<(String, usize)>,
}

impl Walk {
    /// A walk from the KV verdict (invariant 1).
    pub fn new(kv_pages: usize) -> Self {
        let report = if kv_pages > 0 {
            vec![("kv".to_string(), kv_pages)]
        } else {
            Vec::new()
        };
        Self {
            kv_pages,
            restorable: vec![true; kv_pages],
            report,
        }
    }

    /// Whether no length is restorable any more (invariant 2).
    pub fn done(&self) -> bool {
        !self.restorable.contains(&true)
    }

    /// Takes pool `name`'s presence flags: of the query's first pages, or for
    /// `BlockGroups` of its own keys (invariants 3-6). Missing flags count as absent.
    pub fn apply(&mut self, name: &str, policy: Policy, flags: &[bool]) {
        let kv = self.kv_pages;
        let has = |i: usize| flags.get(i).copied().unwrap_or(false);
        let boundary = match policy {
            Policy::AllPages => {
                let b = (0..kv).take_while(|&i| has(i)).count();
                for p in b + 1..=kv {
                    self.restorable[p - 1] = false;
                }
                b
            }
            Policy::TrailingPages { window } => {
                // Pages present in the window before each length, counted as it slides.
                let mut best = 0;
                let mut missing = 0usize;
                for p in 1..=kv {
                    if !has(p - 1) {
                        missing += 1;
                    }
                    if p > window && !has(p - 1 - window) {
                        missing -= 1;
                    }
                    if missing == 0 {
                        best = p;
                    } else {
                        self.restorable[p - 1] = false;
                    }
                }
                best
            }
            Policy::BlockGroups { block, group } => {
                let b = kv.min((leading_run(flags) / group).saturating_mul(block));
                if b > 0 {
                    self.report.push((name.to_string(), b));
                }
                return;
            }
        };
        if boundary > 0 {
            self.report.push((name.to_string(), boundary));
        }
    }

    /// `(kv_hit_pages, extra_pool_hit_pages, restorable_prefix_pages)` (invariant 5).
    pub fn finish(self) -> (usize, Vec<(String, usize)>, Vec<usize>) {
        let restorable: Vec<usize> = (1..=self.kv_pages)
            .filter(|&p| self.restorable[p - 1])
            .collect();
        (
            restorable.last().copied().unwrap_or(0),
            self.report,
            restorable,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(s: &str) -> Vec<bool> {
        s.chars().map(|c| c == '1').collect()
    }

    fn walk(
        kv: usize,
        pools: &[(&str, Policy, &str)],
    ) -> (usize, Vec<(String, usize)>, Vec<usize>) {
        let mut w = Walk::new(kv);
        for (name, p, f) in pools {
            if w.done() {
                break;
            }
            w.apply(name, *p, &flags(f));
        }
        w.finish()
    }

    #[test]
    fn kv_alone_restores_every_length() {
        assert_eq!(walk(3, &[]), (3, vec![("kv".into(), 3)], vec![1, 2, 3]));
        assert_eq!(walk(0, &[]), (0, vec![], vec![]));
    }

    #[test]
    fn all_pages_cuts_at_the_first_hole() {
        let r = walk(4, &[("dsa", Policy::AllPages, "1101")]);
        assert_eq!(
            r,
            (2, vec![("kv".into(), 4), ("dsa".into(), 2)], vec![1, 2])
        );
        let r = walk(4, &[("dsa", Policy::AllPages, "0111")]);
        assert_eq!(r, (0, vec![("kv".into(), 4)], vec![]));
    }

    #[test]
    fn trailing_pages_allow_holes_before_the_window() {
        let t = Policy::TrailingPages { window: 1 };
        let r = walk(5, &[("mamba", t, "00101")]);
        assert_eq!(
            r,
            (5, vec![("kv".into(), 5), ("mamba".into(), 5)], vec![3, 5])
        );
        let t2 = Policy::TrailingPages { window: 2 };
        let r = walk(5, &[("swa", t2, "10111")]);
        assert_eq!(
            r,
            (5, vec![("kv".into(), 5), ("swa".into(), 5)], vec![1, 4, 5])
        );
        // Flags shorter than the query count as absent.
        let r = walk(3, &[("mamba", t, "1")]);
        assert_eq!(r, (1, vec![("kv".into(), 3), ("mamba".into(), 1)], vec![1]));
    }

    #[test]
    fn pools_intersect_and_the_walk_stops_when_nothing_is_left() {
        let t = Policy::TrailingPages { window: 1 };
        let r = walk(
            4,
            &[
                ("mamba", t, "0101"),
                ("dsa", Policy::AllPages, "1110"),
                ("late", Policy::AllPages, "0000"),
            ],
        );
        // `late` is still asked (length 2 was restorable) and takes the last length away.
        assert_eq!(
            r,
            (
                0,
                vec![("kv".into(), 4), ("mamba".into(), 4), ("dsa".into(), 3)],
                vec![]
            )
        );
        let r = walk(
            2,
            &[("a", Policy::AllPages, "00"), ("b", Policy::AllPages, "11")],
        );
        assert_eq!(r, (0, vec![("kv".into(), 2)], vec![]));
    }

    #[test]
    fn block_groups_report_without_gating() {
        let b = Policy::BlockGroups { block: 2, group: 2 };
        let r = walk(5, &[("c4", b, "111101")]);
        assert_eq!(
            r,
            (
                5,
                vec![("kv".into(), 5), ("c4".into(), 4)],
                vec![1, 2, 3, 4, 5]
            )
        );
        assert_eq!(b.keys_to_ask(5), 6);
        assert_eq!(Policy::AllPages.keys_to_ask(5), 5);
    }

    #[test]
    fn policies_parse_as_sglang_names_them() {
        assert_eq!(Policy::parse("all_pages", 3, 0, 0), Some(Policy::AllPages));
        assert_eq!(
            Policy::parse("trailing_pages", 0, 0, 0),
            Some(Policy::TrailingPages { window: 1 })
        );
        assert_eq!(
            Policy::parse("block_groups", 3, 2, 4),
            Some(Policy::BlockGroups { block: 2, group: 4 })
        );
        assert_eq!(Policy::parse("block_groups", 3, 0, 4), None);
        assert_eq!(Policy::parse("nope", 3, 1, 1), None);
    }
}
