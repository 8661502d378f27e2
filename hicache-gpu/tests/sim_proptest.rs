//! Random transfers on the sim device against the naive reference: random layout, io
//! backend, shape, pool kind, page lists (distinct destinations, any sources) and layer ranges.

mod common;

use common::{Case, Fixture, dslots, hslots};
use hicache_core::LayoutKind;
use hicache_gpu::{Device, Direction, IoBackend};
use proptest::prelude::*;

fn case_strategy() -> impl Strategy<Value = Case> {
    let shapes = common::shapes();
    (
        0..shapes.len(),
        0..3usize,
        0..3usize,
        0..3usize,
        1usize..10,
        1usize..10,
    )
        .prop_map(move |(s, l, io, reg, dp, hp)| Case {
            shape: shapes[s],
            layout: LayoutKind::ALL[l],
            io: if io == 2 {
                IoBackend::Direct
            } else {
                IoBackend::Kernel
            },
            engine: reg > 0,
            misalign: if reg == 2 { 1 } else { 0 },
            device_pages: dp,
            host_pages: hp,
            staged: if io == 1 { 2 } else { 0 },
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn random_transfers_match_the_naive_reference(
        case in case_strategy(),
        picks in proptest::collection::vec((any::<u32>(), any::<u32>()), 0..10),
        to_host in any::<bool>(),
        layer_pick in any::<(u32, u32)>(),
        seed in any::<u64>(),
    ) {
        let device = Device::sim();
        let fx = Fixture::new(&device, case);
        let dir = if to_host { Direction::ToHost } else { Direction::ToDevice };
        // Distinct destinations, arbitrary (possibly repeated) sources.
        let mut dev = Vec::new();
        let mut host = Vec::new();
        for (a, b) in picks {
            let d = a % case.device_pages as u32;
            let h = b % case.host_pages as u32;
            let dst_taken = match dir {
                Direction::ToHost => host.contains(&h),
                Direction::ToDevice => dev.contains(&d),
            };
            if !dst_taken {
                dev.push(d);
                host.push(h);
            }
        }
        let l = case.shape.layers;
        let (a, b) = (layer_pick.0 % (l + 1), layer_pick.1 % (l + 1));
        let mut layers = a.min(b)..a.max(b);
        fx.randomize(seed);
        let before = fx.snapshot();
        if dir == Direction::ToHost && case.staged > 0 {
            // Staging applies to whole backups.
            layers = 0..l;
            fx.engine.backup(&dslots(&dev), &hslots(&host), &[]).unwrap().wait().unwrap();
        } else {
            fx.engine
                .copy_layers(dir, &dslots(&dev), &hslots(&host), layers.clone(), &[])
                .unwrap()
                .wait()
                .unwrap();
        }
        let want = fx.expected(&before, dir, &dev, &host, layers);
        prop_assert!(fx.snapshot() == want, "{:?} {:?} dev {:?} host {:?}", case, dir, dev, host);
    }
}
