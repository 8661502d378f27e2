//! Device Mamba state slots on CUDA: the sim suite's round trips, event ordering, refusal of
//! bad slots and random sequences against the model, run on CUDA device 0 (device memory,
//! `cuMemHostRegister`ed host pool, `cuMemcpy{DtoH,HtoD,DtoD}Async` on our streams).
//!
//! Built with `HICACHE_TEST_CUDA=1` (see `build.rs`) the tests run: on a GPU, or on the
//! emulated driver under `scripts/with-cuda-emu.sh` as CI runs them (no NVRTC needed: state
//! copies use no kernel). Built without it, cargo reports them as ignored, with that command.

mod state_common;

use hicache_gpu::Device;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use state_common::{Op, bad_slots_are_refused, ordered_by_events, round_trips, run_model, shapes};

/// CUDA device 0; the tests that call it are ignored unless built with `HICACHE_TEST_CUDA=1`.
fn cuda_device(test: &str) -> Device {
    let d = Device::cuda(0).unwrap_or_else(|e| panic!("{test} needs a CUDA device: {e}"));
    println!("{test} on {}", d.name());
    d
}

#[test]
#[cfg_attr(
    not(hicache_test_cuda),
    ignore = "needs a CUDA device: HICACHE_TEST_CUDA=1 cargo test -p hicache-gpu --test cuda_state \
              (on a GPU, or prefixed with scripts/with-cuda-emu.sh for the emulated driver)"
)]
fn state_round_trips_events_and_bad_slots_on_cuda() {
    let device = cuda_device("state_round_trips_events_and_bad_slots_on_cuda");
    for shape in shapes() {
        round_trips(&device, &shape);
        ordered_by_events(&device, &shape);
        bad_slots_are_refused(&device, &shape);
    }
}

/// A random op of the model runner (the sim suite draws them with proptest).
fn random_op(rng: &mut ChaCha8Rng) -> Op {
    let picks = |rng: &mut ChaCha8Rng| {
        (0..rng.random_range(0..4))
            .map(|_| (rng.random_range(0..8), rng.random_range(0..8)))
            .collect()
    };
    match rng.random_range(0..10) {
        0 => Op::AllocDev(rng.random_range(0..3)),
        1 => Op::FreeDev(rng.random_range(0..8)),
        2 => Op::AllocHost(rng.random_range(0..3)),
        3 => Op::FreeHost(rng.random_range(0..8)),
        4 => Op::Write(rng.random_range(0..8), rng.random()),
        5 => Op::SetHost(rng.random_range(0..8), rng.random()),
        6 => Op::Backup(picks(rng)),
        7 => Op::Load(picks(rng)),
        8 => Op::Copy(rng.random_range(0..8), rng.random_range(0..8)),
        _ => Op::BadBackup(rng.random_range(0..8)),
    }
}

#[test]
#[cfg_attr(
    not(hicache_test_cuda),
    ignore = "needs a CUDA device: HICACHE_TEST_CUDA=1 cargo test -p hicache-gpu --test cuda_state \
              (on a GPU, or prefixed with scripts/with-cuda-emu.sh for the emulated driver)"
)]
fn random_state_sequences_match_a_model_on_cuda() {
    let device = cuda_device("random_state_sequences_match_a_model_on_cuda");
    let mut rng = ChaCha8Rng::seed_from_u64(26);
    for round in 0..12 {
        let shape = &shapes()[round % shapes().len()];
        let ops: Vec<Op> = (0..30).map(|_| random_op(&mut rng)).collect();
        run_model(&device, shape, 1 + round % 5, &ops);
    }
}
