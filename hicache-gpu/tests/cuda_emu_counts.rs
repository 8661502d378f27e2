//! Launch efficiency through the emulated driver's call counts (`hicache-cuda-emu`): an
//! all-layer backup and an all-layer load of 256 pages cost a bounded number of launches and
//! driver calls, not one per page.
//!
//! Runs with `HICACHE_TEST_CUDA=1` under `scripts/with-cuda-emu.sh` (the counters are symbols
//! of the emulated `libcuda.so`); elsewhere it prints why it is skipped and passes.

mod common;

use common::{Case, Fixture, dslots, hslots};
use hicache_core::{DType, KvKind, KvShape, LayoutKind};
use hicache_gpu::{DEFAULT_CTAS, Device, IoBackend, TransferConfig};

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

    /// Calls that queue device work or move bytes.
    fn work_calls(&self) -> u64 {
        [
            "cuLaunchKernel",
            "cuMemcpyHtoDAsync_v2",
            "cuMemcpyDtoHAsync_v2",
            "cuMemcpy2DAsync_v2",
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

fn emulated() -> Option<(Device, Counters)> {
    if std::env::var("HICACHE_TEST_CUDA").as_deref() != Ok("1") {
        println!("SKIPPED: set HICACHE_TEST_CUDA=1 under scripts/with-cuda-emu.sh to run it");
        return None;
    }
    let d = Device::cuda(0).unwrap_or_else(|e| panic!("HICACHE_TEST_CUDA=1 but no CUDA: {e}"));
    match Counters::open() {
        Some(c) => Some((d, c)),
        None => {
            println!(
                "SKIPPED: {} is not the emulated driver (no counters)",
                d.name()
            );
            None
        }
    }
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

#[test]
fn default_cta_count_is_at_most_eight() {
    assert!(TransferConfig::default().ctas <= 8);
    assert_eq!(TransferConfig::default().ctas, DEFAULT_CTAS);
}

#[test]
fn all_layer_backup_and_load_of_256_pages_cost_bounded_launches_and_calls() {
    let Some((device, counters)) = emulated() else {
        return;
    };
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let layers = shape().layers as u64;
    for io in [IoBackend::Kernel, IoBackend::Direct] {
        for layout in LayoutKind::ALL {
            let case = Case {
                shape: shape(),
                layout,
                io,
                engine: false,
                misalign: 0,
                device_pages: PAGES,
                host_pages: PAGES,
                staged: 0,
            };
            let fx = Fixture::with_config(
                &device,
                case,
                TransferConfig {
                    io,
                    ..Default::default()
                },
            );
            fx.randomize(7);
            let pages: Vec<u32> = (0..PAGES as u32).collect();
            let (d, h) = (dslots(&pages), hslots(&pages));

            counters.reset();
            fx.engine.backup(&d, &h, &[]).unwrap().wait().unwrap();
            let (b_launch, b_calls) = (counters.launches(), counters.work_calls());
            counters.reset();
            fx.engine.load(&h, &d, &[]).unwrap().wait().unwrap();
            let (l_launch, l_calls) = (counters.launches(), counters.work_calls());
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
            // Not yet bounded: the direct backend on page_first_direct issues one copy per
            // (page, half) for a backup and per (page, half, layer) for a load (513 and 2052
            // work calls here); batching them (cuMemcpyBatchAsync) is open work of issue 14.
            if io == IoBackend::Direct && layout == LayoutKind::PageFirstDirect {
                continue;
            }
            // Never one call per page: bounded by layers and halves, not by 256 pages.
            let bound = 8 * layers * 2 + 8;
            assert!(b_calls <= bound, "backup: {b_calls} calls > {bound}");
            assert!(l_calls <= bound, "load: {l_calls} calls > {bound}");
        }
    }
}

#[test]
fn transfer_streams_are_created_at_the_highest_priority() {
    let Some((device, counters)) = emulated() else {
        return;
    };
    let _serial = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    counters.reset();
    let case = Case {
        shape: shape(),
        layout: LayoutKind::PageFirst,
        io: IoBackend::Kernel,
        engine: false,
        misalign: 0,
        device_pages: 4,
        host_pages: 4,
        staged: 0,
    };
    let _fx = Fixture::with_config(&device, case, TransferConfig::default());
    assert!(counters.calls("cuStreamCreateWithPriority") >= 2);
    assert_eq!(
        counters.calls("cuStreamCreate"),
        0,
        "a default-priority stream"
    );
}
