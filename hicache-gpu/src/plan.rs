//! The `direct` io backend's copy plan: a transfer of page pairs as a list of DMA copies
//! (`cuMemcpyAsync` / `cuMemcpy2DAsync`), with contiguous runs coalesced.
//!
//! How a plan is built ([`plan_direct`]):
//! 1. Pairs are sorted by host page; consecutive pairs whose device *and* host pages both
//!    advance by one form a **run** of `k` pages.
//! 2. For each run, half and layer, the device side is one contiguous block of `k·ps·R` bytes
//!    (a device layer is `[page][token][row]`). The host side is:
//!    - one contiguous block when rows are adjacent (`token == R`) and pages are adjacent
//!      (`page == ps·R`, or `k == 1`): `layer_first`, and `page_first_direct` per page;
//!    - a pitched block of `k·ps` rows of `R` bytes with pitch `token` when pages continue the
//!      row pattern (`page == ps·token`): `page_first`, whose page is one contiguous run across
//!      all layers, so one 2D copy moves a whole run of pages of one layer;
//!    - otherwise one block per page (`page_first_direct` runs of more than one page); there,
//!      when that takes fewer copies, each layer of the run is instead one pitched block of
//!      `k` page-layer blocks (`ps·R` bytes each, pitch = the host page stride), so a run
//!      costs one copy per layer rather than one per page.
//! 3. When more than one layer is copied and a block is contiguous on both sides, the device
//!    layers are one allocation (our own pool; engine buffers are separate allocations, and a
//!    driver copy may not span two) and both they and the host layers are equally spaced, the per-layer blocks of all layers become one 2D copy
//!    (`height = layers`, pitches = the two layer strides): `page_first_direct` moves a whole
//!    page half in one copy and `layer_first` a whole run.
//!
//! Invariant: the plan writes exactly the destination rows of the pairs, each once, and reads
//! exactly their source rows (checked against the naive reference by the tests).

use std::ops::Range;

/// Largest pitch used in a 2D copy (the driver's pitch limit).
pub const MAX_PITCH: u64 = i32::MAX as u64;

/// Where the driver batches copies (`cuMemcpyBatchAsync`), a pitched copy of at most this many
/// rows goes into the batch as one copy per row; taller ones stay one 2D copy, which the copy
/// engine walks faster than as many small copies.
pub const BATCH_MAX_ROWS: u64 = 64;

/// Splits a plan for a driver that batches copies: the copies of one batch as `(device,
/// host, bytes)` (every linear op, and every row of pitched ops of at most `max_rows` rows),
/// and the ops left to issue one by one. Together they move exactly the bytes of `ops`.
pub fn split_for_batch(ops: &[MemcpyOp], max_rows: u64) -> (Vec<(u64, u64, u64)>, Vec<MemcpyOp>) {
    let mut rows = Vec::new();
    let mut rest = Vec::new();
    for op in ops {
        match *op {
            MemcpyOp::Linear { dev, host, bytes } => rows.push((dev, host, bytes)),
            MemcpyOp::Pitched {
                dev,
                dev_pitch,
                host,
                host_pitch,
                width,
                height,
            } if height <= max_rows => rows
                .extend((0..height).map(|i| (dev + i * dev_pitch, host + i * host_pitch, width))),
            MemcpyOp::Pitched { .. } => rest.push(*op),
        }
    }
    (rows, rest)
}

/// Which way bytes move.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Device → host (backup).
    ToHost,
    /// Host → device (load).
    ToDevice,
}

/// One DMA copy; addresses are device addresses and host virtual addresses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MemcpyOp {
    /// `bytes` contiguous bytes.
    Linear {
        /// Device address.
        dev: u64,
        /// Host address.
        host: u64,
        /// Bytes.
        bytes: u64,
    },
    /// `height` rows of `width` bytes with different pitches on each side.
    Pitched {
        /// Device address of row 0.
        dev: u64,
        /// Device bytes between rows.
        dev_pitch: u64,
        /// Host address of row 0.
        host: u64,
        /// Host bytes between rows.
        host_pitch: u64,
        /// Bytes per row.
        width: u64,
        /// Rows.
        height: u64,
    },
}

impl MemcpyOp {
    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        match *self {
            MemcpyOp::Linear { bytes, .. } => bytes,
            MemcpyOp::Pitched { width, height, .. } => width * height,
        }
    }
}

/// One device-to-device copy (`cuMemcpyDtoDAsync`); source and destination never overlap.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceCopy {
    /// Destination device address.
    pub dst: u64,
    /// Source device address.
    pub src: u64,
    /// Bytes.
    pub bytes: u64,
}

/// Appends a linear copy to `ops`, merged into the last op when that is a linear copy whose
/// device and host ranges both end where the new one starts (one DMA copy per contiguous run).
pub fn push_linear(ops: &mut Vec<MemcpyOp>, dev: u64, host: u64, bytes: u64) {
    if let Some(MemcpyOp::Linear {
        dev: d0,
        host: h0,
        bytes: n0,
    }) = ops.last_mut()
        && *d0 + *n0 == dev
        && *h0 + *n0 == host
    {
        *n0 += bytes;
        return;
    }
    ops.push(MemcpyOp::Linear { dev, host, bytes });
}

/// The geometry a plan needs (all strides in bytes).
#[derive(Clone, Debug)]
pub struct PlanGeometry<'a> {
    /// `[half · total_layers + layer]` base address of each device layer.
    pub dev_table: &'a [u64],
    /// Layers in the model.
    pub total_layers: u32,
    /// 2 for MHA, 1 for MLA.
    pub halves: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Bytes per row.
    pub row_bytes: u32,
    /// Host address of the pool.
    pub host_base: u64,
    /// Host layout strides.
    pub host: hicache_host::Strides,
    /// Whether every device layer lies in one allocation (our own pool). Only then may one
    /// 2D copy span several layers: a driver copy must stay inside one allocation, and engine
    /// buffers are separate allocations even where they happen to be equally spaced.
    pub dev_one_allocation: bool,
}

/// Runs of `(device page, host page, pages)`, sorted by host page (step 1).
pub fn coalesce(dev: &[u32], host: &[u32]) -> Vec<(u32, u32, u32)> {
    let mut pairs: Vec<(u32, u32)> = host.iter().copied().zip(dev.iter().copied()).collect();
    pairs.sort_unstable();
    let mut runs: Vec<(u32, u32, u32)> = Vec::new();
    for (h, d) in pairs {
        match runs.last_mut() {
            Some((d0, h0, k)) if h0.checked_add(*k) == Some(h) && d0.checked_add(*k) == Some(d) => {
                *k += 1
            }
            _ => runs.push((d, h, 1)),
        }
    }
    runs
}

/// The plan of copying `layers` of every pair (module docs).
pub fn plan_direct(
    g: &PlanGeometry<'_>,
    dev: &[u32],
    host: &[u32],
    layers: Range<u32>,
) -> Vec<MemcpyOp> {
    let r = g.row_bytes as u64;
    let ps = g.page_size as u64;
    let s = g.host;
    let (hs, hps, hls, hts) = (s.half as u64, s.page as u64, s.layer as u64, s.token as u64);
    let dps = ps * r;
    let nl = (layers.end - layers.start) as u64;
    let mut ops = Vec::new();
    for (d0, h0, k) in coalesce(dev, host) {
        let k = k as u64;
        for half in 0..g.halves as u64 {
            let row = |l: u32| &g.dev_table[(half * g.total_layers as u64 + l as u64) as usize];
            let dev_stride = uniform_stride(
                &g.dev_table[(half * g.total_layers as u64 + layers.start as u64) as usize..]
                    [..nl as usize],
            );
            let host_at = |page: u64, l: u32| g.host_base + half * hs + page * hps + l as u64 * hls;
            // Step 3: whether the per-layer blocks of `width` bytes merge into one 2D copy.
            let can_merge = |width: u64| {
                nl > 1
                    && g.dev_one_allocation
                    && dev_stride.is_some_and(|st| st >= width && st <= MAX_PITCH)
                    && hls >= width
                    && hls <= MAX_PITCH
            };
            // Contiguous blocks of this run, per layer: (first page, pages).
            let blocks: Vec<(u64, u64)> = if hts == r && (k == 1 || hps == ps * r) {
                vec![(0, k)]
            } else if hps == ps * hts {
                // Pitched rows within a layer (page_first).
                for l in layers.clone() {
                    ops.push(MemcpyOp::Pitched {
                        dev: row(l) + d0 as u64 * dps,
                        dev_pitch: r,
                        host: host_at(h0 as u64, l),
                        host_pitch: hts,
                        width: r,
                        height: k * ps,
                    });
                }
                continue;
            } else if hts == r
                && (hps >= dps && hps <= MAX_PITCH && dps <= MAX_PITCH)
                && nl < if can_merge(dps) { k } else { k * nl }
            {
                // page_first_direct: per layer, the run's page blocks as one pitched copy.
                for l in layers.clone() {
                    ops.push(MemcpyOp::Pitched {
                        dev: row(l) + d0 as u64 * dps,
                        dev_pitch: dps,
                        host: host_at(h0 as u64, l),
                        host_pitch: hps,
                        width: dps,
                        height: k,
                    });
                }
                continue;
            } else {
                (0..k).map(|i| (i, 1)).collect()
            };
            for (first, n) in blocks {
                let width = n * ps * r;
                let dev_addr = |l: u32| row(l) + (d0 as u64 + first) * dps;
                let host_addr = |l: u32| host_at(h0 as u64 + first, l);
                if can_merge(width) {
                    ops.push(MemcpyOp::Pitched {
                        dev: dev_addr(layers.start),
                        dev_pitch: dev_stride.expect("checked above"),
                        host: host_addr(layers.start),
                        host_pitch: hls,
                        width,
                        height: nl,
                    });
                } else {
                    for l in layers.clone() {
                        ops.push(MemcpyOp::Linear {
                            dev: dev_addr(l),
                            host: host_addr(l),
                            bytes: width,
                        });
                    }
                }
            }
        }
    }
    ops
}

/// The common positive difference of consecutive addresses, if there is one (and at least
/// two addresses).
fn uniform_stride(addrs: &[u64]) -> Option<u64> {
    let first = addrs.get(1)?.checked_sub(addrs[0])?;
    (first > 0
        && addrs
            .windows(2)
            .all(|w| w[1].checked_sub(w[0]) == Some(first)))
    .then_some(first)
}

/// Runs a plan on the CPU (the sim device's DMA engine).
///
/// # Safety
/// Every address of every op must be valid host memory of this process for the bytes the op
/// moves, and no destination may overlap a source.
pub unsafe fn run_plan_on_cpu(dir: Direction, ops: &[MemcpyOp]) {
    let copy = |dev: u64, host: u64, n: u64| {
        let (src, dst) = match dir {
            Direction::ToHost => (dev, host),
            Direction::ToDevice => (host, dev),
        };
        // SAFETY: valid and disjoint per the function's contract.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, n as usize) };
    };
    for op in ops {
        match *op {
            MemcpyOp::Linear { dev, host, bytes } => copy(dev, host, bytes),
            MemcpyOp::Pitched {
                dev,
                dev_pitch,
                host,
                host_pitch,
                width,
                height,
            } => {
                for i in 0..height {
                    copy(dev + i * dev_pitch, host + i * host_pitch, width);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_need_both_sides_contiguous() {
        assert_eq!(
            coalesce(&[5, 6, 7, 1], &[10, 11, 12, 13]),
            vec![(5, 10, 3), (1, 13, 1)]
        );
        // Sorted by host page first.
        assert_eq!(coalesce(&[7, 6, 5], &[12, 11, 10]), vec![(5, 10, 3)]);
        assert_eq!(coalesce(&[3, 2], &[0, 1]), vec![(3, 0, 1), (2, 1, 1)]);
        assert_eq!(
            coalesce(&[u32::MAX, 0], &[0, 1]),
            vec![(u32::MAX, 0, 1), (0, 1, 1)]
        );
        assert!(coalesce(&[], &[]).is_empty());
    }

    #[test]
    fn batches_keep_every_byte_and_leave_tall_copies_alone() {
        let ops = [
            MemcpyOp::Linear {
                dev: 1000,
                host: 5000,
                bytes: 64,
            },
            MemcpyOp::Pitched {
                dev: 2000,
                dev_pitch: 100,
                host: 9000,
                host_pitch: 300,
                width: 40,
                height: 3,
            },
            MemcpyOp::Pitched {
                dev: 40_000,
                dev_pitch: 8,
                host: 90_000,
                host_pitch: 16,
                width: 8,
                height: 65,
            },
        ];
        let (rows, rest) = split_for_batch(&ops, 64);
        assert_eq!(
            rows,
            vec![
                (1000, 5000, 64),
                (2000, 9000, 40),
                (2100, 9300, 40),
                (2200, 9600, 40)
            ]
        );
        assert_eq!(rest, vec![ops[2]]);
        let moved: u64 =
            rows.iter().map(|r| r.2).sum::<u64>() + rest.iter().map(|o| o.bytes()).sum::<u64>();
        assert_eq!(moved, ops.iter().map(|o| o.bytes()).sum::<u64>());
        assert_eq!(split_for_batch(&ops, 0).0.len(), 1);
    }

    #[test]
    fn linear_copies_merge_only_when_both_sides_continue() {
        let mut ops = Vec::new();
        push_linear(&mut ops, 100, 1000, 10);
        push_linear(&mut ops, 110, 1010, 5);
        push_linear(&mut ops, 115, 2000, 5);
        push_linear(&mut ops, 300, 2005, 5);
        push_linear(&mut ops, 305, 2010, 1);
        let lin = |dev, host, bytes| MemcpyOp::Linear { dev, host, bytes };
        assert_eq!(
            ops,
            vec![lin(100, 1000, 15), lin(115, 2000, 5), lin(300, 2005, 6)]
        );
    }

    #[test]
    fn uniform_strides() {
        assert_eq!(uniform_stride(&[100, 200, 300]), Some(100));
        assert_eq!(uniform_stride(&[100, 200, 350]), None);
        assert_eq!(uniform_stride(&[300, 200]), None);
        assert_eq!(uniform_stride(&[100]), None);
    }
}
