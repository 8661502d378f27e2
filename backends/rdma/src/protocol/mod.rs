//! The wire protocol between clients and the memory-pool server.
//!
//! # Framing
//!
//! Every message, in both directions, is one frame:
//!
//! ```text
//! u32 body_len | u64 payload_len | u64 request_id | u8 op | body (body_len) | payload (payload_len)
//! ```
//!
//! All integers are little-endian. The *body* is the encoded message (below); the *payload* is
//! raw page bytes that follow it (`WRITE` requests, `READ` replies), streamed straight between
//! the socket and page memory so large pages are never buffered whole. A reply carries the
//! request id of its request and the request's op with the high bit set ([`REPLY_BIT`]), or
//! [`op::ERROR`].
//!
//! # Rules
//!
//! 1. The first frame of a connection is `HELLO`, whose body starts with [`MAGIC`] and the
//!    client's [`VERSION`] (checked before the rest of the body, so a client of another
//!    version gets a [`code::VERSION`] error naming both versions), then the client's nonce.
//!    The server answers with its own nonce and whether it requires credentials; the client
//!    sends `AUTH` with its MAC (computed by the `auth` module); the server answers `AUTH` with its
//!    [`ServerInfo`] and its proof. Any failure is an `ERROR` frame (bad magic, other
//!    version, [`code::AUTH`]) and the server closes the connection. Nothing but `HELLO` and
//!    then `AUTH` is accepted before the handshake completes, and it must complete within the
//!    server's handshake timeout.
//! 2. A connection may pipeline: the client sends several requests before reading replies. The
//!    server handles the requests of one connection in order and replies in the same order;
//!    the client checks every reply's id against the request it expects.
//! 3. Limits: a body is at most [`MAX_BODY`] bytes and a list at most [`MAX_ENTRIES`] entries;
//!    a frame over a limit, an unknown op, a truncated body or trailing bytes are protocol
//!    errors. The server answers a protocol error with an `ERROR` frame naming it and closes
//!    the connection (the stream may no longer be in step).
//! 4. Every reply except `ERROR` starts with an [`Occupancy`] snapshot stamped with a
//!    server-wide sequence number, so clients keep an up-to-date view of the pool's occupancy
//!    without extra calls (the newest sequence wins).

use hicache_core::{LayoutKind, PageKey};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

mod codec;

/// The 8 bytes that open a `HELLO` body.
pub const MAGIC: [u8; 8] = *b"HICRDMA\0";
/// The protocol version this crate speaks.
pub const VERSION: u16 = 2;
/// Bytes of the fixed frame head.
pub const HEAD_LEN: usize = 21;
/// Largest body accepted (16 MiB; a `READ` of 65 536 keys is about 3.5 MiB).
pub const MAX_BODY: u32 = 16 << 20;
/// Largest body of a handshake frame (`HELLO`, `AUTH`), before the peer is authenticated.
pub const MAX_HANDSHAKE_BODY: u32 = 8 << 10;
/// Largest list in one message.
pub const MAX_ENTRIES: usize = 65_536;
/// Largest payload of one frame (64 GiB: far above any batch, small enough to catch garbage).
pub const MAX_PAYLOAD: u64 = 64 << 30;
/// Read buffer of a connection. Small on purpose: tokio's `BufReader` hands a read of at
/// least its capacity straight to the socket, so page payloads land in page memory with one
/// copy; only frame heads and bodies (and a payload's first and last few bytes) are buffered.
pub const READ_BUFFER: usize = 16 << 10;
/// Write buffer of a connection (the same reasoning: payload writes bypass it).
pub const WRITE_BUFFER: usize = 64 << 10;
/// Largest number of regions a [`ServerInfo`] describes.
pub const MAX_REGIONS: usize = MAX_ENTRIES;
/// Set in the op of every reply (except `ERROR`).
pub const REPLY_BIT: u8 = 0x80;
/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a handshake MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;

/// Operation codes.
pub mod op {
    /// Handshake, step 1: magic, version, client name, client nonce.
    pub const HELLO: u8 = 1;
    /// Leading run of present keys.
    pub const EXISTS: u8 = 2;
    /// Read pages; the reply's payload carries the hits' bytes (TCP data plane).
    pub const READ: u8 = 3;
    /// Look pages up and lease them; the reply names where they lie (verbs data plane).
    pub const LOOKUP: u8 = 4;
    /// Release leases taken by `LOOKUP`.
    pub const RELEASE: u8 = 5;
    /// Reserve slots for pages to be written.
    pub const ALLOCATE: u8 = 6;
    /// Write page bytes (the payload) into reserved slots (TCP data plane).
    pub const WRITE: u8 = 7;
    /// Make written slots visible under their keys.
    pub const COMMIT: u8 = 8;
    /// Give reserved slots back without committing them.
    pub const ABORT: u8 = 9;
    /// Drop pages whose stored checksum is the one given (a client found them corrupt).
    pub const DROP: u8 = 10;
    /// Delete pages.
    pub const DELETE: u8 = 11;
    /// Server counters.
    pub const STATS: u8 = 12;
    /// Exchange RDMA queue-pair endpoints (verbs data plane).
    pub const VERBS_CONNECT: u8 = 13;
    /// Handshake, step 2: the client's MAC over both nonces; answered with [`super::ServerInfo`].
    pub const AUTH: u8 = 14;
    /// A refused request; body: code, message.
    pub const ERROR: u8 = 0x7f;
}

/// Error codes of `ERROR` frames.
pub mod code {
    /// The frame could not be parsed or broke a protocol rule.
    pub const PROTOCOL: u16 = 1;
    /// The client speaks another protocol version.
    pub const VERSION: u16 = 2;
    /// The request is valid but the server cannot serve it (e.g. verbs not available).
    pub const UNSUPPORTED: u16 = 3;
    /// The server failed internally.
    pub const INTERNAL: u16 = 4;
    /// Authentication failed (no credentials where the server requires them, a wrong MAC).
    pub const AUTH: u16 = 5;
    /// The tenant may not use a namespace named in the request.
    pub const FORBIDDEN: u16 = 6;
    /// A limit was reached (connections of the server or of the tenant); try again later.
    pub const BUSY: u16 = 7;
    /// The peer took too long (handshake, idle connection, an unconsumed reply).
    pub const TIMEOUT: u16 = 8;
}

/// What was wrong with a frame.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The handshake did not start with [`MAGIC`].
    #[error("bad magic {0:02x?}: not a hicache-rdma peer")]
    BadMagic(Vec<u8>),
    /// The peer speaks another version.
    #[error(
        "unsupported protocol version {got} (this side speaks {want}): run the same \
         hicache-rdma release on client and server"
    )]
    Version {
        /// The peer's version.
        got: u16,
        /// Ours.
        want: u16,
    },
    /// An op code this side does not know (or not in this direction).
    #[error("unknown op {0:#04x}")]
    UnknownOp(u8),
    /// A frame over a size limit.
    #[error("{what} of {len} exceeds the limit of {max}")]
    TooLarge {
        /// Which field.
        what: &'static str,
        /// Its value.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A body ended early.
    #[error("truncated body: {0} missing")]
    Truncated(&'static str),
    /// A body had bytes after its message.
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
    /// A field has a value outside its domain.
    #[error("invalid {what}: {value}")]
    Invalid {
        /// Which field.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// A reply did not match the request it answers.
    #[error("reply mismatch: expected {expected}, got {got}")]
    Mismatch {
        /// What was expected.
        expected: String,
        /// What came.
        got: String,
    },
    /// The first frame was not `HELLO`.
    #[error("expected HELLO as the first frame, got op {0:#04x}")]
    NoHello(u8),
    /// The second frame was not `AUTH`.
    #[error("expected AUTH after HELLO, got op {0:#04x}")]
    NoAuth(u8),
}

/// The fixed head of a frame.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FrameHead {
    /// Bytes of the body.
    pub body_len: u32,
    /// Bytes of raw payload after the body.
    pub payload_len: u64,
    /// Request id (echoed in the reply).
    pub id: u64,
    /// Operation code.
    pub op: u8,
}

impl FrameHead {
    /// Encodes the head.
    pub fn encode(&self) -> [u8; HEAD_LEN] {
        let mut b = [0u8; HEAD_LEN];
        b[..4].copy_from_slice(&self.body_len.to_le_bytes());
        b[4..12].copy_from_slice(&self.payload_len.to_le_bytes());
        b[12..20].copy_from_slice(&self.id.to_le_bytes());
        b[20] = self.op;
        b
    }

    /// Decodes and checks the limits.
    pub fn decode(b: &[u8; HEAD_LEN]) -> Result<Self, ProtocolError> {
        let h = Self {
            body_len: u32::from_le_bytes(b[..4].try_into().expect("4 bytes")),
            payload_len: u64::from_le_bytes(b[4..12].try_into().expect("8 bytes")),
            id: u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")),
            op: b[20],
        };
        if h.body_len > MAX_BODY {
            return Err(ProtocolError::TooLarge {
                what: "frame body",
                len: h.body_len as u64,
                max: MAX_BODY as u64,
            });
        }
        if h.payload_len > MAX_PAYLOAD {
            return Err(ProtocolError::TooLarge {
                what: "frame payload",
                len: h.payload_len,
                max: MAX_PAYLOAD,
            });
        }
        Ok(h)
    }
}

/// One page of a `READ`, `LOOKUP` or `ALLOCATE`: its key and the metadata the caller has.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PageReq {
    /// The page's key (namespace included).
    pub key: PageKey,
    /// Byte length.
    pub len: u64,
    /// Layout tag ([`LayoutKind::tag`]).
    pub layout: u8,
}

/// The layout of a tag, if valid.
pub fn layout_of(tag: u8) -> Option<LayoutKind> {
    [
        LayoutKind::LayerFirst,
        LayoutKind::PageFirst,
        LayoutKind::PageFirstDirect,
    ]
    .into_iter()
    .find(|l| l.tag() == tag)
}

/// A memory region of the server's pool, as published to clients.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RegionDesc {
    /// Region number (slots name it).
    pub id: u32,
    /// Bytes.
    pub len: u64,
    /// Virtual address on the server (for RDMA; 0 when not registered).
    pub addr: u64,
    /// Remote key of its RDMA registration (0 when not registered).
    pub rkey: u32,
}

/// What the server tells a client at the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// The server's protocol version.
    pub version: u16,
    /// A random id of this server process (a client notices a restart).
    pub server_id: u64,
    /// Bytes of the whole pool.
    pub pool_bytes: u64,
    /// Largest page accepted.
    pub max_page_bytes: u64,
    /// Largest list accepted in one request.
    pub max_batch: u32,
    /// Lifetime of a `LOOKUP` lease, in milliseconds.
    pub lease_ms: u32,
    /// Lifetime of an uncommitted reservation, in milliseconds.
    pub alloc_ttl_ms: u32,
    /// Whether the regions are registered for RDMA (verbs data plane available).
    pub verbs: bool,
    /// The pool's regions.
    pub regions: Vec<RegionDesc>,
}

/// The pool's occupancy, stamped with a server-wide sequence number.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    /// Increases with every reply the server sends.
    pub seq: u64,
    /// Committed pages.
    pub pages: u64,
    /// Bytes of committed pages.
    pub bytes: u64,
    /// Pages evicted since the server started.
    pub evicted_pages: u64,
    /// Bytes evicted since the server started.
    pub evicted_bytes: u64,
}

/// Server counters (`STATS`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Occupancy now.
    pub occupancy: Occupancy,
    /// Bytes of the pool.
    pub pool_bytes: u64,
    /// Bytes reserved by uncommitted allocations.
    pub reserved_bytes: u64,
    /// Uncommitted reservations.
    pub reservations: u64,
    /// Live leases (held by in-flight reads).
    pub leases: u64,
    /// Reservations given back because their connection closed or their time ran out.
    pub reclaimed_reservations: u64,
    /// Leases that ran out before being released.
    pub expired_leases: u64,
    /// Connections accepted since start.
    pub connections: u64,
    /// Frames refused as protocol errors.
    pub protocol_errors: u64,
    /// Handshakes refused for bad or missing credentials (failed TLS handshakes included).
    pub auth_failures: u64,
    /// Requests refused because a key's namespace is not the tenant's.
    pub forbidden: u64,
    /// Connections refused at a connection limit.
    pub refused_connections: u64,
    /// Connections closed for a timeout (handshake, idle, an unconsumed reply).
    pub timed_out_connections: u64,
    /// Connections open now (authenticated or not).
    pub open_connections: u64,
}

/// An RDMA RC queue pair's address, exchanged by `VERBS_CONNECT`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct VerbsEndpoint {
    /// Port LID (InfiniBand).
    pub lid: u16,
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Port GID (RoCE).
    pub gid: [u8; 16],
}

/// Per-page answer of `READ`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ReadStatus {
    /// Absent.
    Miss,
    /// Present with other metadata (layout or length).
    Mismatch,
    /// Present; its bytes follow in the payload, in page order.
    Hit {
        /// XXH3-64 stored at commit.
        checksum: u64,
    },
}

/// Per-page answer of `LOOKUP`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LookupStatus {
    /// Absent.
    Miss,
    /// Present with other metadata.
    Mismatch,
    /// Present and leased.
    Hit {
        /// Region of the page.
        region: u32,
        /// Offset in the region.
        offset: u64,
        /// XXH3-64 stored at commit.
        checksum: u64,
        /// Lease to release after reading.
        lease: u64,
    },
}

/// Per-page answer of `ALLOCATE`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AllocStatus {
    /// A slot reserved for the page.
    Slot {
        /// Reservation id (for `WRITE` / `COMMIT` / `ABORT`).
        id: u64,
        /// Region of the slot.
        region: u32,
        /// Offset in the region.
        offset: u64,
    },
    /// The page is committed with the same metadata; nothing to write.
    Present,
    /// The page is larger than the server accepts.
    TooLarge {
        /// The largest page accepted.
        max: u64,
    },
    /// No room, and nothing evictable.
    NoSpace,
    /// The page has no bytes.
    Empty,
}

/// A request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Handshake, step 1.
    Hello {
        /// Must be [`MAGIC`].
        magic: [u8; 8],
        /// The client's [`VERSION`].
        version: u16,
        /// A name for logs.
        client: String,
        /// The client's fresh nonce.
        nonce: [u8; NONCE_LEN],
    },
    /// Handshake, step 2.
    Auth {
        /// The client's MAC (`auth::client_mac`); `None` without credentials.
        mac: Option<[u8; MAC_LEN]>,
    },
    /// Leading run.
    Exists {
        /// Keys, in order.
        keys: Vec<PageKey>,
    },
    /// Read pages over TCP.
    Read {
        /// Pages, in order.
        pages: Vec<PageReq>,
    },
    /// Look up and lease pages (verbs).
    Lookup {
        /// Pages, in order.
        pages: Vec<PageReq>,
    },
    /// Release leases.
    Release {
        /// Lease ids.
        leases: Vec<u64>,
    },
    /// Reserve slots.
    Allocate {
        /// Pages, in order.
        pages: Vec<PageReq>,
    },
    /// Write the payload into slots: `(reservation, len)` in payload order.
    Write {
        /// Slots and their byte counts.
        slots: Vec<(u64, u64)>,
    },
    /// Commit slots: `(reservation, checksum)`.
    Commit {
        /// Slots and the XXH3-64 of their bytes.
        slots: Vec<(u64, u64)>,
    },
    /// Give slots back.
    Abort {
        /// Reservation ids.
        slots: Vec<u64>,
    },
    /// Drop pages whose stored checksum matches.
    Drop {
        /// Keys and the checksum they were read with.
        pages: Vec<(PageKey, u64)>,
    },
    /// Delete pages.
    Delete {
        /// Keys.
        keys: Vec<PageKey>,
    },
    /// Counters.
    Stats,
    /// Queue-pair exchange.
    VerbsConnect {
        /// The client's endpoint.
        endpoint: VerbsEndpoint,
    },
}

/// A reply body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Handshake, step 1 answered.
    Hello {
        /// The server's fresh nonce.
        nonce: [u8; NONCE_LEN],
        /// Whether the server requires credentials (`false`: started with
        /// `--insecure-no-auth`).
        auth: bool,
    },
    /// Handshake accepted.
    Auth {
        /// What the client needs to know.
        info: ServerInfo,
        /// The server's proof (`auth::server_proof`); `None` without credentials.
        proof: Option<[u8; MAC_LEN]>,
    },
    /// Leading run.
    Exists {
        /// Number of leading keys present.
        run: u32,
    },
    /// Per page; hits' bytes follow in the payload.
    Read(Vec<ReadStatus>),
    /// Per page.
    Lookup(Vec<LookupStatus>),
    /// Leases released.
    Release {
        /// How many were still live.
        released: u32,
    },
    /// Per page.
    Allocate(Vec<AllocStatus>),
    /// Per slot: whether it was written (false: the reservation is gone).
    Write(Vec<bool>),
    /// Per slot: whether it was committed (false: the reservation is gone).
    Commit(Vec<bool>),
    /// Reservations given back.
    Abort {
        /// How many were live.
        n: u32,
    },
    /// Pages dropped.
    Drop {
        /// How many.
        n: u32,
    },
    /// Pages deleted.
    Delete {
        /// How many.
        n: u32,
    },
    /// Counters.
    Stats(ServerStats),
    /// The server's endpoint.
    VerbsConnect(VerbsEndpoint),
}

/// A whole reply: occupancy plus the body, or an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyFrame {
    /// A successful reply.
    Ok(Occupancy, Reply),
    /// A refused request.
    Error {
        /// One of [`code`].
        code: u16,
        /// What was wrong.
        message: String,
    },
}

// ---------------------------------------------------------------------------------------------
// Frame I/O.

/// Either a protocol violation or an I/O error while reading or writing a frame.
#[derive(Debug, Error)]
pub enum FrameError {
    /// The peer broke the protocol.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The connection failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Writes a frame's head and body (the caller writes `payload_len` payload bytes after it).
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    id: u64,
    op: u8,
    body: &[u8],
    payload_len: u64,
) -> std::io::Result<()> {
    let head = FrameHead {
        body_len: body.len() as u32,
        payload_len,
        id,
        op,
    };
    let mut buf = Vec::with_capacity(HEAD_LEN + body.len());
    buf.extend_from_slice(&head.encode());
    buf.extend_from_slice(body);
    w.write_all(&buf).await
}

/// Reads a frame's head and body (the caller reads or skips the payload).
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<(FrameHead, Vec<u8>), FrameError> {
    read_frame_limited(r, MAX_BODY).await
}

/// [`read_frame`] refusing a body over `max_body` bytes before allocating it (the handshake
/// uses [`MAX_HANDSHAKE_BODY`], so an unauthenticated peer cannot make the server allocate
/// [`MAX_BODY`]).
pub async fn read_frame_limited<R: AsyncRead + Unpin>(
    r: &mut R,
    max_body: u32,
) -> Result<(FrameHead, Vec<u8>), FrameError> {
    let mut h = [0u8; HEAD_LEN];
    r.read_exact(&mut h).await?;
    let head = FrameHead::decode(&h)?;
    if head.body_len > max_body {
        return Err(ProtocolError::TooLarge {
            what: "frame body",
            len: head.body_len as u64,
            max: max_body as u64,
        }
        .into());
    }
    let mut body = vec![0u8; head.body_len as usize];
    r.read_exact(&mut body).await?;
    Ok((head, body))
}

/// Reads and discards `n` payload bytes.
pub async fn skip_payload<R: AsyncRead + Unpin>(r: &mut R, mut n: u64) -> std::io::Result<()> {
    let mut buf = vec![0u8; n.min(1 << 20) as usize];
    while n > 0 {
        let k = n.min(buf.len() as u64) as usize;
        r.read_exact(&mut buf[..k]).await?;
        n -= k as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_core::{NamespaceId, PageHash};
    use proptest::prelude::*;

    fn key(i: u8) -> PageKey {
        PageKey::new(NamespaceId([i; 16]), PageHash([i.wrapping_mul(3); 32]))
    }

    fn requests() -> Vec<Request> {
        vec![
            Request::Hello {
                magic: MAGIC,
                version: VERSION,
                client: "rank-0".into(),
                nonce: [7; NONCE_LEN],
            },
            Request::Auth { mac: None },
            Request::Auth {
                mac: Some([3; MAC_LEN]),
            },
            Request::Exists {
                keys: vec![key(1), key(2)],
            },
            Request::Read {
                pages: vec![PageReq {
                    key: key(3),
                    len: 4096,
                    layout: 2,
                }],
            },
            Request::Lookup { pages: vec![] },
            Request::Release {
                leases: vec![1, 2, 3],
            },
            Request::Allocate {
                pages: vec![PageReq {
                    key: key(4),
                    len: 8 << 20,
                    layout: 1,
                }],
            },
            Request::Write {
                slots: vec![(7, 4096)],
            },
            Request::Commit {
                slots: vec![(7, 0xdead_beef)],
            },
            Request::Abort { slots: vec![9] },
            Request::Drop {
                pages: vec![(key(5), 42)],
            },
            Request::Delete { keys: vec![key(6)] },
            Request::Stats,
            Request::VerbsConnect {
                endpoint: VerbsEndpoint {
                    lid: 3,
                    qpn: 77,
                    psn: 5,
                    gid: [9; 16],
                },
            },
        ]
    }

    #[test]
    fn requests_round_trip() {
        for r in requests() {
            let b = r.encode();
            assert_eq!(Request::decode(r.op(), &b).unwrap(), r);
            // Every strict prefix is truncated (or, for empty bodies, trailing checks pass).
            for cut in 0..b.len() {
                assert!(
                    Request::decode(r.op(), &b[..cut]).is_err(),
                    "{r:?} cut {cut}"
                );
            }
            let mut long = b.clone();
            long.push(0);
            assert_eq!(
                Request::decode(r.op(), &long),
                Err(ProtocolError::Trailing(1))
            );
        }
    }

    #[test]
    fn replies_round_trip() {
        let occ = Occupancy {
            seq: 9,
            pages: 2,
            bytes: 100,
            evicted_pages: 1,
            evicted_bytes: 50,
        };
        let info = ServerInfo {
            version: VERSION,
            server_id: 2,
            pool_bytes: 4096,
            max_page_bytes: 4096,
            max_batch: 128,
            lease_ms: 1,
            alloc_ttl_ms: 1,
            verbs: true,
            regions: vec![],
        };
        let replies = vec![
            Reply::Hello {
                nonce: [1; NONCE_LEN],
                auth: true,
            },
            Reply::Auth {
                proof: None,
                info: info.clone(),
            },
            Reply::Auth {
                proof: Some([4; MAC_LEN]),
                info: ServerInfo {
                    version: VERSION,
                    server_id: 1,
                    pool_bytes: 1 << 30,
                    max_page_bytes: 1 << 28,
                    max_batch: 4096,
                    lease_ms: 5000,
                    alloc_ttl_ms: 30000,
                    verbs: false,
                    regions: vec![RegionDesc {
                        id: 0,
                        len: 1 << 30,
                        addr: 0,
                        rkey: 0,
                    }],
                },
            },
            Reply::Exists { run: 3 },
            Reply::Read(vec![
                ReadStatus::Miss,
                ReadStatus::Mismatch,
                ReadStatus::Hit { checksum: 5 },
            ]),
            Reply::Lookup(vec![LookupStatus::Hit {
                region: 1,
                offset: 4096,
                checksum: 3,
                lease: 8,
            }]),
            Reply::Allocate(vec![
                AllocStatus::Slot {
                    id: 1,
                    region: 0,
                    offset: 0,
                },
                AllocStatus::Present,
                AllocStatus::TooLarge { max: 10 },
                AllocStatus::NoSpace,
                AllocStatus::Empty,
            ]),
            Reply::Write(vec![true, false]),
            Reply::Commit(vec![true]),
            Reply::Release { released: 1 },
            Reply::Abort { n: 2 },
            Reply::Drop { n: 0 },
            Reply::Delete { n: 4 },
            Reply::Stats(ServerStats {
                occupancy: occ,
                pool_bytes: 10,
                timed_out_connections: 3,
                ..ServerStats::default()
            }),
            Reply::VerbsConnect(VerbsEndpoint::default()),
        ];
        for r in replies {
            let f = ReplyFrame::Ok(occ, r);
            let b = f.encode();
            assert_eq!(ReplyFrame::decode(f.op(), &b).unwrap(), f);
        }
        let e = ReplyFrame::Error {
            code: code::VERSION,
            message: "nope".into(),
        };
        assert_eq!(ReplyFrame::decode(op::ERROR, &e.encode()).unwrap(), e);
    }

    #[test]
    fn heads_check_limits() {
        let h = FrameHead {
            body_len: MAX_BODY + 1,
            payload_len: 0,
            id: 1,
            op: op::EXISTS,
        };
        assert!(matches!(
            FrameHead::decode(&h.encode()),
            Err(ProtocolError::TooLarge { .. })
        ));
        let ok = FrameHead {
            body_len: 10,
            payload_len: 1 << 20,
            id: 99,
            op: op::WRITE,
        };
        assert_eq!(FrameHead::decode(&ok.encode()).unwrap(), ok);
    }

    #[test]
    fn bad_magic_and_unknown_ops() {
        let mut b = Request::Hello {
            magic: MAGIC,
            version: VERSION,
            client: String::new(),
            nonce: [0; NONCE_LEN],
        }
        .encode();
        b[0] = b'X';
        assert!(matches!(
            Request::decode(op::HELLO, &b),
            Err(ProtocolError::BadMagic(_))
        ));
        // A version-1 HELLO (magic, version, name; no nonce) is a version error, not a
        // truncated body: an old client learns what is wrong.
        let mut old = MAGIC.to_vec();
        old.extend_from_slice(&1u16.to_le_bytes());
        old.extend_from_slice(&3u32.to_le_bytes());
        old.extend_from_slice(b"old");
        assert_eq!(
            Request::decode(op::HELLO, &old),
            Err(ProtocolError::Version {
                got: 1,
                want: VERSION
            })
        );
        assert_eq!(
            Request::decode(0x42, &[]),
            Err(ProtocolError::UnknownOp(0x42))
        );
        assert_eq!(
            ReplyFrame::decode(op::EXISTS, &[]),
            Err(ProtocolError::UnknownOp(op::EXISTS))
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Decoding arbitrary bytes never panics, whatever the op.
        #[test]
        fn garbage_never_panics(op in any::<u8>(), body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Request::decode(op, &body);
            let _ = ReplyFrame::decode(op, &body);
        }
    }
}
