//! The Mamba component's pools. Until `hicache-gpu`'s device state pool is available no
//! Mamba part can be built (the builder refuses a Mamba shape), so this type has no value.

use crate::error::Result;

use super::pools::Launched;

/// A Mamba state slot on the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StateSlot(pub u32);

/// The Mamba component's pools (none can exist yet, see the module docs).
pub(crate) enum StatePart {}

impl StatePart {
    /// Free device state slots.
    pub fn dev_available(&self) -> usize {
        match *self {}
    }
    /// Free host state slots.
    pub fn host_available(&self) -> usize {
        match *self {}
    }
    /// `n` device state slots.
    pub fn alloc_dev(&self, _n: usize) -> Option<Vec<u32>> {
        match *self {}
    }
    /// Frees device state slots.
    pub fn free_dev(&self, _s: &[u32]) -> Result<()> {
        match *self {}
    }
    /// `n` host state slots.
    pub fn alloc_host(&self, _n: usize) -> Option<Vec<u32>> {
        match *self {}
    }
    /// Frees host state slots.
    pub fn free_host(&self, _s: &[u32]) -> Result<()> {
        match *self {}
    }
    /// Device → host copy of one state.
    pub fn backup(&self, _dev: u32, _host: u32) -> Result<Launched> {
        match *self {}
    }
    /// Host → device copy of one state.
    pub fn load(&self, _host: u32, _dev: u32) -> Result<Launched> {
        match *self {}
    }
    /// Device copy-on-write of one state.
    pub fn copy(&self, _src: u32, _dst: u32) -> Result<Launched> {
        match *self {}
    }
    /// Bytes of one state.
    pub fn slot_bytes(&self) -> usize {
        match *self {}
    }
    /// Reads one device state (synchronous).
    pub fn read(&self, _slot: u32) -> Result<Vec<u8>> {
        match *self {}
    }
    /// Writes one device state (synchronous).
    pub fn write(&self, _slot: u32, _src: &[u8]) -> Result<()> {
        match *self {}
    }
    /// Waits for the streams.
    pub fn synchronize(&self) -> Result<()> {
        match *self {}
    }
}
