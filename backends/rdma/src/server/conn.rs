//! One connection's life: the byte stream (TLS or not), the request loop with its time
//! limits and protocol checks, and how the connection ends ([`End`]: an error frame, or
//! silence).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;

use super::Shared;
use super::frames::{End, Rd, Wr, bounded, refuse_request, send_error};
use super::handle::handle;
use super::session::handshake;
use crate::protocol::{self, FrameHead, ProtocolError, Request, code};
use crate::tls::{BoxRead, BoxWrite};

/// How long a refusal or a closing error frame may take to send.
const FAREWELL: Duration = Duration::from_secs(1);

/// The connection's byte stream: `stream` itself, or with TLS on, the TLS session after its
/// handshake (bounded by `handshake_ms`; a failed or slow handshake ends the connection
/// without a word, since the peer does not speak TLS or is not trusted).
async fn open_stream(
    shared: &Shared,
    stream: TcpStream,
) -> std::result::Result<(BoxRead, BoxWrite), End> {
    let _ = stream.set_nodelay(true);
    match &shared.tls {
        None => Ok(crate::tls::split_tcp(stream)),
        Some(acceptor) => {
            let tls = bounded(
                shared.opts.handshake_ms,
                "the TLS handshake",
                true,
                acceptor.accept(stream),
            )
            .await?;
            Ok(crate::tls::split(tls))
        }
    }
}

/// Tells a connection it is refused, then closes it once the peer has had a moment to read
/// the error (reading what it sent meanwhile, so the close is not a reset that loses the
/// error frame). Bounded by [`FAREWELL`] twice (plus the TLS handshake, if on).
pub(super) async fn refuse(shared: Arc<Shared>, stream: TcpStream, code: u16, message: String) {
    let Ok((mut r, w)) = open_stream(&shared, stream).await else {
        return;
    };
    let mut w = BufWriter::new(w);
    let _ = tokio::time::timeout(FAREWELL, send_error(&mut w, 0, code, &message)).await;
    let _ = tokio::time::timeout(FAREWELL, async {
        let _ = w.shutdown().await;
        let mut sink = [0u8; 4096];
        while matches!(r.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// Releases a connection's reservations and leases when its task ends, however it ends.
struct ConnGuard {
    shared: Arc<Shared>,
    conn: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.shared.index.lock().connection_closed(self.conn);
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            v.connection_closed(self.conn);
        }
        self.shared.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs connection `conn` from `peer` to its end, telling the peer why it ends where it
/// should hear it.
pub(super) async fn connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    conn: u64,
) {
    let _guard = ConnGuard {
        shared: shared.clone(),
        conn,
    };
    let (r, w) = match open_stream(&shared, stream).await {
        Ok(halves) => halves,
        Err(e) => {
            shared.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::info!("rdma server: TLS handshake with {peer} failed: {e:?}");
            return;
        }
    };
    let mut r = BufReader::with_capacity(crate::protocol::READ_BUFFER, r);
    let mut w = BufWriter::with_capacity(crate::protocol::WRITE_BUFFER, w);
    let farewell = match serve(&shared, &mut r, &mut w, conn, peer).await {
        Ok(()) => None,
        Err(End::Protocol(e)) => {
            shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("rdma server: protocol error from {peer}: {e}");
            let c = match e {
                ProtocolError::Version { .. } => code::VERSION,
                _ => code::PROTOCOL,
            };
            Some((c, e.to_string()))
        }
        Err(End::Io(e)) => {
            tracing::debug!("rdma server: connection {peer} ended: {e}");
            None
        }
        Err(End::Timeout { what, ms, silent }) => {
            shared.timed_out_connections.fetch_add(1, Ordering::Relaxed);
            tracing::info!("rdma server: closing {peer}: {what} took over {ms} ms");
            (!silent).then(|| {
                (
                    code::TIMEOUT,
                    format!("closing the connection: {what} took over {ms} ms"),
                )
            })
        }
        Err(End::Refused { code, message }) => {
            tracing::warn!("rdma server: refusing {peer}: {message}");
            Some((code, message))
        }
    };
    if let Some((c, m)) = farewell {
        let _ = tokio::time::timeout(FAREWELL, send_error(&mut w, 0, c, &m)).await;
    }
}

/// Serves one connection until it closes (`Ok`) or fails.
async fn serve(
    shared: &Arc<Shared>,
    r: &mut Rd,
    w: &mut Wr,
    conn: u64,
    peer: SocketAddr,
) -> Result<(), End> {
    let o = &shared.opts;
    let session = bounded(
        o.handshake_ms,
        "the handshake",
        false,
        handshake(shared, r, w, conn, peer),
    )
    .await?;
    // A connection carrying an RDMA queue pair may stay quiet (its reads bypass the socket).
    let mut verbs_attached = false;
    loop {
        let idle = (!verbs_attached).then_some(o.idle_ms);
        let Some((head, req)) = next_request(r, idle, o.idle_ms, shared.info.max_batch).await?
        else {
            return Ok(());
        };
        if let Some((code, message)) = session.refusal(&req, peer) {
            refuse_request(w, head.id, o.idle_ms, code, message).await?;
            continue;
        }
        let attach = matches!(req, Request::VerbsConnect { .. });
        let served = handle(shared, r, w, conn, head.id, head.payload_len, req).await?;
        verbs_attached |= attach && served;
        if r.buffer().is_empty() {
            bounded(o.idle_ms, "sending a reply", false, w.flush()).await?;
        }
    }
}

/// Reads the next request (`None`: the peer closed between requests), waiting at most
/// `idle_ms` for it to start (`None`: no limit) and `stall_ms` for its body; checks its list
/// length against `max_batch` and that only `WRITE` carries a payload.
async fn next_request(
    r: &mut Rd,
    idle_ms: Option<u32>,
    stall_ms: u32,
    max_batch: u32,
) -> Result<Option<(FrameHead, Request)>, End> {
    let mut h = [0u8; protocol::HEAD_LEN];
    let got = match idle_ms {
        None => r.read_exact(&mut h).await,
        Some(ms) => {
            match tokio::time::timeout(Duration::from_millis(ms as u64), r.read_exact(&mut h)).await
            {
                Ok(got) => got,
                Err(_) => {
                    return Err(End::Timeout {
                        what: "waiting for a request (idle connection)",
                        ms,
                        silent: true,
                    });
                }
            }
        }
    };
    match got {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let head = FrameHead::decode(&h)?;
    let mut body = vec![0u8; head.body_len as usize];
    bounded(stall_ms, "a request body", false, r.read_exact(&mut body)).await?;
    let req = Request::decode(head.op, &body)?;
    check_request(&head, &req, max_batch)?;
    Ok(Some((head, req)))
}

/// Protocol limits of a decoded request: at most `max_batch` list entries, and a payload only
/// on `WRITE`.
fn check_request(head: &FrameHead, req: &Request, max_batch: u32) -> Result<(), ProtocolError> {
    let listed = match req {
        Request::Exists { keys } | Request::Delete { keys } => keys.len(),
        Request::Read { pages } | Request::Lookup { pages } | Request::Allocate { pages } => {
            pages.len()
        }
        Request::Write { slots } | Request::Commit { slots } => slots.len(),
        Request::Abort { slots } | Request::Release { leases: slots } => slots.len(),
        Request::Drop { pages } => pages.len(),
        _ => 0,
    };
    if listed > max_batch as usize {
        return Err(ProtocolError::TooLarge {
            what: "request list",
            len: listed as u64,
            max: max_batch as u64,
        });
    }
    if head.payload_len != 0 && !matches!(req, Request::Write { .. }) {
        return Err(ProtocolError::Invalid {
            what: "payload length of a request without payload",
            value: head.payload_len,
        });
    }
    Ok(())
}
