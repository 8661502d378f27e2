//! Shared fixtures of the transfer tests: pools filled with random bytes, a naive reference of
//! every transfer written from the layout definitions alone, and the case matrix.
#![allow(dead_code)]

use std::sync::Arc;

use hicache_core::{DType, KvKind, KvShape, LayoutKind};
use hicache_gpu::{
    Device, DeviceBuffer, DevicePool, DeviceRegion, DeviceSlot, Direction, EngineLayer,
    HostRegistration, IoBackend, TransferConfig, TransferEngine,
};
use hicache_host::{HostPool, HostPoolConfig, HostSlot, HugePagePolicy, PoolSize};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One configuration of pools and engine.
#[derive(Copy, Clone, Debug)]
pub struct Case {
    pub shape: KvShape,
    pub layout: LayoutKind,
    pub io: IoBackend,
    /// Device pool registered from "engine" buffers (separate allocations) instead of ours.
    pub engine: bool,
    /// Engine buffers start `misalign` bytes into their allocation (scalar kernel fallback).
    pub misalign: u64,
    pub device_pages: usize,
    pub host_pages: usize,
    /// `TransferConfig::staged_backup_pages` (kernel io only).
    pub staged: u32,
}

/// MHA and MLA rows of every element size, including rows that are not a multiple of 16
/// (word widths 8, 4, 2, 1) and an odd page size.
pub fn shapes() -> Vec<KvShape> {
    let mut v = Vec::new();
    for dtype in [DType::Fp8E4m3, DType::Bf16, DType::F32] {
        v.push(KvShape {
            kind: KvKind::Mha {
                heads: 2,
                head_dim: 8,
            },
            layers: 3,
            dtype,
            page_size: 4,
        });
        v.push(KvShape {
            kind: KvKind::Mla { kv_dim: 6 },
            layers: 4,
            dtype,
            page_size: 3,
        });
    }
    v.push(KvShape {
        kind: KvKind::Mha {
            heads: 1,
            head_dim: 3,
        },
        layers: 2,
        dtype: DType::Fp8E5m2,
        page_size: 5,
    });
    v
}

/// The full matrix: shapes × layouts × io backends × (ours, engine, engine misaligned).
pub fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for shape in shapes() {
        for layout in LayoutKind::ALL {
            for (io, staged) in [
                (IoBackend::Kernel, 0),
                (IoBackend::Kernel, 2),
                (IoBackend::Direct, 0),
            ] {
                for (engine, misalign) in [(false, 0), (true, 0), (true, 2)] {
                    v.push(Case {
                        shape,
                        layout,
                        io,
                        engine,
                        misalign,
                        device_pages: 11,
                        host_pages: 13,
                        staged,
                    });
                }
            }
        }
    }
    v
}

/// Page lists of every kind: odd counts, contiguous, reversed, scattered, runs, empty.
pub fn pair_lists(device_pages: usize, host_pages: usize, seed: u64) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = device_pages.min(host_pages) as u32;
    let mut scattered_d: Vec<u32> = (0..device_pages as u32).collect();
    let mut scattered_h: Vec<u32> = (0..host_pages as u32).collect();
    shuffle(&mut scattered_d, &mut rng);
    shuffle(&mut scattered_h, &mut rng);
    vec![
        (vec![], vec![]),
        (vec![3], vec![5]),
        ((0..n).collect(), (0..n).collect()),
        ((0..7).collect(), (0..7).rev().collect()),
        ((0..7).rev().collect(), (2..9).collect()),
        (scattered_d[..5].to_vec(), scattered_h[..5].to_vec()),
        // Two runs of 3 contiguous on both sides, out of order.
        (vec![6, 7, 8, 0, 1, 2, 9], vec![1, 2, 3, 7, 8, 9, 12]),
    ]
}

fn shuffle(v: &mut [u32], rng: &mut ChaCha8Rng) {
    for i in (1..v.len()).rev() {
        let j = rng.random_range(0..=i);
        v.swap(i, j);
    }
}

/// Pools, engine and (for engine-registered pools) the engine's buffers.
pub struct Fixture {
    pub case: Case,
    pub engine: TransferEngine,
    pub device_pool: Arc<DevicePool>,
    pub host_pool: Arc<HostPool>,
    pub engine_buffers: Vec<DeviceBuffer>,
}

impl Fixture {
    pub fn new(device: &Device, case: Case) -> Self {
        Self::with_config(
            device,
            case,
            TransferConfig {
                io: case.io,
                ctas: 3,
                threads_per_cta: 64,
                chunk_bytes: 512,
                staged_backup_pages: case.staged,
            },
        )
    }

    pub fn with_config(device: &Device, case: Case, config: TransferConfig) -> Self {
        let shape = case.shape;
        let host_pool = Arc::new(
            HostPool::new(
                HostPoolConfig::new(shape, case.layout, PoolSize::Pages(case.host_pages))
                    .huge_pages(HugePagePolicy::Off)
                    .reserve_bytes(0),
            )
            .unwrap(),
        );
        let mut engine_buffers = Vec::new();
        let device_pool = if case.engine {
            let need = shape.page_layer_bytes() * case.device_pages;
            let mut region = || {
                let b = device
                    .alloc_zeroed(need + case.misalign as usize + 64)
                    .unwrap();
                let r = DeviceRegion {
                    ptr: b.addr() + case.misalign,
                    len: need,
                };
                engine_buffers.push(b);
                r
            };
            let mut layers: Vec<EngineLayer> = (0..shape.layers)
                .map(|_| EngineLayer {
                    k: region(),
                    v: None,
                })
                .collect();
            if shape.halves() == 2 {
                for l in &mut layers {
                    l.v = Some(region());
                }
            }
            // SAFETY: the buffers live in `engine_buffers` as long as the fixture.
            unsafe { DevicePool::from_engine(device, shape, case.device_pages, &layers).unwrap() }
        } else {
            DevicePool::new(device, shape, case.device_pages).unwrap()
        };
        let device_pool = Arc::new(device_pool);
        let reg = HostRegistration::new(device, host_pool.clone()).unwrap();
        let engine = TransferEngine::new(device_pool.clone(), reg, config).unwrap();
        Self {
            case,
            engine,
            device_pool,
            host_pool,
            engine_buffers,
        }
    }

    /// Fills every page of both pools with bytes from `seed`.
    pub fn randomize(&self, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut page = vec![0u8; self.host_pool.page_bytes()];
        for p in 0..self.case.device_pages as u32 {
            rng.fill_bytes(&mut page);
            self.device_pool.write_page(DeviceSlot(p), &page).unwrap();
        }
        for p in 0..self.case.host_pages as u32 {
            rng.fill_bytes(&mut page);
            self.host_pool.set_page(HostSlot(p), &page).unwrap();
        }
    }

    /// Every device page (flat `[h][l][t][row]`) and every host page (layout flat order).
    pub fn snapshot(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let pb = self.host_pool.page_bytes();
        let dev = (0..self.case.device_pages as u32)
            .map(|p| {
                let mut b = vec![0u8; pb];
                self.device_pool.read_page(DeviceSlot(p), &mut b).unwrap();
                b
            })
            .collect();
        let host = (0..self.case.host_pages as u32)
            .map(|p| {
                let mut b = vec![0u8; pb];
                self.host_pool.get_page(HostSlot(p), &mut b).unwrap();
                b
            })
            .collect();
        (dev, host)
    }

    /// The naive expectation of copying `layers` of the pairs in `dir`, from `before`.
    pub fn expected(
        &self,
        before: &(Vec<Vec<u8>>, Vec<Vec<u8>>),
        dir: Direction,
        dev: &[u32],
        host: &[u32],
        layers: std::ops::Range<u32>,
    ) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let (mut d, mut h) = before.clone();
        let s = self.case.shape;
        let lay = self.host_pool.layout();
        let r = s.row_bytes();
        let ps = s.page_size as usize;
        let nl = s.layers as usize;
        for (&dp, &hp) in dev.iter().zip(host) {
            for half in 0..s.halves() {
                for l in layers.clone() {
                    let l = l as usize;
                    for t in 0..ps {
                        let doff = ((half * nl + l) * ps + t) * r;
                        let hoff = lay.flat_offset(half, l, t);
                        match dir {
                            Direction::ToHost => h[hp as usize][hoff..hoff + r]
                                .copy_from_slice(&before.0[dp as usize][doff..doff + r]),
                            Direction::ToDevice => d[dp as usize][doff..doff + r]
                                .copy_from_slice(&before.1[hp as usize][hoff..hoff + r]),
                        }
                    }
                }
            }
        }
        (d, h)
    }
}

pub fn dslots(v: &[u32]) -> Vec<DeviceSlot> {
    v.iter().map(|&p| DeviceSlot(p)).collect()
}

pub fn hslots(v: &[u32]) -> Vec<HostSlot> {
    v.iter().map(|&p| HostSlot(p)).collect()
}

/// Runs every pair list through backup, load and a partial-layer copy on `fx`, checking each
/// against the naive reference. Returns the number of transfers checked.
pub fn check_all_pair_lists(fx: &Fixture, seed: u64) -> usize {
    let mut checked = 0;
    let c = fx.case;
    for (i, (dev, host)) in pair_lists(c.device_pages, c.host_pages, seed)
        .into_iter()
        .enumerate()
    {
        let ctx = format!("{c:?} list {i} dev {dev:?} host {host:?}");
        let all = 0..c.shape.layers;
        // Backup.
        fx.randomize(seed + i as u64);
        let before = fx.snapshot();
        fx.engine
            .backup(&dslots(&dev), &hslots(&host), &[])
            .unwrap()
            .wait()
            .unwrap();
        let want = fx.expected(&before, Direction::ToHost, &dev, &host, all.clone());
        assert!(fx.snapshot() == want, "backup mismatch: {ctx}");
        // Load, layer by layer.
        fx.randomize(seed + 100 + i as u64);
        let before = fx.snapshot();
        let h = fx.engine.load(&hslots(&host), &dslots(&dev), &[]).unwrap();
        assert_eq!(h.num_layers(), c.shape.layers as usize);
        for l in 0..h.num_layers() {
            h.wait_layer(l).unwrap();
            assert!(h.is_layer_done(l).unwrap());
        }
        h.wait().unwrap();
        let want = fx.expected(&before, Direction::ToDevice, &dev, &host, all.clone());
        assert!(fx.snapshot() == want, "load mismatch: {ctx}");
        // One middle layer each way.
        let mid = c.shape.layers / 2;
        for dir in [Direction::ToHost, Direction::ToDevice] {
            fx.randomize(seed + 200 + i as u64);
            let before = fx.snapshot();
            fx.engine
                .copy_layers(dir, &dslots(&dev), &hslots(&host), mid..mid + 1, &[])
                .unwrap()
                .wait()
                .unwrap();
            let want = fx.expected(&before, dir, &dev, &host, mid..mid + 1);
            assert!(fx.snapshot() == want, "{dir:?} layer {mid} mismatch: {ctx}");
        }
        checked += 4;
    }
    checked
}
