//! The components of a host pool group, named as SGLang names its pools. Below both
//! [`group`](crate::group) and [`error`](crate::error), which name them.

use std::fmt;

/// A component of a host pool group (SGLang's `PoolName` values for these pools).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HostComponent {
    /// The KV pool of the full-attention layers.
    Kv,
    /// The KV pool of the sliding-window layers.
    Swa,
    /// The Mamba / linear-attention state pool.
    Mamba,
}

impl HostComponent {
    /// Every component, in group order.
    pub const ALL: [HostComponent; 3] =
        [HostComponent::Kv, HostComponent::Swa, HostComponent::Mamba];

    /// SGLang's pool name (`kv`, `swa`, `mamba`).
    pub fn as_str(self) -> &'static str {
        match self {
            HostComponent::Kv => "kv",
            HostComponent::Swa => "swa",
            HostComponent::Mamba => "mamba",
        }
    }
}

impl fmt::Display for HostComponent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
