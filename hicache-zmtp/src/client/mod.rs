//! The clients: [`SubClient`] (follows a PUB) and [`DealerClient`] (asks a ROUTER), with
//! [`ClientOptions`] and the connection machinery they share.
//!
//! A client is one TCP connection. It writes straight to its socket (nothing is queued) and
//! reads with the same bounds as the servers. An error from a read or a write means the
//! connection is lost: the client then answers [`ZmtpError::Closed`] forever, and the caller
//! connects again (a new connection, with a new `connection_id`).

mod dealer;
mod sub;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

use crate::ZmtpError;
use crate::codec::{self, Command};
use crate::conn::{self, FrameLimits, FrameReader, Input, Role};

pub use dealer::DealerClient;
pub use sub::SubClient;

/// Bytes a client asks of the kernel per read (batches can be megabytes).
const READ_CHUNK: usize = 64 << 10;

/// What a client accepts from its server and how it watches it. [`Default`] suits KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientOptions {
    /// The longest frame accepted, checked from its header before anything is buffered
    /// (default 64 MiB: a KV batch with long token lists can be megabytes).
    pub max_frame: usize,
    /// The most bytes of one message, its frames together (default 64 MiB).
    pub max_message: usize,
    /// The most frames of one message (default 16).
    pub max_frames_per_message: usize,
    /// How long connecting and the handshake may take together (default 5 s).
    pub handshake_timeout: Duration,
    /// Send a ZMTP 3.1 PING after this long without hearing from the server (default 5 s;
    /// `None`: never). Servers that speak only ZMTP 3.0 are not pinged.
    pub heartbeat_interval: Option<Duration>,
    /// With heartbeats on, the server is declared dead ([`ZmtpError::DeadPeer`]) when nothing
    /// at all arrived for this long after a PING (default 15 s).
    pub heartbeat_timeout: Duration,
    /// How long one write (a subscription, a request, a PONG) may wait on a server that does
    /// not read (default 5 s); past it the connection is lost.
    pub send_timeout: Duration,
    /// The DEALER's routing id (the `Identity` property); `None`: the server generates one.
    pub identity: Option<Bytes>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            max_frame: 64 << 20,
            max_message: 64 << 20,
            max_frames_per_message: 16,
            handshake_timeout: Duration::from_secs(5),
            heartbeat_interval: Some(Duration::from_secs(5)),
            heartbeat_timeout: Duration::from_secs(15),
            send_timeout: Duration::from_secs(5),
            identity: None,
        }
    }
}

/// A number no other connection of this process has had.
fn next_connection_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `tcp://HOST:PORT` (or `HOST:PORT`) to what `TcpStream::connect` takes.
fn host_port(endpoint: &str) -> Result<&str, ZmtpError> {
    let rest = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    if rest.contains("://") || !rest.contains(':') {
        return Err(ZmtpError::Endpoint(endpoint.to_string()));
    }
    Ok(rest)
}

/// One client connection after its handshake.
struct Conn {
    reader: FrameReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    opts: ClientOptions,
    /// Whether the server knows PING (ZMTP 3.1 or later).
    pings: bool,
    /// When something last arrived.
    heard: Instant,
    /// When our unanswered PING went out.
    pinged: Option<Instant>,
    id: u64,
    peer: std::net::SocketAddr,
    lost: bool,
}

impl Conn {
    async fn connect(
        endpoint: &str,
        our_type: &'static str,
        accepts: &[&str],
        opts: ClientOptions,
    ) -> Result<Self, ZmtpError> {
        let addr = host_port(endpoint)?;
        let limits = FrameLimits {
            max_frame: opts.max_frame,
            max_frames: opts.max_frames_per_message.max(1),
            max_message: opts.max_message,
            read_chunk: READ_CHUNK,
        };
        let deadline = Instant::now() + opts.handshake_timeout;
        let stream = tokio::time::timeout_at(deadline, TcpStream::connect(addr))
            .await
            .map_err(|_| ZmtpError::HandshakeTimeout(opts.handshake_timeout))??;
        let _ = stream.set_nodelay(true);
        let peer = stream.peer_addr()?;
        let left = deadline.saturating_duration_since(Instant::now());
        let role = Role {
            our_type,
            accepts,
            identity: opts.identity.as_deref(),
        };
        let c = conn::handshake(stream, role, limits, left).await?;
        Ok(Self {
            reader: c.reader,
            writer: c.writer,
            pings: c.minor >= 1,
            heard: Instant::now(),
            pinged: None,
            id: next_connection_id(),
            peer,
            opts,
            lost: false,
        })
    }

    /// Writes `bytes` within the send timeout; a failure loses the connection.
    async fn write(&mut self, bytes: &[u8]) -> Result<(), ZmtpError> {
        if self.lost {
            return Err(ZmtpError::Closed);
        }
        let limit = self.opts.send_timeout;
        let r = match tokio::time::timeout(limit, self.writer.write_all(bytes)).await {
            Ok(r) => r.map_err(ZmtpError::from),
            Err(_) => Err(ZmtpError::Timeout(limit)),
        };
        if r.is_err() {
            self.lost = true;
        }
        r
    }

    /// Sends one message.
    async fn send(&mut self, frames: &[Bytes]) -> Result<(), ZmtpError> {
        let mut out = BytesMut::new();
        codec::encode_message(frames, &mut out);
        self.write(&out).await
    }

    /// The next message, answering PINGs and sending ours on the way; `Err(Timeout)` (the
    /// connection kept) when `deadline` passes first.
    async fn recv(&mut self, deadline: Option<Instant>) -> Result<Vec<Bytes>, ZmtpError> {
        if self.lost {
            return Err(ZmtpError::Closed);
        }
        let r = self.recv_inner(deadline).await;
        if matches!(&r, Err(e) if !matches!(e, ZmtpError::Timeout(_))) {
            self.lost = true;
        }
        r
    }

    async fn recv_inner(&mut self, deadline: Option<Instant>) -> Result<Vec<Bytes>, ZmtpError> {
        let started = Instant::now();
        loop {
            // The next thing the heartbeat has to do, if any: send a PING, or give up.
            let beat = match (self.opts.heartbeat_interval, self.pings) {
                (Some(ivl), true) => Some(match self.pinged {
                    None => (self.heard + ivl, false),
                    Some(at) => (at + self.opts.heartbeat_timeout, true),
                }),
                _ => None,
            };
            let wake = match (beat, deadline) {
                (Some((b, _)), Some(d)) => Some(b.min(d)),
                (Some((b, _)), None) => Some(b),
                (None, d) => d,
            };
            let input = match wake {
                Some(w) => match tokio::time::timeout_at(w, self.reader.input()).await {
                    Ok(i) => Some(i?),
                    Err(_) => None,
                },
                None => Some(self.reader.input().await?),
            };
            let Some(input) = input else {
                let now = Instant::now();
                if let Some(d) = deadline
                    && now >= d
                {
                    return Err(ZmtpError::Timeout(d.saturating_duration_since(started)));
                }
                match beat {
                    Some((_, true)) => {
                        return Err(ZmtpError::DeadPeer(
                            now.saturating_duration_since(self.heard),
                        ));
                    }
                    Some((_, false)) => {
                        let mut out = BytesMut::new();
                        codec::encode_ping(self.opts.heartbeat_timeout, b"", &mut out);
                        self.write(&out).await?;
                        self.pinged = Some(now);
                    }
                    None => {}
                }
                continue;
            };
            self.heard = Instant::now();
            self.pinged = None;
            match input {
                Input::Message(frames) => return Ok(frames),
                Input::Command(Command::Ping(context)) => {
                    let mut out = BytesMut::new();
                    codec::encode_pong(&context, &mut out);
                    self.write(&out).await?;
                }
                Input::Command(Command::Error(reason)) => return Err(ZmtpError::PeerError(reason)),
                Input::Command(Command::Ready(_)) => {
                    return Err(ZmtpError::NotReady("a second READY"));
                }
                // PONG (heard is updated above), SUBSCRIBE/CANCEL from a confused server, and
                // unknown commands are ignored.
                Input::Command(_) => {}
            }
        }
    }
}
