//! What both sockets do with one connection: accept it within the peer cap, read bounded
//! frames, do the NULL handshake, and write from a bounded queue.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, mpsc};

use super::codec::{self, Command, Frame, GREETING_LEN, Metadata, SIGNATURE_LEN};
use super::{Counters, HANDSHAKE_TIMEOUT, MAX_FRAME, MAX_FRAMES_PER_MESSAGE, MAX_PEERS, ZmtpError};

/// Bytes asked of the kernel per read.
const READ_CHUNK: usize = 4096;

/// Reads frames from a stream into a buffer that never holds more than one frame of at most
/// [`MAX_FRAME`] bytes plus its header and one read chunk.
pub(crate) struct FrameReader<R> {
    io: R,
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    fn new(io: R, buf: BytesMut) -> Self {
        Self { io, buf }
    }

    /// Reads more bytes; EOF is an error (the peer closed).
    async fn fill(&mut self) -> Result<(), ZmtpError> {
        self.buf.reserve(READ_CHUNK);
        let n = (&mut self.io)
            .take(READ_CHUNK as u64)
            .read_buf(&mut self.buf)
            .await?;
        if n == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        Ok(())
    }

    /// The next `n` raw bytes (the greeting).
    async fn bytes(&mut self, n: usize) -> Result<Bytes, ZmtpError> {
        while self.buf.len() < n {
            self.fill().await?;
        }
        Ok(self.buf.split_to(n).freeze())
    }

    /// The next frame.
    async fn frame(&mut self) -> Result<Frame, ZmtpError> {
        loop {
            if let Some(f) = codec::decode_frame(&mut self.buf, MAX_FRAME)? {
                return Ok(f);
            }
            self.fill().await?;
        }
    }

    /// The next message (its frames) or command. Commands are handed back as they come.
    pub(crate) async fn input(&mut self) -> Result<Input, ZmtpError> {
        let mut frames = Vec::new();
        loop {
            match self.frame().await? {
                Frame::Command(body) => return Ok(Input::Command(codec::parse_command(&body)?)),
                Frame::Message { more, body } => {
                    if frames.len() == MAX_FRAMES_PER_MESSAGE {
                        return Err(ZmtpError::TooManyFrames(MAX_FRAMES_PER_MESSAGE));
                    }
                    frames.push(body);
                    if !more {
                        return Ok(Input::Message(frames));
                    }
                }
            }
        }
    }
}

/// One thing a peer sent after the handshake.
pub(crate) enum Input {
    /// A whole message.
    Message(Vec<Bytes>),
    /// A command.
    Command(Command),
}

/// Answers the commands both sockets treat alike; `Ok(Some(cmd))` hands back the ones the
/// socket handles itself (SUBSCRIBE, CANCEL).
pub(crate) fn common_command(cmd: Command, outbox: &Outbox) -> Result<Option<Command>, ZmtpError> {
    match cmd {
        Command::Ping(context) => {
            let mut out = BytesMut::new();
            codec::encode_pong(&context, &mut out);
            // A peer whose queue is full is not reading; its PONG can wait for the next PING.
            let _ = outbox.try_send(out.freeze());
            Ok(None)
        }
        Command::Pong | Command::Other(_) => Ok(None),
        Command::Error(reason) => Err(ZmtpError::PeerError(reason)),
        Command::Ready(_) => Err(ZmtpError::NotReady("a second READY")),
        c @ (Command::Subscribe(_) | Command::Cancel(_)) => Ok(Some(c)),
    }
}

/// A connection after its handshake: the peer's metadata, the halves of the stream.
pub(crate) struct Connected {
    /// The peer's READY properties.
    pub meta: Metadata,
    /// Reads frames (with whatever the handshake read past READY).
    pub reader: FrameReader<OwnedReadHalf>,
    /// The write half, for [`write_queue`].
    pub writer: OwnedWriteHalf,
}

/// The NULL handshake as the server: greetings both ways, READY both ways, the peer's socket
/// type one of `accepts`; all within [`HANDSHAKE_TIMEOUT`].
pub(crate) async fn handshake(
    stream: TcpStream,
    our_type: &'static str,
    accepts: &[&str],
    identity: Option<&[u8]>,
) -> Result<Connected, ZmtpError> {
    let work = async {
        let mut stream = stream;
        stream.write_all(&codec::greeting()).await?;
        let mut reader = FrameReader::new(&mut stream, BytesMut::new());
        let sig = reader.bytes(SIGNATURE_LEN).await?;
        // Refuse garbage at its first bytes rather than after 64.
        codec::check_signature(&sig)?;
        let rest = reader.bytes(GREETING_LEN - SIGNATURE_LEN).await?;
        let mut whole = sig.to_vec();
        whole.extend_from_slice(&rest);
        codec::parse_greeting(&whole)?;
        // Our READY goes out before we read theirs: a client may wait for it.
        let mut out = BytesMut::new();
        codec::encode_ready(our_type, identity, &mut out);
        reader.io.write_all(&out).await?;
        let meta = match reader.frame().await? {
            Frame::Command(body) => match codec::parse_command(&body)? {
                Command::Ready(meta) => meta,
                Command::Error(reason) => return Err(ZmtpError::PeerError(reason)),
                _ => return Err(ZmtpError::NotReady("another command")),
            },
            Frame::Message { .. } => return Err(ZmtpError::NotReady("a message")),
        };
        let leftover = std::mem::take(&mut reader.buf);
        let peer_type = meta.socket_type.clone().unwrap_or_default();
        if !accepts.iter().any(|t| t.eq_ignore_ascii_case(&peer_type)) {
            let mut out = BytesMut::new();
            let reason = b"invalid socket type";
            let mut data = vec![reason.len() as u8];
            data.extend_from_slice(reason);
            codec::encode_command("ERROR", &data, &mut out);
            let _ = stream.write_all(&out).await;
            return Err(ZmtpError::SocketType(peer_type, our_type));
        }
        if let Some(id) = &meta.identity
            && id.len() > 255
        {
            return Err(ZmtpError::Identity(id.len()));
        }
        let (rd, writer) = stream.into_split();
        Ok(Connected {
            meta,
            reader: FrameReader::new(rd, leftover),
            writer,
        })
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, work).await {
        Ok(r) => r,
        Err(_) => Err(ZmtpError::HandshakeTimeout(HANDSHAKE_TIMEOUT)),
    }
}

/// A peer's outgoing queue: bounded, never awaited by the PUB, awaited with a deadline by the
/// ROUTER; `close` ends the connection.
#[derive(Clone, Debug)]
pub(crate) struct Outbox {
    tx: mpsc::Sender<Bytes>,
    pending: Arc<AtomicUsize>,
    close: Arc<Notify>,
}

/// Why a message was not queued.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NotQueued {
    /// The queue is full (the peer does not read fast enough).
    Full,
    /// The connection is gone.
    Closed,
}

impl Outbox {
    /// A queue of `len` messages and the receiver its writer drains.
    pub(crate) fn new(len: usize) -> (Self, mpsc::Receiver<Bytes>, Arc<AtomicUsize>) {
        let (tx, rx) = mpsc::channel(len);
        let pending = Arc::new(AtomicUsize::new(0));
        let outbox = Self {
            tx,
            pending: pending.clone(),
            close: Arc::new(Notify::new()),
        };
        (outbox, rx, pending)
    }

    /// Queues `wire` (encoded frames) if there is room.
    pub(crate) fn try_send(&self, wire: Bytes) -> Result<(), NotQueued> {
        self.pending.fetch_add(1, Ordering::Relaxed);
        self.tx.try_send(wire).map_err(|e| {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            match e {
                mpsc::error::TrySendError::Full(_) => NotQueued::Full,
                mpsc::error::TrySendError::Closed(_) => NotQueued::Closed,
            }
        })
    }

    /// Queues `wire`, waiting at most `limit` for room.
    pub(crate) async fn send_timeout(&self, wire: Bytes, limit: Duration) -> Result<(), NotQueued> {
        self.pending.fetch_add(1, Ordering::Relaxed);
        let r = self
            .tx
            .send_timeout(wire, limit)
            .await
            .map_err(|e| match e {
                mpsc::error::SendTimeoutError::Timeout(_) => NotQueued::Full,
                mpsc::error::SendTimeoutError::Closed(_) => NotQueued::Closed,
            });
        if r.is_err() {
            self.pending.fetch_sub(1, Ordering::Relaxed);
        }
        r
    }

    /// Whether everything queued was written to the kernel.
    pub(crate) fn is_flushed(&self) -> bool {
        self.pending.load(Ordering::Relaxed) == 0 || self.tx.is_closed()
    }

    /// Ends the connection.
    pub(crate) fn close(&self) {
        self.close.notify_one();
    }

    /// Resolves when [`Outbox::close`] was called.
    pub(crate) async fn closed(&self) {
        self.close.notified().await;
    }
}

/// Writes the queue to the peer until the queue closes or a write fails.
pub(crate) async fn write_queue(
    mut writer: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Bytes>,
    pending: Arc<AtomicUsize>,
) -> Result<(), ZmtpError> {
    while let Some(wire) = rx.recv().await {
        writer.write_all(&wire).await?;
        pending.fetch_sub(1, Ordering::Relaxed);
    }
    Ok(())
}

/// One served connection's place under [`MAX_PEERS`]; dropping it frees the place.
pub(crate) struct PeerSlot(Arc<Counters>);

impl Drop for PeerSlot {
    fn drop(&mut self) {
        self.0.peers.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts connections until the runtime ends, closing the ones beyond [`MAX_PEERS`] and
/// handing the others to `serve` (which runs them as tasks of their own).
pub(crate) async fn accept_loop<F>(
    listener: tokio::net::TcpListener,
    counters: Arc<Counters>,
    socket: &'static str,
    serve: F,
) where
    F: Fn(TcpStream, SocketAddr, PeerSlot),
{
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, or a connection reset before it was accepted: wait a
                // little rather than spin.
                tracing::warn!(socket, error = %e, "KV events: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let served = counters.peers.fetch_add(1, Ordering::Relaxed);
        let slot = PeerSlot(counters.clone());
        if served >= MAX_PEERS {
            let n = counters.refused_peers.fetch_add(1, Ordering::Relaxed) + 1;
            // Every refusal at debug; at warn only the 1st, 2nd, 4th... (a flood of connections
            // must not become a flood of log lines).
            if n.is_power_of_two() {
                tracing::warn!(socket, peer = %addr, max = MAX_PEERS, refused = n, "KV events: too many peers, connection refused");
            } else {
                tracing::debug!(socket, peer = %addr, max = MAX_PEERS, refused = n, "KV events: too many peers, connection refused");
            }
            drop(stream);
            drop(slot);
            continue;
        }
        let _ = stream.set_nodelay(true);
        serve(stream, addr, slot);
    }
}

/// Logs and counts how a connection ended.
pub(crate) fn ended(
    counters: &Counters,
    socket: &'static str,
    addr: SocketAddr,
    r: Result<(), ZmtpError>,
) {
    match r {
        Ok(()) => tracing::debug!(socket, peer = %addr, "KV events: peer closed"),
        Err(e) if e.is_protocol() => {
            let n = counters.closed_for_errors.fetch_add(1, Ordering::Relaxed) + 1;
            // At warn only the 1st, 2nd, 4th... (bad peers must not flood the log).
            if n.is_power_of_two() {
                tracing::warn!(socket, peer = %addr, error = %e, closed = n, "KV events: connection closed");
            } else {
                tracing::debug!(socket, peer = %addr, error = %e, closed = n, "KV events: connection closed");
            }
        }
        Err(e) => tracing::debug!(socket, peer = %addr, error = %e, "KV events: peer gone"),
    }
}
