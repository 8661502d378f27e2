//! [`StateTransfer`]: moves Mamba states between a [`StatePool`] (device) and a [`MambaPool`]
//! (host), and copies states between device slots.
//!
//! - `backup` (D2H) copies whole states on the **write stream** and returns a [`Completion`].
//! - `load` (H2D) copies layer by layer on the **load stream**, recording one event per Mamba
//!   layer (a [`LoadHandle`]), as [`TransferEngine::load`](crate::TransferEngine::load) does.
//! - `copy_slot` (D2D) copies one state into another device slot on the load stream: the
//!   copy-on-write of a matched state into a request's own slot.
//!
//! Every copy is a DMA copy (`cuMemcpyAsync`-family; the sim device copies on the stream's
//! worker thread): one per piece, layer and slot, with copies that continue each other on both
//! sides merged into one ([`plan::push_linear`]). A state's row on the host is
//! `[slot][layer]` per piece and on the device `[layer][slot]`, so rows merge when a pool has
//! one layer (consecutive slots) or the device pool one slot (consecutive layers).
//!
//! Validation before anything is queued (nothing is written on error): equal list lengths,
//! every slot in range of its pool *and allocated there*, no destination slot twice, and for
//! `copy_slot` distinct slots; at construction, pools of the same shape.
//!
//! Ordering: each call waits (on the device) for the events in `after` before it reads its
//! source. Calls on one stream run in call order (a `copy_slot` after a `load` of its source
//! sees the loaded state); across the two streams the caller orders them, passing the event
//! of the earlier transfer (e.g. a backup of a slot that `copy_slot` just wrote waits for the
//! copy's [`Completion::event`]). Dropping the transfer synchronises both streams, so
//! in-flight copies never outlive the pools and the registration they use.

use std::sync::Arc;

use hicache_host::{MambaPool, MambaSlot};

use crate::device::{Device, Event, Stream};
use crate::error::{GpuError, Result};
use crate::plan::{self, DeviceCopy, Direction, MemcpyOp};
use crate::registration::StateRegistration;
use crate::state::{StatePool, StateSlot, check_allocated};
use crate::transfer::{Completion, LoadHandle};

/// Moves states between a [`StatePool`] and a registered [`MambaPool`] (module docs).
pub struct StateTransfer {
    device: Device,
    pool: Arc<StatePool>,
    host: Arc<StateRegistration>,
    write_stream: Stream,
    load_stream: Stream,
}

impl std::fmt::Debug for StateTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateTransfer")
            .field("device", &self.device)
            .field("pool", &self.pool)
            .finish()
    }
}

impl StateTransfer {
    /// A transfer between `pool` and `host`, registering `host`'s memory with the device
    /// (CUDA: page-locked for DMA; one registration per host pool, so build one
    /// `StateTransfer` per pool or share a registration with
    /// [`StateTransfer::with_registration`]).
    ///
    /// Errors: pools of different shapes ([`GpuError::StateShapeMismatch`]), a refused
    /// registration.
    pub fn new(pool: Arc<StatePool>, host: Arc<MambaPool>) -> Result<Self> {
        check_shapes(&pool, &host)?;
        let reg = StateRegistration::new(pool.device(), host)?;
        Self::with_registration(pool, reg)
    }

    /// A transfer over an existing registration of the host pool.
    ///
    /// Errors: pools of different shapes, a registration with another device.
    pub fn with_registration(pool: Arc<StatePool>, host: Arc<StateRegistration>) -> Result<Self> {
        check_shapes(&pool, host.pool())?;
        let device = pool.device().clone();
        if !device.same_as(host.device()) {
            return Err(GpuError::WrongDevice("host state registration"));
        }
        Ok(Self {
            write_stream: device.new_stream("state-write")?,
            load_stream: device.new_stream("state-load")?,
            device,
            pool,
            host,
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device state pool.
    pub fn device_pool(&self) -> &Arc<StatePool> {
        &self.pool
    }

    /// The host state pool.
    pub fn host_pool(&self) -> &Arc<MambaPool> {
        self.host.pool()
    }

    /// The registration of the host pool.
    pub fn registration(&self) -> &Arc<StateRegistration> {
        &self.host
    }

    /// The stream backups run on.
    pub fn write_stream(&self) -> &Stream {
        &self.write_stream
    }

    /// The stream loads and slot copies run on.
    pub fn load_stream(&self) -> &Stream {
        &self.load_stream
    }

    /// Backs up the state of `dev[i]` into `host[i]` (D2H, every piece and layer) on the write
    /// stream, after the events in `after`.
    #[tracing::instrument(level = "debug", skip_all, fields(slots = dev.len()))]
    pub fn backup(
        &self,
        dev: &[StateSlot],
        host: &[MambaSlot],
        after: &[&Event],
    ) -> Result<Completion> {
        self.validate(Direction::ToHost, dev, host)?;
        let stream = &self.write_stream;
        stream.wait_all(after)?;
        let layers = 0..self.pool.shape().layers as usize;
        let ops = self.plan(dev, host, layers)?;
        if !ops.is_empty() {
            // SAFETY: validated slots, so every op is a row of both pools; the host pool is
            // registered (held by `self.host`) and the pools outlive the work (Drop syncs).
            unsafe { stream.run_plan(Direction::ToHost, ops)? };
        }
        Ok(Completion::new(stream.record()?))
    }

    /// Loads the state of `host[i]` into `dev[i]` (H2D) layer by layer on the load stream,
    /// after the events in `after`, with one event per Mamba layer.
    #[tracing::instrument(level = "debug", skip_all, fields(slots = dev.len()))]
    pub fn load(
        &self,
        host: &[MambaSlot],
        dev: &[StateSlot],
        after: &[&Event],
    ) -> Result<LoadHandle> {
        self.validate(Direction::ToDevice, dev, host)?;
        let stream = &self.load_stream;
        stream.wait_all(after)?;
        let layers = self.pool.shape().layers as usize;
        let mut events = Vec::with_capacity(layers);
        for l in 0..layers {
            let ops = self.plan(dev, host, l..l + 1)?;
            if !ops.is_empty() {
                // SAFETY: as in `backup`, with the copy reversed.
                unsafe { stream.run_plan(Direction::ToDevice, ops)? };
            }
            events.push(stream.record()?);
        }
        Ok(LoadHandle::from_events(events))
    }

    /// Copies the state of device slot `src` into device slot `dst` (D2D, every piece and
    /// layer) on the load stream, after the events in `after`. Both slots must be allocated
    /// and distinct.
    #[tracing::instrument(level = "debug", skip(self, after))]
    pub fn copy_slot(
        &self,
        src: StateSlot,
        dst: StateSlot,
        after: &[&Event],
    ) -> Result<Completion> {
        self.pool.check_slots(&[src, dst])?;
        if src == dst {
            return Err(GpuError::SameSlot { slot: src.0 });
        }
        let stream = &self.load_stream;
        stream.wait_all(after)?;
        let copies = self
            .pool
            .slot_rows(src)
            .zip(self.pool.slot_rows(dst))
            .map(|((s, bytes), (d, _))| DeviceCopy {
                dst: d,
                src: s,
                bytes: bytes as u64,
            })
            .collect();
        // SAFETY: rows of two distinct checked slots of the pool, so disjoint and inside its
        // buffers, which outlive the work (Drop syncs).
        unsafe { stream.run_d2d(copies)? };
        Ok(Completion::new(stream.record()?))
    }

    /// Blocks until both streams are idle.
    pub fn synchronize(&self) -> Result<()> {
        self.write_stream.synchronize()?;
        self.load_stream.synchronize()
    }

    /// The validation of the module docs.
    fn validate(&self, dir: Direction, dev: &[StateSlot], host: &[MambaSlot]) -> Result<()> {
        if dev.len() != host.len() {
            return Err(GpuError::LengthMismatch {
                what: "device state slots vs host state slots",
                left: dev.len(),
                right: host.len(),
            });
        }
        self.pool.check_slots(dev)?;
        let hp = self.host.pool();
        check_allocated("host state", host, hp.num_slots(), |s| hp.is_allocated(s))?;
        let (pool, dst, cap): (_, Vec<u32>, _) = match dir {
            Direction::ToHost => (
                "host state",
                host.iter().map(|s| s.0).collect(),
                hp.num_slots(),
            ),
            Direction::ToDevice => (
                "device state",
                dev.iter().map(|s| s.0).collect(),
                self.pool.num_slots(),
            ),
        };
        let mut seen = vec![false; cap];
        for p in dst {
            if std::mem::replace(&mut seen[p as usize], true) {
                return Err(GpuError::DuplicateDestination { pool, page: p });
            }
        }
        Ok(())
    }

    /// The DMA copies of `layers` of every pair (validated), sorted by host address and with
    /// contiguous runs merged.
    fn plan(
        &self,
        dev: &[StateSlot],
        host: &[MambaSlot],
        layers: std::ops::Range<usize>,
    ) -> Result<Vec<MemcpyOp>> {
        let hp = self.host.pool();
        let mut rows: Vec<(u64, u64, u64)> = Vec::new();
        for (&d, &h) in dev.iter().zip(host) {
            for piece in 0..self.pool.num_pieces() {
                for l in layers.clone() {
                    let hv = hp.layer_iovec(h, piece, l)?;
                    let (dv, _) = self.pool.row(piece, l, d);
                    rows.push((hv.addr as u64, dv, hv.len as u64));
                }
            }
        }
        rows.sort_unstable();
        let mut ops = Vec::with_capacity(rows.len());
        for (h, d, n) in rows {
            plan::push_linear(&mut ops, d, h, n);
        }
        Ok(ops)
    }
}

/// Host and device pools must hold the same state shape.
fn check_shapes(pool: &StatePool, host: &MambaPool) -> Result<()> {
    if pool.shape() != host.shape() {
        return Err(GpuError::StateShapeMismatch {
            host: Box::new(host.shape().clone()),
            device: Box::new(pool.shape().clone()),
        });
    }
    Ok(())
}

impl Drop for StateTransfer {
    fn drop(&mut self) {
        if let Err(e) = self.synchronize() {
            tracing::error!(error = %e, "synchronising state transfer streams on drop failed");
        }
    }
}
