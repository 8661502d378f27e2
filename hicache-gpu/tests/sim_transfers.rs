//! Every layout × direction × MHA/MLA × element size × io backend × pool kind on the sim
//! device, against the naive reference, plus the layer events and bad input.

mod common;

use std::sync::Arc;

use common::{Case, Fixture, cases, check_all_pair_lists, dslots, hslots};
use hicache_core::{KvShape, LayoutKind};
use hicache_gpu::{
    Device, DevicePool, DeviceRegion, Direction, EngineLayer, GpuError, HostRegistration,
    IoBackend, LayerDoneCounter, MemcpyOp, TransferConfig, TransferEngine,
};
use hicache_host::{HostPool, HostPoolConfig, HugePagePolicy, PoolSize};

#[test]
fn every_case_matches_the_naive_reference() {
    let device = Device::sim();
    let mut checked = 0;
    for (i, case) in cases().into_iter().enumerate() {
        let fx = Fixture::new(&device, case);
        checked += check_all_pair_lists(&fx, i as u64 * 1000);
    }
    println!("{checked} transfers checked");
    assert!(checked > 1000);
}

#[test]
fn default_launch_geometry_matches_too() {
    // The default config (8 CTAs × 512 threads, 16 KiB chunks) on a Llama-shaped row.
    let device = Device::sim();
    let case = Case {
        shape: KvShape::llama3_8b(4),
        layout: LayoutKind::PageFirst,
        io: IoBackend::Kernel,
        engine: false,
        misalign: 0,
        device_pages: 11,
        host_pages: 13,
        staged: 0,
    };
    let fx = Fixture::with_config(&device, case, TransferConfig::default());
    assert_eq!(fx.engine.word_bytes(), 16);
    check_all_pair_lists(&fx, 7);
}

fn small_case(layout: LayoutKind, io: IoBackend) -> Case {
    Case {
        shape: common::shapes()[1],
        layout,
        io,
        engine: false,
        misalign: 0,
        device_pages: 8,
        host_pages: 8,
        staged: 0,
    }
}

#[test]
fn direct_plan_coalesces_runs_and_pages() {
    let device = Device::sim();
    let layers = common::shapes()[1].layers; // MLA, 4 layers, one half
    // layer_first + our pool (uniform layers): a run of 4 pages over all layers is one copy.
    let fx = Fixture::new(
        &device,
        small_case(LayoutKind::LayerFirst, IoBackend::Direct),
    );
    let plan = fx
        .engine
        .direct_plan(&dslots(&[0, 1, 2, 3]), &hslots(&[4, 5, 6, 7]), 0..layers)
        .unwrap();
    assert_eq!(plan.len(), 1, "{plan:?}");
    assert!(matches!(plan[0], MemcpyOp::Pitched { height, .. } if height == layers as u64));
    // page_first: one 2D copy per layer for the whole run.
    let fx = Fixture::new(
        &device,
        small_case(LayoutKind::PageFirst, IoBackend::Direct),
    );
    let plan = fx
        .engine
        .direct_plan(&dslots(&[0, 1, 2, 3]), &hslots(&[4, 5, 6, 7]), 0..layers)
        .unwrap();
    assert_eq!(plan.len(), layers as usize, "{plan:?}");
    // page_first_direct: one 2D copy per page over all layers.
    let fx = Fixture::new(
        &device,
        small_case(LayoutKind::PageFirstDirect, IoBackend::Direct),
    );
    let plan = fx
        .engine
        .direct_plan(&dslots(&[0, 1, 2, 3]), &hslots(&[4, 5, 6, 7]), 0..layers)
        .unwrap();
    assert_eq!(plan.len(), 4, "{plan:?}");
    // Scattered pages do not coalesce.
    let plan = fx
        .engine
        .direct_plan(&dslots(&[0, 2]), &hslots(&[1, 0]), 0..1)
        .unwrap();
    assert_eq!(plan.len(), 2);
    let bytes: u64 = plan.iter().map(MemcpyOp::bytes).sum();
    assert_eq!(
        bytes as usize,
        2 * fx.device_pool.shape().page_layer_bytes()
    );
}

#[test]
fn bad_input_is_rejected_and_nothing_is_written() {
    let device = Device::sim();
    for io in [IoBackend::Kernel, IoBackend::Direct] {
        let fx = Fixture::new(&device, small_case(LayoutKind::PageFirst, io));
        fx.randomize(1);
        let before = fx.snapshot();
        let e = fx
            .engine
            .backup(&dslots(&[0, 1]), &hslots(&[0]), &[])
            .unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::LengthMismatch {
                    left: 2,
                    right: 1,
                    ..
                }
            ),
            "{e}"
        );
        let e = fx
            .engine
            .backup(&dslots(&[0, 8]), &hslots(&[0, 1]), &[])
            .unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::PageOutOfRange {
                    pool: "device",
                    page: 8,
                    position: 1,
                    ..
                }
            ),
            "{e}"
        );
        let e = fx
            .engine
            .load(&hslots(&[0, 99]), &dslots(&[0, 1]), &[])
            .unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::PageOutOfRange {
                    pool: "host",
                    page: 99,
                    ..
                }
            ),
            "{e}"
        );
        let e = fx
            .engine
            .backup(&dslots(&[0, 1]), &hslots(&[3, 3]), &[])
            .unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::DuplicateDestination {
                    pool: "host",
                    page: 3
                }
            ),
            "{e}"
        );
        let e = fx
            .engine
            .load(&hslots(&[0, 1]), &dslots(&[2, 2]), &[])
            .unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::DuplicateDestination {
                    pool: "device",
                    page: 2
                }
            ),
            "{e}"
        );
        // Duplicate sources are fine.
        fx.engine
            .backup(&dslots(&[2, 2]), &hslots(&[0, 1]), &[])
            .unwrap()
            .wait()
            .unwrap();
        let before2 = fx.snapshot();
        let e = fx
            .engine
            .copy_layers(Direction::ToHost, &dslots(&[0]), &hslots(&[0]), 2..9, &[])
            .unwrap_err();
        assert!(matches!(e, GpuError::LayerOutOfRange { .. }), "{e}");
        assert!(
            fx.snapshot() == before2,
            "a rejected transfer wrote something"
        );
        assert!(before != before2);
    }
}

#[test]
fn mismatched_pools_and_bad_registrations_are_errors() {
    let device = Device::sim();
    let shape = common::shapes()[0];
    let host = Arc::new(
        HostPool::new(
            HostPoolConfig::new(shape, LayoutKind::PageFirst, PoolSize::Pages(4))
                .huge_pages(HugePagePolicy::Off)
                .reserve_bytes(0),
        )
        .unwrap(),
    );
    let mut other = shape;
    other.layers += 1;
    let dev = Arc::new(DevicePool::new(&device, other, 4).unwrap());
    let reg = HostRegistration::new(&device, host.clone()).unwrap();
    let e = TransferEngine::new(dev, reg.clone(), TransferConfig::default()).unwrap_err();
    assert!(matches!(e, GpuError::ShapeMismatch { .. }), "{e}");
    // A pool of another device.
    let other_dev = Device::sim();
    let dev = Arc::new(DevicePool::new(&other_dev, shape, 4).unwrap());
    let e = TransferEngine::new(dev, reg.clone(), TransferConfig::default()).unwrap_err();
    assert!(matches!(e, GpuError::WrongDevice(_)), "{e}");
    // Bad configs.
    let dev = Arc::new(DevicePool::new(&device, shape, 4).unwrap());
    for cfg in [
        TransferConfig {
            ctas: 0,
            ..Default::default()
        },
        TransferConfig {
            threads_per_cta: 100,
            ..Default::default()
        },
        TransferConfig {
            chunk_bytes: 10,
            ..Default::default()
        },
    ] {
        let e = TransferEngine::new(dev.clone(), reg.clone(), cfg).unwrap_err();
        assert!(matches!(e, GpuError::InvalidConfig(_)), "{e}");
    }
    // Engine registrations that do not fit the shape.
    let need = shape.page_layer_bytes() * 4;
    let buf = device
        .alloc_zeroed(need * 2 * shape.layers as usize + 64)
        .unwrap();
    let region = |i: usize, len: usize| DeviceRegion {
        ptr: buf.addr() + (i * need) as u64,
        len,
    };
    let good: Vec<EngineLayer> = (0..shape.layers as usize)
        .map(|l| EngineLayer {
            k: region(2 * l, need),
            v: Some(region(2 * l + 1, need)),
        })
        .collect();
    // SAFETY: the regions lie inside `buf`, alive for the whole test (all calls below).
    unsafe {
        assert!(DevicePool::from_engine(&device, shape, 4, &good).is_ok());
        let mut small = good.clone();
        small[1].v = Some(region(3, need - 1));
        let e = DevicePool::from_engine(&device, shape, 4, &small).unwrap_err();
        assert!(matches!(e, GpuError::BufferTooSmall { .. }), "{e}");
        assert!(e.to_string().contains("layer 1 V"), "{e}");
        let e = DevicePool::from_engine(&device, shape, 4, &good[1..]).unwrap_err();
        assert!(matches!(e, GpuError::BadRegistration(_)), "{e}");
        let mut no_v = good.clone();
        no_v[0].v = None;
        assert!(DevicePool::from_engine(&device, shape, 4, &no_v).is_err());
        let mut overlap = good.clone();
        overlap[2].k = region(1, need);
        let e = DevicePool::from_engine(&device, shape, 4, &overlap).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let mut null = good.clone();
        null[0].k.ptr = 0;
        assert!(DevicePool::from_engine(&device, shape, 4, &null).is_err());
    }
}

#[test]
fn device_pool_allocates_and_reads_pages() {
    let device = Device::sim();
    let shape = common::shapes()[3];
    let pool = DevicePool::new(&device, shape, 5).unwrap();
    let a = pool.alloc(5).unwrap();
    assert!(pool.alloc(1).is_none());
    pool.free(&a[..2]).unwrap();
    assert!(matches!(pool.free(&a[..1]), Err(GpuError::Alloc(_))));
    let page: Vec<u8> = (0..pool.page_bytes()).map(|i| i as u8).collect();
    pool.write_page(a[4], &page).unwrap();
    let mut back = vec![0; pool.page_bytes()];
    pool.read_page(a[4], &mut back).unwrap();
    assert_eq!(back, page);
    assert!(
        pool.read_page(hicache_gpu::DeviceSlot(5), &mut back)
            .is_err()
    );
    assert!(pool.write_page(a[0], &page[1..]).is_err());
}

#[test]
fn load_events_feed_the_layer_done_counter() {
    let device = Device::sim();
    let fx = Fixture::new(
        &device,
        small_case(LayoutKind::LayerFirst, IoBackend::Kernel),
    );
    let layers = fx.case.shape.layers as usize;
    let counter = LayerDoneCounter::new(layers, 1).unwrap();
    // No consumer: waits are no-ops.
    counter.wait_until(0).unwrap();
    assert!(counter.is_ready(layers - 1).unwrap());
    assert!(counter.wait_until(layers).is_err());

    // The engine's compute stream is busy (gated); the load waits for its event.
    let compute = device.new_stream("compute").unwrap();
    let gate = compute.sim_gate().unwrap();
    let kv_written = compute.record().unwrap();
    fx.randomize(3);
    let before = fx.snapshot();
    let h = fx
        .engine
        .load(&hslots(&[0, 1]), &dslots(&[2, 3]), &[&kv_written])
        .unwrap();
    assert!(
        !h.is_done().unwrap(),
        "the load must wait for the compute event"
    );
    assert!(!h.is_layer_done(0).unwrap());
    let id = counter.publish(h.clone()).unwrap();
    counter.set_consumer(id).unwrap();
    assert!(!counter.is_ready(0).unwrap());
    let e = counter.publish(h.clone()).unwrap_err();
    assert!(e.to_string().contains("in flight"), "{e}");
    assert!(
        fx.snapshot() == before,
        "nothing may move before the gate opens"
    );

    gate.open();
    for l in 0..layers {
        counter.wait_until(l).unwrap();
        assert!(counter.is_ready(l).unwrap());
        counter.stream_wait(&compute, l).unwrap();
    }
    h.wait().unwrap();
    let want = fx.expected(
        &before,
        Direction::ToDevice,
        &[2, 3],
        &[0, 1],
        0..layers as u32,
    );
    assert!(fx.snapshot() == want);
    // The slot is free again once its load is done.
    assert_eq!(counter.publish(h.clone()).unwrap(), id);
    assert!(counter.set_consumer(7).is_err());
    counter.reset_consumer();
    assert!(LayerDoneCounter::new(0, 3).is_err());
    let wrong = LayerDoneCounter::new(layers + 1, 3).unwrap();
    assert!(wrong.publish(h).is_err());
}

#[test]
fn backups_poll_without_blocking() {
    let device = Device::sim();
    let fx = Fixture::new(
        &device,
        small_case(LayoutKind::PageFirstDirect, IoBackend::Direct),
    );
    let compute = device.new_stream("compute").unwrap();
    let gate = compute.sim_gate().unwrap();
    let ready = compute.record().unwrap();
    let c = fx
        .engine
        .backup(&dslots(&[0, 1, 2]), &hslots(&[5, 6, 7]), &[&ready])
        .unwrap();
    assert!(!c.is_done().unwrap());
    gate.open();
    c.wait().unwrap();
    assert!(c.is_done().unwrap());
    // The sim-only helper works on a sim stream, and the CUDA-only helpers answer "none" there;
    // the other direction (sim_gate refused on a CUDA stream) is
    // `sim_gate_is_refused_on_a_cuda_stream` in cuda_transfers.rs, which needs a GPU.
    assert!(compute.sim_gate().is_ok());
    assert!(compute.as_raw_cuda().is_none());
    assert!(compute.record().unwrap().as_raw_cuda().is_none());
}

/// Without libcuda, opening a CUDA device is a clear `NoDriver` error naming it; with one,
/// opening never reports a missing driver (it opens, or fails for another reason, such as no
/// device).
#[test]
#[cfg(feature = "cuda")]
fn a_missing_cuda_driver_is_a_clear_error() {
    match Device::cuda(0) {
        Err(e) if !Device::cuda_driver_available() => {
            assert!(matches!(e, GpuError::NoDriver(_)), "{e}");
            assert!(e.to_string().contains("libcuda"), "{e}");
        }
        Err(e) => assert!(
            !matches!(e, GpuError::NoDriver(_)),
            "libcuda loads, yet: {e}"
        ),
        Ok(d) => assert!(
            Device::cuda_driver_available(),
            "{} opened without a driver",
            d.name()
        ),
    }
}

#[test]
fn cuda_interop_is_refused_on_sim() {
    let device = Device::sim();
    // SAFETY: the sim device refuses before touching the pointer.
    let e = unsafe { hicache_gpu::Stream::borrow_cuda(&device, std::ptr::null_mut()) }.unwrap_err();
    assert!(matches!(e, GpuError::InvalidConfig(_)), "{e}");
    let s = device.new_stream("x").unwrap();
    assert!(s.record().unwrap().as_raw_cuda().is_none());
    assert!(s.as_raw_cuda().is_none());
}

/// A sim device without payload queues, orders and completes every copy (per-layer events
/// included) and moves no byte; its synchronous reads and writes still move bytes.
#[test]
fn a_device_without_payload_completes_copies_without_moving_bytes() {
    let device = Device::sim_without_payload();
    assert!(!device.moves_payload() && Device::sim().moves_payload());
    for io in [IoBackend::Kernel, IoBackend::Direct] {
        let fx = Fixture::new(&device, small_case(LayoutKind::PageFirst, io));
        fx.randomize(3);
        let before = fx.snapshot();
        fx.engine
            .backup(&dslots(&[0, 1, 2]), &hslots(&[3, 4, 5]), &[])
            .unwrap()
            .wait()
            .unwrap();
        let h = fx
            .engine
            .load(&hslots(&[6, 7]), &dslots(&[4, 5]), &[])
            .unwrap();
        for l in 0..h.num_layers() {
            h.wait_layer(l).unwrap();
            assert!(h.is_layer_done(l).unwrap());
        }
        h.wait().unwrap();
        assert!(fx.snapshot() == before, "{io:?}: a copy moved bytes");
        // The same copy on the sim device with payload does move them.
        let real = Fixture::new(&Device::sim(), small_case(LayoutKind::PageFirst, io));
        real.randomize(3);
        let before = real.snapshot();
        real.engine
            .backup(&dslots(&[0]), &hslots(&[3]), &[])
            .unwrap()
            .wait()
            .unwrap();
        assert!(real.snapshot() != before, "{io:?}");
    }
}
