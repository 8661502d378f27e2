//! A server socket's counters ([`SocketStats`]) and the live view of them ([`StatsHandle`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A socket's counters, as [`StatsHandle::snapshot`] reads them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SocketStats {
    /// Connections served now (handshaking ones included).
    pub peers: usize,
    /// Connections closed at accept (always 0 since peers are evicted instead; kept for the
    /// readers of earlier versions).
    pub refused_peers: u64,
    /// Peers closed to make room for a newer connection (the stalest of a full socket or of a
    /// full IP address).
    pub evicted_peers: u64,
    /// Peers closed for neither subscribing nor sending a request within the idle deadline.
    pub idle_closed: u64,
    /// Connections closed for breaking the protocol or the limits.
    pub closed_for_errors: u64,
    /// Messages not queued for a subscriber whose queue was full (PUB).
    pub dropped_messages: u64,
    /// Peers disconnected because they did not read what was queued for them.
    pub stalled_peers: u64,
    /// Bytes queued for all peers now (each peer's share of a shared message counted).
    pub queued_bytes: u64,
    /// The most [`SocketStats::queued_bytes`] ever reached.
    pub queued_bytes_peak: u64,
}

/// The live counters behind [`SocketStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub peers: AtomicUsize,
    pub refused_peers: AtomicU64,
    pub evicted_peers: AtomicU64,
    pub idle_closed: AtomicU64,
    pub closed_for_errors: AtomicU64,
    pub dropped_messages: AtomicU64,
    pub stalled_peers: AtomicU64,
    pub queued_bytes: AtomicU64,
    pub queued_bytes_peak: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> SocketStats {
        SocketStats {
            peers: self.peers.load(Ordering::Relaxed),
            refused_peers: self.refused_peers.load(Ordering::Relaxed),
            evicted_peers: self.evicted_peers.load(Ordering::Relaxed),
            idle_closed: self.idle_closed.load(Ordering::Relaxed),
            closed_for_errors: self.closed_for_errors.load(Ordering::Relaxed),
            dropped_messages: self.dropped_messages.load(Ordering::Relaxed),
            stalled_peers: self.stalled_peers.load(Ordering::Relaxed),
            queued_bytes: self.queued_bytes.load(Ordering::Relaxed),
            queued_bytes_peak: self.queued_bytes_peak.load(Ordering::Relaxed),
        }
    }

    /// Counts `n` bytes queued.
    pub fn queued(&self, n: usize) {
        let now = self.queued_bytes.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        self.queued_bytes_peak.fetch_max(now, Ordering::Relaxed);
    }

    /// Counts `n` bytes written or released.
    pub fn dequeued(&self, n: usize) {
        self.queued_bytes.fetch_sub(n as u64, Ordering::Relaxed);
    }
}

/// A live view of one socket's counters, readable from any thread.
#[derive(Clone, Debug)]
pub struct StatsHandle(pub(crate) Arc<Counters>);

impl StatsHandle {
    /// The counters now.
    pub fn snapshot(&self) -> SocketStats {
        self.0.snapshot()
    }
}

/// Logs a peer-caused event at `warn` only the 1st, 2nd, 4th, 8th... time (`n` is the count
/// including this one) and at `debug` otherwise, so that a flood of bad peers never becomes a
/// flood of log lines.
pub(crate) fn throttled(n: u64) -> bool {
    n.is_power_of_two()
}
