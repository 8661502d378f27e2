//! [`SubClient`]: a ZMQ SUB connected to one PUB.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::time::Instant;

use super::{ClientOptions, Conn};
use crate::ZmtpError;

/// A SUB connected to one PUB (ours, or libzmq's): receives the messages whose first frame
/// starts with one of its topic prefixes.
///
/// ```no_run
/// # async fn f() -> Result<(), hicache_zmtp::ZmtpError> {
/// use hicache_zmtp::{ClientOptions, SubClient};
/// let mut sub = SubClient::connect("tcp://127.0.0.1:5557", &[b"kv"], ClientOptions::default()).await?;
/// loop {
///     match sub.recv().await {
///         Ok(frames) => println!("{} frames", frames.len()),
///         // Lost: connect again; the new connection has a new `connection_id`.
///         Err(e) => break eprintln!("connection {} lost: {e}", sub.connection_id()),
///     }
/// }
/// # Ok(()) }
/// ```
pub struct SubClient {
    conn: Conn,
}

impl SubClient {
    /// Connects to `endpoint` (`tcp://HOST:PORT`), does the handshake (the server must be a PUB
    /// or XPUB) and subscribes to each of `topics` (a prefix; the empty one matches all).
    pub async fn connect<T: AsRef<[u8]>>(
        endpoint: &str,
        topics: &[T],
        opts: ClientOptions,
    ) -> Result<Self, ZmtpError> {
        let conn = Conn::connect(endpoint, "SUB", &["PUB", "XPUB"], opts).await?;
        let mut sub = Self { conn };
        for t in topics {
            sub.subscribe(t.as_ref()).await?;
        }
        Ok(sub)
    }

    /// Adds a topic prefix. Sent as a ZMTP 3.0 subscription message (`0x01` + prefix), which
    /// every ZMTP 3 publisher understands.
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        self.subscription(1, topic).await
    }

    /// Withdraws one subscription to `topic`.
    pub async fn unsubscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        self.subscription(0, topic).await
    }

    async fn subscription(&mut self, op: u8, topic: &[u8]) -> Result<(), ZmtpError> {
        let mut f = BytesMut::with_capacity(1 + topic.len());
        f.put_u8(op);
        f.put_slice(topic);
        self.conn.send(&[f.freeze()]).await
    }

    /// The next message's frames. Errors mean the connection is lost (the server closed, broke
    /// the limits, or said nothing within the heartbeat timeout).
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        self.conn.recv(None).await
    }

    /// [`SubClient::recv`] waiting at most `limit`: `Err(ZmtpError::Timeout)` then, and the
    /// connection is kept.
    pub async fn recv_timeout(&mut self, limit: Duration) -> Result<Vec<Bytes>, ZmtpError> {
        self.conn.recv(Some(Instant::now() + limit)).await
    }

    /// This connection's number, unique in the process: a new connection (after a loss) has a
    /// new one, which is how a caller tells "the same stream" from "a new stream".
    pub fn connection_id(&self) -> u64 {
        self.conn.id
    }

    /// The server's address.
    pub fn peer_addr(&self) -> std::net::SocketAddr {
        self.conn.peer
    }

    /// Whether the connection was lost (every later call answers [`ZmtpError::Closed`]).
    pub fn is_lost(&self) -> bool {
        self.conn.lost
    }
}
