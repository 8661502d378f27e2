//! ZMTP 3.0 / 3.1 (rfc.zeromq.org specs 23 and 37, ZeroMQ's wire protocol) over TCP with the
//! NULL security mechanism, every frame, peer and queue bounded. One implementation for both
//! sides of hicache-rs's KV events:
//!
//! - servers: [`PubSocket`] and [`RouterSocket`], behind the `hicache` facade's KV-event
//!   publisher (live batches and the replay endpoint); their clients are any ZMQ implementation
//!   (libzmq through pyzmq, the `zeromq` crate, ours);
//! - clients: [`SubClient`] and [`DealerClient`], with which the fleet index follows publishers
//!   (ours, or SGLang's and vLLM's libzmq sockets).
//!
//! It exists because a socket facing the network must bound what a peer can make it do, and
//! the `zeromq` crate cannot: its codec reserves whatever length a frame header claims (one
//! 73-byte packet aborted the process), and its sends wait on the slowest peer.
//!
//! # Server invariants (per socket, limits from [`ServerLimits`])
//! 1. Nothing a peer sends can make the process panic or reserve more than `max_frame` (plus a
//!    header and a read chunk) per connection: a frame's claimed length is checked from its
//!    header alone, before any byte of its body is buffered; a message has at most
//!    `max_frames_per_message` frames, a subscriber at most `max_subscriptions` subscriptions.
//! 2. A bad greeting, another mechanism than NULL, an incompatible socket type, a too-long
//!    frame, malformed commands, or a handshake not done within `handshake_timeout` close
//!    *that* connection only, logged with the peer's address (every one at `debug`, the 1st,
//!    2nd, 4th... of a socket at `warn`) and counted ([`SocketStats::closed_for_errors`]).
//! 3. At most `max_peers` connections (handshaking ones included) are served, at most
//!    `max_peers_per_ip` from one IP address. A connection beyond either limit is served and
//!    the *stalest* peer of that set is closed instead ([`SocketStats::evicted_peers`]): a peer
//!    that never subscribed (PUB) or sent a request (ROUTER) before any that did, then the one
//!    with the oldest activity (a frame received, bytes written to it). Idle connections
//!    therefore cannot lock honest peers out; an honest peer is evicted only when every peer
//!    of its set did something useful more recently.
//! 4. A peer that has neither subscribed (PUB) nor sent a request (ROUTER) `idle_timeout`
//!    after its handshake is closed ([`SocketStats::idle_closed`]); so is a peer to which
//!    nothing could be written for `stall_timeout` while something was queued for it
//!    ([`SocketStats::stalled_peers`]).
//! 5. Sending never waits on a peer: each has a queue bounded in messages (`peer_queue`) and in
//!    bytes (`peer_queue_bytes`), and the queues of one socket together hold at most
//!    `max_queued_bytes` ([`SocketStats::queued_bytes`]; a message bigger than a budget is
//!    admitted only into an otherwise empty one). Queued messages share their bytes
//!    ([`bytes::Bytes`], reference-counted): a message sent to many peers, or a buffered batch
//!    replayed to many, is in memory once. Everything queued for a peer is released when its
//!    connection ends. The PUB drops a message for a subscriber without room (libzmq's SNDHWM
//!    behaviour) and counts it ([`SocketStats::dropped_messages`]); a ROUTER reply waits at
//!    most `stall_timeout` for room, then that peer is disconnected
//!    ([`SocketStats::stalled_peers`]).
//! 6. A ROUTER peer has at most [`MAX_OUTSTANDING_REQUESTS`] request being answered; until it
//!    is answered the peer's next bytes are not read (they wait in the kernel, and TCP flow
//!    control stops the peer), so a peer flooding requests costs a bounded amount of memory.
//! 7. Every connection is a task of the runtime the socket was bound in; dropping that runtime
//!    ends them all without waiting on any peer.
//!
//! # Client invariants (limits from [`ClientOptions`])
//! The same frame, message and handshake bounds as the servers (with a larger default frame
//! limit, 64 MiB, since a KV batch with long token lists can be megabytes), checked from the
//! header before buffering; nothing queued (a client writes straight to its socket, with a
//! deadline). A server that says nothing for `heartbeat_timeout` after a ZMTP 3.1 PING is
//! declared dead ([`ZmtpError::DeadPeer`]). A client is one connection: an error from `recv`
//! means it was lost; connecting again makes a new one with a new
//! [`SubClient::connection_id`], which a caller uses to notice "a new connection" (the fleet
//! index fences a publisher on one).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod client;
pub mod codec;
mod conn;
mod error;
mod limits;
mod peer;
mod publish;
mod registry;
mod router;
mod stats;

pub use client::{ClientOptions, DealerClient, SubClient};
pub use error::ZmtpError;
pub use limits::{
    HANDSHAKE_TIMEOUT, IDLE_TIMEOUT, MAX_FRAME, MAX_FRAMES_PER_MESSAGE, MAX_OUTSTANDING_REQUESTS,
    MAX_PEERS, MAX_PEERS_PER_IP, MAX_QUEUED_BYTES, MAX_SUBSCRIPTIONS, PEER_QUEUE, PEER_QUEUE_BYTES,
    REPLY_STALL_TIMEOUT, STALL_TIMEOUT, ServerLimits,
};
pub use publish::PubSocket;
pub use router::{ReplyError, Request, RouterSocket};
pub use stats::{SocketStats, StatsHandle};
