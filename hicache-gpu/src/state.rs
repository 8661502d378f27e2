//! [`StatePool`]: device memory of Mamba / linear-attention states, one state per
//! [`StateSlot`], with a slot allocator.
//!
//! Device layout (SGLang's device `MambaPool`): each piece of a state (the temporal (SSM)
//! state when it has elements, then each conv piece, as [`MambaShape::piece_bytes`] lists
//! them) is its own buffer `[layer][slot][piece_layer_bytes]`, so layer `l` of piece `p` of
//! slot `s` is the `piece_layer_bytes(p)` bytes at `piece_ptr(p, l) + s·piece_layer_bytes(p)`
//! and an engine's kernels index a layer's states by slot.
//!
//! Invariants:
//! 1. The flat bytes of a slot ([`StatePool::read_slot`] / [`StatePool::write_slot`]) are the
//!    host pool's ([`MambaPool::get_slot`](hicache_host::MambaPool::get_slot)): for each
//!    piece in order, its layers in order. A device slot and a host slot holding the same
//!    state read back equal.
//! 2. Every access names an allocated slot of this pool; anything else is an error before a
//!    byte is touched.
//! 3. A slot's bytes have one user at a time, the holder of its [`StateSlot`]; synchronous
//!    reads and writes must not race a transfer queued on the same slot.

use std::fmt;

use hicache_host::{MambaShape, PageAllocator, Slot};
use parking_lot::Mutex;

use crate::device::{Device, DeviceBuffer};
use crate::error::{GpuError, Result};

/// A state slot of a [`StatePool`] (device memory of one Mamba state).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StateSlot(pub u32);

impl fmt::Display for StateSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "state slot {}", self.0)
    }
}

impl Slot for StateSlot {
    fn from_index(index: u32) -> Self {
        StateSlot(index)
    }
    fn index(self) -> u32 {
        self.0
    }
}

/// One piece's buffer: `[layer][slot][layer_bytes]`.
struct Piece {
    buf: DeviceBuffer,
    layer_bytes: usize,
}

/// Device memory for the Mamba states of `num_slots` slots (see the module docs).
pub struct StatePool {
    device: Device,
    shape: MambaShape,
    slots: usize,
    pieces: Vec<Piece>,
    allocator: Mutex<PageAllocator<StateSlot>>,
}

impl fmt::Debug for StatePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatePool")
            .field("shape", &self.shape)
            .field("slots", &self.slots)
            .field("available", &self.available())
            .finish()
    }
}

impl StatePool {
    /// Allocates zeroed device memory for `slots` states of `shape` on `device`.
    ///
    /// Errors: an invalid shape, 0 slots or more than `u32::MAX`, sizes that overflow, or a
    /// failed device allocation.
    pub fn new(device: &Device, shape: &MambaShape, slots: usize) -> Result<Self> {
        shape.validate()?;
        if slots == 0 || slots > u32::MAX as usize {
            return Err(GpuError::InvalidConfig(format!(
                "{slots} state slots (1 to 2^32 - 1)"
            )));
        }
        let layers = shape.layers as usize;
        let pieces = shape
            .piece_bytes()
            .into_iter()
            .map(|bytes| {
                // Exact: a piece is `elems · dtype · layers` bytes.
                let layer_bytes = bytes / layers;
                let total = bytes.checked_mul(slots).ok_or_else(|| {
                    GpuError::InvalidConfig(format!("{slots} state slots of {shape:?} overflow"))
                })?;
                Ok(Piece {
                    buf: device.alloc_zeroed(total)?,
                    layer_bytes,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            device: device.clone(),
            shape: shape.clone(),
            slots,
            pieces,
            allocator: Mutex::new(PageAllocator::new(slots)),
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The state geometry.
    pub fn shape(&self) -> &MambaShape {
        &self.shape
    }

    /// Slots in the pool.
    pub fn num_slots(&self) -> usize {
        self.slots
    }

    /// Bytes of one state (all pieces and layers; the host pool's slot size).
    pub fn slot_bytes(&self) -> usize {
        self.pieces
            .iter()
            .map(|p| p.layer_bytes * self.shape.layers as usize)
            .sum()
    }

    /// Pieces of a state (temporal when it has elements, then each conv piece).
    pub fn num_pieces(&self) -> usize {
        self.pieces.len()
    }

    /// Bytes of one layer of piece `piece` of one slot, or `None` for a piece out of range.
    pub fn piece_layer_bytes(&self, piece: usize) -> Option<usize> {
        self.pieces.get(piece).map(|p| p.layer_bytes)
    }

    /// Slots free now.
    pub fn available(&self) -> usize {
        self.allocator.lock().available()
    }

    /// `n` free slots, or `None` when fewer are free (nothing changes then).
    pub fn alloc(&self, n: usize) -> Option<Vec<StateSlot>> {
        self.allocator.lock().alloc(n)
    }

    /// Frees slots; all-or-nothing: a double free or a slot out of range is an error naming
    /// the slot, and frees nothing.
    pub fn free(&self, slots: &[StateSlot]) -> Result<()> {
        Ok(self.allocator.lock().free(slots)?)
    }

    /// Whether `slot` is allocated now (false out of range).
    pub fn is_allocated(&self, slot: StateSlot) -> bool {
        self.allocator.lock().is_allocated(slot)
    }

    /// Device address of slot 0 of layer `layer` of piece `piece` (for an engine's kernels:
    /// slot `s` is at `+ s·piece_layer_bytes(piece)`), or an error out of range.
    pub fn try_piece_ptr(&self, piece: usize, layer: usize) -> Result<u64> {
        let layers = self.shape.layers as usize;
        match self.pieces.get(piece) {
            Some(p) if layer < layers => {
                Ok(p.buf.addr() + (layer * self.slots * p.layer_bytes) as u64)
            }
            Some(_) => Err(GpuError::LayerOutOfRange {
                begin: layer as u32,
                end: layer as u32 + 1,
                layers: layers as u32,
            }),
            None => Err(GpuError::InvalidConfig(format!(
                "piece {piece} of a state of {} pieces",
                self.pieces.len()
            ))),
        }
    }

    /// Device address of slot 0 of layer `layer` of piece `piece` (see
    /// [`StatePool::try_piece_ptr`]).
    ///
    /// # Panics
    /// When `piece` or `layer` is out of range.
    pub fn piece_ptr(&self, piece: usize, layer: usize) -> u64 {
        self.try_piece_ptr(piece, layer)
            .unwrap_or_else(|e| panic!("StatePool::piece_ptr: {e}"))
    }

    /// Checks that every slot of `slots` is in range and allocated (invariant 2).
    pub(crate) fn check_slots(&self, slots: &[StateSlot]) -> Result<()> {
        let alloc = self.allocator.lock();
        check_allocated("device state", slots, self.slots, |s| alloc.is_allocated(s))
    }

    /// `(device address, bytes)` of layer `layer` of piece `piece` of `slot`, for each piece
    /// and layer in flat order (invariant 1). The slot must be checked.
    pub(crate) fn slot_rows(&self, slot: StateSlot) -> impl Iterator<Item = (u64, usize)> + '_ {
        let layers = self.shape.layers as usize;
        (0..self.pieces.len()).flat_map(move |p| (0..layers).map(move |l| self.row(p, l, slot)))
    }

    /// `(device address, bytes)` of layer `layer` of piece `piece` of `slot`. Piece, layer and
    /// slot must be in range (checked by the caller).
    pub(crate) fn row(&self, piece: usize, layer: usize, slot: StateSlot) -> (u64, usize) {
        let p = &self.pieces[piece];
        let offset = (layer * self.slots + slot.0 as usize) * p.layer_bytes;
        (p.buf.addr() + offset as u64, p.layer_bytes)
    }

    /// Copies slot `slot` in flat order (invariant 1) into `dst`, exactly one slot long
    /// (synchronous; no queued transfer may be writing the slot).
    pub fn read_slot(&self, slot: StateSlot, dst: &mut [u8]) -> Result<()> {
        self.check_access(slot, dst.len())?;
        let mut at = 0;
        for (addr, len) in self.slot_rows(slot) {
            // SAFETY: a row of a checked slot, inside its piece's buffer.
            unsafe { self.device.read_raw(addr, &mut dst[at..at + len])? };
            at += len;
        }
        Ok(())
    }

    /// Writes slot `slot` from `src` in flat order, exactly one slot long (synchronous; no
    /// queued transfer may be using the slot).
    pub fn write_slot(&self, slot: StateSlot, src: &[u8]) -> Result<()> {
        self.check_access(slot, src.len())?;
        let mut at = 0;
        for (addr, len) in self.slot_rows(slot) {
            // SAFETY: a row of a checked slot, inside its piece's buffer.
            unsafe { self.device.write_raw(addr, &src[at..at + len])? };
            at += len;
        }
        Ok(())
    }

    fn check_access(&self, slot: StateSlot, len: usize) -> Result<()> {
        self.check_slots(&[slot])?;
        if len != self.slot_bytes() {
            return Err(GpuError::LengthMismatch {
                what: "buffer bytes vs state slot bytes",
                left: len,
                right: self.slot_bytes(),
            });
        }
        Ok(())
    }
}

/// Checks that every slot of `slots` is below `capacity` and allocated; errors name the first
/// slot that is not, and its position.
pub(crate) fn check_allocated<S: Slot>(
    pool: &'static str,
    slots: &[S],
    capacity: usize,
    is_allocated: impl Fn(S) -> bool,
) -> Result<()> {
    for (position, &s) in slots.iter().enumerate() {
        let slot = s.index();
        if slot as usize >= capacity {
            return Err(GpuError::PageOutOfRange {
                pool,
                page: slot,
                position,
                capacity,
            });
        }
        if !is_allocated(s) {
            return Err(GpuError::SlotNotAllocated {
                pool,
                slot,
                position,
            });
        }
    }
    Ok(())
}
