//! The peers a server socket serves, and which one makes room for a newer connection.
//!
//! Invariants:
//! 1. At most `max_peers` entries, at most `max_peers_per_ip` per IP address: [`Registry::admit`]
//!    removes the stalest entry of a full set (and tells its connection to close) before it
//!    inserts the new one, under one lock.
//! 2. Stalest = not yet useful before useful (a PUB peer becomes useful at its first
//!    subscription, a ROUTER peer at its first request), then the oldest activity (a frame
//!    received, bytes written to it), then the oldest connection.
//! 3. [`SocketStats::peers`](crate::SocketStats::peers) is the number of entries; an entry
//!    leaves when its connection ends ([`Admitted`]'s `Drop`) or when it is evicted.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::ServerLimits;
use crate::stats::{Counters, throttled};

/// What a connection and the registry share about one peer.
#[derive(Debug)]
pub(crate) struct Liveness {
    epoch: Instant,
    useful: AtomicBool,
    /// Milliseconds from `epoch` to the last activity.
    last: AtomicU64,
    close: Notify,
}

impl Liveness {
    fn new(epoch: Instant) -> Self {
        let l = Self {
            epoch,
            useful: AtomicBool::new(false),
            last: AtomicU64::new(0),
            close: Notify::new(),
        };
        l.touch();
        l
    }

    /// Records activity now.
    pub(crate) fn touch(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.fetch_max(ms, Ordering::Relaxed);
    }

    /// Records that the peer did what its socket is for (subscribed, sent a request).
    pub(crate) fn mark_useful(&self) {
        self.useful.store(true, Ordering::Relaxed);
        self.touch();
    }

    /// Whether the peer did what its socket is for.
    pub(crate) fn is_useful(&self) -> bool {
        self.useful.load(Ordering::Relaxed)
    }

    /// Asks the connection to end.
    pub(crate) fn close(&self) {
        // notify_one keeps the wake-up for a `closed` that is not waiting yet.
        self.close.notify_one();
    }

    /// Resolves when [`Liveness::close`] was called.
    pub(crate) async fn closed(&self) {
        self.close.notified().await;
    }

    fn rank(&self, id: u64) -> (bool, u64, u64) {
        (self.is_useful(), self.last.load(Ordering::Relaxed), id)
    }
}

struct Entry {
    ip: IpAddr,
    live: Arc<Liveness>,
    /// Set when the registry closed it to make room (the connection reports `Evicted`).
    evicted: Arc<AtomicBool>,
}

/// The peers of one socket.
pub(crate) struct Registry {
    epoch: Instant,
    peers: Mutex<HashMap<u64, Entry>>,
    next_id: AtomicU64,
    counters: Arc<Counters>,
    max_peers: usize,
    max_per_ip: usize,
    socket: &'static str,
}

/// One served connection's place; dropping it frees the place.
pub(crate) struct Admitted {
    id: u64,
    /// The peer's liveness, shared with the registry.
    pub live: Arc<Liveness>,
    evicted: Arc<AtomicBool>,
    registry: Arc<Registry>,
}

impl Admitted {
    /// Whether the registry closed this peer to make room for another.
    pub(crate) fn was_evicted(&self) -> bool {
        self.evicted.load(Ordering::Relaxed)
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut peers = self.registry.peers.lock();
        if peers.remove(&self.id).is_some() {
            self.registry
                .counters
                .peers
                .store(peers.len(), Ordering::Relaxed);
        }
    }
}

impl Registry {
    pub(crate) fn new(
        limits: &ServerLimits,
        counters: Arc<Counters>,
        socket: &'static str,
    ) -> Arc<Self> {
        Arc::new(Self {
            epoch: Instant::now(),
            peers: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            counters,
            max_peers: limits.max_peers.max(1),
            max_per_ip: limits.max_peers_per_ip.max(1),
            socket,
        })
    }

    /// Admits a new connection from `ip`, evicting the stalest peer of a full set first.
    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr) -> Admitted {
        let live = Arc::new(Liveness::new(self.epoch));
        let evicted = Arc::new(AtomicBool::new(false));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut peers = self.peers.lock();
        let same_ip = peers.values().filter(|e| e.ip == ip).count();
        let victim = if same_ip >= self.max_per_ip {
            stalest(peers.iter().filter(|(_, e)| e.ip == ip))
        } else if peers.len() >= self.max_peers {
            stalest(peers.iter())
        } else {
            None
        };
        if let Some(v) = victim
            && let Some(e) = peers.remove(&v)
        {
            e.evicted.store(true, Ordering::Relaxed);
            e.live.close();
            let n = self.counters.evicted_peers.fetch_add(1, Ordering::Relaxed) + 1;
            let per_ip = same_ip >= self.max_per_ip;
            if throttled(n) {
                tracing::warn!(socket = self.socket, evicted_ip = %e.ip, for_ip = %ip, per_ip, evicted = n, "ZMTP: connection limit reached; the stalest peer was closed for a newer one");
            } else {
                tracing::debug!(socket = self.socket, evicted_ip = %e.ip, for_ip = %ip, per_ip, evicted = n, "ZMTP: connection limit reached; the stalest peer was closed for a newer one");
            }
        }
        peers.insert(
            id,
            Entry {
                ip,
                live: live.clone(),
                evicted: evicted.clone(),
            },
        );
        self.counters.peers.store(peers.len(), Ordering::Relaxed);
        Admitted {
            id,
            live,
            evicted,
            registry: self.clone(),
        }
    }
}

/// The id of the stalest of `peers` (module invariant 2).
fn stalest<'a>(peers: impl Iterator<Item = (&'a u64, &'a Entry)>) -> Option<u64> {
    peers
        .min_by_key(|(id, e)| e.live.rank(**id))
        .map(|(id, _)| *id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry(max_peers: usize, max_peers_per_ip: usize) -> Arc<Registry> {
        let limits = ServerLimits {
            max_peers,
            max_peers_per_ip,
            ..ServerLimits::default()
        };
        Registry::new(&limits, Arc::new(Counters::default()), "test")
    }

    #[test]
    fn a_full_socket_evicts_a_never_useful_peer_before_a_useful_one() {
        let r = registry(3, 3);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let honest = r.admit(a);
        honest.live.mark_useful();
        let idle1 = r.admit(b);
        let idle2 = r.admit(b);
        let newer = r.admit(b);
        // b is not over its own limit (3): the socket is; the first idle one goes.
        assert!(idle1.was_evicted());
        assert!(!honest.was_evicted() && !idle2.was_evicted() && !newer.was_evicted());
        assert_eq!(r.counters.peers.load(Ordering::Relaxed), 3);
        drop(idle1);
        assert_eq!(
            r.counters.peers.load(Ordering::Relaxed),
            3,
            "an evicted entry is gone already"
        );
        drop(newer);
        assert_eq!(r.counters.peers.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_full_address_evicts_its_own_stalest_peer() {
        let r = registry(10, 2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let other = r.admit(b);
        let a1 = r.admit(a);
        a1.live.mark_useful();
        let a2 = r.admit(a);
        let a3 = r.admit(a);
        assert!(a2.was_evicted(), "the idle one of a");
        assert!(!a1.was_evicted() && !a3.was_evicted() && !other.was_evicted());
        assert_eq!(r.counters.evicted_peers.load(Ordering::Relaxed), 1);
    }
}
