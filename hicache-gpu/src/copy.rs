//! The page copy of the `kernel` io backend: its parameters ([`CopyParams`], shared bit for
//! bit with the CUDA kernel in [`kernels`](crate::kernels)), its work decomposition, and its
//! CPU reference ([`copy_reference`]), which the sim device runs and the GPU tests compare the
//! kernel against.
//!
//! Work decomposition (the kernel and the reference agree on it):
//! 1. A **unit** is one `(pair, half, layer)`: `page_size` rows of `row_bytes` bytes. Unit `u`
//!    is `((pair · halves) + half) · num_layers + (layer − layer_begin)`, so the units of one
//!    page pair are adjacent (its host writes stay local).
//! 2. A unit is cut into `chunks_per_unit` **chunks** of `rows_per_chunk` rows (the last may be
//!    shorter). An **item** is `(unit, chunk)`; item `i` is unit `i / chunks_per_unit`, chunk
//!    `i % chunks_per_unit`. Each warp takes items `warp, warp + nwarps, …` (grid stride).
//! 3. Inside an item the 32 lanes stride over the chunk's words (`W` = 16, 8, 4, 2 or 1 bytes),
//!    `UNROLL` words per lane loaded to registers before any store (more bytes in flight over
//!    PCIe). Word `i` of a chunk is row `row0 + i / (row_bytes/W)`, column `i % (row_bytes/W)`.
//! 4. Device rows: `table[half · total_layers + layer] + dev_page · dev_page_stride +
//!    row · row_bytes`. Host rows: `host_base + half · host_half_stride + host_page ·
//!    host_page_stride + layer · host_layer_stride + row · host_token_stride`.
//! 5. `to_host = 1` copies device → host (backup, gather), `0` host → device (load, scatter).
//!
//! The word width is the largest of 16/8/4/2/1 that divides `row_bytes` and every base
//! address (layer pointers, host base); strides are multiples of `row_bytes`, so every word
//! access is aligned.

/// Kernel parameters, passed by value as the kernel's only argument. `repr(C)` with every
/// `u64` before every `u32`, matching `struct CopyParams` of the kernel source.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CopyParams {
    /// Device address of `u64[halves · total_layers]`: each layer's base pointer.
    pub dev_table: u64,
    /// Device address of `u32[num_pairs]`: device page of each pair.
    pub dev_pages: u64,
    /// Device address of `u32[num_pairs]`: host page of each pair.
    pub host_pages: u64,
    /// Device-visible address of the host pool (or of a staging buffer).
    pub host_base: u64,
    /// Host stride between K and V.
    pub host_half_stride: u64,
    /// Host stride between pages.
    pub host_page_stride: u64,
    /// Host stride between layers.
    pub host_layer_stride: u64,
    /// Host stride between tokens.
    pub host_token_stride: u64,
    /// Device stride between pages of one layer (`page_size · row_bytes`).
    pub dev_page_stride: u64,
    /// Page pairs.
    pub num_pairs: u32,
    /// First layer copied.
    pub layer_begin: u32,
    /// Layers copied.
    pub num_layers: u32,
    /// Layers in the model (row stride of `dev_table`).
    pub total_layers: u32,
    /// 2 for MHA, 1 for MLA.
    pub num_halves: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Bytes per token row.
    pub row_bytes: u32,
    /// 1: device → host; 0: host → device.
    pub to_host: u32,
    /// Rows per chunk (≥ 1, ≤ page_size).
    pub rows_per_chunk: u32,
    /// `ceil(page_size / rows_per_chunk)`.
    pub chunks_per_unit: u32,
}

impl CopyParams {
    /// Units (`pairs · halves · layers`).
    pub fn units(&self) -> u64 {
        self.num_pairs as u64 * self.num_halves as u64 * self.num_layers as u64
    }

    /// Items (`units · chunks_per_unit`).
    pub fn items(&self) -> u64 {
        self.units() * self.chunks_per_unit as u64
    }

    /// Sets `rows_per_chunk` / `chunks_per_unit` for chunks of about `chunk_bytes`.
    pub fn with_chunk_bytes(mut self, chunk_bytes: u32) -> Self {
        let rows = (chunk_bytes / self.row_bytes.max(1)).clamp(1, self.page_size.max(1));
        self.rows_per_chunk = rows;
        self.chunks_per_unit = self.page_size.div_ceil(rows);
        self
    }

    /// Largest word width (16, 8, 4, 2 or 1 bytes) that divides `row_bytes` and every address
    /// in `bases`.
    pub fn word_bytes(&self, bases: impl IntoIterator<Item = u64>) -> u32 {
        let mut align = self.row_bytes as u64 | 16;
        for b in bases {
            align |= b;
        }
        align |= self.host_base;
        1 << align.trailing_zeros().min(4)
    }
}

/// The addresses of one unit: `(device row 0, host row 0)`.
///
/// # Safety
/// `p.dev_table`, `p.dev_pages`, `p.host_pages` must be readable host addresses of the sizes
/// the params declare, and `pair`, `half`, `layer_rel` in range.
unsafe fn unit_bases(p: &CopyParams, pair: u64, half: u64, layer: u64) -> (u64, u64) {
    // SAFETY: in range per the contract.
    let (table, dpage, hpage) = unsafe {
        (
            *(p.dev_table as *const u64).add((half * p.total_layers as u64 + layer) as usize),
            *(p.dev_pages as *const u32).add(pair as usize) as u64,
            *(p.host_pages as *const u32).add(pair as usize) as u64,
        )
    };
    let dev = table + dpage * p.dev_page_stride;
    let host = p.host_base
        + half * p.host_half_stride
        + hpage * p.host_page_stride
        + layer * p.host_layer_stride;
    (dev, host)
}

/// Runs the copy of `p` on the CPU, item by item as the kernel decomposes it (module docs).
///
/// # Safety
/// Every address the params reach (table, index arrays, every device and host row of every
/// unit) must be valid host memory of this process, the sources readable, the destinations
/// writable, and no destination row may overlap a source row. The transfer engine checks
/// this before it queues a copy.
pub unsafe fn copy_reference(p: &CopyParams) {
    let units = p.units();
    let r = p.row_bytes as u64;
    for item in 0..p.items() {
        let unit = item / p.chunks_per_unit as u64;
        let chunk = item % p.chunks_per_unit as u64;
        debug_assert!(unit < units);
        let layer_rel = unit % p.num_layers as u64;
        let t = unit / p.num_layers as u64;
        let half = t % p.num_halves as u64;
        let pair = t / p.num_halves as u64;
        let layer = p.layer_begin as u64 + layer_rel;
        // SAFETY: indices in range by construction; memory valid per the contract.
        let (dev, host) = unsafe { unit_bases(p, pair, half, layer) };
        let row0 = chunk * p.rows_per_chunk as u64;
        let rows = (p.rows_per_chunk as u64).min(p.page_size as u64 - row0);
        if p.host_token_stride == r {
            // Rows adjacent on both sides: the chunk is one run (same bytes, fewer calls).
            let (d, h) = (dev + row0 * r, host + row0 * r);
            let (src, dst) = if p.to_host != 0 { (d, h) } else { (h, d) };
            // SAFETY: the chunk's rows are valid and disjoint per the contract.
            unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, (rows * r) as usize)
            };
            continue;
        }
        for row in row0..row0 + rows {
            let d = dev + row * r;
            let h = host + row * p.host_token_stride;
            let (src, dst) = if p.to_host != 0 { (d, h) } else { (h, d) };
            // SAFETY: both rows valid and disjoint per the contract.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, r as usize) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_the_kernel_struct() {
        // 9 u64 + 10 u32, no padding.
        assert_eq!(std::mem::size_of::<CopyParams>(), 9 * 8 + 10 * 4);
        assert_eq!(std::mem::align_of::<CopyParams>(), 8);
    }

    #[test]
    fn word_width_follows_alignment() {
        let p = CopyParams {
            row_bytes: 2048,
            host_base: 4096,
            ..Default::default()
        };
        assert_eq!(p.word_bytes([256u64, 512]), 16);
        assert_eq!(p.word_bytes([256u64, 8]), 8);
        let odd = CopyParams {
            row_bytes: 6,
            host_base: 4096,
            ..Default::default()
        };
        assert_eq!(odd.word_bytes([256u64]), 2);
        let one = CopyParams {
            row_bytes: 3,
            ..Default::default()
        };
        assert_eq!(one.word_bytes([]), 1);
    }

    #[test]
    fn chunks_cover_the_page() {
        let p = CopyParams {
            row_bytes: 2048,
            page_size: 64,
            ..Default::default()
        }
        .with_chunk_bytes(16 << 10);
        assert_eq!((p.rows_per_chunk, p.chunks_per_unit), (8, 8));
        let q = CopyParams {
            row_bytes: 1152,
            page_size: 5,
            ..Default::default()
        }
        .with_chunk_bytes(4096);
        assert_eq!((q.rows_per_chunk, q.chunks_per_unit), (3, 2));
        let big = CopyParams {
            row_bytes: 1 << 20,
            page_size: 2,
            ..Default::default()
        }
        .with_chunk_bytes(4096);
        assert_eq!((big.rows_per_chunk, big.chunks_per_unit), (1, 2));
    }
}
