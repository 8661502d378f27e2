//! [`MambaPool`]: the host pool of Mamba / linear-attention states, one state per slot, with
//! SGLang's `MambaPoolHost` geometry (page size 1, `page_first` / `page_first_direct`).
//!
//! A slot holds, for every linear-attention layer, one temporal (SSM) state and one state of
//! each conv piece, with their own dtypes. As in SGLang, each piece kind is its own array,
//! slot-major: `temporal[slot][layer][elems]`, then `conv_j[slot][layer][elems]` for every
//! conv piece `j`, so one slot is one contiguous run per piece kind. SGLang keeps these
//! arrays as separate buffers; here they are consecutive, 4 KiB-aligned ranges of one
//! [`HostMemory`] mapping, so the pool is one region to register.
//!
//! Invariant 1 (SGLang's flat data page, `get_data_page`): the flat bytes of a slot are its
//! pieces concatenated in order: temporal (omitted when a layer's temporal state has no
//! elements, as SGLang omits it), then conv 0, 1, ...; [`MambaPool::slot_iovecs`] lists them
//! in that order and [`MambaPool::get_slot`] / [`MambaPool::set_slot`] copy exactly them.
//!
//! Ownership rules are [`HostPool`](crate::HostPool)'s: a slot's bytes have one user at a
//! time, the holder of its [`MambaSlot`].

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use hicache_core::{DType, LayoutKind, MemoryRegion, PoolFingerprint};
use parking_lot::Mutex;

use crate::alloc::{PageAllocator, Slot};
use crate::error::{HostError, Result};
use crate::memory::{HostMemory, HugePagePolicy, Populate};
use crate::pool::{self, IoVec, PoolSize};

/// Alignment of each piece array inside the mapping.
const ARRAY_ALIGN: usize = 4096;

/// A state slot of a [`MambaPool`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MambaSlot(pub u32);

impl fmt::Display for MambaSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "mamba slot {}", self.0)
    }
}

impl Slot for MambaSlot {
    fn from_index(index: u32) -> Self {
        MambaSlot(index)
    }
    fn index(self) -> u32 {
        self.0
    }
}

/// The geometry of one Mamba state (SGLang's `MambaStateBufferInfo` per slot).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MambaShape {
    /// Linear-attention layers (SGLang's `num_mamba_layers`, draft layers included).
    pub layers: u32,
    /// Elements of one layer's temporal (SSM) state; 0 for conv-only models.
    pub temporal_elems: u64,
    /// Element type of the temporal state.
    pub temporal_dtype: DType,
    /// Elements of one layer's state of each conv piece (at least one).
    pub conv_elems: Vec<u64>,
    /// Element type of the conv states.
    pub conv_dtype: DType,
}

impl MambaShape {
    /// Checks the shape: at least one layer and one conv piece, no empty conv piece, and a
    /// slot that fits in memory.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: &str| Err(HostError::BadMambaShape(format!("{why}: {self:?}")));
        if self.layers == 0 {
            return bad("no layers");
        }
        if self.conv_elems.is_empty() || self.conv_elems.contains(&0) {
            return bad("every Mamba state needs conv pieces of at least one element");
        }
        let total = self
            .pieces_u64()
            .try_fold(0u64, |acc, p| acc.checked_add(p?));
        match total {
            Some(t) if usize::try_from(t).is_ok() => Ok(()),
            _ => bad("slot size overflows"),
        }
    }

    fn pieces_u64(&self) -> impl Iterator<Item = Option<u64>> + '_ {
        let l = u64::from(self.layers);
        let piece =
            move |elems: u64, dtype: DType| elems.checked_mul(l)?.checked_mul(dtype.size() as u64);
        let temporal =
            (self.temporal_elems > 0).then(|| piece(self.temporal_elems, self.temporal_dtype));
        temporal.into_iter().chain(
            self.conv_elems
                .iter()
                .map(move |&c| piece(c, self.conv_dtype)),
        )
    }

    /// Bytes of each piece of one slot (all layers), in flat order: temporal (when it has
    /// elements), then each conv piece. Call on a validated shape.
    pub fn piece_bytes(&self) -> Vec<usize> {
        self.pieces_u64()
            .map(|p| p.unwrap_or(u64::MAX) as usize)
            .collect()
    }

    /// Bytes of one slot (its flat data page).
    pub fn slot_bytes(&self) -> usize {
        self.piece_bytes().iter().sum()
    }

    /// The storage fingerprint of a pool of this shape (SGLang's `MambaPoolHost` as the
    /// Python package names it), for its L3 namespace.
    pub fn fingerprint(&self, layout: LayoutKind) -> PoolFingerprint {
        PoolFingerprint::mamba(
            layout,
            self.layers,
            self.temporal_elems,
            self.temporal_dtype,
            &self.conv_elems,
            self.conv_dtype,
        )
    }
}

/// Everything needed to build a [`MambaPool`].
#[derive(Clone, Debug, PartialEq)]
pub struct MambaPoolConfig {
    /// State geometry.
    pub shape: MambaShape,
    /// `page_first` or `page_first_direct` (SGLang refuses `layer_first` for Mamba state; both
    /// arrange a slot's bytes the same way).
    pub layout: LayoutKind,
    /// Slots: exactly [`PoolSize::Pages`], or by bytes / ratio over the device slots as
    /// SGLang sizes `MambaPoolHost` (page size 1, plus one slot).
    pub size: PoolSize,
    /// Huge page policy.
    pub huge_pages: HugePagePolicy,
    /// When the pool's memory is populated (see [`HostPoolConfig::populate`]).
    ///
    /// [`HostPoolConfig::populate`]: crate::HostPoolConfig::populate
    pub populate: Populate,
}

impl MambaPoolConfig {
    /// A `page_first` config with the default huge page policy.
    pub fn new(shape: MambaShape, size: PoolSize) -> Self {
        Self {
            shape,
            layout: LayoutKind::PageFirst,
            size,
            huge_pages: HugePagePolicy::Auto,
            populate: Populate::Now,
        }
    }

    /// Sets when the pool's memory is populated.
    pub fn populate(mut self, populate: Populate) -> Self {
        self.populate = populate;
        self
    }

    /// Slots of the pool, checked (valid shape and layout, a slot count that fits).
    pub fn slots(&self) -> Result<usize> {
        self.shape.validate()?;
        if self.layout == LayoutKind::LayerFirst {
            return Err(HostError::BadMambaShape(
                "Mamba state pools support page_first and page_first_direct, not layer_first \
                 (as SGLang's MambaPoolHost)"
                    .into(),
            ));
        }
        let slots = self.size.units(self.shape.slot_bytes() as u64, 1)?;
        if slots == 0 || slots > u32::MAX as usize {
            return Err(HostError::BadSize(format!(
                "{slots} Mamba slots (1 to 2^32 - 1)"
            )));
        }
        Ok(slots)
    }

    /// Bytes the pool maps for `slots` slots, or `None` on overflow.
    pub fn mapped_bytes(&self, slots: usize) -> Option<usize> {
        self.shape.piece_bytes().iter().try_fold(0usize, |acc, &p| {
            acc.checked_add(p.checked_mul(slots)?)?
                .checked_next_multiple_of(ARRAY_ALIGN)
        })
    }
}

/// The host pool of Mamba states (see the module docs).
pub struct MambaPool {
    shape: MambaShape,
    layout: LayoutKind,
    slots: usize,
    /// Bytes of each piece of a slot, and where its array starts in the mapping.
    pieces: Vec<(usize, usize)>,
    memory: HostMemory,
    allocator: Mutex<PageAllocator<MambaSlot>>,
    cuda_registered: AtomicBool,
}

impl fmt::Debug for MambaPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MambaPool")
            .field("shape", &self.shape)
            .field("slots", &self.slots)
            .field("available", &self.available())
            .finish()
    }
}

impl MambaPool {
    /// Sizes and maps a pool. The RAM check is the caller's (the [`HostPoolGroup`]'s, over
    /// the whole group).
    ///
    /// [`HostPoolGroup`]: crate::HostPoolGroup
    pub fn new(config: MambaPoolConfig) -> Result<Self> {
        let slots = config.slots()?;
        let total = config.mapped_bytes(slots).ok_or_else(|| {
            HostError::BadSize(format!(
                "{slots} Mamba slots of {:?} overflow",
                config.shape
            ))
        })?;
        let mut at = 0;
        let pieces = config
            .shape
            .piece_bytes()
            .into_iter()
            .map(|bytes| {
                let start = at;
                // Cannot overflow: mapped_bytes computed the same sums.
                at = (at + bytes * slots).next_multiple_of(ARRAY_ALIGN);
                (bytes, start)
            })
            .collect();
        let memory = HostMemory::with_population(total, config.huge_pages, config.populate)?;
        tracing::info!(slots, bytes = total, "mamba host pool mapped");
        Ok(Self {
            shape: config.shape,
            layout: config.layout,
            slots,
            pieces,
            memory,
            allocator: Mutex::new(PageAllocator::new(slots)),
            cuda_registered: AtomicBool::new(false),
        })
    }

    /// The state geometry.
    pub fn shape(&self) -> &MambaShape {
        &self.shape
    }

    /// The layout (`page_first` or `page_first_direct`).
    pub fn layout_kind(&self) -> LayoutKind {
        self.layout
    }

    /// Slots in the pool.
    pub fn num_slots(&self) -> usize {
        self.slots
    }

    /// Bytes of one slot (its flat data page).
    pub fn slot_bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.0).sum()
    }

    /// The backing mapping.
    pub fn memory(&self) -> &HostMemory {
        &self.memory
    }

    /// The whole mapping as a [`MemoryRegion`], for io_uring / RDMA / CUDA registration.
    pub fn region(&self) -> MemoryRegion {
        pool::region_of(&self.memory, &self.cuda_registered)
    }

    /// Records whether the region is page-locked with CUDA (see
    /// [`HostPool::set_cuda_registered`](crate::HostPool::set_cuda_registered)).
    pub fn set_cuda_registered(&self, registered: bool) {
        self.cuda_registered.store(registered, Ordering::Release);
    }

    /// `n` free slots, or `None` when fewer are free.
    pub fn alloc(&self, n: usize) -> Option<Vec<MambaSlot>> {
        self.allocator.lock().alloc(n)
    }

    /// Frees slots; all-or-nothing, double frees are errors naming the slot.
    pub fn free(&self, slots: &[MambaSlot]) -> Result<()> {
        Ok(self.allocator.lock().free(slots)?)
    }

    /// Slots free now.
    pub fn available(&self) -> usize {
        self.allocator.lock().available()
    }

    /// Whether `slot` is allocated now.
    pub fn is_allocated(&self, slot: MambaSlot) -> bool {
        self.allocator.lock().is_allocated(slot)
    }

    /// Checks that `slot` is a slot of this pool.
    pub fn check_slot(&self, slot: MambaSlot) -> Result<()> {
        if (slot.0 as usize) < self.slots {
            Ok(())
        } else {
            Err(HostError::PageOutOfRange {
                page: slot.0,
                capacity: self.slots,
            })
        }
    }

    /// The iovecs of one slot: one per piece, in flat order (invariant 1).
    pub fn slot_iovecs(&self, slot: MambaSlot) -> Result<Vec<IoVec>> {
        let mut v = Vec::with_capacity(self.pieces.len());
        self.extend_iovecs(&[slot], &mut v)?;
        Ok(v)
    }

    /// Appends the iovecs of every slot of `slots`, slot after slot, to `out`. Checks every
    /// slot first; on error `out` is unchanged.
    pub fn extend_iovecs(&self, slots: &[MambaSlot], out: &mut Vec<IoVec>) -> Result<()> {
        for &s in slots {
            self.check_slot(s)?;
        }
        let base = self.memory.as_ptr() as usize;
        out.reserve(slots.len() * self.pieces.len());
        for &s in slots {
            out.extend(self.pieces.iter().map(|&(len, start)| IoVec {
                addr: base + start + s.0 as usize * len,
                len,
            }));
        }
        Ok(())
    }

    /// Pieces per slot (temporal when it has elements, then each conv piece).
    pub fn pieces_per_slot(&self) -> usize {
        self.pieces.len()
    }

    /// The bytes of layer `layer` of piece `piece` of slot `slot` (one layer's state, for
    /// per-layer transfers to and from the device; SGLang's `[slot][layer][1][shape]` row).
    pub fn layer_iovec(&self, slot: MambaSlot, piece: usize, layer: usize) -> Result<IoVec> {
        self.check_slot(slot)?;
        let (len, start) = *self.pieces.get(piece).ok_or(HostError::PartOutOfRange {
            part: piece,
            parts: self.pieces.len(),
        })?;
        let layers = self.shape.layers as usize;
        if layer >= layers {
            return Err(HostError::BadMambaShape(format!(
                "layer {layer} of a state of {layers} layers"
            )));
        }
        let row = len / layers;
        Ok(IoVec {
            addr: self.memory.as_ptr() as usize + start + slot.0 as usize * len + layer * row,
            len: row,
        })
    }

    /// Copies slot `slot` in flat order into `dst` (exactly one slot long).
    pub fn get_slot(&self, slot: MambaSlot, dst: &mut [u8]) -> Result<()> {
        pool::check_buffer("get_slot", dst.len(), self.slot_bytes())?;
        let iovs = self.slot_iovecs(slot)?;
        // SAFETY: the iovecs lie inside the mapping (checked slot); dst is a distinct buffer of
        // the slot's length; the slot has one user (module ownership rule).
        unsafe { pool::gather(&iovs, dst) };
        Ok(())
    }

    /// Writes slot `slot` from `src` in flat order (exactly one slot long).
    pub fn set_slot(&self, slot: MambaSlot, src: &[u8]) -> Result<()> {
        pool::check_buffer("set_slot", src.len(), self.slot_bytes())?;
        let iovs = self.slot_iovecs(slot)?;
        // SAFETY: as in get_slot, with the copy reversed.
        unsafe { pool::scatter(&iovs, src) };
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The shape of `bindings/python/tests/sglang_pools.py::mamba_pool()`: 2 layers, temporal
    /// (4, 8) f32, convs (6, 3) and (5,) bf16.
    pub(crate) fn shape() -> MambaShape {
        MambaShape {
            layers: 2,
            temporal_elems: 32,
            temporal_dtype: DType::F32,
            conv_elems: vec![18, 5],
            conv_dtype: DType::Bf16,
        }
    }

    #[test]
    fn geometry_matches_sglang() {
        let s = shape();
        // The pieces SGLang's get_page_buffer_meta gives for this pool: 256, 72, 20.
        assert_eq!(s.piece_bytes(), vec![256, 72, 20]);
        assert_eq!(s.slot_bytes(), 348);
        assert!(
            s.fingerprint(LayoutKind::PageFirst)
                .render()
                .contains("pieces=256,72,20")
        );
        let conv_only = MambaShape {
            temporal_elems: 0,
            ..shape()
        };
        assert_eq!(conv_only.piece_bytes(), vec![72, 20]);
        // SGLang: host slots = int(device_capacity * ratio) + 1.
        let ratio = PoolSize::Ratio {
            ratio: 2.0,
            device_pages: 8,
        };
        assert_eq!(MambaPoolConfig::new(s.clone(), ratio).slots().unwrap(), 17);
        let bytes = MambaPoolConfig::new(s.clone(), PoolSize::Bytes(348 * 10 + 5));
        assert_eq!(bytes.slots().unwrap(), 11);
    }

    #[test]
    fn bad_shapes_and_layouts_are_refused() {
        for bad in [
            MambaShape {
                layers: 0,
                ..shape()
            },
            MambaShape {
                conv_elems: vec![],
                ..shape()
            },
            MambaShape {
                conv_elems: vec![4, 0],
                ..shape()
            },
            MambaShape {
                temporal_elems: u64::MAX,
                ..shape()
            },
        ] {
            let e = MambaPoolConfig::new(bad, PoolSize::Pages(2)).slots();
            assert!(matches!(e, Err(HostError::BadMambaShape(_))), "{e:?}");
        }
        let mut c = MambaPoolConfig::new(shape(), PoolSize::Pages(2));
        c.layout = LayoutKind::LayerFirst;
        assert!(c.slots().unwrap_err().to_string().contains("layer_first"));
    }

    #[test]
    fn slots_round_trip_and_stay_apart() {
        let pool = MambaPool::new(MambaPoolConfig::new(shape(), PoolSize::Pages(4))).unwrap();
        let data: Vec<u8> = (0..348).map(|i| (i * 5 + 1) as u8).collect();
        pool.set_slot(MambaSlot(2), &data).unwrap();
        let mut back = vec![0; 348];
        pool.get_slot(MambaSlot(2), &mut back).unwrap();
        assert_eq!(back, data);
        for s in [1, 3] {
            pool.get_slot(MambaSlot(s), &mut back).unwrap();
            assert!(back.iter().all(|&b| b == 0), "slot {s} touched");
        }
        // Layer 1 of conv piece 0 of slot 2: bytes 256 + 36 .. 256 + 72 of the flat slot.
        let row = pool.layer_iovec(MambaSlot(2), 1, 1).unwrap();
        assert_eq!(row.len, 36);
        // SAFETY: inside the pool's mapping; nothing writes slot 2 while this reads.
        let got = unsafe { std::slice::from_raw_parts(row.as_ptr(), row.len) };
        assert_eq!(got, &data[292..328]);
        assert!(pool.layer_iovec(MambaSlot(2), 3, 0).is_err());
        assert!(pool.layer_iovec(MambaSlot(2), 0, 2).is_err());
        let iovs = pool.slot_iovecs(MambaSlot(3)).unwrap();
        assert_eq!(
            iovs.iter().map(|v| v.len).collect::<Vec<_>>(),
            vec![256, 72, 20]
        );
        assert!(matches!(
            pool.get_slot(MambaSlot(4), &mut back),
            Err(HostError::PageOutOfRange { page: 4, .. })
        ));
        assert!(matches!(
            pool.set_slot(MambaSlot(0), &data[1..]),
            Err(HostError::BufferSize { .. })
        ));
    }
}
