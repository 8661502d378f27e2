//! One client connection to the server: handshake, framed requests and replies, payload
//! streaming, every socket step bounded by a timeout.
//!
//! [`Connection`] is public so tools and tests can speak the protocol step by step (allocate
//! without committing, pipeline by hand); [`RdmaStorage`](crate::RdmaStorage) is built on it.

use std::future::Future;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;

use crate::auth::{self, Token};
use crate::error::{RdmaError, Result};
use crate::protocol::{
    self, HEAD_LEN, MAC_LEN, MAGIC, NONCE_LEN, Occupancy, ProtocolError, REPLY_BIT, Reply,
    ReplyFrame, Request, ServerInfo, VERSION,
};
use crate::tls::{BoxRead, BoxWrite, TlsClient};

/// Largest step of a payload transfer bounded by one timeout.
const STEP: usize = 8 << 20;

/// Connects to `addr` (within `connect_timeout`) and, with `tls`, runs the TLS handshake
/// (within `io_timeout`): the connection's byte stream.
async fn open_stream(
    addr: &str,
    tls: Option<&TlsClient>,
    connect_timeout: Duration,
    io_timeout: Duration,
) -> Result<(BoxRead, BoxWrite)> {
    let peer = addr.to_string();
    let stream = match tokio::time::timeout(connect_timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(RdmaError::Io {
                op: "connect",
                peer,
                source: e,
            });
        }
        Err(_) => {
            return Err(RdmaError::Timeout {
                op: "connect",
                peer,
                ms: connect_timeout.as_millis() as u64,
            });
        }
    };
    let _ = stream.set_nodelay(true);
    let Some(t) = tls else {
        return Ok(crate::tls::split_tcp(stream));
    };
    match tokio::time::timeout(io_timeout, t.connect(stream)).await {
        Ok(Ok(s)) => Ok(crate::tls::split(s)),
        Ok(Err(e)) => Err(RdmaError::Auth {
            peer,
            reason: format!("TLS handshake failed: {e}"),
        }),
        Err(_) => Err(RdmaError::Timeout {
            op: "TLS handshake",
            peer,
            ms: io_timeout.as_millis() as u64,
        }),
    }
}

/// A connected, handshaken connection.
pub struct Connection {
    r: BufReader<BoxRead>,
    w: BufWriter<BoxWrite>,
    peer: String,
    info: ServerInfo,
    io_timeout: Duration,
    next_id: u64,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .field("info", &self.info)
            .field("io_timeout", &self.io_timeout)
            .field("next_id", &self.next_id)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Connects to `addr`, with `connect_timeout` for the TCP connect and `io_timeout` for
    /// every later step, and performs the handshake ([`crate::auth`]): with `token`, the
    /// server must require authentication and prove it knows the token; without, the server
    /// must be one started with `--insecure-no-auth`.
    pub async fn connect(
        addr: &str,
        client_name: &str,
        token: Option<&Token>,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Result<Self> {
        Self::connect_tls(addr, client_name, token, None, connect_timeout, io_timeout).await
    }

    /// [`connect`](Self::connect), with TLS when `tls` is given: the TLS handshake (bounded
    /// by `io_timeout`) verifies the server's certificate before the protocol's handshake
    /// runs inside the session.
    pub async fn connect_tls(
        addr: &str,
        client_name: &str,
        token: Option<&Token>,
        tls: Option<&TlsClient>,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Result<Self> {
        let (r, w) = open_stream(addr, tls, connect_timeout, io_timeout).await?;
        let mut c = Self {
            r: BufReader::with_capacity(crate::protocol::READ_BUFFER, r),
            w: BufWriter::with_capacity(crate::protocol::WRITE_BUFFER, w),
            peer: addr.to_string(),
            info: ServerInfo {
                version: 0,
                server_id: 0,
                pool_bytes: 0,
                max_page_bytes: 0,
                max_batch: 0,
                lease_ms: 0,
                alloc_ttl_ms: 0,
                verbs: false,
                regions: Vec::new(),
            },
            io_timeout,
            next_id: 1,
        };
        let client_nonce = auth::random_bytes::<{ auth::NONCE_LEN }>()?;
        let (server_nonce, required) = c.hello(client_name, client_nonce).await?;
        let nonces = (&client_nonce, &server_nonce);
        let mac = match (required, token) {
            (true, Some(t)) => Some(auth::client_mac(t, nonces.0, nonces.1)),
            (true, None) => {
                return Err(c.auth_error(
                    "the server requires authentication: set `token` or `token_file` in the \
                     rdma extra-config",
                ));
            }
            (false, Some(_)) => {
                return Err(c.auth_error(
                    "the server runs without authentication (--insecure-no-auth) but this \
                     client has a token: refusing to trust an unauthenticated server",
                ));
            }
            (false, None) => None,
        };
        c.info = c.authenticate(mac, token, nonces).await?;
        Ok(c)
    }

    /// Handshake step 1: sends `HELLO` with `client_nonce`; returns the server's nonce and
    /// whether it requires credentials.
    async fn hello(
        &mut self,
        client_name: &str,
        client_nonce: [u8; NONCE_LEN],
    ) -> Result<([u8; NONCE_LEN], bool)> {
        let hello = Request::Hello {
            magic: MAGIC,
            version: VERSION,
            client: client_name.to_string(),
            nonce: client_nonce,
        };
        match self.call(&hello).await {
            Ok((_, Reply::Hello { nonce, auth })) => Ok((nonce, auth)),
            Ok((_, other)) => Err(self.mismatch("HELLO reply", &other)),
            Err(RdmaError::Refused {
                peer,
                code: protocol::code::PROTOCOL,
                message,
            }) => Err(RdmaError::Refused {
                peer,
                code: protocol::code::PROTOCOL,
                message: format!(
                    "{message} (an older hicache-rdma-server? this client speaks protocol \
                     version {VERSION})"
                ),
            }),
            Err(e) => Err(e),
        }
    }

    /// Handshake step 2: sends `AUTH` with `mac`; checks the server's version and, with a
    /// `token`, its proof over both `nonces` (client's, server's). Returns the server's info.
    async fn authenticate(
        &mut self,
        mac: Option<[u8; MAC_LEN]>,
        token: Option<&Token>,
        nonces: (&[u8; NONCE_LEN], &[u8; NONCE_LEN]),
    ) -> Result<ServerInfo> {
        let (info, proof) = match self.call(&Request::Auth { mac }).await? {
            (_, Reply::Auth { info, proof }) => (info, proof),
            (_, other) => return Err(self.mismatch("AUTH reply", &other)),
        };
        if info.version != VERSION {
            return Err(self.protocol(ProtocolError::Version {
                got: info.version,
                want: VERSION,
            }));
        }
        if let Some(t) = token {
            let proven =
                proof.is_some_and(|p| auth::verify_server_proof(t, nonces.0, nonces.1, &p));
            if !proven {
                return Err(self.auth_error(
                    "the server did not prove it knows the token: not the server this \
                     client was configured for",
                ));
            }
        }
        Ok(info)
    }

    fn auth_error(&self, reason: &str) -> RdmaError {
        RdmaError::Auth {
            peer: self.peer.clone(),
            reason: reason.to_string(),
        }
    }

    /// What the server said at the handshake.
    pub fn info(&self) -> &ServerInfo {
        &self.info
    }

    /// The server's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    fn protocol(&self, source: ProtocolError) -> RdmaError {
        RdmaError::Protocol {
            peer: self.peer.clone(),
            source,
        }
    }

    /// An error for a reply that does not answer the request.
    pub fn mismatch(&self, expected: &str, got: &Reply) -> RdmaError {
        self.protocol(ProtocolError::Mismatch {
            expected: expected.to_string(),
            got: format!("{got:?}").chars().take(200).collect(),
        })
    }

    /// Queues a request (head and body) announcing `payload_len` payload bytes, which the
    /// caller then writes with [`write_payload`](Self::write_payload). Returns its id.
    pub async fn send(&mut self, req: &Request, payload_len: u64) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let body = req.encode();
        let (peer, t) = (self.peer.clone(), self.io_timeout);
        let w = &mut self.w;
        timed_io(
            &peer,
            t,
            "send request",
            protocol::write_frame(w, id, req.op(), &body, payload_len),
        )
        .await?;
        Ok(id)
    }

    /// Writes payload bytes of the request just sent.
    pub async fn write_payload(&mut self, bytes: &[u8]) -> Result<()> {
        let (peer, t) = (self.peer.clone(), self.io_timeout);
        for step in bytes.chunks(STEP) {
            timed_io(&peer, t, "send payload", self.w.write_all(step)).await?;
        }
        Ok(())
    }

    /// Sends everything queued.
    pub async fn flush(&mut self) -> Result<()> {
        let (peer, t) = (self.peer.clone(), self.io_timeout);
        timed_io(&peer, t, "send", self.w.flush()).await
    }

    /// Reads the reply to request `id`; returns its occupancy, body and payload length (the
    /// caller reads the payload with [`read_payload`](Self::read_payload)). An `ERROR` reply
    /// is [`RdmaError::Refused`].
    pub async fn recv(&mut self, id: u64) -> Result<(Occupancy, Reply, u64)> {
        let mut h = [0u8; HEAD_LEN];
        let (peer, t) = (self.peer.clone(), self.io_timeout);
        timed_io(&peer, t, "read reply", self.r.read_exact(&mut h))
            .await
            .map_err(|e| match e {
                RdmaError::Io { op, peer, source }
                    if source.kind() == std::io::ErrorKind::UnexpectedEof =>
                {
                    RdmaError::Io {
                        op,
                        peer,
                        source: std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "server closed the connection",
                        ),
                    }
                }
                e => e,
            })?;
        let head = protocol::FrameHead::decode(&h).map_err(|e| self.protocol(e))?;
        let mut body = vec![0u8; head.body_len as usize];
        let (peer, t) = (self.peer.clone(), self.io_timeout);
        timed_io(&peer, t, "read reply", self.r.read_exact(&mut body)).await?;
        let frame = ReplyFrame::decode(head.op, &body).map_err(|e| self.protocol(e))?;
        match frame {
            ReplyFrame::Error { code, message } => Err(RdmaError::Refused {
                peer: self.peer.clone(),
                code,
                message,
            }),
            ReplyFrame::Ok(occ, reply) => {
                if head.id != id {
                    return Err(self.protocol(ProtocolError::Mismatch {
                        expected: format!("reply to request {id}"),
                        got: format!("reply to request {}", head.id),
                    }));
                }
                debug_assert_eq!(head.op & REPLY_BIT, REPLY_BIT);
                Ok((occ, reply, head.payload_len))
            }
        }
    }

    /// Reads payload bytes of the reply just received.
    pub async fn read_payload(&mut self, dst: &mut [u8]) -> Result<()> {
        let (peer, t) = (self.peer.clone(), self.io_timeout);
        for step in dst.chunks_mut(STEP) {
            timed_io(&peer, t, "read payload", self.r.read_exact(step)).await?;
        }
        Ok(())
    }

    /// Sends a request without payload and reads its reply (which must have no payload).
    pub async fn call(&mut self, req: &Request) -> Result<(Occupancy, Reply)> {
        let id = self.send(req, 0).await?;
        self.flush().await?;
        let (occ, reply, payload) = self.recv(id).await?;
        if payload != 0 {
            return Err(self.protocol(ProtocolError::Invalid {
                what: "payload on a reply without payload",
                value: payload,
            }));
        }
        if reply.op() != req.op() | REPLY_BIT {
            return Err(self.mismatch(&format!("reply to op {:#04x}", req.op()), &reply));
        }
        Ok((occ, reply))
    }
}

async fn timed_io<T>(
    peer: &str,
    t: Duration,
    op: &'static str,
    f: impl Future<Output = std::io::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(t, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(RdmaError::Io {
            op,
            peer: peer.to_string(),
            source: e,
        }),
        Err(_) => Err(RdmaError::Timeout {
            op,
            peer: peer.to_string(),
            ms: t.as_millis() as u64,
        }),
    }
}
