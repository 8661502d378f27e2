//! One authorized request of a connection: the requests that only touch the index are
//! answered inline, the others (`READ`, `LOOKUP`, `WRITE`, `VERBS_CONNECT`) have one function
//! each.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::Shared;
use super::frames::{End, Rd, Refusal, Wr, bounded, refuse_request, send};
use super::index::Pinned;
use crate::protocol::{self, PageReq, ProtocolError, Reply, Request, VerbsEndpoint, code, op};

/// Releases server-side read pins when a send ends, however it ends.
struct PinGuard<'a> {
    shared: &'a Shared,
    leases: Vec<u64>,
}

impl Drop for PinGuard<'_> {
    fn drop(&mut self) {
        if !self.leases.is_empty() {
            self.shared.index.lock().release(&self.leases);
        }
    }
}

/// Marks a reservation as no longer being written when a write ends, however it ends.
struct WriteGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.shared.index.lock().end_write(self.id);
    }
}

/// Handles one request; `Ok(false)` if it was refused with an error frame (the connection
/// goes on).
pub(super) async fn handle(
    shared: &Shared,
    r: &mut Rd,
    w: &mut Wr,
    conn: u64,
    id: u64,
    payload_len: u64,
    req: Request,
) -> Result<bool, End> {
    let o = &shared.opts;
    let answer = match req {
        Request::Hello { .. } | Request::Auth { .. } => {
            return Err(ProtocolError::Invalid {
                what: "handshake op after the handshake (op)",
                value: op::HELLO as u64,
            }
            .into());
        }
        Request::Read { pages } => return read(shared, w, conn, id, &pages).await.map(|()| true),
        Request::Lookup { pages } => lookup(shared, conn, &pages),
        Request::Write { slots } => Ok(write(shared, r, conn, payload_len, slots).await?),
        Request::VerbsConnect { endpoint } => verbs_connect(shared, conn, endpoint),
        Request::Exists { keys } => Ok(Reply::Exists {
            run: shared.index.lock().exists(&keys) as u32,
        }),
        Request::Release { leases } => Ok(Reply::Release {
            released: shared.index.lock().release_for(conn, &leases) as u32,
        }),
        Request::Allocate { pages } => {
            let deadline = Instant::now() + Duration::from_millis(o.alloc_ttl_ms as u64);
            Ok(Reply::Allocate(
                shared.index.lock().allocate(conn, &pages, deadline),
            ))
        }
        Request::Commit { slots } => {
            let mut ix = shared.index.lock();
            let ok = slots.iter().map(|(s, sum)| ix.commit(conn, *s, *sum));
            Ok(Reply::Commit(ok.collect()))
        }
        Request::Abort { slots } => Ok(Reply::Abort {
            n: shared.index.lock().abort(conn, &slots) as u32,
        }),
        Request::Drop { pages } => Ok(Reply::Drop {
            n: shared.index.lock().drop_if(&pages) as u32,
        }),
        Request::Delete { keys } => Ok(Reply::Delete {
            n: shared.index.lock().delete(&keys) as u32,
        }),
        Request::Stats => Ok(Reply::Stats(shared.stats())),
    };
    let reply = match answer {
        Ok(reply) => reply,
        Err((code, message)) => return refuse_request(w, id, o.idle_ms, code, message).await,
    };
    bounded(
        o.idle_ms,
        "sending a reply",
        false,
        send(shared, w, id, reply, 0),
    )
    .await?;
    Ok(true)
}

/// `READ` over TCP: pins the hits, sends their statuses and then their bytes straight from
/// the pool, and unpins when the send ends, however it ends.
async fn read(
    shared: &Shared,
    w: &mut Wr,
    conn: u64,
    id: u64,
    pages: &[PageReq],
) -> Result<(), End> {
    let statuses = shared.index.lock().read(conn, pages);
    let pins: Vec<Pinned> = statuses.iter().filter_map(|s| s.1).collect();
    let guard = PinGuard {
        shared,
        leases: pins.iter().map(|p| p.lease).collect(),
    };
    let total: u64 = pins.iter().map(|p| p.len).sum();
    // The pins are read leases: the reply must be consumed within `lease_ms`, or the
    // connection ends and `guard` unpins (a reader that stops reading cannot keep pages from
    // eviction).
    bounded(
        shared.opts.lease_ms,
        "consuming a READ reply",
        false,
        async {
            let reply = Reply::Read(statuses.into_iter().map(|s| s.0).collect());
            send(shared, w, id, reply, total).await?;
            for p in &pins {
                let region = &shared.regions[p.extent.region as usize];
                // SAFETY: the extent is pinned by `guard` until the send ends (index
                // invariant 3): it is committed, hence immutable (invariant 2), and cannot be
                // freed or reused while pinned.
                let bytes = unsafe { region.bytes(p.extent.offset, p.len as usize) };
                w.write_all(bytes).await?;
            }
            std::io::Result::Ok(())
        },
    )
    .await?;
    drop(guard);
    Ok(())
}

/// `LOOKUP` (verbs data plane): leases the hits for `lease_ms`; refused without verbs.
fn lookup(shared: &Shared, conn: u64, pages: &[PageReq]) -> Result<Reply, Refusal> {
    #[cfg(feature = "verbs")]
    let available = shared.verbs.is_some();
    #[cfg(not(feature = "verbs"))]
    let available = false;
    if !available {
        return Err((
            code::UNSUPPORTED,
            "LOOKUP needs the verbs data plane, which this server does not offer".into(),
        ));
    }
    let deadline = Instant::now() + Duration::from_millis(shared.opts.lease_ms as u64);
    Ok(Reply::Lookup(
        shared.index.lock().lookup(conn, pages, deadline),
    ))
}

/// `WRITE` over TCP: the payload is the slots' bytes in order, each read straight into its
/// reserved extent (or skipped if the reservation is gone).
async fn write(
    shared: &Shared,
    r: &mut Rd,
    conn: u64,
    payload_len: u64,
    slots: Vec<(u64, u64)>,
) -> Result<Reply, End> {
    let sum = slots
        .iter()
        .try_fold(0u64, |a, s| a.checked_add(s.1))
        .unwrap_or(u64::MAX);
    if sum != payload_len {
        return Err(ProtocolError::Invalid {
            what: "WRITE payload length (must equal the sum of slot lengths)",
            value: payload_len,
        }
        .into());
    }
    let mut ok = Vec::with_capacity(slots.len());
    for (slot, len) in slots {
        ok.push(receive_slot(shared, r, conn, slot, len).await?);
    }
    Ok(Reply::Write(ok))
}

/// Reads one slot's `len` bytes of a `WRITE` payload; `false` if the reservation is not this
/// connection's to write (its bytes are skipped).
async fn receive_slot(
    shared: &Shared,
    r: &mut Rd,
    conn: u64,
    slot: u64,
    len: u64,
) -> Result<bool, End> {
    let extent = shared.index.lock().begin_write(conn, slot, len);
    // Each slot's bytes must arrive within the reservation's lifetime: a writer that stalls
    // cannot keep a reservation from expiring forever.
    let what = "receiving one page of a WRITE payload";
    let ttl = shared.opts.alloc_ttl_ms;
    let Some(e) = extent else {
        bounded(ttl, what, false, protocol::skip_payload(r, len)).await?;
        return Ok(false);
    };
    let _g = WriteGuard { shared, id: slot };
    let region = &shared.regions[e.region as usize];
    // SAFETY: the reservation belongs to this connection and is marked as being written
    // (index invariant 4): nobody else reads or writes the extent until `_g` clears the mark,
    // and it is not visible before commit (invariant 1).
    let dst = unsafe { region.bytes_mut(e.offset, len as usize) };
    bounded(ttl, what, false, r.read_exact(dst)).await?;
    Ok(true)
}

/// `VERBS_CONNECT`: creates this connection's queue pair and answers with its endpoint.
#[cfg(feature = "verbs")]
fn verbs_connect(shared: &Shared, conn: u64, endpoint: VerbsEndpoint) -> Result<Reply, Refusal> {
    let v = shared.verbs.as_ref().ok_or_else(|| {
        (
            code::UNSUPPORTED,
            "this server has no RDMA device registered".to_string(),
        )
    })?;
    v.accept(conn, endpoint)
        .map(Reply::VerbsConnect)
        .map_err(|e| (code::INTERNAL, e.to_string()))
}

/// `VERBS_CONNECT` on a build without verbs: refused.
#[cfg(not(feature = "verbs"))]
fn verbs_connect(_shared: &Shared, _conn: u64, _endpoint: VerbsEndpoint) -> Result<Reply, Refusal> {
    Err((
        code::UNSUPPORTED,
        "this server was built without the verbs feature".into(),
    ))
}
