//! The CUDA path through the emulated driver's counters and hooks (`hicache-cuda-emu`):
//! - launch efficiency: an all-layer backup and an all-layer load of 256 pages cost a bounded
//!   number of launches and driver calls, not one per page, for every io backend and layout
//!   (the direct backend as one `cuMemcpyBatchAsync` per plan; per-op copies, still correct,
//!   on a driver that predates it);
//! - the kernels load as a cubin for the device's `sm_XY`, PTX only when that is refused;
//! - every event blocks its host waits (`CU_EVENT_BLOCKING_SYNC`);
//! - a failed release of an earlier handle is reported under its own name;
//! - engine buffers in expandable (VMM) segments that span two mappings register and copy.
//!
//! Built with `HICACHE_TEST_CUDA=1` under `scripts/with-cuda-emu.sh` (which sets
//! `HICACHE_CUDA_EMU=1`; see `build.rs`) the tests run: the counters are symbols of the
//! emulated `libcuda.so`. Built otherwise, cargo reports them as ignored, with that command.

mod common;

use std::sync::Arc;

use common::{Case, Fixture, check_all_pair_lists, dslots, hslots};
use hicache_core::{DType, KvKind, KvShape, LayoutKind};
use hicache_gpu::{
    DEFAULT_CTAS, Device, DevicePool, DeviceRegion, DeviceSlot, EngineLayer, GpuError,
    HostRegistration, IoBackend, TransferConfig, TransferEngine,
};
use hicache_host::{HostPool, HostPoolConfig, HostSlot, HugePagePolicy, PoolSize};

/// The emulator's counters, looked up in the `libcuda.so` the CUDA path loaded.
struct Counters {
    lib: libloading::Library,
}

impl Counters {
    fn open() -> Option<Self> {
        // SAFETY: opening the driver library the CUDA path already loaded (same handle).
        let lib = unsafe { libloading::Library::new("libcuda.so") }.ok()?;
        // SAFETY: only checks that the symbol exists.
        unsafe { lib.get::<unsafe extern "C" fn() -> u64>(b"hicache_emu_launch_count") }.ok()?;
        Some(Self { lib })
    }

    fn reset(&self) {
        // SAFETY: the emulator's exported `void hicache_emu_reset_counts(void)`.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn()>(b"hicache_emu_reset_counts")
                .unwrap())()
        }
    }

    fn launches(&self) -> u64 {
        // SAFETY: the emulator's exported `uint64_t hicache_emu_launch_count(void)`.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn() -> u64>(b"hicache_emu_launch_count")
                .unwrap())()
        }
    }

    fn calls(&self, name: &str) -> u64 {
        let c = std::ffi::CString::new(name).unwrap();
        // SAFETY: the emulator's exported `uint64_t hicache_emu_call_count(const char*)`.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn(*const std::ffi::c_char) -> u64>(
                    b"hicache_emu_call_count",
                )
                .unwrap())(c.as_ptr())
        }
    }

    /// A symbol of the emulator.
    fn sym<T: Copy>(&self, name: &str) -> T {
        // SAFETY: callers name the emulator's exported functions with their C signatures.
        unsafe { *self.lib.get::<T>(name.as_bytes()).unwrap() }
    }

    /// Makes the next call of `entry` fail with `code`.
    fn fail_next(&self, entry: &str, code: u32) {
        let c = std::ffi::CString::new(entry).unwrap();
        let f: unsafe extern "C" fn(*const std::ffi::c_char, u32) =
            self.sym("hicache_emu_fail_next");
        // SAFETY: the emulator's `void hicache_emu_fail_next(const char*, uint32_t)`.
        unsafe { f(c.as_ptr(), code) }
    }

    /// Makes the emulated driver report `version` (0: its default).
    fn set_driver_version(&self, version: i32) {
        let f: extern "C" fn(i32) = self.sym("hicache_emu_set_driver_version");
        f(version)
    }

    /// Calls that queue device work or move bytes.
    fn work_calls(&self) -> u64 {
        [
            "cuLaunchKernel",
            "cuMemcpyHtoDAsync_v2",
            "cuMemcpyDtoHAsync_v2",
            "cuMemcpy2DAsync_v2",
            "cuMemcpyBatchAsync_v2",
            "cuMemAllocAsync",
            "cuMemFreeAsync",
            "cuEventRecord",
            "cuStreamWaitEvent",
        ]
        .iter()
        .map(|n| self.calls(n))
        .sum()
    }
}

/// CUDA device 0 on the emulated driver, and its counters; the tests that call it are ignored
/// unless built with `HICACHE_TEST_CUDA=1` under `scripts/with-cuda-emu.sh`.
fn emulated() -> (Device, Counters) {
    let d = Device::cuda(0).unwrap_or_else(|e| panic!("needs the emulated CUDA driver: {e}"));
    let c = Counters::open().unwrap_or_else(|| {
        panic!(
            "{} is not the emulated driver (no counters): run under scripts/with-cuda-emu.sh",
            d.name()
        )
    });
    (d, c)
}

const PAGES: usize = 256;

/// The counters are process-wide: tests that reset and read them run one at a time.
static COUNTED: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn shape() -> KvShape {
    KvShape {
        kind: KvKind::Mha {
            heads: 1,
            head_dim: 8,
        },
        layers: 4,
        dtype: DType::Bf16,
        page_size: 4,
    }
}

/// A case of [`shape()`] with no engine buffers, no misalignment and no staging.
fn plain_case(layout: LayoutKind, io: IoBackend, device_pages: usize, host_pages: usize) -> Case {
    Case {
        shape: shape(),
        layout,
        io,
        engine: false,
        misalign: 0,
        device_pages,
        host_pages,
        staged: 0,
    }
}

/// The config that selects `io`, defaults otherwise.
fn io_config(io: IoBackend) -> TransferConfig {
    TransferConfig {
        io,
        ..Default::default()
    }
}

/// An all-layer backup of `d` into `h`, then an all-layer load back, each measured on its own:
/// the counters are reset before each and `measure` read after it completes.
fn backup_then_load<T>(
    fx: &Fixture,
    counters: &Counters,
    (d, h): (&[DeviceSlot], &[HostSlot]),
    measure: impl Fn(&Counters) -> T,
) -> (T, T) {
    counters.reset();
    fx.engine.backup(d, h, &[]).unwrap().wait().unwrap();
    let backup = measure(counters);
    counters.reset();
    fx.engine.load(h, d, &[]).unwrap().wait().unwrap();
    (backup, measure(counters))
}

#[test]
fn default_cta_count_is_at_most_eight() {
    assert!(TransferConfig::default().ctas <= 8);
    assert_eq!(TransferConfig::default().ctas, DEFAULT_CTAS);
}

#[test]
#[cfg_attr(
    not(all(hicache_test_cuda, hicache_cuda_emu)),
    ignore = "needs the emulated CUDA driver: \
              HICACHE_TEST_CUDA=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test cuda_emu_counts"
)]
fn all_layer_backup_and_load_of_256_pages_cost_bounded_launches_and_calls() {
    let (device, counters) = emulated();
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let layers = shape().layers as u64;
    for io in [IoBackend::Kernel, IoBackend::Direct] {
        for layout in LayoutKind::ALL {
            let case = plain_case(layout, io, PAGES, PAGES);
            let fx = Fixture::with_config(&device, case, io_config(io));
            fx.randomize(7);
            let pages: Vec<u32> = (0..PAGES as u32).collect();
            let (d, h) = (dslots(&pages), hslots(&pages));
            let ((b_launch, b_calls), (l_launch, l_calls)) =
                backup_then_load(&fx, &counters, (&d, &h), |c| (c.launches(), c.work_calls()));
            println!(
                "{io:?} {}: backup {b_launch} launches / {b_calls} work calls; \
                 load {l_launch} launches / {l_calls} work calls ({PAGES} pages, {layers} layers)",
                layout.as_str()
            );
            match io {
                IoBackend::Kernel => {
                    assert_eq!(b_launch, 1, "one launch per all-layer backup");
                    assert!(l_launch <= layers, "at most one launch per layer per load");
                }
                IoBackend::Direct => {
                    assert_eq!(b_launch + l_launch, 0);
                }
            }
            // Never one call per page: bounded by layers and halves, not by 256 pages.
            let bound = 8 * layers * 2 + 8;
            assert!(b_calls <= bound, "backup: {b_calls} calls > {bound}");
            assert!(l_calls <= bound, "load: {l_calls} calls > {bound}");
        }
    }
}

#[test]
#[cfg_attr(
    not(all(hicache_test_cuda, hicache_cuda_emu)),
    ignore = "needs the emulated CUDA driver: \
              HICACHE_TEST_CUDA=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test cuda_emu_counts"
)]
fn transfer_streams_are_created_at_the_highest_priority() {
    let (device, counters) = emulated();
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    counters.reset();
    let case = plain_case(LayoutKind::PageFirst, IoBackend::Kernel, 4, 4);
    let _fx = Fixture::with_config(&device, case, TransferConfig::default());
    assert!(counters.calls("cuStreamCreateWithPriority") >= 2);
    assert_eq!(
        counters.calls("cuStreamCreate"),
        0,
        "a default-priority stream"
    );
}

/// Scattered pages (no two consecutive on both sides, so no runs to coalesce): the direct
/// backend still costs one `cuMemcpyBatchAsync` per all-layer backup and one per loaded layer,
/// not one call per page.
#[test]
#[cfg_attr(
    not(all(hicache_test_cuda, hicache_cuda_emu)),
    ignore = "needs the emulated CUDA driver: \
              HICACHE_TEST_CUDA=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test cuda_emu_counts"
)]
fn scattered_pages_go_to_the_driver_as_one_batch_per_plan() {
    let (device, counters) = emulated();
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let layers = shape().layers as u64;
    for layout in LayoutKind::ALL {
        let case = plain_case(layout, IoBackend::Direct, PAGES, PAGES);
        let fx = Fixture::with_config(&device, case, io_config(IoBackend::Direct));
        let dev: Vec<u32> = (0..PAGES as u32).rev().collect();
        let host: Vec<u32> = (0..PAGES as u32).collect();
        let (d, h) = (dslots(&dev), hslots(&host));
        let ((b_batches, b_calls), (l_batches, l_calls)) =
            backup_then_load(&fx, &counters, (&d, &h), |c| {
                (c.calls("cuMemcpyBatchAsync_v2"), c.work_calls())
            });
        println!(
            "Direct {} scattered: backup {b_batches} batches / {b_calls} work calls; load \
             {l_batches} batches / {l_calls} work calls",
            layout.as_str()
        );
        assert_eq!(b_batches, 1, "{layout:?}");
        assert_eq!(l_batches, layers, "{layout:?}");
        assert!(
            b_calls <= 2 && l_calls <= 2 * layers,
            "{b_calls} / {l_calls}"
        );
    }
}

/// On a driver without `cuMemcpyBatchAsync_v2` (before CUDA 13.0) the direct backend falls
/// back to one copy call per op, moves the same bytes, and stays bounded for runs of pages.
#[test]
#[cfg_attr(
    not(all(hicache_test_cuda, hicache_cuda_emu)),
    ignore = "needs the emulated CUDA driver: \
              HICACHE_TEST_CUDA=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test cuda_emu_counts"
)]
fn direct_copies_fall_back_to_one_call_per_op_on_older_drivers() {
    let (_, counters) = emulated();
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    counters.set_driver_version(12080);
    let old = Device::cuda(0);
    counters.set_driver_version(0);
    let old = old.unwrap();
    let case = plain_case(LayoutKind::PageFirstDirect, IoBackend::Direct, 11, 13);
    counters.reset();
    let fx = Fixture::new(&old, case);
    check_all_pair_lists(&fx, 5);
    assert_eq!(counters.calls("cuMemcpyBatchAsync_v2"), 0);
    assert!(counters.calls("cuMemcpyHtoDAsync_v2") > 0);
    // Still bounded at 256 pages: a run of pages is one pitched copy per layer.
    let fx = Fixture::with_config(
        &old,
        Case {
            device_pages: PAGES,
            host_pages: PAGES,
            ..case
        },
        io_config(IoBackend::Direct),
    );
    let pages: Vec<u32> = (0..PAGES as u32).collect();
    let (d, h) = (dslots(&pages), hslots(&pages));
    let layers = shape().layers as u64;
    let bound = 8 * layers * 2 + 8;
    let (b_calls, l_calls) = backup_then_load(&fx, &counters, (&d, &h), Counters::work_calls);
    println!(
        "pre-13.0 driver, direct page_first_direct: backup {b_calls}, load {l_calls} work calls"
    );
    assert!(
        b_calls <= bound && l_calls <= bound,
        "{b_calls} / {l_calls} > {bound}"
    );
    assert_eq!(counters.calls("cuMemcpyBatchAsync_v2"), 0);
}

/// The kernels are loaded as a cubin for the device's sm_90; PTX only when the driver refuses
/// the cubin (here: an injected CUDA_ERROR_NO_BINARY_FOR_GPU), and the PTX kernels then move
/// the right bytes.
#[test]
#[cfg_attr(
    not(all(hicache_test_cuda, hicache_cuda_emu)),
    ignore = "needs the emulated CUDA driver: \
              HICACHE_TEST_CUDA=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test cuda_emu_counts"
)]
fn kernels_load_as_a_cubin_and_fall_back_to_ptx() {
    let (_, counters) = emulated();
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let case = plain_case(LayoutKind::PageFirst, IoBackend::Kernel, 11, 13);
    counters.reset();
    let fx = Fixture::new(&Device::cuda(0).unwrap(), case);
    assert_eq!(counters.calls("cuModuleLoadData[cubin]"), 1);
    assert_eq!(counters.calls("cuModuleLoadData[ptx]"), 0);
    check_all_pair_lists(&fx, 11);

    counters.reset();
    counters.fail_next("cuModuleLoadData", 209);
    let fx = Fixture::new(&Device::cuda(0).unwrap(), case);
    assert_eq!(
        counters.calls("cuModuleLoadData"),
        2,
        "cubin refused, then PTX"
    );
    assert_eq!(counters.calls("cuModuleLoadData[ptx]"), 1);
    check_all_pair_lists(&fx, 12);
}

/// Every event the transfer path creates has CU_EVENT_BLOCKING_SYNC: a host waiting for a
/// transfer sleeps instead of spinning a core.
#[test]
#[cfg_attr(
    not(all(hicache_test_cuda, hicache_cuda_emu)),
    ignore = "needs the emulated CUDA driver: \
              HICACHE_TEST_CUDA=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test cuda_emu_counts"
)]
fn every_event_blocks_its_host_waits() {
    let (device, counters) = emulated();
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    counters.reset();
    for io in [IoBackend::Kernel, IoBackend::Direct] {
        let case = Case {
            staged: if io == IoBackend::Kernel { 2 } else { 0 },
            ..plain_case(LayoutKind::LayerFirst, io, 11, 13)
        };
        let fx = Fixture::new(&device, case);
        check_all_pair_lists(&fx, 3);
    }
    let created = counters.calls("cuEventCreate");
    assert!(created > 0);
    assert_eq!(counters.calls("cuEventCreate[BLOCKING_SYNC]"), created);
}

/// A failed cuEventDestroy (cudarc-style: it happens in a drop) is reported by the next call
/// as that failure, not as a failure of cuCtxSetCurrent or of the call at hand; the call after
/// it works again.
#[test]
#[cfg_attr(
    not(all(hicache_test_cuda, hicache_cuda_emu)),
    ignore = "needs the emulated CUDA driver: \
              HICACHE_TEST_CUDA=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test cuda_emu_counts"
)]
fn a_failed_release_is_reported_under_its_own_name() {
    let (device, counters) = emulated();
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    counters.reset();
    let stream = device.new_stream("s").unwrap();
    let event = stream.record().unwrap();
    event.wait().unwrap();
    counters.fail_next("cuEventDestroy_v2", 400);
    drop(event);
    let e = device.alloc_zeroed(64).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            GpuError::ReleaseFailed {
                call: "cuEventDestroy",
                ..
            }
        ),
        "{msg}"
    );
    assert!(!msg.contains("cuCtxSetCurrent"), "{msg}");
    assert!(msg.contains("CUDA_ERROR_INVALID_HANDLE"), "{msg}");
    device.alloc_zeroed(64).unwrap();
}

/// Expandable segments (PyTorch's allocator on the VMM API): one reserved range with two
/// physical chunks mapped back to back. `cuMemGetAddressRange` reports one chunk, yet a layer
/// buffer running across the boundary is one valid buffer: it registers, and every transfer
/// through it (kernel and direct) moves the right bytes.
#[test]
#[cfg_attr(
    not(all(hicache_test_cuda, hicache_cuda_emu)),
    ignore = "needs the emulated CUDA driver: \
              HICACHE_TEST_CUDA=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test cuda_emu_counts"
)]
fn engine_buffers_spanning_two_vmm_mappings_register_and_copy() {
    let (device, counters) = emulated();
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    const CHUNK: usize = 2 << 20;
    type Reserve = unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> u32;
    type Create = unsafe extern "C" fn(*mut u64, usize, *const u8, u64) -> u32;
    type Map = unsafe extern "C" fn(u64, usize, usize, u64, u64) -> u32;
    type SetAccess = unsafe extern "C" fn(u64, usize, *const u8, usize) -> u32;
    let (reserve, create, map, set_access) = (
        counters.sym::<Reserve>("cuMemAddressReserve"),
        counters.sym::<Create>("cuMemCreate"),
        counters.sym::<Map>("cuMemMap"),
        counters.sym::<SetAccess>("cuMemSetAccess"),
    );
    // Opaque property/descriptor blocks: the emulator only needs them non-null.
    let prop = [0u8; 64];
    let mut base = 0u64;
    // SAFETY: the emulator's VMM entry points with the driver API's signatures; out-pointers
    // to locals; handles from the emulator.
    unsafe {
        assert_eq!(reserve(&mut base, 2 * CHUNK, 0, 0, 0), 0);
        for i in 0..2u64 {
            let mut h = 0u64;
            assert_eq!(create(&mut h, CHUNK, prop.as_ptr(), 0), 0);
            assert_eq!(map(base + i * CHUNK as u64, CHUNK, 0, h, 0), 0);
        }
        assert_eq!(set_access(base, 2 * CHUNK, prop.as_ptr(), 1), 0);
    }
    let shape = shape();
    let pages = 11;
    let need = shape.page_layer_bytes() * pages;
    // Eight layer buffers back to back, the fourth across the chunk boundary.
    let first = base + CHUNK as u64 - 3 * need as u64 - 300;
    let region = |i: u64| DeviceRegion {
        ptr: first + i * need as u64,
        len: need,
    };
    assert!(region(3).ptr < base + CHUNK as u64);
    assert!(region(3).ptr + need as u64 > base + CHUNK as u64);
    let layers: Vec<EngineLayer> = (0..shape.layers as u64)
        .map(|l| EngineLayer {
            k: region(l),
            v: Some(region(shape.layers as u64 + l)),
        })
        .collect();
    // SAFETY: every region lies in the mapped chunks, which stay mapped for the process.
    let pool = unsafe { DevicePool::from_engine(&device, shape, pages, &layers) }
        .unwrap_or_else(|e| panic!("a buffer across two VMM mappings was refused: {e}"));
    let pool = Arc::new(pool);
    for io in [IoBackend::Kernel, IoBackend::Direct] {
        let case = Case {
            shape,
            layout: LayoutKind::PageFirst,
            io,
            engine: true,
            misalign: 0,
            device_pages: pages,
            host_pages: 13,
            staged: 0,
        };
        let host_pool = Arc::new(
            HostPool::new(
                HostPoolConfig::new(shape, case.layout, PoolSize::Pages(case.host_pages))
                    .huge_pages(HugePagePolicy::Off)
                    .reserve_bytes(0),
            )
            .unwrap(),
        );
        let reg = HostRegistration::new(&device, host_pool.clone()).unwrap();
        let config = TransferConfig {
            io,
            ..TransferConfig::default()
        };
        let fx = Fixture {
            case,
            engine: TransferEngine::new(pool.clone(), reg, config).unwrap(),
            device_pool: pool.clone(),
            host_pool,
            engine_buffers: Vec::new(),
        };
        check_all_pair_lists(&fx, 21);
    }
}

/// Mamba states on CUDA: the host state pool is page-locked while a `StateTransfer` lives
/// (and no longer after), a backup of several slots is one `cuMemcpyBatchAsync`, a load one
/// per layer (an event each), and a slot copy one `cuMemcpyDtoDAsync` per piece and layer.
#[test]
#[cfg_attr(
    not(all(hicache_test_cuda, hicache_cuda_emu)),
    ignore = "needs the emulated CUDA driver: \
              HICACHE_TEST_CUDA=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test cuda_emu_counts"
)]
fn state_copies_are_batched_and_slot_copies_stay_on_the_device() {
    let (device, counters) = emulated();
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let shape = hicache_host::MambaShape {
        layers: 2,
        temporal_elems: 32,
        temporal_dtype: DType::F32,
        conv_elems: vec![18, 5],
        conv_dtype: DType::Bf16,
    };
    let pool = Arc::new(hicache_gpu::StatePool::new(&device, &shape, 4).unwrap());
    let host = Arc::new(
        hicache_host::MambaPool::new(hicache_host::MambaPoolConfig::new(
            shape.clone(),
            PoolSize::Pages(4),
        ))
        .unwrap(),
    );
    counters.reset();
    let xfer = hicache_gpu::StateTransfer::new(pool.clone(), host.clone()).unwrap();
    assert_eq!(counters.calls("cuMemHostRegister_v2"), 1);
    assert!(host.region().cuda_registered);
    let (d, h) = (pool.alloc(4).unwrap(), host.alloc(4).unwrap());
    counters.reset();
    xfer.backup(&d, &h, &[]).unwrap().wait().unwrap();
    assert_eq!(counters.calls("cuMemcpyBatchAsync_v2"), 1);
    assert_eq!(counters.calls("cuMemcpyDtoHAsync_v2"), 0);
    counters.reset();
    xfer.load(&h, &d, &[]).unwrap().wait().unwrap();
    assert_eq!(
        counters.calls("cuMemcpyBatchAsync_v2"),
        2,
        "one batch per layer"
    );
    counters.reset();
    xfer.copy_slot(d[0], d[1], &[]).unwrap().wait().unwrap();
    assert_eq!(counters.calls("cuMemcpyDtoDAsync_v2"), 3 * 2);
    assert_eq!(counters.calls("cuMemcpyDtoHAsync_v2"), 0);
    assert_eq!(counters.calls("cuMemcpyHtoDAsync_v2"), 0);
    drop(xfer);
    assert!(
        !host.region().cuda_registered,
        "unregistered with the transfer"
    );
}
