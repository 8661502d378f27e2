//! The simulated links background copies travel on, so that copy time is charged on the
//! simulated clock the way a real node experiences it.
//!
//! # The link model (normative)
//!
//! - **H2D** (L2 → L1 loads) is not here: loads are part of the prefill step that needs them,
//!   overlapped layer by layer with its compute ([`ComputeModel::prefill_step`]).
//! - **D2H** (L1 → L2 write-through copies): one link at [`ComputeModel::d2h_bytes_per_s`].
//!   PCIe is full duplex, so it does not compete with H2D loads; D2H batches queue behind each
//!   other. A page is backed up in L2 (and its device page unlocked) only once its batch has
//!   completed in simulated time.
//! - **L3** (L3 → L2 prefetch reads and L2 → L3 backup writes): one link at
//!   [`ComputeModel::l3_bytes_per_s`] shared by both directions in the order transfers are
//!   issued, as on one NVMe drive (conservative for a full-duplex NIC). A prefetch also waits
//!   [`ComputeModel::l3_latency_s`] before its first byte. A page backed up to L3 becomes
//!   visible to lookups, and its host pin is released, only once its backup has completed in
//!   simulated time.
//!
//! Each link is a FIFO: a transfer issued at `t` starts at `max(t, link free)` and takes
//! `bytes / bandwidth`.
//!
//! [`ComputeModel::prefill_step`]: crate::ComputeModel::prefill_step
//! [`ComputeModel::d2h_bytes_per_s`]: crate::ComputeModel::d2h_bytes_per_s
//! [`ComputeModel::l3_bytes_per_s`]: crate::ComputeModel::l3_bytes_per_s
//! [`ComputeModel::l3_latency_s`]: crate::ComputeModel::l3_latency_s

use serde::Serialize;

use crate::model::ComputeModel;

/// How background copies are timed.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum CopyTime {
    /// Write-through copies and L3 backups take simulated time on their links (the module's
    /// model).
    #[default]
    Charged,
    /// They are waited for in wall time between ticks while the simulated clock stands still:
    /// free, so the L2/L3 hits and TTFT of a run are upper bounds (the model before issue 19).
    Free,
}

/// One simulated link: a FIFO of transfers at a fixed bandwidth.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Link {
    /// Bandwidth in bytes per second.
    pub bytes_per_s: f64,
    /// Simulated time the link is free from (s).
    pub free_at: f64,
    /// Seconds the link was busy.
    pub busy_seconds: f64,
    /// Bytes carried.
    pub bytes: u64,
    /// Transfers carried.
    pub transfers: u64,
}

impl Link {
    /// A free link of `bytes_per_s`.
    pub fn new(bytes_per_s: f64) -> Self {
        Self {
            bytes_per_s,
            ..Self::default()
        }
    }

    /// Issues a transfer of `bytes` that may start at `earliest`; returns when it completes.
    pub fn transfer(&mut self, earliest: f64, bytes: u64) -> f64 {
        let start = earliest.max(self.free_at);
        let took = bytes as f64 / self.bytes_per_s;
        self.free_at = start + took;
        self.busy_seconds += took;
        self.bytes += bytes;
        self.transfers += 1;
        self.free_at
    }
}

/// The links of one run (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Links {
    /// Whether copies are charged.
    pub copy_time: CopyTime,
    /// L1 → L2.
    pub d2h: Link,
    /// L3 ↔ L2, both directions.
    pub l3: Link,
    /// Bytes of the L3 link that were prefetch reads (the rest were backup writes).
    pub l3_read_bytes: u64,
}

impl Links {
    /// Free links with the bandwidths of `compute`.
    pub fn new(compute: &ComputeModel, copy_time: CopyTime) -> Self {
        Self {
            copy_time,
            d2h: Link::new(compute.d2h_bytes_per_s),
            l3: Link::new(compute.l3_bytes_per_s),
            l3_read_bytes: 0,
        }
    }

    /// Whether copies take simulated time.
    pub fn charged(&self) -> bool {
        self.copy_time == CopyTime::Charged
    }

    /// A prefetch read of `bytes` for a request that arrived at `arrival`, after the L3
    /// latency; returns when it completes.
    pub fn prefetch(&mut self, arrival: f64, latency: f64, bytes: u64) -> f64 {
        self.l3_read_bytes += bytes;
        self.l3.transfer(arrival + latency, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_queue_behind_each_other() {
        let mut l = Link::new(100.0);
        assert_eq!(l.transfer(1.0, 100), 2.0);
        // Issued at 1.5 while busy until 2.0: starts at 2.0.
        assert_eq!(l.transfer(1.5, 50), 2.5);
        // Issued after the link went idle: starts when issued.
        assert_eq!(l.transfer(10.0, 0), 10.0);
        assert_eq!(l.bytes, 150);
        assert_eq!(l.transfers, 3);
        assert!((l.busy_seconds - 1.5).abs() < 1e-12);
    }

    #[test]
    fn prefetch_reads_and_backup_writes_share_the_l3_link() {
        let c = ComputeModel {
            l3_bytes_per_s: 1000.0,
            ..ComputeModel::h100(&crate::ModelShape::llama3_8b())
        };
        let mut links = Links::new(&c, CopyTime::Charged);
        let backup_done = links.l3.transfer(0.0, 1000);
        assert_eq!(backup_done, 1.0);
        // A prefetch for a request that arrived at 0.1 waits for the backup.
        assert_eq!(links.prefetch(0.1, 0.01, 500), 1.5);
        assert_eq!(links.l3_read_bytes, 500);
        assert_eq!(links.l3.bytes, 1500);
    }
}
