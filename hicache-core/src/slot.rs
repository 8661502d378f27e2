//! Page slots: the index of a page in the device (L1) or host (L2) KV pool.
//!
//! One type per pool, shared by every crate: the tree records them, the pools
//! (`hicache-host`, `hicache-gpu`) allocate and free them, the transfer engine copies between
//! them and the facade hands device slots to the engine. A slot of one pool can never be
//! passed where the other's is expected.

use std::fmt;

/// A page of the device pool (L1), by index.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DeviceSlot(pub u32);

/// A page of the host pool (L2), by index.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostSlot(pub u32);

impl fmt::Display for DeviceSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device page {}", self.0)
    }
}

impl fmt::Display for HostSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host page {}", self.0)
    }
}

impl From<u32> for DeviceSlot {
    fn from(index: u32) -> Self {
        DeviceSlot(index)
    }
}

impl From<u32> for HostSlot {
    fn from(index: u32) -> Self {
        HostSlot(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_name_their_pool() {
        assert_eq!(DeviceSlot(3).to_string(), "device page 3");
        assert_eq!(HostSlot(7).to_string(), "host page 7");
    }
}
