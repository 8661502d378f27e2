//! The frame I/O a connection's parts share: the buffered halves ([`Rd`], [`Wr`]), how a
//! connection ends ([`End`]), time-bounded steps ([`bounded`]), replies ([`send`]) and
//! refusals ([`refuse_request`]). Below the connection loop (`conn`), the handshake
//! (`session`) and the request handlers (`handle`), which all use it and none of which it
//! imports.

use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader, BufWriter};

use super::Shared;
use crate::protocol::{self, FrameError, ProtocolError, Reply, ReplyFrame, op};
use crate::tls::{BoxRead, BoxWrite};

/// An error frame's code and message, for a request refused while the connection goes on.
pub(super) type Refusal = (u16, String);

/// The buffered read half of a connection.
pub(super) type Rd = BufReader<BoxRead>;
/// The buffered write half of a connection.
pub(super) type Wr = BufWriter<BoxWrite>;

/// Why a connection ends early.
#[derive(Debug)]
pub(super) enum End {
    /// A frame broke the protocol.
    Protocol(ProtocolError),
    /// The socket failed (or the peer closed mid-frame).
    Io(std::io::Error),
    /// The peer took too long; `silent`: close without an error frame (idle).
    Timeout {
        what: &'static str,
        ms: u32,
        silent: bool,
    },
    /// Refused with an error frame (authentication, a tenant's connection limit).
    Refused { code: u16, message: String },
}

impl From<FrameError> for End {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Protocol(p) => End::Protocol(p),
            FrameError::Io(e) => End::Io(e),
        }
    }
}

impl From<ProtocolError> for End {
    fn from(e: ProtocolError) -> Self {
        End::Protocol(e)
    }
}

impl From<std::io::Error> for End {
    fn from(e: std::io::Error) -> Self {
        End::Io(e)
    }
}

/// Runs `f`, ending the connection if it takes longer than `ms`.
pub(super) async fn bounded<T, E: Into<End>>(
    ms: u32,
    what: &'static str,
    silent: bool,
    f: impl std::future::Future<Output = std::result::Result<T, E>>,
) -> std::result::Result<T, End> {
    match tokio::time::timeout(Duration::from_millis(ms as u64), f).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(End::Timeout { what, ms, silent }),
    }
}

/// Sends an `ERROR` frame for request `id` and flushes.
pub(super) async fn send_error(
    w: &mut Wr,
    id: u64,
    code: u16,
    message: &str,
) -> std::io::Result<()> {
    let f = ReplyFrame::Error {
        code,
        message: message.to_string(),
    };
    protocol::write_frame(w, id, op::ERROR, &f.encode(), 0).await?;
    w.flush().await
}

/// Sends `reply` with the pool's current occupancy (the caller writes `payload_len` bytes
/// after it).
pub(super) async fn send(
    shared: &Shared,
    w: &mut Wr,
    id: u64,
    reply: Reply,
    payload_len: u64,
) -> std::io::Result<()> {
    let occ = shared.occupancy(&shared.index.lock());
    let f = ReplyFrame::Ok(occ, reply);
    protocol::write_frame(w, id, f.op(), &f.encode(), payload_len).await
}

/// Answers request `id` with an error frame; the connection goes on.
pub(super) async fn refuse_request(
    w: &mut Wr,
    id: u64,
    idle_ms: u32,
    code: u16,
    message: String,
) -> Result<bool, End> {
    bounded(
        idle_ms,
        "sending a reply",
        false,
        send_error(w, id, code, &message),
    )
    .await
    .map(|()| false)
}
