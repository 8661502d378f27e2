//! How the driver reaches a publisher: a subscription to its PUB socket and replay requests to
//! its ROUTER, behind a small trait so the stream logic never sees a socket.
//!
//! Frames (SGLang's and vLLM's publishers, and ours):
//! - live: `[topic, seq (8 bytes big-endian), payload]`;
//! - replay: the DEALER sends `[b"", start_seq (8 bytes big-endian)]`; the ROUTER answers
//!   `[b"", topic, seq, payload]` per batch and ends with `[b"", b"", -1 (8 bytes), b""]`
//!   (a reply without the topic frame, `[b"", seq, payload]`, is accepted as well).
//!
//! [`ZmtpTransport`] implements it with hicache-zmtp's SUB and DEALER clients (every frame,
//! message and wait bounded; heartbeats detect a silent peer): the only ZMTP code the index
//! runs. The frames it hands on are checked here (count, sequence frame).

use bytes::Bytes;
use std::future::Future;
use std::time::Duration;
use tokio::sync::mpsc;

/// What a subscription reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubEvent {
    /// Connected (again): a new connection to the publisher.
    Connected,
    /// The connection is lost.
    Disconnected,
    /// A live batch.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        payload: Bytes,
    },
    /// A message that is not a batch (wrong frame count, bad sequence frame): counted.
    Garbage,
}

/// One item of a replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayItem {
    /// A replayed batch.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        payload: Bytes,
    },
    /// The end of the replay.
    End,
}

/// A transport to publishers.
pub trait Transport: Send + Sync + 'static {
    /// Subscribes to `endpoint` under `topic` for as long as `events` is open, reconnecting
    /// after a loss; each (re)connection is reported as [`SubEvent::Connected`].
    fn subscribe(
        &self,
        endpoint: String,
        topic: String,
        events: mpsc::Sender<SubEvent>,
    ) -> impl Future<Output = ()> + Send;

    /// Asks `endpoint` for every batch from `start` on, sending them to `items` in order; ends
    /// with [`ReplayItem::End`] or an error.
    fn replay(
        &self,
        endpoint: String,
        start: u64,
        items: mpsc::Sender<ReplayItem>,
    ) -> impl Future<Output = std::io::Result<()>> + Send;
}

/// Pause between connection attempts to a publisher that is down (kept short: a restarted
/// publisher must be seen within the fencing bound).
pub const RECONNECT_PAUSE: Duration = Duration::from_millis(200);

fn seq_of(frame: &[u8]) -> Option<i64> {
    <[u8; 8]>::try_from(frame).ok().map(i64::from_be_bytes)
}

fn io_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// hicache-zmtp's SUB and DEALER clients (the service's transport).
#[derive(Clone, Debug, Default)]
pub struct ZmtpTransport {
    /// The clients' bounds (frames, messages, handshake, heartbeats).
    pub options: hicache_zmtp::ClientOptions,
}

impl Transport for ZmtpTransport {
    async fn subscribe(&self, endpoint: String, topic: String, events: mpsc::Sender<SubEvent>) {
        loop {
            if events.is_closed() {
                return;
            }
            let connected = hicache_zmtp::SubClient::connect(
                &endpoint,
                &[topic.as_bytes()],
                self.options.clone(),
            )
            .await;
            let Ok(mut sub) = connected else {
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            };
            if events.send(SubEvent::Connected).await.is_err() {
                return;
            }
            loop {
                tokio::select! {
                    msg = sub.recv() => match msg {
                        Ok(frames) => {
                            let ev = match (frames.len(), frames.get(1).and_then(|f| seq_of(f))) {
                                (3, Some(seq)) if seq >= 0 => SubEvent::Batch {
                                    seq: seq as u64,
                                    payload: frames[2].clone(),
                                },
                                _ => SubEvent::Garbage,
                            };
                            if events.send(ev).await.is_err() { return; }
                        }
                        Err(_) => break,
                    },
                    () = events.closed() => return,
                }
            }
            if events.send(SubEvent::Disconnected).await.is_err() {
                return;
            }
            tokio::time::sleep(RECONNECT_PAUSE).await;
        }
    }

    async fn replay(
        &self,
        endpoint: String,
        start: u64,
        items: mpsc::Sender<ReplayItem>,
    ) -> std::io::Result<()> {
        let mut dealer = hicache_zmtp::DealerClient::connect(&endpoint, self.options.clone())
            .await
            .map_err(io_err)?;
        dealer
            .send(&[Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())])
            .await
            .map_err(io_err)?;
        loop {
            let frames = dealer.recv().await.map_err(io_err)?;
            let (seq, payload) = match frames.len() {
                4 => (seq_of(&frames[2]), frames[3].clone()),
                3 => (seq_of(&frames[1]), frames[2].clone()),
                n => return Err(io_err(format!("replay reply of {n} frames"))),
            };
            if !frames[0].is_empty() {
                return Err(io_err("replay reply without the empty delimiter frame"));
            }
            match seq {
                Some(-1) => {
                    let _ = items.send(ReplayItem::End).await;
                    return Ok(());
                }
                Some(s) if s >= 0 => {
                    let item = ReplayItem::Batch {
                        seq: s as u64,
                        payload,
                    };
                    if items.send(item).await.is_err() {
                        return Ok(());
                    }
                }
                _ => return Err(io_err("replay reply with a bad sequence frame")),
            }
        }
    }
}
