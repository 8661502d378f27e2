//! [`DealerClient`]: a ZMQ DEALER connected to one ROUTER.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::{ClientOptions, Conn};
use crate::ZmtpError;

/// A DEALER connected to one ROUTER (ours, or libzmq's): sends requests and receives replies,
/// each a multipart message, frames as sent (no envelope is added or removed).
///
/// ```no_run
/// # async fn f() -> Result<(), hicache_zmtp::ZmtpError> {
/// use std::time::Duration;
/// use bytes::Bytes;
/// use hicache_zmtp::{ClientOptions, DealerClient};
/// let mut d = DealerClient::connect("tcp://127.0.0.1:5558", ClientOptions::default()).await?;
/// // SGLang's replay request: an empty frame, then the first sequence number wanted.
/// d.send(&[Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())]).await?;
/// let reply = d.recv_timeout(Duration::from_secs(5)).await?;
/// # Ok(()) }
/// ```
pub struct DealerClient {
    conn: Conn,
}

impl DealerClient {
    /// Connects to `endpoint` (`tcp://HOST:PORT`) and does the handshake (the server must be
    /// a ROUTER; `opts.identity` is the routing id asked for).
    pub async fn connect(endpoint: &str, opts: ClientOptions) -> Result<Self, ZmtpError> {
        let conn = Conn::connect(endpoint, "DEALER", &["ROUTER"], opts).await?;
        Ok(Self { conn })
    }

    /// Sends one message (an empty slice sends nothing).
    pub async fn send(&mut self, frames: &[Bytes]) -> Result<(), ZmtpError> {
        self.conn.send(frames).await
    }

    /// The next reply. Errors mean the connection is lost.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        self.conn.recv(None).await
    }

    /// The next reply within `limit`: `Err(ZmtpError::Timeout)` then, and the connection is
    /// kept (a late reply is the next one received).
    pub async fn recv_timeout(&mut self, limit: Duration) -> Result<Vec<Bytes>, ZmtpError> {
        self.conn.recv(Some(Instant::now() + limit)).await
    }

    /// This connection's number, unique in the process (see [`super::SubClient::connection_id`]).
    pub fn connection_id(&self) -> u64 {
        self.conn.id
    }

    /// The server's address.
    pub fn peer_addr(&self) -> std::net::SocketAddr {
        self.conn.peer
    }

    /// Whether the connection was lost.
    pub fn is_lost(&self) -> bool {
        self.conn.lost
    }
}
