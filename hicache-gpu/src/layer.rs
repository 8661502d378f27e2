//! [`LayerDoneCounter`]: lets the engine's attention for layer `i` wait for layer `i` of the
//! current batch's load, and nothing more.
//!
//! Like SGLang's, it is a ring of per-layer event sets with a producer index (the controller
//! publishes each batch's [`LoadHandle`]) and a consumer index (the forward pass selects which
//! published load its layers wait on). A ring of depth ≥ 2 lets the next batch's load be
//! queued while the current batch still computes (overlap scheduling); SGLang uses 3.
//!
//! Invariants:
//! 1. A slot is reused only after the load it held has completed; publishing into a slot whose
//!    load is still in flight is an error ([`GpuError::InvalidConfig`] naming the slot), where
//!    SGLang asserts.
//! 2. Without a consumer, waits are no-ops (nothing was loaded for this batch).
//! 3. Producer ids are the ring positions `0..depth`; a consumer id must name a slot that holds
//!    a load.

use parking_lot::Mutex;

use crate::device::Stream;
use crate::error::{GpuError, Result};
use crate::transfer::LoadHandle;

struct Ring {
    slots: Vec<Option<LoadHandle>>,
    next: usize,
    consumer: Option<usize>,
}

/// Ring of per-layer load events (see the module docs).
pub struct LayerDoneCounter {
    num_layers: usize,
    ring: Mutex<Ring>,
}

impl std::fmt::Debug for LayerDoneCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.ring.lock();
        f.debug_struct("LayerDoneCounter")
            .field("num_layers", &self.num_layers)
            .field("depth", &r.slots.len())
            .field("next", &r.next)
            .field("consumer", &r.consumer)
            .finish()
    }
}

impl LayerDoneCounter {
    /// SGLang's ring depth.
    pub const DEFAULT_DEPTH: usize = 3;

    /// A counter for `num_layers` layers with a ring of `depth` (≥ 1) slots.
    pub fn new(num_layers: usize, depth: usize) -> Result<Self> {
        if depth == 0 || num_layers == 0 {
            return Err(GpuError::InvalidConfig(format!(
                "LayerDoneCounter needs at least one layer and one slot (got {num_layers} \
                 layers, depth {depth})"
            )));
        }
        Ok(Self {
            num_layers,
            ring: Mutex::new(Ring {
                slots: vec![None; depth],
                next: 0,
                consumer: None,
            }),
        })
    }

    /// Layers per load.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Publishes a load into the next slot and returns its producer id (invariant 1).
    pub fn publish(&self, load: LoadHandle) -> Result<usize> {
        if load.num_layers() != self.num_layers {
            return Err(GpuError::LengthMismatch {
                what: "load layers vs counter layers",
                left: load.num_layers(),
                right: self.num_layers,
            });
        }
        let mut r = self.ring.lock();
        let id = r.next;
        if let Some(old) = &r.slots[id]
            && !old.is_done()?
        {
            return Err(GpuError::InvalidConfig(format!(
                "LayerDoneCounter slot {id} still holds a load in flight (ring depth {} too \
                 small for the overlap in use)",
                r.slots.len()
            )));
        }
        r.slots[id] = Some(load);
        r.next = (id + 1) % r.slots.len();
        Ok(id)
    }

    /// Selects the load the following waits refer to (invariant 3).
    pub fn set_consumer(&self, producer_id: usize) -> Result<()> {
        let mut r = self.ring.lock();
        if r.slots.get(producer_id).is_none_or(Option::is_none) {
            return Err(GpuError::InvalidConfig(format!(
                "LayerDoneCounter has no load in slot {producer_id}"
            )));
        }
        r.consumer = Some(producer_id);
        Ok(())
    }

    /// Forgets the consumer: waits become no-ops (a batch with nothing loaded).
    pub fn reset_consumer(&self) {
        self.ring.lock().consumer = None;
    }

    fn consumer_load(&self, layer: usize) -> Result<Option<LoadHandle>> {
        if layer >= self.num_layers {
            return Err(GpuError::LayerOutOfRange {
                begin: layer as u32,
                end: layer as u32 + 1,
                layers: self.num_layers as u32,
            });
        }
        let r = self.ring.lock();
        Ok(r.consumer.and_then(|c| r.slots[c].clone()))
    }

    /// Makes `stream` (the engine's compute stream) wait on the device for layer `layer` of
    /// the consumer's load; no-op without a consumer.
    pub fn stream_wait(&self, stream: &Stream, layer: usize) -> Result<()> {
        match self.consumer_load(layer)? {
            Some(l) => l.stream_wait_layer(stream, layer),
            None => Ok(()),
        }
    }

    /// Blocks the calling thread until layer `layer` of the consumer's load has arrived;
    /// no-op without a consumer.
    pub fn wait_until(&self, layer: usize) -> Result<()> {
        match self.consumer_load(layer)? {
            Some(l) => l.wait_layer(layer),
            None => Ok(()),
        }
    }

    /// Whether layer `layer` of the consumer's load has arrived (true without a consumer).
    pub fn is_ready(&self, layer: usize) -> Result<bool> {
        match self.consumer_load(layer)? {
            Some(l) => l.is_layer_done(layer),
            None => Ok(true),
        }
    }
}
