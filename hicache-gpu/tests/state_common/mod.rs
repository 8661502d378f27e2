//! Shared fixtures of the state tests (sim and CUDA): Mamba shapes, a device and a host state
//! pool with their transfer, and a model-based runner of random alloc / free / write /
//! backup / load / copy sequences that checks every live slot on both sides after each step.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use hicache_core::DType;
use hicache_gpu::{Device, GpuError, StatePool, StateSlot, StateTransfer};
use hicache_host::{MambaPool, MambaPoolConfig, MambaShape, MambaSlot, PoolSize};

/// SGLang's test pool (2 layers, temporal (4, 8) f32, convs (6, 3) and (5,) bf16); a
/// conv-only state of one layer (rows of consecutive slots merge on both sides); three layers
/// with a one-byte temporal piece.
pub fn shapes() -> Vec<MambaShape> {
    vec![
        MambaShape {
            layers: 2,
            temporal_elems: 32,
            temporal_dtype: DType::F32,
            conv_elems: vec![18, 5],
            conv_dtype: DType::Bf16,
        },
        MambaShape {
            layers: 1,
            temporal_elems: 0,
            temporal_dtype: DType::F32,
            conv_elems: vec![6],
            conv_dtype: DType::F32,
        },
        MambaShape {
            layers: 3,
            temporal_elems: 1,
            temporal_dtype: DType::Fp8E4m3,
            conv_elems: vec![3, 2],
            conv_dtype: DType::F16,
        },
    ]
}

/// A device and a host state pool of one shape, and the transfer between them.
pub struct Fixture {
    pub pool: Arc<StatePool>,
    pub host: Arc<MambaPool>,
    pub xfer: StateTransfer,
}

impl Fixture {
    pub fn new(device: &Device, shape: &MambaShape, dev_slots: usize, host_slots: usize) -> Self {
        let pool = Arc::new(StatePool::new(device, shape, dev_slots).unwrap());
        let host = Arc::new(
            MambaPool::new(MambaPoolConfig::new(
                shape.clone(),
                PoolSize::Pages(host_slots),
            ))
            .unwrap(),
        );
        let xfer = StateTransfer::new(pool.clone(), host.clone()).unwrap();
        Self { pool, host, xfer }
    }

    pub fn read_dev(&self, s: StateSlot) -> Vec<u8> {
        let mut v = vec![0; self.pool.slot_bytes()];
        self.pool.read_slot(s, &mut v).unwrap();
        v
    }

    pub fn read_host(&self, s: MambaSlot) -> Vec<u8> {
        let mut v = vec![0; self.host.slot_bytes()];
        self.host.get_slot(s, &mut v).unwrap();
        v
    }
}

/// `len` bytes that differ for every seed and position.
pub fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(131).wrapping_add(i as u32 * 7 + 1) % 251) as u8)
        .collect()
}

/// The round trips of the module contract on one shape: a state written on the device and
/// backed up reads back equal on the host (`MambaPool::get_slot`), a state set on the host and
/// loaded reads back equal on the device, and a copied slot equals its source.
pub fn round_trips(device: &Device, shape: &MambaShape) {
    let f = Fixture::new(device, shape, 4, 3);
    assert_eq!(f.pool.slot_bytes(), shape.slot_bytes());
    let d = f.pool.alloc(3).unwrap();
    let h = f.host.alloc(2).unwrap();
    let a = pattern(1, f.pool.slot_bytes());
    f.pool.write_slot(d[0], &a).unwrap();
    assert_eq!(f.read_dev(d[0]), a);
    f.xfer
        .backup(&d[..1], &h[..1], &[])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        f.read_host(h[0]),
        a,
        "backup keeps MambaPool::get_slot order"
    );
    let b = pattern(2, f.pool.slot_bytes());
    f.host.set_slot(h[1], &b).unwrap();
    let load = f.xfer.load(&h[1..2], &d[1..2], &[]).unwrap();
    assert_eq!(load.num_layers(), shape.layers as usize);
    load.wait().unwrap();
    assert_eq!(f.read_dev(d[1]), b, "load keeps MambaPool::set_slot order");
    f.xfer.copy_slot(d[1], d[2], &[]).unwrap().wait().unwrap();
    assert_eq!(f.read_dev(d[2]), b);
    assert_eq!(f.read_dev(d[0]), a, "other slots untouched");
    // The piece pointers place a slot's rows where `read_slot` finds them.
    // Each piece is `[layer][slot][piece_layer_bytes]`.
    let lb = f.pool.piece_layer_bytes(0).unwrap();
    if shape.layers > 1 {
        let stride = f.pool.piece_ptr(0, 1) - f.pool.piece_ptr(0, 0);
        assert_eq!(stride, (f.pool.num_slots() * lb) as u64);
    }
    assert!(f.pool.try_piece_ptr(f.pool.num_pieces(), 0).is_err());
    assert!(f.pool.try_piece_ptr(0, shape.layers as usize).is_err());
}

/// Ordering without waits: a load, a copy of the loaded slot (same stream) and a backup of
/// the copy on the other stream after the copy's event end with the loaded state on the host.
pub fn ordered_by_events(device: &Device, shape: &MambaShape) {
    let f = Fixture::new(device, shape, 3, 3);
    let d = f.pool.alloc(2).unwrap();
    let h = f.host.alloc(2).unwrap();
    let want = pattern(9, f.pool.slot_bytes());
    f.host.set_slot(h[0], &want).unwrap();
    f.xfer.load(&h[..1], &d[..1], &[]).unwrap();
    let copied = f.xfer.copy_slot(d[0], d[1], &[]).unwrap();
    let backed = f.xfer.backup(&d[1..], &h[1..], &[copied.event()]).unwrap();
    backed.wait().unwrap();
    assert_eq!(f.read_host(h[1]), want);
}

/// Bad slots are errors before anything is queued, and leave every slot as it was.
pub fn bad_slots_are_refused(device: &Device, shape: &MambaShape) {
    let f = Fixture::new(device, shape, 3, 2);
    let d = f.pool.alloc(2).unwrap();
    let h = f.host.alloc(1).unwrap();
    let a = pattern(3, f.pool.slot_bytes());
    f.pool.write_slot(d[0], &a).unwrap();
    let free_dev = StateSlot(2);
    let e = f.xfer.backup(&[free_dev], &h, &[]).unwrap_err();
    assert!(
        matches!(e, GpuError::SlotNotAllocated { slot: 2, .. }),
        "{e}"
    );
    let e = f.xfer.load(&h, &[StateSlot(7)], &[]).unwrap_err();
    assert!(matches!(e, GpuError::PageOutOfRange { page: 7, .. }), "{e}");
    let e = f.xfer.load(&[MambaSlot(1)], &d[..1], &[]).unwrap_err();
    assert!(
        matches!(e, GpuError::SlotNotAllocated { slot: 1, .. }),
        "{e}"
    );
    let e = f.xfer.backup(&d, &h, &[]).unwrap_err();
    assert!(matches!(e, GpuError::LengthMismatch { .. }), "{e}");
    let e = f.xfer.load(&[h[0], h[0]], &[d[1], d[1]], &[]).unwrap_err();
    assert!(matches!(e, GpuError::DuplicateDestination { .. }), "{e}");
    let e = f.xfer.copy_slot(d[0], d[0], &[]).unwrap_err();
    assert!(matches!(e, GpuError::SameSlot { .. }), "{e}");
    let e = f.xfer.copy_slot(d[0], free_dev, &[]).unwrap_err();
    assert!(matches!(e, GpuError::SlotNotAllocated { .. }), "{e}");
    let mut short = vec![0; f.pool.slot_bytes() - 1];
    assert!(f.pool.read_slot(d[0], &mut short).is_err());
    assert!(f.pool.write_slot(free_dev, &a).is_err());
    f.xfer.synchronize().unwrap();
    assert_eq!(f.read_dev(d[0]), a);
    assert_eq!(f.read_dev(d[1]), vec![0; f.pool.slot_bytes()]);
    // Double free and out of range free nothing.
    assert!(f.pool.free(&[d[1], d[1]]).is_err());
    assert!(f.pool.free(&[StateSlot(3)]).is_err());
    assert!(f.pool.is_allocated(d[1]));
    f.pool.free(&d).unwrap();
    assert_eq!(f.pool.available(), 3);
}

/// One step of a random sequence; indices pick among the live slots at run time.
#[derive(Clone, Debug)]
pub enum Op {
    AllocDev(usize),
    FreeDev(usize),
    AllocHost(usize),
    FreeHost(usize),
    Write(usize, u32),
    SetHost(usize, u32),
    /// (device source, host destination) picks; destinations deduplicated.
    Backup(Vec<(usize, usize)>),
    /// (host source, device destination) picks; destinations deduplicated.
    Load(Vec<(usize, usize)>),
    Copy(usize, usize),
    /// A transfer naming a slot that is not allocated: an error that changes nothing.
    BadBackup(usize),
}

/// The live slots and their contents on both sides.
#[derive(Default)]
struct Model {
    dev: BTreeMap<u32, Vec<u8>>,
    host: BTreeMap<u32, Vec<u8>>,
}

fn pick(map: &BTreeMap<u32, Vec<u8>>, i: usize) -> Option<u32> {
    map.keys().nth(i % map.len().max(1)).copied()
}

/// Pairs of live slots (source side `a`, destination side `b`), destinations distinct.
fn pairs(
    a: &BTreeMap<u32, Vec<u8>>,
    b: &BTreeMap<u32, Vec<u8>>,
    picks: &[(usize, usize)],
) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &(i, j) in picks {
        if let (Some(s), Some(d)) = (pick(a, i), pick(b, j))
            && !out.iter().any(|&(_, x)| x == d)
        {
            out.push((s, d));
        }
    }
    out
}

/// Runs `ops` on fresh pools and checks, after every step, that alloc never hands a live
/// slot out twice and that every live slot on both sides holds what the model says.
pub fn run_model(device: &Device, shape: &MambaShape, dev_slots: usize, ops: &[Op]) {
    let f = Fixture::new(device, shape, dev_slots, 4);
    let bytes = f.pool.slot_bytes();
    let mut m = Model::default();
    let mut seed = 1000;
    for op in ops {
        seed += 1;
        step(&f, &mut m, op, seed, bytes);
        assert_eq!(f.pool.available(), dev_slots - m.dev.len());
        assert_eq!(f.host.available(), 4 - m.host.len());
        for (&s, want) in &m.dev {
            assert_eq!(
                &f.read_dev(StateSlot(s)),
                want,
                "device slot {s} after {op:?}"
            );
        }
        for (&s, want) in &m.host {
            assert_eq!(
                &f.read_host(MambaSlot(s)),
                want,
                "host slot {s} after {op:?}"
            );
        }
    }
}

fn step(f: &Fixture, m: &mut Model, op: &Op, seed: u32, bytes: usize) {
    match op {
        Op::AllocDev(n) => match f.pool.alloc(*n) {
            None => assert!(*n > f.pool.num_slots() - m.dev.len()),
            Some(got) => {
                assert_eq!(got.len(), *n);
                for (k, s) in got.into_iter().enumerate() {
                    let data = pattern(seed * 8 + k as u32, bytes);
                    f.pool.write_slot(s, &data).unwrap();
                    assert!(m.dev.insert(s.0, data).is_none(), "{s} handed out twice");
                }
            }
        },
        Op::AllocHost(n) => {
            if let Some(got) = f.host.alloc(*n) {
                for (k, s) in got.into_iter().enumerate() {
                    let data = pattern(seed * 8 + k as u32 + 4, bytes);
                    f.host.set_slot(s, &data).unwrap();
                    assert!(m.host.insert(s.0, data).is_none(), "{s} handed out twice");
                }
            }
        }
        Op::FreeDev(i) => {
            if let Some(s) = pick(&m.dev, *i) {
                f.pool.free(&[StateSlot(s)]).unwrap();
                m.dev.remove(&s);
                assert!(f.pool.free(&[StateSlot(s)]).is_err(), "double free refused");
            }
        }
        Op::FreeHost(i) => {
            if let Some(s) = pick(&m.host, *i) {
                f.host.free(&[MambaSlot(s)]).unwrap();
                m.host.remove(&s);
            }
        }
        Op::Write(i, b) => {
            if let Some(s) = pick(&m.dev, *i) {
                let data = pattern(*b, bytes);
                f.pool.write_slot(StateSlot(s), &data).unwrap();
                m.dev.insert(s, data);
            }
        }
        Op::SetHost(i, b) => {
            if let Some(s) = pick(&m.host, *i) {
                let data = pattern(*b, bytes);
                f.host.set_slot(MambaSlot(s), &data).unwrap();
                m.host.insert(s, data);
            }
        }
        Op::Backup(picks) => {
            let p = pairs(&m.dev, &m.host, picks);
            let dev: Vec<StateSlot> = p.iter().map(|&(d, _)| StateSlot(d)).collect();
            let host: Vec<MambaSlot> = p.iter().map(|&(_, h)| MambaSlot(h)).collect();
            f.xfer.backup(&dev, &host, &[]).unwrap().wait().unwrap();
            for (d, h) in p {
                let v = m.dev[&d].clone();
                m.host.insert(h, v);
            }
        }
        Op::Load(picks) => {
            let p = pairs(&m.host, &m.dev, picks);
            let host: Vec<MambaSlot> = p.iter().map(|&(h, _)| MambaSlot(h)).collect();
            let dev: Vec<StateSlot> = p.iter().map(|&(_, d)| StateSlot(d)).collect();
            f.xfer.load(&host, &dev, &[]).unwrap().wait().unwrap();
            for (h, d) in p {
                let v = m.host[&h].clone();
                m.dev.insert(d, v);
            }
        }
        Op::Copy(i, j) => {
            let (Some(s), Some(d)) = (pick(&m.dev, *i), pick(&m.dev, *j)) else {
                return;
            };
            let r = f.xfer.copy_slot(StateSlot(s), StateSlot(d), &[]);
            if s == d {
                assert!(matches!(r, Err(GpuError::SameSlot { .. })));
            } else {
                r.unwrap().wait().unwrap();
                let v = m.dev[&s].clone();
                m.dev.insert(d, v);
            }
        }
        Op::BadBackup(i) => {
            let free = (0..f.pool.num_slots() as u32).find(|s| !m.dev.contains_key(s));
            let (Some(d), Some(h)) = (free, pick(&m.host, *i)) else {
                return;
            };
            let e = f
                .xfer
                .backup(&[StateSlot(d)], &[MambaSlot(h)], &[])
                .unwrap_err();
            assert!(matches!(e, GpuError::SlotNotAllocated { .. }), "{e}");
        }
    }
}
