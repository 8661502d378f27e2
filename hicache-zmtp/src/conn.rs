//! What servers and clients do alike with one connection: read bounded frames and messages,
//! and the NULL handshake.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use crate::ZmtpError;
use crate::codec::{self, Command, Frame, GREETING_LEN, Metadata, SIGNATURE_LEN};

/// What one connection may receive.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FrameLimits {
    /// The longest frame.
    pub max_frame: usize,
    /// The most frames of one message.
    pub max_frames: usize,
    /// The most bytes of one message, its frames together.
    pub max_message: usize,
    /// Bytes asked of the kernel per read.
    pub read_chunk: usize,
}

/// Reads frames from a stream into a buffer that never holds more than one frame of at most
/// `max_frame` bytes plus its header and one read chunk, and the frames of one message of at
/// most `max_message` bytes.
///
/// [`FrameReader::input`] is cancel-safe: a partly read message stays in the reader, so a
/// caller may race it against a timer.
pub(crate) struct FrameReader<R> {
    io: R,
    buf: BytesMut,
    limits: FrameLimits,
    /// The frames of the message being read.
    partial: Vec<Bytes>,
    partial_bytes: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(crate) fn new(io: R, buf: BytesMut, limits: FrameLimits) -> Self {
        Self {
            io,
            buf,
            limits,
            partial: Vec::new(),
            partial_bytes: 0,
        }
    }

    /// Reads more bytes; EOF is an error (the peer closed).
    async fn fill(&mut self) -> Result<(), ZmtpError> {
        let chunk = self.limits.read_chunk.max(64);
        self.buf.reserve(chunk);
        let n = (&mut self.io)
            .take(chunk as u64)
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

    /// The next frame, at most `max` bytes.
    async fn frame(&mut self, max: usize) -> Result<Frame, ZmtpError> {
        loop {
            if let Some(f) = codec::decode_frame(&mut self.buf, max)? {
                return Ok(f);
            }
            self.fill().await?;
        }
    }

    /// The next message (its frames) or command. Commands are handed back as they come, even
    /// between the frames of a message (they are not part of it).
    pub(crate) async fn input(&mut self) -> Result<Input, ZmtpError> {
        loop {
            // A command may be as long as a frame; a message frame at most what its message
            // has left. Either is checked from the header, before its body is buffered.
            let left = self.limits.max_message.saturating_sub(self.partial_bytes);
            let frame = loop {
                let max = match self.buf.first() {
                    Some(&flags) if codec::is_command(flags) => self.limits.max_frame,
                    _ => self.limits.max_frame.min(left),
                };
                if let Some(f) = codec::decode_frame(&mut self.buf, max)? {
                    break f;
                }
                self.fill().await?;
            };
            match frame {
                Frame::Command(body) => return Ok(Input::Command(codec::parse_command(&body)?)),
                Frame::Message { more, body } => {
                    if self.partial.len() == self.limits.max_frames {
                        return Err(ZmtpError::TooManyFrames(self.limits.max_frames));
                    }
                    self.partial_bytes += body.len();
                    self.partial.push(body);
                    if !more {
                        self.partial_bytes = 0;
                        return Ok(Input::Message(std::mem::take(&mut self.partial)));
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

/// A connection after its handshake: the peer's metadata, the halves of the stream.
pub(crate) struct Connected {
    /// The peer's READY properties.
    pub meta: Metadata,
    /// The peer's ZMTP minor version (1: it knows PING/PONG).
    pub minor: u8,
    /// Reads frames (with whatever the handshake read past READY).
    pub reader: FrameReader<OwnedReadHalf>,
    /// The write half.
    pub writer: OwnedWriteHalf,
}

/// Who we are in a handshake and whom we accept.
pub(crate) struct Role<'a> {
    /// Our socket type (`PUB`, `ROUTER`, `SUB`, `DEALER`).
    pub our_type: &'static str,
    /// The peer socket types we talk to.
    pub accepts: &'a [&'a str],
    /// The `Identity` property we send, if any.
    pub identity: Option<&'a [u8]>,
}

/// The NULL handshake (the same both ways): greetings, READY both ways, the peer's socket type
/// one of `role.accepts`; all within `timeout`.
pub(crate) async fn handshake(
    stream: TcpStream,
    role: Role<'_>,
    limits: FrameLimits,
    timeout: Duration,
) -> Result<Connected, ZmtpError> {
    let our_type = role.our_type;
    let work = async {
        let mut stream = stream;
        stream.write_all(&codec::greeting()).await?;
        let mut reader = FrameReader::new(&mut stream, BytesMut::new(), limits);
        let sig = reader.bytes(SIGNATURE_LEN).await?;
        // Refuse garbage at its first bytes rather than after 64.
        codec::check_signature(&sig)?;
        let rest = reader.bytes(GREETING_LEN - SIGNATURE_LEN).await?;
        let mut whole = sig.to_vec();
        whole.extend_from_slice(&rest);
        let greeting = codec::parse_greeting(&whole)?;
        // Our READY goes out before we read theirs: the other side may wait for it.
        let mut out = BytesMut::new();
        codec::encode_ready(our_type, role.identity, &mut out);
        reader.io.write_all(&out).await?;
        // READY is at most a few hundred bytes whatever the message limit.
        let meta = match reader.frame(limits.max_frame.min(4096)).await? {
            Frame::Command(body) => match codec::parse_command(&body)? {
                Command::Ready(meta) => meta,
                Command::Error(reason) => return Err(ZmtpError::PeerError(reason)),
                _ => return Err(ZmtpError::NotReady("another command")),
            },
            Frame::Message { .. } => return Err(ZmtpError::NotReady("a message")),
        };
        let leftover = std::mem::take(&mut reader.buf);
        let peer_type = meta.socket_type.clone().unwrap_or_default();
        if !role
            .accepts
            .iter()
            .any(|t| t.eq_ignore_ascii_case(&peer_type))
        {
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
            minor: greeting.minor,
            reader: FrameReader::new(rd, leftover, limits),
            writer,
        })
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(ZmtpError::HandshakeTimeout(timeout)),
    }
}
