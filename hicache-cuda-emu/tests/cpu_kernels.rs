//! The transfer kernels' exact CUDA source, compiled as C++ and run on the CPU for every
//! block and thread of small grids, against the host layout (`HostLayout::offset`) and the
//! sim's CPU reference (`copy_reference`): every layout, MHA and MLA (576 × bf16 rows),
//! element sizes 1/2/4, misaligned rows and bases, partial layer ranges, chunked launches,
//! every word width the alignment allows, with every global access checked for bounds,
//! direction and natural alignment.

use std::ops::Range;

use hicache_core::layout::{DType, KvKind, KvShape, LayoutKind};
use hicache_cuda_emu::EmuError;
use hicache_cuda_emu::cpu_kernels::{self, AccessCheck};
use hicache_gpu::copy::{CopyParams, copy_reference};
use hicache_gpu::kernels::{ENTRY_POINTS, entry_point};
use hicache_host::HostLayout;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn params_bytes(p: &CopyParams) -> Vec<u8> {
    // SAFETY: CopyParams is repr(C) plain data without padding (9 u64 then 10 u32).
    unsafe {
        std::slice::from_raw_parts(
            (p as *const CopyParams).cast::<u8>(),
            std::mem::size_of::<CopyParams>(),
        )
    }
    .to_vec()
}

/// A 16-byte aligned byte buffer with `offset` bytes of lead-in (for misaligned bases).
struct Buf {
    words: Vec<u128>,
    offset: usize,
    len: usize,
}

impl Buf {
    fn new(len: usize, offset: usize, rng: &mut ChaCha8Rng) -> Self {
        let mut b = Self {
            words: vec![0u128; (len + offset).div_ceil(16) + 1],
            offset,
            len,
        };
        rng.fill_bytes(b.bytes_mut());
        b
    }
    fn addr(&self) -> u64 {
        self.words.as_ptr() as u64 + self.offset as u64
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: within the u128 vector (offset + len ≤ its byte length).
        unsafe { std::slice::from_raw_parts((self.addr()) as *const u8, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.addr() as *mut u8, self.len) }
    }
}

struct Region {
    name: &'static str,
    start: u64,
    len: u64,
    writable: bool,
}

/// Allows exactly the regions a copy may touch: the table and index lists and the source
/// pool read-only, the destination pool read-write; every access naturally aligned.
struct Regions(Vec<Region>);

impl AccessCheck for Regions {
    fn check(&self, addr: u64, bytes: usize, write: bool) -> Result<(), String> {
        if !addr.is_multiple_of(bytes as u64) {
            return Err(format!("misaligned {bytes}-byte access at {addr:#x}"));
        }
        let end = addr + bytes as u64;
        match self
            .0
            .iter()
            .find(|r| addr >= r.start && end <= r.start + r.len)
        {
            Some(r) if write && !r.writable => Err(format!("write to read-only {}", r.name)),
            Some(_) => Ok(()),
            None => Err(format!("{bytes} bytes at {addr:#x} outside every buffer")),
        }
    }
}

#[derive(Clone, Debug)]
struct Case {
    shape: KvShape,
    layout: LayoutKind,
    layers: Range<u32>,
    to_host: bool,
    chunk_bytes: u32,
    dev_misalign: usize,
    host_misalign: usize,
    grid: u32,
    threads: u32,
}

const DEV_PAGES: usize = 6;
const HOST_PAGES: usize = 5;
/// (device page, host page): scattered, out of order.
const PAIRS: [(u32, u32); 3] = [(4, 1), (0, 3), (5, 0)];

/// Runs `case` with every word width the alignment allows and checks the result each time.
/// Returns the number of launches.
fn run_case(case: &Case, seed: u64) -> usize {
    let shape = case.shape;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let layout = HostLayout::new(shape, case.layout, HOST_PAGES).unwrap();
    let (halves, total_layers) = (shape.halves(), shape.layers as usize);
    let (row, page_size) = (shape.row_bytes(), shape.page_size as usize);
    let dev_layer_bytes = DEV_PAGES * shape.page_layer_bytes();
    let mut dev = Buf::new(
        halves * total_layers * dev_layer_bytes,
        case.dev_misalign,
        &mut rng,
    );
    let mut host = Buf::new(layout.total_bytes(), case.host_misalign, &mut rng);
    let table: Vec<u64> = (0..halves * total_layers)
        .map(|i| dev.addr() + (i * dev_layer_bytes) as u64)
        .collect();
    let dpages: Vec<u32> = PAIRS.iter().map(|p| p.0).collect();
    let hpages: Vec<u32> = PAIRS.iter().map(|p| p.1).collect();
    let s = layout.strides();
    let params = CopyParams {
        dev_table: table.as_ptr() as u64,
        dev_pages: dpages.as_ptr() as u64,
        host_pages: hpages.as_ptr() as u64,
        host_base: host.addr(),
        host_half_stride: s.half as u64,
        host_page_stride: s.page as u64,
        host_layer_stride: s.layer as u64,
        host_token_stride: s.token as u64,
        dev_page_stride: shape.page_layer_bytes() as u64,
        num_pairs: PAIRS.len() as u32,
        layer_begin: case.layers.start,
        num_layers: case.layers.end - case.layers.start,
        total_layers: shape.layers,
        num_halves: halves as u32,
        page_size: shape.page_size,
        row_bytes: row as u32,
        to_host: case.to_host as u32,
        rows_per_chunk: 0,
        chunks_per_unit: 0,
    }
    .with_chunk_bytes(case.chunk_bytes);
    let widest = params.word_bytes(table.iter().copied());

    // The expected result, from the layout's offsets alone.
    let (dev0, host0) = (dev.bytes().to_vec(), host.bytes().to_vec());
    let (mut want_dev, mut want_host) = (dev0.clone(), host0.clone());
    for &(dp, hp) in &PAIRS {
        for h in 0..halves {
            for l in case.layers.clone() {
                for t in 0..page_size {
                    let d = (h * total_layers + l as usize) * dev_layer_bytes
                        + dp as usize * shape.page_layer_bytes()
                        + t * row;
                    let o = layout.offset(h, hp as usize, l as usize, t);
                    if case.to_host {
                        want_host[o..o + row].copy_from_slice(&dev0[d..d + row]);
                    } else {
                        want_dev[d..d + row].copy_from_slice(&host0[o..o + row]);
                    }
                }
            }
        }
    }

    // The sim's reference agrees with the layout.
    // SAFETY: every address is inside `table`, the index lists, `dev` or `host`.
    unsafe { copy_reference(&params) };
    assert_eq!(
        dev.bytes(),
        &want_dev[..],
        "reference, device side, {case:?}"
    );
    assert_eq!(
        host.bytes(),
        &want_host[..],
        "reference, host side, {case:?}"
    );

    let (dev_region, host_region) = ((dev.addr(), dev.len as u64), (host.addr(), host.len as u64));
    let regions = Regions(vec![
        Region {
            name: "layer table",
            start: table.as_ptr() as u64,
            len: (table.len() * 8) as u64,
            writable: false,
        },
        Region {
            name: "device page list",
            start: dpages.as_ptr() as u64,
            len: (dpages.len() * 4) as u64,
            writable: false,
        },
        Region {
            name: "host page list",
            start: hpages.as_ptr() as u64,
            len: (hpages.len() * 4) as u64,
            writable: false,
        },
        Region {
            name: "device pool",
            start: dev_region.0,
            len: dev_region.1,
            writable: !case.to_host,
        },
        Region {
            name: "host pool",
            start: host_region.0,
            len: host_region.1,
            writable: case.to_host,
        },
    ]);
    let mut launches = 0;
    for (w, name) in ENTRY_POINTS.iter().copied().filter(|(w, _)| *w <= widest) {
        dev.bytes_mut().copy_from_slice(&dev0);
        host.bytes_mut().copy_from_slice(&host0);
        let k = cpu_kernels::kernel(name).unwrap();
        // SAFETY: the checker refuses every access outside the buffers above.
        unsafe {
            k.run(
                [case.grid, 1, 1],
                [case.threads, 1, 1],
                &params_bytes(&params),
                Some(&regions),
            )
        }
        .unwrap_or_else(|e| panic!("{name} (w{w}) on {case:?}: {e}"));
        assert_eq!(dev.bytes(), &want_dev[..], "{name}, device side, {case:?}");
        assert_eq!(host.bytes(), &want_host[..], "{name}, host side, {case:?}");
        launches += 1;
    }
    assert_eq!(
        entry_point(widest),
        ENTRY_POINTS.iter().find(|e| e.0 == widest).unwrap().1
    );
    launches
}

fn mha(heads: u32, head_dim: u32, dtype: DType, layers: u32, page_size: u32) -> KvShape {
    KvShape {
        kind: KvKind::Mha { heads, head_dim },
        layers,
        dtype,
        page_size,
    }
}

fn mla_576(layers: u32, page_size: u32) -> KvShape {
    KvShape {
        kind: KvKind::Mla { kv_dim: 576 },
        layers,
        dtype: DType::Bf16,
        page_size,
    }
}

const LAYOUTS: [LayoutKind; 3] = [
    LayoutKind::LayerFirst,
    LayoutKind::PageFirst,
    LayoutKind::PageFirstDirect,
];

/// Runs `shape` in every layout, both directions, all and partial layer ranges, whole-page
/// and chunked items, and two grids (fewer warps than items, and more).
fn sweep(shape: KvShape, dev_misalign: usize, host_misalign: usize) -> usize {
    let mut launches = 0;
    let l = shape.layers;
    let row = shape.row_bytes() as u32;
    for (i, layout) in LAYOUTS.into_iter().enumerate() {
        for to_host in [true, false] {
            for layers in [0..l, 1..l - 1, l - 1..l] {
                for (chunk_bytes, grid, threads) in
                    [(row * shape.page_size, 1, 32), (row * 3, 3, 64), (1, 5, 96)]
                {
                    let case = Case {
                        shape,
                        layout,
                        layers: layers.clone(),
                        to_host,
                        chunk_bytes,
                        dev_misalign,
                        host_misalign,
                        grid,
                        threads,
                    };
                    launches += run_case(&case, i as u64 * 1000 + launches as u64);
                }
            }
        }
    }
    launches
}

#[test]
fn parameter_block_matches_copy_params() {
    let ks = cpu_kernels::kernels();
    let names: Vec<&str> = ks.iter().map(|k| k.name()).collect();
    let want: Vec<&str> = ENTRY_POINTS.iter().map(|e| e.1).collect();
    assert_eq!(names, want);
    for k in ks {
        assert_eq!(
            k.param_bytes(),
            std::mem::size_of::<CopyParams>(),
            "{}",
            k.name()
        );
    }
}

#[test]
fn mha_bf16_every_layout() {
    // 2 heads × 8 × bf16 = 32-byte rows: w16 down to w1.
    assert!(sweep(mha(2, 8, DType::Bf16, 3, 4), 0, 0) > 0);
}

#[test]
fn mla_576_bf16_every_layout() {
    // 1152-byte rows, odd page size.
    assert!(sweep(mla_576(3, 3), 0, 0) > 0);
}

#[test]
fn element_sizes_one_two_four() {
    for dtype in [DType::Fp8E4m3, DType::F16, DType::F32] {
        // 12 elements: 12, 24, 48-byte rows (w4, w8, w16 at most).
        sweep(mha(1, 12, dtype, 3, 4), 0, 0);
    }
}

#[test]
fn misaligned_rows_and_bases() {
    // 3-byte rows (w1), 6-byte rows (w2), and 32-byte rows on bases off by 4 and 2 bytes.
    sweep(mha(1, 3, DType::Fp8E4m3, 3, 5), 0, 0);
    sweep(mha(1, 3, DType::Bf16, 3, 5), 0, 0);
    sweep(mha(2, 8, DType::Bf16, 3, 4), 4, 0);
    sweep(mha(2, 8, DType::Bf16, 3, 4), 0, 2);
}

#[test]
fn wrong_parameter_size_is_refused() {
    let k = cpu_kernels::kernel("hicache_copy_w16").unwrap();
    let bytes = vec![0u8; std::mem::size_of::<CopyParams>() - 4];
    // SAFETY: refused before anything runs.
    let e = unsafe { k.run([1, 1, 1], [32, 1, 1], &bytes, None) }.unwrap_err();
    let size = std::mem::size_of::<CopyParams>();
    assert!(
        matches!(e, EmuError::ParamSize { given, expected, .. } if given == size - 4 && expected == size),
        "{e}"
    );
    assert!(matches!(
        cpu_kernels::kernel("hicache_copy_w3"),
        Err(EmuError::UnknownKernel(_))
    ));
}

#[test]
fn out_of_bounds_access_is_reported_not_performed() {
    // Host page 9 of a 5-page pool: the checker refuses, the launch reports it.
    let shape = mha(1, 8, DType::Bf16, 2, 2);
    let layout = HostLayout::new(shape, LayoutKind::LayerFirst, HOST_PAGES).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let dev = Buf::new(2 * DEV_PAGES * shape.page_layer_bytes(), 0, &mut rng);
    let host = Buf::new(layout.total_bytes(), 0, &mut rng);
    let table: Vec<u64> = (0..2)
        .map(|i| dev.addr() + (i * DEV_PAGES * shape.page_layer_bytes()) as u64)
        .collect();
    let (dp, hp) = ([0u32], [9u32]);
    let s = layout.strides();
    let p = CopyParams {
        dev_table: table.as_ptr() as u64,
        dev_pages: dp.as_ptr() as u64,
        host_pages: hp.as_ptr() as u64,
        host_base: host.addr(),
        host_half_stride: s.half as u64,
        host_page_stride: s.page as u64,
        host_layer_stride: s.layer as u64,
        host_token_stride: s.token as u64,
        dev_page_stride: shape.page_layer_bytes() as u64,
        num_pairs: 1,
        layer_begin: 0,
        num_layers: 2,
        total_layers: 2,
        num_halves: 2,
        page_size: 2,
        row_bytes: 16,
        to_host: 1,
        rows_per_chunk: 0,
        chunks_per_unit: 0,
    }
    .with_chunk_bytes(64);
    let regions = Regions(vec![
        Region {
            name: "all inputs",
            start: table.as_ptr() as u64,
            len: 16,
            writable: false,
        },
        Region {
            name: "dp",
            start: dp.as_ptr() as u64,
            len: 4,
            writable: false,
        },
        Region {
            name: "hp",
            start: hp.as_ptr() as u64,
            len: 4,
            writable: false,
        },
        Region {
            name: "device pool",
            start: dev.addr(),
            len: dev.len as u64,
            writable: false,
        },
        Region {
            name: "host pool",
            start: host.addr(),
            len: host.len as u64,
            writable: true,
        },
    ]);
    let k = cpu_kernels::kernel("hicache_copy_w16").unwrap();
    // SAFETY: the checker refuses the out-of-range host rows before they are written.
    let e = unsafe { k.run([1, 1, 1], [32, 1, 1], &params_bytes(&p), Some(&regions)) }.unwrap_err();
    assert!(
        matches!(&e, EmuError::IllegalAccess { first, .. } if first.contains("outside every buffer")),
        "{e}"
    );
}
