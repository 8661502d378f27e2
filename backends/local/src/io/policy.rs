//! [`FsyncPolicy`]: when a local layout makes written pages durable; [`IoEngine`]: which
//! driver issues its I/O.

use std::io;

/// When written pages are flushed to stable storage before `Stored` is returned. One policy
/// for every local layout; each layout's README says which syncs it issues under each.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum FsyncPolicy {
    /// Never: pages are complete and checksummed, but a power loss may lose acknowledged
    /// pages. A process crash loses nothing acknowledged (the page cache survives it).
    None,
    /// Once per batch (default): the batch's data, then its metadata (renames or index
    /// records), are made durable before any page of the batch is acknowledged.
    #[default]
    Batch,
    /// Every page is made durable on its own before it is acknowledged.
    Always,
}

impl FsyncPolicy {
    /// Configuration spellings, in the order of the variants.
    pub const NAMES: [&'static str; 3] = ["none", "batch", "always"];

    /// The policy a configuration spelling names (one of [`NAMES`](Self::NAMES)); `None` for
    /// any other text.
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "none" => Some(Self::None),
            "batch" => Some(Self::Batch),
            "always" => Some(Self::Always),
            _ => None,
        }
    }

    /// Whether acknowledged pages survive a power loss under this policy.
    pub fn durable(self) -> bool {
        self != Self::None
    }
}

/// Which driver issues a layout's I/O (`io_engine`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum IoEngine {
    /// io_uring where the kernel allows it (probed at open), threads otherwise (default).
    #[default]
    Auto,
    /// io_uring or fail to open.
    Uring,
    /// A pool of threads doing blocking system calls.
    Threads,
}

impl IoEngine {
    /// Configuration spellings, in the order of the variants.
    pub const NAMES: [&'static str; 3] = ["auto", "uring", "threads"];

    /// The engine a configuration spelling names (one of [`NAMES`](Self::NAMES)); `None`
    /// for any other text.
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "uring" => Some(Self::Uring),
            "threads" => Some(Self::Threads),
            _ => None,
        }
    }

    /// Picks the io_uring driver `probe` builds (and proves), or `None` for threads: never
    /// probed under `threads`; under `auto` a failed probe falls back to threads; under
    /// `uring` it is the error.
    pub fn choose<T>(self, probe: impl FnOnce() -> io::Result<T>) -> io::Result<Option<T>> {
        match self {
            Self::Threads => Ok(None),
            Self::Uring => probe().map(Some),
            Self::Auto => match probe() {
                Ok(t) => Ok(Some(t)),
                Err(e) => {
                    tracing::info!(%e, "io_uring unavailable, using the threads engine");
                    Ok(None)
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for (n, p) in FsyncPolicy::NAMES.iter().zip([
            FsyncPolicy::None,
            FsyncPolicy::Batch,
            FsyncPolicy::Always,
        ]) {
            assert_eq!(FsyncPolicy::from_name(n), Some(p));
        }
        assert_eq!(FsyncPolicy::from_name("sometimes"), None);
        assert!(!FsyncPolicy::None.durable() && FsyncPolicy::Batch.durable());
    }
}
