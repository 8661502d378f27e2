//! [`ServerLimits`]: what one PUB or ROUTER socket lets its peers hold, and the defaults.

use std::time::Duration;

/// The longest frame a peer may send a server by default. Subscriptions and replay requests
/// are a few bytes; READY carries a socket type and a routing id (at most 255 bytes).
pub const MAX_FRAME: usize = 4096;
/// The most frames one incoming message may have by default (a replay request has 2).
pub const MAX_FRAMES_PER_MESSAGE: usize = 8;
/// The most connections one socket serves at a time by default, handshaking ones included.
pub const MAX_PEERS: usize = 256;
/// The most connections one socket serves from one IP address by default.
pub const MAX_PEERS_PER_IP: usize = 64;
/// How long a peer has to finish the handshake (greeting and READY) after it connects.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long after its handshake a peer may go without subscribing (PUB) or sending a request
/// (ROUTER) before it is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Messages queued for one peer before the PUB drops new ones for it (libzmq's default SNDHWM).
pub const PEER_QUEUE: usize = 1000;
/// Bytes queued for one peer before the PUB drops new messages for it (a ROUTER reply waits).
pub const PEER_QUEUE_BYTES: usize = 64 << 20;
/// Bytes queued for all the peers of one socket together (each peer's share of a shared
/// message counted, so the memory they hold is at most this, and usually far less).
pub const MAX_QUEUED_BYTES: usize = 1 << 30;
/// The most topic subscriptions one subscriber may hold; one more closes its connection.
pub const MAX_SUBSCRIPTIONS: usize = 64;
/// How long a peer may read nothing while something is queued for it before it is closed;
/// also how long a ROUTER reply waits for room in a peer's queue.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The ROUTER's reply wait (the same as [`STALL_TIMEOUT`]; the name the facade used).
pub const REPLY_STALL_TIMEOUT: Duration = STALL_TIMEOUT;
/// Requests of one ROUTER peer being answered at a time (1: in order, one after the other).
pub const MAX_OUTSTANDING_REQUESTS: usize = 1;

/// What one server socket lets its peers hold. [`Default`] is the constants of this module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// The longest frame a peer may send (checked from the header).
    pub max_frame: usize,
    /// The most frames of one incoming message.
    pub max_frames_per_message: usize,
    /// The most connections served at a time (at least 1).
    pub max_peers: usize,
    /// The most connections served from one IP address (at least 1).
    pub max_peers_per_ip: usize,
    /// The handshake deadline.
    pub handshake_timeout: Duration,
    /// The deadline for a first subscription (PUB) or request (ROUTER) after the handshake.
    pub idle_timeout: Duration,
    /// Messages queued per peer.
    pub peer_queue: usize,
    /// Bytes queued per peer.
    pub peer_queue_bytes: usize,
    /// Bytes queued for all peers together.
    pub max_queued_bytes: usize,
    /// Subscriptions per subscriber (PUB).
    pub max_subscriptions: usize,
    /// How long a peer may read nothing while something is queued for it.
    pub stall_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_frame: MAX_FRAME,
            max_frames_per_message: MAX_FRAMES_PER_MESSAGE,
            max_peers: MAX_PEERS,
            max_peers_per_ip: MAX_PEERS_PER_IP,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            peer_queue: PEER_QUEUE,
            peer_queue_bytes: PEER_QUEUE_BYTES,
            max_queued_bytes: MAX_QUEUED_BYTES,
            max_subscriptions: MAX_SUBSCRIPTIONS,
            stall_timeout: STALL_TIMEOUT,
        }
    }
}

impl ServerLimits {
    /// The limits with every count at least 1 and the byte budgets within what a semaphore
    /// counts (so that no setting can make a socket refuse everything or panic).
    pub(crate) fn sane(&self) -> Self {
        let max_permits = tokio::sync::Semaphore::MAX_PERMITS;
        Self {
            max_frame: self.max_frame,
            max_frames_per_message: self.max_frames_per_message.max(1),
            max_peers: self.max_peers.max(1),
            max_peers_per_ip: self.max_peers_per_ip.max(1),
            handshake_timeout: self.handshake_timeout,
            idle_timeout: self.idle_timeout,
            peer_queue: self.peer_queue.clamp(1, max_permits),
            peer_queue_bytes: self.peer_queue_bytes.clamp(1, u32::MAX as usize),
            max_queued_bytes: self.max_queued_bytes.clamp(1, max_permits),
            max_subscriptions: self.max_subscriptions,
            stall_timeout: self.stall_timeout,
        }
    }
}
