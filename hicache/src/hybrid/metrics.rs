//! Prometheus text of the hybrid facade's counters ([`HybridTotals`]), in the style of
//! [`crate::metrics`]: `hicache_hybrid_` prefix, `_total` counters, base units, and a
//! `component` label (`full`, `swa`, `mamba`) beside the dense metrics' `tier` and
//! `direction` labels. Pages of Mamba are states.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::types::{ComponentTotals, HybridTotals};
use crate::metrics::{Direction, L3Op, Tier};

/// A component of a hybrid model, as a label value.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum ComponentLabel {
    full,
    swa,
    mamba,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    component: ComponentLabel,
    tier: Tier,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    component: ComponentLabel,
    op: L3Op,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    component: ComponentLabel,
    direction: Direction,
}

/// The counters of one component per direction: (pages, bytes).
fn moved(t: &ComponentTotals) -> [(Direction, u64, u64); 4] {
    [
        (Direction::d2h, t.pages_d2h, t.bytes_d2h),
        (Direction::h2d, t.pages_h2d, t.bytes_h2d),
        (Direction::l2_to_l3, t.pages_l2_to_l3, t.bytes_l2_to_l3),
        (Direction::l3_to_l2, t.pages_l3_to_l2, t.bytes_l3_to_l2),
    ]
}

/// Renders `totals` in the Prometheus text format.
pub(crate) fn render(totals: &HybridTotals) -> String {
    let hits = Family::<TierLabels, Counter>::default();
    let evicted = Family::<TierLabels, Counter>::default();
    let pages = Family::<DirectionLabels, Counter>::default();
    let bytes = Family::<DirectionLabels, Counter>::default();
    let failed = Family::<OpLabels, Counter>::default();
    let comps = [
        (ComponentLabel::full, &totals.full),
        (ComponentLabel::swa, &totals.swa),
        (ComponentLabel::mamba, &totals.mamba),
    ];
    for (component, t) in comps {
        let tiers = [
            (Tier::l1, t.hit_tokens_l1),
            (Tier::l2, t.hit_tokens_l2),
            (Tier::l3, t.hit_tokens_l3),
        ];
        for (tier, v) in tiers {
            hits.get_or_create(&TierLabels { component, tier })
                .inc_by(v);
        }
        for (tier, v) in [(Tier::l1, t.evicted_device), (Tier::l2, t.evicted_host)] {
            evicted
                .get_or_create(&TierLabels { component, tier })
                .inc_by(v);
        }
        for (op, v) in [
            (L3Op::write, t.l3_failed_write_pages),
            (L3Op::read, t.l3_failed_read_pages),
        ] {
            failed.get_or_create(&OpLabels { component, op }).inc_by(v);
        }
        for (direction, p, b) in moved(t) {
            let l = DirectionLabels {
                component,
                direction,
            };
            pages.get_or_create(&l).inc_by(p);
            bytes.get_or_create(&l).inc_by(b);
        }
    }
    let mut registry = Registry::with_prefix("hicache_hybrid");
    registry.register(
        "hit_tokens",
        "Prompt tokens served per tier at admission, per component",
        hits,
    );
    registry.register(
        "evicted_pages",
        "Pages (Mamba: states) evicted per tier, per component",
        evicted,
    );
    registry.register(
        "moved_pages",
        "Pages (Mamba: states) moved between tiers, per component and direction",
        pages,
    );
    registry.register(
        "moved_bytes",
        "Bytes moved between tiers, per component and direction",
        bytes,
    );
    registry.register(
        "l3_failed_pages",
        "L3 pages (Mamba: states) that failed, per component and operation",
        failed,
    );
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_carry_a_component_label() {
        let mut t = HybridTotals::default();
        t.swa.pages_d2h = 3;
        t.swa.bytes_d2h = 3072;
        t.mamba.hit_tokens_l3 = 40;
        t.full.evicted_host = 2;
        t.mamba.l3_failed_write_pages = 1;
        let text = render(&t);
        for line in [
            r#"hicache_hybrid_moved_pages_total{component="swa",direction="d2h"} 3"#,
            r#"hicache_hybrid_moved_bytes_total{component="swa",direction="d2h"} 3072"#,
            r#"hicache_hybrid_hit_tokens_total{component="mamba",tier="l3"} 40"#,
            r#"hicache_hybrid_evicted_pages_total{component="full",tier="l2"} 2"#,
            r#"hicache_hybrid_l3_failed_pages_total{component="mamba",op="write"} 1"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
    }
}
