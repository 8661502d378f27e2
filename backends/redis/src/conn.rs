//! The data path's own connections: one TCP (or rustls TLS) stream per connection, written
//! with vectored writes (a page's bytes go from the caller's buffer to the socket, never
//! through a command buffer) and read through a small reused buffer by the RESP reader
//! ([`resp`](crate::resp)); a `GET` reply's page bytes are read straight into the caller's
//! page buffer ([`Conn::read_page`]).
//!
//! A connection is used by one pipeline at a time (its replies come back in order on it), so
//! `WAIT` at the end of a pipeline answers for that pipeline's writes. A connection on which
//! anything failed (I/O, a reply that is not RESP, a timeout) is dropped by its user, never
//! reused: its position in the reply stream is unknown.
//!
//! Memory: every read names the [`Limits`] of the reply it expects; the buffer grows only
//! while one reply is longer than it, to at most [`Limits::max_reply`], and a claimed length
//! above its bound is an error before a byte is buffered for it (the connection is then
//! dropped by its user). A page body is read straight into the caller's buffer, whose size
//! the caller chose; a value of another length is skipped through the fixed buffer.
//!
//! Errors keep their cause apart: [`ConnError::Closed`] (the peer closed the connection),
//! [`ConnError::Io`] (reset and other socket errors), [`ConnError::Resp`] (bytes that are not
//! RESP, or a reply over its bound).

use std::io::IoSlice;
use std::sync::Arc;

use hicache_core::PageKey;
use hicache_storage::PageBufMut;
use hicache_storage::checksum::Checksummer;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::config::{RedisOptions, split_addr};
use crate::resp::{self, Frame, Head, Limits, RespError};
use crate::value::{self, Damage, HEADER_LEN};

/// Bytes of the read buffer kept per connection.
const READ_BUF: usize = 64 << 10;
/// Reads at least this long go straight from the socket into the page buffer.
const DIRECT_READ: usize = 16 << 10;
/// Largest piece of a page body read from the socket at once: each piece is checksummed
/// right after it lands, while it is still in the CPU cache.
const BODY_PIECE: usize = 256 << 10;

/// Why a connection failed. The connection is unusable after any of these.
#[derive(Debug, Error)]
pub enum ConnError {
    /// The peer closed the connection (end of stream before a whole reply).
    #[error("connection closed by the server")]
    Closed,
    /// The socket failed (reset, refused, unreachable).
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent bytes that are not a RESP reply, or a reply over its bound.
    #[error("protocol error: {0}")]
    Resp(#[from] RespError),
    /// TLS setup or handshake failed.
    #[error("tls: {0}")]
    Tls(String),
    /// `AUTH` was refused.
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The address is not `host:port`.
    #[error("not a host:port address")]
    Address,
    /// `EXEC` of a ranged page read was refused for permissions (`NOPERM`) without the
    /// transaction being discarded (servers before 6.2 keep it open): the replies that follow
    /// on the connection are not those of the commands sent.
    #[error("EXEC refused ({0}); the connection may still be inside MULTI")]
    ExecRefused(String),
}

/// What a `GET` reply held, read by [`Conn::read_page`].
#[derive(Debug, PartialEq)]
pub enum PageRead {
    /// The page, verified, is in the caller's buffer.
    Hit,
    /// No value under the key.
    Nil,
    /// A page value whose layout or length differs from the caller's buffer (another
    /// configuration wrote it): a miss, the buffer untouched.
    OtherMeta,
    /// A value that is not this page (damaged, foreign, truncated): the buffer holds no
    /// bytes of it (zeroed where the body had been read into it).
    Damaged(Damage),
    /// Another reply (an error such as `MOVED`, or a value of another type).
    Frame(Frame),
}

impl ConnError {
    /// Whether the peer broke the protocol (garbage, a reply over its bound), as opposed to a
    /// closed or failed socket.
    pub fn is_protocol(&self) -> bool {
        matches!(self, ConnError::Resp(_))
    }
}

trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

/// How to open a connection: TLS and credentials, shared by every connection.
pub struct Connector {
    tls: Option<tokio_rustls::TlsConnector>,
    auth: Option<(Option<String>, String)>,
}

impl Connector {
    /// The connector for `opts`; `root_pem` is the content of `tls_ca_file` (else the
    /// system's roots are trusted).
    pub fn new(opts: &RedisOptions, root_pem: Option<&[u8]>) -> Result<Self, ConnError> {
        let tls = if opts.tls {
            let mut roots = rustls::RootCertStore::empty();
            match root_pem {
                Some(pem) => {
                    for c in CertificateDer::pem_slice_iter(pem) {
                        let c = c.map_err(|e| ConnError::Tls(format!("tls_ca_file: {e}")))?;
                        roots
                            .add(c)
                            .map_err(|e| ConnError::Tls(format!("tls_ca_file: {e}")))?;
                    }
                }
                None => {
                    for c in rustls_native_certs::load_native_certs().certs {
                        // A system certificate rustls cannot use is skipped, as browsers do.
                        let _ = roots.add(c);
                    }
                }
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| ConnError::Tls(e.to_string()))?
                .with_root_certificates(roots)
                .with_no_client_auth();
            Some(tokio_rustls::TlsConnector::from(Arc::new(config)))
        } else {
            None
        };
        Ok(Self {
            tls,
            auth: opts.password.clone().map(|p| (opts.username.clone(), p)),
        })
    }

    /// Opens a connection to `addr` (`host:port`) and authenticates it.
    pub async fn connect(&self, addr: &str) -> Result<Conn, ConnError> {
        let (host, port) = split_addr(addr).ok_or(ConnError::Address)?;
        let tcp = TcpStream::connect((host.as_str(), port)).await?;
        tcp.set_nodelay(true)?;
        let io: Box<dyn Stream> = match &self.tls {
            Some(tls) => {
                let name = ServerName::try_from(host.clone())
                    .map_err(|e| ConnError::Tls(format!("server name {host:?}: {e}")))?;
                Box::new(
                    tls.connect(name, tcp)
                        .await
                        .map_err(|e| ConnError::Tls(e.to_string()))?,
                )
            }
            None => Box::new(tcp),
        };
        let mut conn = Conn {
            io,
            buf: vec![0; READ_BUF],
            start: 0,
            end: 0,
        };
        if let Some((user, pass)) = &self.auth {
            let mut cmd = Vec::new();
            match user {
                Some(u) => resp::put_command(&mut cmd, &[b"AUTH", u.as_bytes(), pass.as_bytes()]),
                None => resp::put_command(&mut cmd, &[b"AUTH", pass.as_bytes()]),
            }
            conn.write_all(&mut [IoSlice::new(&cmd)]).await?;
            if let Frame::Error(e) = conn.read_frame(&Limits::control()).await? {
                return Err(ConnError::Auth(e));
            }
        }
        Ok(conn)
    }
}

/// One connection to one node. See the [module docs](self).
pub struct Conn {
    io: Box<dyn Stream>,
    /// Bytes received and not yet consumed are `buf[start..end]`.
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Conn {
    /// Writes every byte of `bufs`, in order, with as few system calls as the socket allows.
    pub async fn write_all(&mut self, mut bufs: &mut [IoSlice<'_>]) -> Result<(), ConnError> {
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            let n = self.io.write_vectored(bufs).await?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
            }
            IoSlice::advance_slices(&mut bufs, n);
        }
        self.io.flush().await?;
        Ok(())
    }

    /// Receives more bytes into the buffer (growing it only for a reply larger than it, to at
    /// most `max_reply` bytes).
    async fn fill(&mut self, max_reply: usize) -> Result<(), ConnError> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
            if self.end == self.buf.len() {
                let grown = (self.buf.len() * 2).min(max_reply.max(READ_BUF));
                if grown <= self.buf.len() {
                    return Err(RespError::TooLarge {
                        what: "reply",
                        len: self.buf.len() as u64,
                        max: max_reply as u64,
                    }
                    .into());
                }
                self.buf.resize(grown, 0);
            }
        }
        let n = self.io.read(&mut self.buf[self.end..]).await?;
        if n == 0 {
            return Err(ConnError::Closed);
        }
        self.end += n;
        Ok(())
    }

    /// Reads one whole reply within `limits`.
    pub async fn read_frame(&mut self, limits: &Limits) -> Result<Frame, ConnError> {
        loop {
            if let Some((f, n)) = resp::parse(&self.buf[self.start..self.end], limits)? {
                self.start += n;
                if self.start == self.end && self.buf.len() > READ_BUF {
                    // A large reply grew the buffer: give the memory back.
                    self.buf = vec![0; READ_BUF];
                    (self.start, self.end) = (0, 0);
                }
                return Ok(f);
            }
            self.fill(limits.max_reply).await?;
        }
    }

    /// Fills `out` with the next bytes of the stream: first what the buffer holds, then, for
    /// long reads, straight from the socket.
    async fn read_exact(&mut self, out: &mut [u8]) -> Result<(), ConnError> {
        self.read_into(out, None).await
    }

    /// Consumes `n` bytes of the stream.
    async fn skip(&mut self, mut n: usize) -> Result<(), ConnError> {
        while n > 0 {
            if self.start == self.end {
                self.fill(READ_BUF).await?;
            }
            let k = (self.end - self.start).min(n);
            self.start += k;
            n -= k;
        }
        Ok(())
    }

    async fn expect_crlf(&mut self) -> Result<(), ConnError> {
        let mut crlf = [0u8; 2];
        self.read_exact(&mut crlf).await?;
        if &crlf != b"\r\n" {
            return Err(RespError::Malformed {
                what: "bulk string",
                detail: "not followed by CRLF".into(),
            }
            .into());
        }
        Ok(())
    }

    /// Reads the reply to `GET` of `key`'s page into `dst`: the header (magic, version,
    /// key, layout, length) is checked before a byte goes into `dst`, the checksum after; a
    /// value that fails is [`PageRead::Damaged`] and `dst` is zeroed, never left holding it.
    /// A value longer than `max_value` bytes is an error (nothing of it is read); another
    /// reply is read within [`Limits::reply`].
    pub async fn read_page(
        &mut self,
        key: &PageKey,
        dst: &mut PageBufMut<'_>,
        max_value: usize,
    ) -> Result<PageRead, ConnError> {
        let limits = Limits {
            max_bulk: max_value,
            ..Limits::reply()
        };
        let head = loop {
            match resp::parse_bulk_head(&self.buf[self.start..self.end], &limits)? {
                Some((h, n)) => {
                    self.start += n;
                    break h;
                }
                None => self.fill(READ_BUF).await?,
            }
        };
        let len = match head {
            Head::Nil => return Ok(PageRead::Nil),
            Head::Other => {
                return Ok(PageRead::Frame(self.read_frame(&Limits::reply()).await?));
            }
            Head::Len(len) => len,
        };
        if len < HEADER_LEN {
            self.skip(len).await?;
            self.expect_crlf().await?;
            return Ok(PageRead::Damaged(Damage::Truncated));
        }
        let mut header = [0u8; HEADER_LEN];
        self.read_exact(&mut header).await?;
        let body = len - HEADER_LEN;
        let refused = match value::parse_header(key, &header) {
            Err(d) => PageRead::Damaged(d),
            Ok(h) if h.meta.len != body => PageRead::Damaged(Damage::BadLength),
            Ok(h) if h.meta != dst.meta() => PageRead::OtherMeta,
            Ok(h) => return self.read_body(dst, h.checksum).await,
        };
        self.skip(body).await?;
        self.expect_crlf().await?;
        Ok(refused)
    }

    /// Reads the replies to a page read of `key` made in ranges ([`value::read_ranges`] of
    /// `HEADER_LEN + dst.len()` bytes by `chunk`): `MULTI`, `STRLEN key`, one `GETRANGE key`
    /// per range, `EXEC`. The value's length (`STRLEN`) and header are checked before a byte
    /// goes into `dst`, the checksum after, exactly as [`read_page`](Self::read_page) does
    /// for one `GET`; the ranges are read straight into `dst`. An error queued or answered
    /// instead (`MOVED`, `ASK`, `WRONGTYPE`, `NOPERM` …) is returned as
    /// [`PageRead::Frame`]`(`[`Frame::Error`]`)` once every reply of the transaction was
    /// read (`MULTI` refused: the commands ran alone, and `EXEC` answered without `MULTI`);
    /// a bare `NOPERM` to `EXEC`, which may leave the transaction open, is
    /// [`ConnError::ExecRefused`]; a range of another length than `STRLEN` implies is a
    /// protocol error.
    pub async fn read_page_chunked(
        &mut self,
        key: &PageKey,
        dst: &mut PageBufMut<'_>,
        chunk: usize,
    ) -> Result<PageRead, ConnError> {
        let ranges: Vec<(usize, usize)> =
            value::read_ranges(HEADER_LEN + dst.len(), chunk).collect();
        let n = ranges.len();
        let widest = ranges.first().map_or(0, |r| r.1);
        // Replies of commands that ran outside a transaction (MULTI refused): ranges whole.
        let loose = Limits {
            max_bulk: widest,
            max_reply: widest + (64 << 10),
            ..Limits::reply()
        };
        if let Frame::Error(e) = self.read_frame(&Limits::reply()).await? {
            for _ in 0..n + 2 {
                self.read_frame(&loose).await?;
            }
            return Ok(PageRead::Frame(Frame::Error(e)));
        }
        let mut queued: Option<String> = None;
        for _ in 0..=n {
            match self.read_frame(&Limits::reply()).await? {
                Frame::Simple(s) if s == "QUEUED" => {}
                Frame::Error(e) => {
                    queued.get_or_insert(e);
                }
                other => return Err(chunk_error(format!("a queued command answered {other:?}"))),
            }
        }
        let limits = Limits {
            max_elements: n + 1,
            ..Limits::reply()
        };
        let head = loop {
            match resp::parse_array_head(&self.buf[self.start..self.end], &limits)? {
                Some((h, used)) => {
                    self.start += used;
                    break h;
                }
                None => self.fill(READ_BUF).await?,
            }
        };
        match (head, queued) {
            (Head::Len(k), None) if k == n + 1 => {}
            (Head::Other, queued) => {
                return match (self.read_frame(&Limits::reply()).await?, queued) {
                    // EXECABORT: the error of the command that was refused says why.
                    (Frame::Error(_), Some(e)) => Ok(PageRead::Frame(Frame::Error(e))),
                    // EXEC itself refused for permissions: since Redis 6.2 as `EXECABORT …
                    // because of: NOPERM …` (the transaction discarded), before as a bare
                    // `NOPERM` that leaves it open.
                    (Frame::Error(e), None) if e.starts_with("NOPERM") => {
                        Err(ConnError::ExecRefused(e))
                    }
                    (Frame::Error(e), None) => Ok(PageRead::Frame(Frame::Error(e))),
                    (other, _) => Err(chunk_error(format!("EXEC answered {other:?}"))),
                };
            }
            (h, q) => {
                return Err(chunk_error(format!(
                    "EXEC answered {h:?} for {} commands (queued error: {q:?})",
                    n + 1
                )));
            }
        }
        let stored = match self.read_frame(&Limits::reply()).await? {
            Frame::Int(v) => {
                usize::try_from(v).map_err(|_| chunk_error(format!("STRLEN answered {v}")))?
            }
            Frame::Error(e) => {
                for _ in 0..n {
                    self.read_frame(&loose).await?;
                }
                return Ok(PageRead::Frame(Frame::Error(e)));
            }
            other => return Err(chunk_error(format!("STRLEN answered {other:?}"))),
        };
        // What GETRANGE returns of each range of a value of `stored` bytes.
        let expect = |(start, len): (usize, usize)| (start + len).min(stored).saturating_sub(start);
        let refused = if stored == 0 {
            Some(PageRead::Nil)
        } else if stored < HEADER_LEN {
            Some(PageRead::Damaged(Damage::Truncated))
        } else {
            None
        };
        if let Some(r) = refused {
            self.skip_ranges(&ranges, expect).await?;
            return Ok(r);
        }
        let first = self.range_head(expect(ranges[0])).await?;
        let mut header = [0u8; HEADER_LEN];
        self.read_exact(&mut header).await?;
        let body = stored - HEADER_LEN;
        let refused = match value::parse_header(key, &header) {
            Err(d) => PageRead::Damaged(d),
            Ok(h) if h.meta.len != body => PageRead::Damaged(Damage::BadLength),
            Ok(h) if h.meta != dst.meta() => PageRead::OtherMeta,
            Ok(h) => {
                // `stored` is the caller's value length: every range is whole.
                let mut sum = Checksummer::default();
                let mut at = (0, 0);
                self.read_span(dst, &mut at, first - HEADER_LEN, &mut sum)
                    .await?;
                self.expect_crlf().await?;
                for &(_, len) in &ranges[1..] {
                    let got = self.range_head(len).await?;
                    self.read_span(dst, &mut at, got, &mut sum).await?;
                    self.expect_crlf().await?;
                }
                if sum.finish() != h.checksum {
                    dst.zero();
                    return Ok(PageRead::Damaged(Damage::BadChecksum));
                }
                return Ok(PageRead::Hit);
            }
        };
        self.skip(first - HEADER_LEN).await?;
        self.expect_crlf().await?;
        self.skip_ranges(&ranges[1..], expect).await?;
        Ok(refused)
    }

    /// Reads the `$len` line of a `GETRANGE` reply that must be `want` bytes long.
    async fn range_head(&mut self, want: usize) -> Result<usize, ConnError> {
        let limits = Limits {
            max_bulk: want,
            ..Limits::reply()
        };
        let head = loop {
            match resp::parse_bulk_head(&self.buf[self.start..self.end], &limits)? {
                Some((h, used)) => {
                    self.start += used;
                    break h;
                }
                None => self.fill(READ_BUF).await?,
            }
        };
        match head {
            Head::Len(len) if len == want => Ok(len),
            Head::Len(len) => Err(chunk_error(format!(
                "GETRANGE answered {len} bytes where STRLEN implies {want}"
            ))),
            Head::Nil => Err(chunk_error("GETRANGE answered nil".into())),
            Head::Other => {
                let f = self.read_frame(&Limits::reply()).await?;
                Err(chunk_error(format!("GETRANGE answered {f:?}")))
            }
        }
    }

    /// Consumes the `GETRANGE` replies of `ranges`, each of the length `expect` says.
    async fn skip_ranges(
        &mut self,
        ranges: &[(usize, usize)],
        expect: impl Fn((usize, usize)) -> usize,
    ) -> Result<(), ConnError> {
        for &r in ranges {
            let len = self.range_head(expect(r)).await?;
            self.skip(len).await?;
            self.expect_crlf().await?;
        }
        Ok(())
    }

    /// Reads the next `n` bytes of the stream into `dst` from position `at` (part, offset),
    /// adding them to `sum`, and moves `at` past them.
    async fn read_span(
        &mut self,
        dst: &mut PageBufMut<'_>,
        at: &mut (usize, usize),
        mut n: usize,
        sum: &mut Checksummer,
    ) -> Result<(), ConnError> {
        let parts = dst.parts_mut();
        while n > 0 {
            let (p, off) = *at;
            let Some(part) = parts.get_mut(p) else {
                return Err(chunk_error("more bytes than the page holds".into()));
            };
            let take = (part.len() - off).min(n);
            self.read_into(&mut part[off..off + take], Some(&mut *sum))
                .await?;
            n -= take;
            *at = if off + take == part.len() {
                (p + 1, 0)
            } else {
                (p, off + take)
            };
        }
        Ok(())
    }

    /// Reads a page body whose header was accepted into `dst`, checksumming each piece as it
    /// lands, then checks the checksum.
    async fn read_body(
        &mut self,
        dst: &mut PageBufMut<'_>,
        checksum: u64,
    ) -> Result<PageRead, ConnError> {
        let mut sum = Checksummer::default();
        for part in dst.parts_mut() {
            self.read_into(part, Some(&mut sum)).await?;
        }
        self.expect_crlf().await?;
        if sum.finish() != checksum {
            dst.zero();
            return Ok(PageRead::Damaged(Damage::BadChecksum));
        }
        Ok(PageRead::Hit)
    }

    /// Fills `out` with the next bytes of the stream, adding each to `sum` if given: what the
    /// buffer holds is copied, runs of at least [`DIRECT_READ`] bytes are read straight from
    /// the socket into `out` (in pieces of at most [`BODY_PIECE`] when summing, so each piece
    /// is hashed while it is still in the CPU cache).
    async fn read_into(
        &mut self,
        out: &mut [u8],
        mut sum: Option<&mut Checksummer>,
    ) -> Result<(), ConnError> {
        let mut done = 0;
        while done < out.len() {
            let want = out.len() - done;
            let n = if self.start == self.end && want >= DIRECT_READ {
                let piece = if sum.is_some() { BODY_PIECE } else { want };
                let n = self.io.read(&mut out[done..done + want.min(piece)]).await?;
                if n == 0 {
                    return Err(ConnError::Closed);
                }
                n
            } else {
                if self.start == self.end {
                    self.fill(READ_BUF).await?;
                }
                let n = (self.end - self.start).min(want);
                out[done..done + n].copy_from_slice(&self.buf[self.start..self.start + n]);
                self.start += n;
                n
            };
            if let Some(sum) = sum.as_deref_mut() {
                sum.update(&out[done..done + n]);
            }
            done += n;
        }
        Ok(())
    }
}

/// A reply of a ranged page read that is not what its commands return.
fn chunk_error(detail: String) -> ConnError {
    RespError::Malformed {
        what: "ranged page read",
        detail,
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_core::LayoutKind;
    use hicache_storage::PageBuf;
    use hicache_storage::pattern::{namespace, page_bytes, page_key};
    use tokio::net::TcpListener;

    const L: LayoutKind = LayoutKind::PageFirst;
    /// The value bound of the tests that do not test it.
    const BIG: usize = 512 << 20;

    /// The stored value of `data` under `key` (header + bytes), as a bulk string.
    fn bulk(key: &PageKey, layout: LayoutKind, data: &[u8]) -> Vec<u8> {
        let page = PageBuf::contiguous(layout, data);
        let mut v = value::header(key, &page).to_vec();
        v.extend_from_slice(data);
        let mut out = Vec::new();
        resp::put_bulk(&mut out, &v);
        out
    }

    /// A connection to a one-shot server on loopback that sends `bytes` in pieces of `piece`
    /// bytes, then closes.
    async fn serve(bytes: Vec<u8>, piece: usize) -> Conn {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            for c in bytes.chunks(piece.max(1)) {
                if s.write_all(c).await.is_err() {
                    return;
                }
                let _ = s.flush().await;
            }
        });
        let opts = RedisOptions::new([addr.clone()]);
        Connector::new(&opts, None)
            .unwrap()
            .connect(&addr)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn pages_land_in_the_buffer_and_the_stream_stays_in_step() {
        let k1 = page_key(namespace(1), 1, 0);
        let k2 = page_key(namespace(1), 1, 1);
        let (d1, d2) = (page_bytes(&k1, 100_000), page_bytes(&k2, 3000));
        for piece in [7, 4096, 1 << 20] {
            let mut wire = bulk(&k1, L, &d1);
            wire.extend(bulk(&k2, L, &d2));
            wire.extend_from_slice(b"$-1\r\n_\r\n-MOVED 1 127.0.0.1:7000\r\n+OK\r\n");
            let mut c = serve(wire, piece).await;
            // A page in two parts, as a layer-first host page would be.
            let mut b1 = vec![0u8; d1.len()];
            let (x, y) = b1.split_at_mut(40_000);
            let mut dst = PageBufMut::from_parts(L, [x, y]);
            assert_eq!(
                c.read_page(&k1, &mut dst, BIG).await.unwrap(),
                PageRead::Hit
            );
            drop(dst);
            assert_eq!(b1, d1);
            let mut b2 = vec![0u8; d2.len()];
            let mut dst = PageBufMut::contiguous(L, &mut b2);
            assert_eq!(
                c.read_page(&k2, &mut dst, BIG).await.unwrap(),
                PageRead::Hit
            );
            drop(dst);
            assert_eq!(b2, d2);
            let mut dst = PageBufMut::contiguous(L, &mut b2);
            assert_eq!(
                c.read_page(&k2, &mut dst, BIG).await.unwrap(),
                PageRead::Nil
            );
            assert_eq!(
                c.read_page(&k2, &mut dst, BIG).await.unwrap(),
                PageRead::Nil
            );
            assert_eq!(
                c.read_page(&k2, &mut dst, BIG).await.unwrap(),
                PageRead::Frame(Frame::Error("MOVED 1 127.0.0.1:7000".into()))
            );
            assert_eq!(
                c.read_frame(&Limits::default()).await.unwrap(),
                Frame::Simple("OK".into())
            );
        }
    }

    #[tokio::test]
    async fn damaged_foreign_and_other_values_never_fill_the_buffer() {
        let k = page_key(namespace(2), 1, 0);
        let other = page_key(namespace(3), 1, 0);
        let d = page_bytes(&k, 50_000);
        let mut flipped = bulk(&k, L, &d);
        let at = flipped.len() - 1000;
        flipped[at] ^= 1;
        let mut wire = flipped;
        wire.extend(bulk(&other, L, &d)); // another page's value under this key
        wire.extend(bulk(&k, LayoutKind::LayerFirst, &d)); // another layout
        wire.extend(bulk(&k, L, &d[..1000])); // another length
        let mut long = value::header(&k, &PageBuf::contiguous(L, &d[..1000])).to_vec();
        long.extend_from_slice(&d[..1010]); // a header whose length is not the body's
        resp::put_bulk(&mut wire, &long);
        wire.extend_from_slice(b"$10\r\nnot a page\r\n"); // shorter than a header
        wire.extend_from_slice(b"*1\r\n:1\r\n"); // not a string
        wire.extend(bulk(&k, L, &d)); // and the stream is still in step
        let mut c = serve(wire, 1500).await;
        let mut buf = vec![0xAAu8; d.len()];
        let mut dst = PageBufMut::contiguous(L, &mut buf);
        assert_eq!(
            c.read_page(&k, &mut dst, BIG).await.unwrap(),
            PageRead::Damaged(Damage::BadChecksum)
        );
        drop(dst);
        assert!(
            buf.iter().all(|b| *b == 0),
            "a checksum failure zeroes the page"
        );
        buf.fill(0xAA);
        for want in [
            PageRead::Damaged(Damage::WrongKey),
            PageRead::OtherMeta,
            PageRead::OtherMeta,
            PageRead::Damaged(Damage::BadLength),
            PageRead::Damaged(Damage::Truncated),
            PageRead::Frame(Frame::Array(vec![Frame::Int(1)])),
        ] {
            let mut dst = PageBufMut::contiguous(L, &mut buf);
            assert_eq!(c.read_page(&k, &mut dst, BIG).await.unwrap(), want);
            drop(dst);
            assert!(
                buf.iter().all(|b| *b == 0xAA),
                "{want:?}: the buffer is untouched"
            );
        }
        let mut dst = PageBufMut::contiguous(L, &mut buf);
        assert_eq!(c.read_page(&k, &mut dst, BIG).await.unwrap(), PageRead::Hit);
        drop(dst);
        assert_eq!(buf, d);
    }

    /// What a server answers to a ranged read ([`Conn::read_page_chunked`]) of a `total`-byte
    /// page value read by `chunk` when it holds `stored` under the key (`None`: no key).
    fn ranged(stored: Option<&[u8]>, total: usize, chunk: usize) -> Vec<u8> {
        let ranges: Vec<(usize, usize)> = value::read_ranges(total, chunk).collect();
        let v = stored.unwrap_or_default();
        let mut out = b"+OK\r\n".to_vec();
        for _ in 0..=ranges.len() {
            out.extend_from_slice(b"+QUEUED\r\n");
        }
        out.extend_from_slice(format!("*{}\r\n:{}\r\n", ranges.len() + 1, v.len()).as_bytes());
        for (s, l) in ranges {
            let (a, b) = (s.min(v.len()), (s + l).min(v.len()));
            resp::put_bulk(&mut out, &v[a..b]);
        }
        out
    }

    /// A stored value: header + bytes.
    fn stored(key: &PageKey, layout: LayoutKind, data: &[u8]) -> Vec<u8> {
        let mut v = value::header(key, &PageBuf::contiguous(layout, data)).to_vec();
        v.extend_from_slice(data);
        v
    }

    #[tokio::test]
    async fn ranged_reads_land_in_the_buffer_refuse_what_is_not_the_page_and_stay_in_step() {
        const CHUNK: usize = 4096;
        let k = page_key(namespace(5), 1, 0);
        let other = page_key(namespace(6), 1, 0);
        let d = page_bytes(&k, 50_000);
        let total = HEADER_LEN + d.len();
        let good = stored(&k, L, &d);
        let mut flipped = good.clone();
        flipped[30_000] ^= 1;
        let mut long = value::header(&k, &PageBuf::contiguous(L, &d[..1000])).to_vec();
        long.extend_from_slice(&d[..1010]);
        let n = value::read_ranges(total, CHUNK).count();
        // A queued command refused (a redirection): EXECABORT follows.
        let mut moved = b"+OK\r\n-MOVED 1 127.0.0.1:7000\r\n".to_vec();
        for _ in 0..n {
            moved.extend_from_slice(b"+QUEUED\r\n");
        }
        moved
            .extend_from_slice(b"-EXECABORT Transaction discarded because of previous errors.\r\n");
        // Another type under the key: every command of the transaction fails.
        let mut wrongtype = b"+OK\r\n".to_vec();
        for _ in 0..=n {
            wrongtype.extend_from_slice(b"+QUEUED\r\n");
        }
        wrongtype.extend_from_slice(format!("*{}\r\n", n + 1).as_bytes());
        for _ in 0..=n {
            wrongtype.extend_from_slice(b"-WRONGTYPE Operation against a key\r\n");
        }
        // MULTI refused (ACL): the commands ran alone, EXEC without MULTI.
        let mut nomulti =
            b"-NOPERM this user has no permissions to run the 'multi' command\r\n:0\r\n".to_vec();
        for _ in 0..n {
            nomulti.extend_from_slice(b"$0\r\n\r\n");
        }
        nomulti.extend_from_slice(b"-ERR EXEC without MULTI\r\n");
        let cases: Vec<(Vec<u8>, PageRead)> = vec![
            (
                ranged(Some(&flipped), total, CHUNK),
                PageRead::Damaged(Damage::BadChecksum),
            ),
            (ranged(None, total, CHUNK), PageRead::Nil),
            (
                ranged(Some(&stored(&other, L, &d)), total, CHUNK),
                PageRead::Damaged(Damage::WrongKey),
            ),
            (
                ranged(Some(&stored(&k, LayoutKind::LayerFirst, &d)), total, CHUNK),
                PageRead::OtherMeta,
            ),
            (
                ranged(Some(&stored(&k, L, &d[..1000])), total, CHUNK),
                PageRead::OtherMeta,
            ),
            (
                ranged(Some(&stored(&k, L, &page_bytes(&k, 90_000))), total, CHUNK),
                PageRead::OtherMeta,
            ),
            (
                ranged(Some(&long), total, CHUNK),
                PageRead::Damaged(Damage::BadLength),
            ),
            (
                ranged(Some(b"not a page"), total, CHUNK),
                PageRead::Damaged(Damage::Truncated),
            ),
            (
                moved,
                PageRead::Frame(Frame::Error("MOVED 1 127.0.0.1:7000".into())),
            ),
            (
                wrongtype,
                PageRead::Frame(Frame::Error("WRONGTYPE Operation against a key".into())),
            ),
            (
                nomulti,
                PageRead::Frame(Frame::Error(
                    "NOPERM this user has no permissions to run the 'multi' command".into(),
                )),
            ),
        ];
        for piece in [7, 4096, 1 << 20] {
            let mut wire = ranged(Some(&good), total, CHUNK);
            for (w, _) in &cases {
                wire.extend_from_slice(w);
            }
            wire.extend_from_slice(b"+OK\r\n");
            let mut c = serve(wire, piece).await;
            // A page in two parts whose boundary is not a range's.
            let mut buf = vec![0xAAu8; d.len()];
            let (x, y) = buf.split_at_mut(12_345);
            let mut dst = PageBufMut::from_parts(L, [x, y]);
            assert_eq!(
                c.read_page_chunked(&k, &mut dst, CHUNK).await.unwrap(),
                PageRead::Hit
            );
            drop(dst);
            assert_eq!(buf, d);
            for (i, (_, want)) in cases.iter().enumerate() {
                buf.fill(0xAA);
                let mut dst = PageBufMut::contiguous(L, &mut buf);
                let got = c.read_page_chunked(&k, &mut dst, CHUNK).await.unwrap();
                assert_eq!(&got, want, "case {i}, pieces of {piece}");
                drop(dst);
                let fill = if i == 0 { 0 } else { 0xAA };
                assert!(
                    buf.iter().all(|b| *b == fill),
                    "case {i}: the buffer holds no byte of the value"
                );
            }
            assert_eq!(
                c.read_frame(&Limits::default()).await.unwrap(),
                Frame::Simple("OK".into())
            );
        }
    }

    /// The shapes a ranged read refused for permissions takes on a real server (what the
    /// backend then reads again with one `GET`): each is the refusal's `NOPERM`, read whole
    /// (the stream stays in step); a bare `NOPERM` to `EXEC` (servers before 6.2, whose
    /// transaction stays open) is [`ConnError::ExecRefused`].
    #[tokio::test]
    async fn ranged_reads_refused_for_permissions_say_so_and_stay_in_step() {
        const CHUNK: usize = 4096;
        let k = page_key(namespace(8), 1, 0);
        let d = page_bytes(&k, 50_000);
        let total = HEADER_LEN + d.len();
        let good = stored(&k, L, &d);
        let ranges: Vec<(usize, usize)> = value::read_ranges(total, CHUNK).collect();
        let n = ranges.len();
        let noperm =
            |cmd: &str| format!("NOPERM this user has no permissions to run the '{cmd}' command");
        // `-@transaction` (Redis 7): MULTI refused, the commands ran alone (whole ranges of
        // the value), EXEC refused outside a transaction.
        let mut no_tx = format!("-{}\r\n:{}\r\n", noperm("multi"), good.len()).into_bytes();
        for &(s, l) in &ranges {
            resp::put_bulk(&mut no_tx, &good[s..s + l]);
        }
        no_tx.extend_from_slice(
            format!(
                "-EXECABORT Transaction discarded because of: {}\r\n",
                noperm("exec")
            )
            .as_bytes(),
        );
        // `-exec` (Redis 6.2 on): every command queued, EXEC refused and the transaction
        // discarded.
        let mut no_exec = b"+OK\r\n".to_vec();
        for _ in 0..=n {
            no_exec.extend_from_slice(b"+QUEUED\r\n");
        }
        let execabort = format!(
            "EXECABORT Transaction discarded because of: {}",
            noperm("exec")
        );
        no_exec.extend_from_slice(format!("-{execabort}\r\n").as_bytes());
        // `-getrange`: each GETRANGE refused as it is queued, EXECABORT.
        let mut no_getrange = b"+OK\r\n+QUEUED\r\n".to_vec();
        for _ in 0..n {
            no_getrange.extend_from_slice(format!("-{}\r\n", noperm("getrange")).as_bytes());
        }
        no_getrange
            .extend_from_slice(b"-EXECABORT Transaction discarded because of previous errors.\r\n");
        let cases = [
            (no_tx, noperm("multi")),
            (no_exec, execabort),
            (no_getrange, noperm("getrange")),
        ];
        for piece in [7, 4096, 1 << 20] {
            let mut wire = Vec::new();
            for (w, _) in &cases {
                wire.extend_from_slice(w);
            }
            wire.extend(ranged(Some(&good), total, CHUNK));
            let mut c = serve(wire, piece).await;
            let mut buf = vec![0xAAu8; d.len()];
            for (i, (_, want)) in cases.iter().enumerate() {
                let mut dst = PageBufMut::contiguous(L, &mut buf);
                let got = c.read_page_chunked(&k, &mut dst, CHUNK).await.unwrap();
                assert_eq!(got, PageRead::Frame(Frame::Error(want.clone())), "case {i}");
                drop(dst);
                assert!(buf.iter().all(|b| *b == 0xAA), "case {i}: buffer untouched");
            }
            let mut dst = PageBufMut::contiguous(L, &mut buf);
            assert_eq!(
                c.read_page_chunked(&k, &mut dst, CHUNK).await.unwrap(),
                PageRead::Hit
            );
            drop(dst);
            assert_eq!(buf, d);
        }
        // `-exec` before Redis 6.2: a bare NOPERM, the transaction still open.
        let mut open_tx = b"+OK\r\n".to_vec();
        for _ in 0..=n {
            open_tx.extend_from_slice(b"+QUEUED\r\n");
        }
        open_tx.extend_from_slice(format!("-{}\r\n", noperm("exec")).as_bytes());
        let mut c = serve(open_tx, 512).await;
        let mut buf = vec![0u8; d.len()];
        let mut dst = PageBufMut::contiguous(L, &mut buf);
        match c.read_page_chunked(&k, &mut dst, CHUNK).await {
            Err(ConnError::ExecRefused(e)) => assert_eq!(e, noperm("exec")),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn ranged_replies_of_the_wrong_shape_are_protocol_errors() {
        const CHUNK: usize = 4096;
        let k = page_key(namespace(7), 1, 0);
        let d = page_bytes(&k, 20_000);
        let total = HEADER_LEN + d.len();
        let good = ranged(Some(&stored(&k, L, &d)), total, CHUNK);
        let n = value::read_ranges(total, CHUNK).count();
        let head = format!("*{}\r\n", n + 1);
        let at = good
            .windows(head.len())
            .position(|w| w == head.as_bytes())
            .unwrap();
        let mut cases: Vec<(Vec<u8>, &str)> = Vec::new();
        // A range one byte short of what STRLEN says.
        let mut short = good[..at].to_vec();
        short.extend_from_slice(head.as_bytes());
        short.extend_from_slice(format!(":{}\r\n", total).as_bytes());
        let first = value::read_ranges(total, CHUNK).next().unwrap().1;
        resp::put_bulk(&mut short, &stored(&k, L, &d)[..first - 1]);
        cases.push((short, "where STRLEN implies"));
        // EXEC with another number of replies than commands.
        let mut count = good[..at].to_vec();
        count.extend_from_slice(b"*2\r\n:1\r\n$1\r\nx\r\n");
        cases.push((count, "EXEC answered"));
        // A queued command that answered neither QUEUED nor an error.
        cases.push((b"+OK\r\n:1\r\n".to_vec(), "a queued command answered"));
        // A range longer than asked: refused at its `$len` line.
        let mut long = good[..at].to_vec();
        long.extend_from_slice(head.as_bytes());
        long.extend_from_slice(format!(":{}\r\n", total).as_bytes());
        long.extend_from_slice(b"$1000000\r\n");
        cases.push((long, "exceeds the limit"));
        for (wire, want) in cases {
            let mut c = serve(wire, 512).await;
            let mut buf = vec![0u8; d.len()];
            let mut dst = PageBufMut::contiguous(L, &mut buf);
            let e = c.read_page_chunked(&k, &mut dst, CHUNK).await.unwrap_err();
            assert!(
                e.is_protocol() && e.to_string().contains(want),
                "{want}: {e}"
            );
        }
    }

    #[tokio::test]
    async fn garbage_oversized_and_cut_replies_are_errors() {
        let k = page_key(namespace(4), 1, 0);
        let mut buf = vec![0u8; 4096];
        let small = Limits {
            max_bulk: 1 << 20,
            ..Limits::default()
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(), "type byte"),
            (b"$2000000\r\n".to_vec(), "exceeds the limit"),
            (b"$abc\r\n".to_vec(), "not a length"),
            (
                {
                    let mut w = bulk(&k, L, &page_bytes(&k, 4096));
                    w.truncate(w.len() - 100);
                    w
                },
                "closed",
            ),
            (
                {
                    let mut w = bulk(&k, L, &page_bytes(&k, 4096));
                    let n = w.len();
                    w[n - 2] = b'X';
                    w
                },
                "CRLF",
            ),
        ];
        for (wire, want) in cases {
            let mut c = serve(wire, 512).await;
            let mut dst = PageBufMut::contiguous(L, &mut buf);
            let e = c
                .read_page(&k, &mut dst, small.max_bulk)
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
        // A bulk claiming 1 TB as the reply to a small command: refused by the reply's bound
        // at its `$len` line, before the buffer grows.
        let mut huge = b"$1000000000000\r\n".to_vec();
        huge.extend(vec![0u8; 4 << 20]);
        let mut c = serve(huge, 64 << 10).await;
        let e = c.read_frame(&Limits::reply()).await.unwrap_err();
        assert!(e.is_protocol(), "{e}");
        assert!(
            e.to_string().contains("exceeds the limit of 1048576"),
            "{e}"
        );
        assert!(c.buf.len() <= READ_BUF, "the buffer did not grow");
        // A reply longer than `max_reply` (never less than the 64 KiB buffer) made of
        // elements each within their bounds is refused once the buffer reaches the bound.
        let mut long = b"*16\r\n".to_vec();
        for _ in 0..16 {
            resp::put_bulk(&mut long, &[b'a'; 8000]);
        }
        let mut c = serve(long, 4096).await;
        let tight = Limits {
            max_reply: 8 << 10,
            ..Limits::reply()
        };
        match c.read_frame(&tight).await {
            Ok(_) => panic!("a 128 KB reply passed a 64 KiB bound"),
            Err(e) => assert!(e.to_string().contains("RESP reply of"), "{e}"),
        }
        assert!(c.buf.len() <= READ_BUF, "the buffer did not grow");
        // A generic reply larger than the bound is refused before it is buffered whole.
        let mut c = serve(b"+".repeat(resp::MAX_LINE + 100), 4096).await;
        assert!(
            c.read_frame(&small)
                .await
                .unwrap_err()
                .to_string()
                .contains("line")
        );
    }
}
