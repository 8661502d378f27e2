//! Device Mamba state slots on the sim device: round trips in `MambaPool::get_slot` order,
//! ordering by events, refusal of bad slots, and random sequences of alloc / free / write /
//! backup / load / copy_slot checked against a model after every step.

mod state_common;

use hicache_gpu::{Device, GpuError, StatePool, StateTransfer};
use hicache_host::{MambaPool, MambaPoolConfig, PoolSize};
use proptest::prelude::*;
use state_common::{Op, bad_slots_are_refused, ordered_by_events, round_trips, run_model, shapes};

/// Round trips in `MambaPool::get_slot` order, ordering by streams and events, and bad slots
/// as errors that change nothing, for every shape.
#[test]
fn state_round_trips_events_and_bad_slots() {
    for shape in shapes() {
        round_trips(&Device::sim(), &shape);
        ordered_by_events(&Device::sim(), &shape);
        bad_slots_are_refused(&Device::sim(), &shape);
    }
}

#[test]
fn pools_of_different_shapes_are_refused() {
    let device = Device::sim();
    let [a, b, ..] = &shapes()[..] else {
        unreachable!()
    };
    let pool = std::sync::Arc::new(StatePool::new(&device, a, 2).unwrap());
    let host = MambaPool::new(MambaPoolConfig::new(b.clone(), PoolSize::Pages(2))).unwrap();
    let e = StateTransfer::new(pool, std::sync::Arc::new(host)).unwrap_err();
    assert!(matches!(e, GpuError::StateShapeMismatch { .. }), "{e}");
    assert!(StatePool::new(&device, a, 0).is_err());
    let mut bad = a.clone();
    bad.conv_elems.clear();
    assert!(StatePool::new(&device, &bad, 2).is_err());
}

/// The state of one slot of SGLang's test pool, piece by piece, as the host pool lays it out:
/// a device slot written with it and backed up is byte-for-byte that host slot.
#[test]
fn slot_bytes_are_pieces_then_layers() {
    let device = Device::sim();
    let shape = shapes()[0].clone();
    let f = state_common::Fixture::new(&device, &shape, 2, 2);
    assert_eq!(f.pool.num_pieces(), 3);
    assert_eq!(
        (0..3)
            .map(|p| f.pool.piece_layer_bytes(p).unwrap())
            .collect::<Vec<_>>(),
        vec![128, 36, 10]
    );
    let d = f.pool.alloc(2).unwrap();
    let h = f.host.alloc(1).unwrap();
    let data = state_common::pattern(5, f.pool.slot_bytes());
    f.pool.write_slot(d[1], &data).unwrap();
    f.xfer.backup(&d[1..], &h, &[]).unwrap().wait().unwrap();
    // Host rows of layer 1 of the temporal piece: offset 128 of the slot's flat bytes.
    let row = f.host.layer_iovec(h[0], 0, 1).unwrap();
    // SAFETY: a row of an allocated host slot that no transfer uses now.
    let got = unsafe { std::slice::from_raw_parts(row.addr as *const u8, row.len) };
    assert_eq!(got, &data[128..256]);
    // Device rows (sim device memory is host memory): `piece_ptr(p, l) + slot·row` for
    // (piece, layer) = (temporal, 1), (conv 0, 0), (conv 1, 1).
    for (piece, layer, flat) in [(0, 1, 128), (1, 0, 256), (2, 1, 256 + 72 + 10)] {
        let lb = f.pool.piece_layer_bytes(piece).unwrap();
        let addr = f.pool.piece_ptr(piece, layer) + (d[1].0 as usize * lb) as u64;
        // SAFETY: inside the piece's buffer (slot 1 of 2), which no transfer uses now.
        let got = unsafe { std::slice::from_raw_parts(addr as *const u8, lb) };
        assert_eq!(got, &data[flat..flat + lb], "piece {piece} layer {layer}");
    }
}

fn op() -> impl Strategy<Value = Op> {
    let picks = proptest::collection::vec((0usize..8, 0usize..8), 0..4);
    prop_oneof![
        (0usize..3).prop_map(Op::AllocDev),
        (0usize..8).prop_map(Op::FreeDev),
        (0usize..3).prop_map(Op::AllocHost),
        (0usize..8).prop_map(Op::FreeHost),
        (0usize..8, any::<u32>()).prop_map(|(i, b)| Op::Write(i, b)),
        (0usize..8, any::<u32>()).prop_map(|(i, b)| Op::SetHost(i, b)),
        picks.clone().prop_map(Op::Backup),
        picks.prop_map(Op::Load),
        (0usize..8, 0usize..8).prop_map(|(i, j)| Op::Copy(i, j)),
        (0usize..8).prop_map(Op::BadBackup),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Alloc never hands a live slot twice; backups, loads and copies keep both pools equal to
    /// the model; bad transfers change nothing.
    #[test]
    fn random_sequences_match_a_model(
        shape in 0..shapes().len(),
        dev_slots in 1usize..6,
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        run_model(&Device::sim(), &shapes()[shape], dev_slots, &ops);
    }
}
