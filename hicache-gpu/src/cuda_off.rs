//! The CUDA backend when `hicache-gpu` is built without its `cuda` feature: the same names as
//! the real module, but every type is uninhabited, so no value of them can exist.
//! [`CudaDevice::open`] is the only way to get one and it always returns
//! [`GpuError::CudaNotBuilt`]; the rest of the crate keeps its CUDA arms, which the compiler
//! knows can never run.
//!
//! Invariant: the signatures here mirror `cuda.rs` (the module built with the feature); the
//! `--no-default-features` check in CI keeps them in step.

use std::convert::Infallible;
use std::sync::Arc;

use crate::copy::CopyParams;
use crate::error::{GpuError, Result};
use crate::plan::{DeviceCopy, Direction, MemcpyOp};

/// Always false: this build has no CUDA backend.
pub fn driver_available() -> bool {
    false
}

/// The loaded kernels of one device (never exists in this build).
#[derive(Debug)]
pub enum Kernels {}

/// One CUDA device (never exists in this build).
#[derive(Debug)]
pub enum CudaDevice {}

/// A CUDA stream (never exists in this build).
#[derive(Debug)]
pub enum CudaStream {}

/// A CUDA event (never exists in this build).
#[derive(Debug)]
pub enum CudaEvent {}

/// Device memory (never exists in this build).
#[derive(Debug)]
pub enum CudaMemory {}

/// Stream-ordered scratch memory (never exists in this build).
#[derive(Debug)]
pub enum StreamScratch {}

impl CudaDevice {
    /// Always [`GpuError::CudaNotBuilt`].
    pub fn open(ordinal: usize) -> Result<Self> {
        Err(GpuError::CudaNotBuilt(format!("device {ordinal}")))
    }

    /// Unreachable: no device exists.
    pub fn name(&self) -> &str {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn sm_count(&self) -> u32 {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn compute_capability(&self) -> (u32, u32) {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn kernels(&self) -> Result<Arc<Kernels>> {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        match *self {}
    }

    /// Unreachable: no device exists.
    ///
    /// # Safety
    /// None needed: it cannot be called.
    pub unsafe fn borrow_stream(&self, _raw: *mut std::ffi::c_void) -> Arc<CudaStream> {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn new_event(&self) -> Result<CudaEvent> {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn alloc_zeroed(&self, _len: usize) -> Result<CudaMemory> {
        match *self {}
    }

    /// Unreachable: no device exists.
    ///
    /// # Safety
    /// None needed: it cannot be called.
    pub unsafe fn read(&self, _src: u64, _dst: &mut [u8]) -> Result<()> {
        match *self {}
    }

    /// Unreachable: no device exists.
    ///
    /// # Safety
    /// None needed: it cannot be called.
    pub unsafe fn write(&self, _dst: u64, _src: &[u8]) -> Result<()> {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn address_range(&self, _ptr: u64) -> Result<(u64, usize)> {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn reachable_end(&self, _ptr: u64, _want: usize) -> Result<u64> {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn batches_copies(&self) -> bool {
        match *self {}
    }

    /// Unreachable: no device exists.
    ///
    /// # Safety
    /// None needed: it cannot be called.
    pub unsafe fn register_host(&self, _addr: usize, _len: usize) -> Result<u64> {
        match *self {}
    }

    /// Unreachable: no device exists.
    ///
    /// # Safety
    /// None needed: it cannot be called.
    pub unsafe fn unregister_host(&self, _addr: usize) -> Result<()> {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn upload_u32(&self, _stream: &Arc<CudaStream>, _data: &[u32]) -> Result<StreamScratch> {
        match *self {}
    }

    /// Unreachable: no device exists.
    pub fn launch_copy(
        &self,
        _stream: &Arc<CudaStream>,
        _params: &CopyParams,
        _word_bytes: u32,
        _ctas: u32,
        _threads: u32,
    ) -> Result<()> {
        match *self {}
    }

    /// Unreachable: no device exists.
    ///
    /// # Safety
    /// None needed: it cannot be called.
    pub unsafe fn run_plan(
        &self,
        _stream: &Arc<CudaStream>,
        _dir: Direction,
        _ops: &[MemcpyOp],
    ) -> Result<()> {
        match *self {}
    }

    /// Unreachable: no device exists.
    ///
    /// # Safety
    /// None needed: it cannot be called.
    pub unsafe fn run_d2d(&self, _stream: &Arc<CudaStream>, _copies: &[DeviceCopy]) -> Result<()> {
        match *self {}
    }
}

impl CudaStream {
    /// Unreachable: no stream exists.
    pub fn synchronize(&self) -> std::result::Result<(), Infallible> {
        match *self {}
    }

    /// Unreachable: no stream exists.
    pub fn cu_stream(&self) -> *mut std::ffi::c_void {
        match *self {}
    }
}

impl CudaEvent {
    /// Unreachable: no event exists.
    pub fn record(&self, _stream: &CudaStream) -> Result<()> {
        match *self {}
    }

    /// Unreachable: no event exists.
    pub fn wait_on(&self, _stream: &CudaStream) -> Result<()> {
        match *self {}
    }

    /// Unreachable: no event exists.
    pub fn is_complete(&self) -> Result<bool> {
        match *self {}
    }

    /// Unreachable: no event exists.
    pub fn synchronize(&self) -> Result<()> {
        match *self {}
    }

    /// Unreachable: no event exists.
    pub fn cu_event(&self) -> *mut std::ffi::c_void {
        match *self {}
    }
}

impl CudaMemory {
    /// Unreachable: no memory exists.
    pub fn addr(&self) -> u64 {
        match *self {}
    }

    /// Unreachable: no memory exists.
    pub fn len(&self) -> usize {
        match *self {}
    }

    /// Unreachable: no memory exists.
    pub fn is_empty(&self) -> bool {
        match *self {}
    }
}

impl StreamScratch {
    /// Unreachable: no scratch exists.
    pub fn addr(&self) -> u64 {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use crate::{Device, GpuError};

    #[test]
    fn opening_a_cuda_device_says_the_feature_is_off() {
        assert!(!Device::cuda_driver_available());
        let e = Device::cuda(0).unwrap_err();
        assert!(matches!(e, GpuError::CudaNotBuilt(_)), "{e}");
        assert!(e.to_string().contains("`cuda` feature"), "{e}");
    }
}
