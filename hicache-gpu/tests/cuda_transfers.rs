//! GPU tests: every kernel width and the direct path on a real GPU, against the naive
//! reference and against the CPU reference (the sim device) on the same random data.
//!
//! Built with `HICACHE_TEST_CUDA=1` (see `build.rs`) the tests run on CUDA device 0: a GPU
//! (with NVRTC on `LD_LIBRARY_PATH`), or the emulated driver under `scripts/with-cuda-emu.sh`
//! as CI runs them. Built without it, cargo reports them as ignored, with that command.

mod common;

use common::{Case, Fixture, cases, check_all_pair_lists, dslots, hslots, pair_lists};
use hicache_core::{KvShape, LayoutKind};
use hicache_gpu::{
    Device, DevicePool, DeviceRegion, Direction, EngineLayer, GpuError, IoBackend, TransferConfig,
};

/// Whether `device` is the emulated driver (`hicache-cuda-emu`), where every kernel access is
/// a checked CPU access: model-sized pools would take hours there.
fn emulated(device: &Device) -> bool {
    device.name().contains("hicache-cuda-emu")
}

/// Model shapes: the real ones on a GPU; on the emulated driver the same rows (Llama-3-8B's
/// 8 × 128 bf16 K/V rows, DeepSeek-V3's 576-wide bf16 latent) with 3 layers and 4 tokens a
/// page, so every kernel width and plan shape is still exercised in CI time.
fn model_shapes(device: &Device, page_size: u32) -> Vec<KvShape> {
    let full = [
        KvShape::llama3_8b(page_size),
        KvShape::deepseek_v3_mla(page_size),
    ];
    if !emulated(device) {
        return full.to_vec();
    }
    full.iter()
        .map(|s| KvShape {
            layers: 3,
            page_size: 4,
            ..*s
        })
        .collect()
}

/// CUDA device 0; the tests that call it are ignored unless built with `HICACHE_TEST_CUDA=1`.
fn cuda_device(test: &str) -> Device {
    let d = Device::cuda(0).unwrap_or_else(|e| panic!("{test} needs a CUDA device: {e}"));
    println!(
        "{test} on {} ({} SMs, cc {:?})",
        d.name(),
        d.sm_count(),
        d.compute_capability()
    );
    d
}

#[test]
#[cfg_attr(
    not(hicache_test_cuda),
    ignore = "needs a CUDA device: HICACHE_TEST_CUDA=1 cargo test -p hicache-gpu --test cuda_transfers \
              (on a GPU, or prefixed with scripts/with-cuda-emu.sh for the emulated driver)"
)]
fn every_case_matches_the_naive_reference_on_the_gpu() {
    let device = cuda_device("every_case_matches_the_naive_reference_on_the_gpu");
    let mut checked = 0;
    for (i, case) in cases().into_iter().enumerate() {
        let fx = Fixture::new(&device, case);
        checked += check_all_pair_lists(&fx, i as u64 * 1000);
    }
    println!("{checked} transfers checked on the GPU");
}

/// The same operations on the GPU and on the sim device (whose kernels are the CPU
/// references), from the same random bytes, must leave identical pools.
#[test]
#[cfg_attr(
    not(hicache_test_cuda),
    ignore = "needs a CUDA device: HICACHE_TEST_CUDA=1 cargo test -p hicache-gpu --test cuda_transfers \
              (on a GPU, or prefixed with scripts/with-cuda-emu.sh for the emulated driver)"
)]
fn kernels_and_direct_path_match_the_cpu_reference() {
    let gpu = cuda_device("kernels_and_direct_path_match_the_cpu_reference");
    let sim = Device::sim();
    let mut shapes = common::shapes();
    shapes.extend(model_shapes(&gpu, 16));
    for shape in shapes {
        for layout in LayoutKind::ALL {
            for (io, staged) in [
                (IoBackend::Kernel, 0),
                (IoBackend::Kernel, 3),
                (IoBackend::Direct, 0),
            ] {
                for (engine, misalign) in [(false, 0), (true, 0), (true, 4)] {
                    let case = Case {
                        shape,
                        layout,
                        io,
                        engine,
                        misalign,
                        device_pages: 11,
                        host_pages: 13,
                        staged,
                    };
                    let config = TransferConfig {
                        io,
                        staged_backup_pages: staged,
                        ..TransferConfig::default()
                    };
                    let g = Fixture::with_config(&gpu, case, config);
                    let s = Fixture::with_config(&sim, case, config);
                    for (i, (dev, host)) in pair_lists(11, 13, 5).into_iter().enumerate() {
                        let seed = i as u64 * 17;
                        for dir in [Direction::ToHost, Direction::ToDevice] {
                            g.randomize(seed);
                            s.randomize(seed);
                            for fx in [&g, &s] {
                                match dir {
                                    Direction::ToHost => fx
                                        .engine
                                        .backup(&dslots(&dev), &hslots(&host), &[])
                                        .unwrap()
                                        .wait()
                                        .unwrap(),
                                    Direction::ToDevice => fx
                                        .engine
                                        .load(&hslots(&host), &dslots(&dev), &[])
                                        .unwrap()
                                        .wait()
                                        .unwrap(),
                                }
                            }
                            assert!(
                                g.snapshot() == s.snapshot(),
                                "GPU and CPU reference differ: {case:?} {dir:?} list {i}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
#[cfg_attr(
    not(hicache_test_cuda),
    ignore = "needs a CUDA device: HICACHE_TEST_CUDA=1 cargo test -p hicache-gpu --test cuda_transfers \
              (on a GPU, or prefixed with scripts/with-cuda-emu.sh for the emulated driver)"
)]
fn launch_geometries_all_agree() {
    let device = cuda_device("launch_geometries_all_agree");
    let case = Case {
        shape: model_shapes(&device, 64)[0],
        layout: LayoutKind::PageFirst,
        io: IoBackend::Kernel,
        engine: false,
        misalign: 0,
        device_pages: 11,
        host_pages: 13,
        staged: 0,
    };
    for (ctas, threads, chunk) in [
        (1, 32, 512),
        (2, 1024, 4096),
        (16, 512, 16384),
        (132, 256, 65536),
    ] {
        let cfg = TransferConfig {
            io: IoBackend::Kernel,
            ctas,
            threads_per_cta: threads,
            chunk_bytes: chunk,
            staged_backup_pages: 0,
        };
        let fx = Fixture::with_config(&device, case, cfg);
        check_all_pair_lists(&fx, ctas as u64);
    }
}

#[test]
#[cfg_attr(
    not(hicache_test_cuda),
    ignore = "needs a CUDA device: HICACHE_TEST_CUDA=1 cargo test -p hicache-gpu --test cuda_transfers \
              (on a GPU, or prefixed with scripts/with-cuda-emu.sh for the emulated driver)"
)]
fn undersized_engine_buffers_are_caught_by_the_driver_check() {
    let device = cuda_device("undersized_engine_buffers_are_caught_by_the_driver_check");
    let shape = common::shapes()[1]; // MLA
    let need = shape.page_layer_bytes() * 4;
    let bufs: Vec<_> = (0..shape.layers)
        .map(|_| device.alloc_zeroed(need).unwrap())
        .collect();
    // Declared large enough, but the allocation behind the last layer is too short when the
    // pointer is moved inside it.
    let mut layers: Vec<EngineLayer> = bufs
        .iter()
        .map(|b| EngineLayer {
            k: DeviceRegion {
                ptr: b.addr(),
                len: need,
            },
            v: None,
        })
        .collect();
    // SAFETY: every region is inside a live allocation of `bufs`.
    unsafe {
        assert!(DevicePool::from_engine(&device, shape, 4, &layers).is_ok());
        layers[2].k.ptr += 64;
        let e = DevicePool::from_engine(&device, shape, 4, &layers).unwrap_err();
        assert!(matches!(e, GpuError::BufferTooSmall { .. }), "{e}");
        layers[2].k.ptr = 0x1000;
        let e = DevicePool::from_engine(&device, shape, 4, &layers).unwrap_err();
        assert!(matches!(e, GpuError::BadRegistration(_)), "{e}");
    }
}

/// An engine-owned stream (here: a raw handle of one of ours) drives a load and waits for its
/// layers through the LayerDoneCounter.
#[test]
#[cfg_attr(
    not(hicache_test_cuda),
    ignore = "needs a CUDA device: HICACHE_TEST_CUDA=1 cargo test -p hicache-gpu --test cuda_transfers \
              (on a GPU, or prefixed with scripts/with-cuda-emu.sh for the emulated driver)"
)]
fn borrowed_engine_stream_orders_loads_and_layers() {
    let device = cuda_device("borrowed_engine_stream_orders_loads_and_layers");
    let case = Case {
        shape: KvShape::llama3_8b(16),
        layout: LayoutKind::PageFirst,
        io: IoBackend::Kernel,
        engine: true,
        misalign: 0,
        device_pages: 11,
        host_pages: 13,
        staged: 0,
    };
    let fx = Fixture::new(&device, case);
    let owner = device.new_stream("engine").unwrap();
    // SAFETY: `owner` outlives `compute`.
    let compute =
        unsafe { hicache_gpu::Stream::borrow_cuda(&device, owner.as_raw_cuda().unwrap()) }.unwrap();
    fx.randomize(9);
    let before = fx.snapshot();
    let ready = compute.record().unwrap();
    assert!(ready.as_raw_cuda().is_some());
    let load = fx
        .engine
        .load(&hslots(&[1, 2, 3]), &dslots(&[4, 5, 6]), &[&ready])
        .unwrap();
    let counter = hicache_gpu::LayerDoneCounter::new(load.num_layers(), 3).unwrap();
    let id = counter.publish(load.clone()).unwrap();
    counter.set_consumer(id).unwrap();
    for l in 0..load.num_layers() {
        counter.stream_wait(&compute, l).unwrap();
    }
    compute.synchronize().unwrap();
    assert!(load.is_done().unwrap());
    let want = fx.expected(&before, Direction::ToDevice, &[4, 5, 6], &[1, 2, 3], 0..32);
    assert!(fx.snapshot() == want);
}

/// The sim-only test helper is refused on a CUDA stream, and the CUDA-only helpers answer there
/// (the sim side of both is `backups_poll_without_blocking` in sim_transfers.rs).
#[test]
#[cfg_attr(
    not(hicache_test_cuda),
    ignore = "needs a CUDA device: HICACHE_TEST_CUDA=1 cargo test -p hicache-gpu --test cuda_transfers \
              (on a GPU, or prefixed with scripts/with-cuda-emu.sh for the emulated driver)"
)]
fn sim_gate_is_refused_on_a_cuda_stream() {
    let device = cuda_device("sim_gate_is_refused_on_a_cuda_stream");
    let s = device.new_stream("compute").unwrap();
    let Err(e) = s.sim_gate() else {
        panic!("sim_gate on a CUDA stream must be refused");
    };
    assert!(matches!(e, GpuError::InvalidConfig(_)), "{e}");
    assert!(s.as_raw_cuda().is_some());
    assert!(s.record().unwrap().as_raw_cuda().is_some());
}
