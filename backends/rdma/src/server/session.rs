//! Who is on a connection: the handshake (protocol rule 1: `HELLO`, then `AUTH`) that makes a
//! [`Session`], the tenant's connection limit, and the per-request checks of its grant and
//! its in-flight bytes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use hicache_core::PageKey;
use tokio::io::AsyncWriteExt;

use super::frames::{End, Rd, Refusal, Wr, send};
use super::{ServerAuth, Shared};
use crate::auth::{self, Grant};
use crate::protocol::{
    self, FrameHead, MAC_LEN, NONCE_LEN, ProtocolError, Reply, ReplyFrame, Request, code, op,
};

/// One authenticated connection's tenant; uncounts the connection from its tenant on drop.
pub(super) struct Session {
    shared: Arc<Shared>,
    conn: u64,
    /// The tenant's name (`insecure` without authentication).
    pub(super) tenant: String,
    grant: Grant,
}

impl Drop for Session {
    fn drop(&mut self) {
        let mut m = self.shared.tenant_conns.lock();
        if let Some(v) = m.get_mut(&self.tenant) {
            v.retain(|c| *c != self.conn);
            if v.is_empty() {
                m.remove(&self.tenant);
            }
        }
    }
}

impl Session {
    /// Why `req` must be refused (with the connection going on), if it must: a key in a
    /// namespace outside the tenant's grant, or more bytes in flight than the tenant may hold.
    pub(super) fn refusal(&self, req: &Request, peer: SocketAddr) -> Option<Refusal> {
        if let Some(k) = self.denied(req) {
            self.shared.forbidden.fetch_add(1, Ordering::Relaxed);
            let ns = k.namespace.to_hex();
            tracing::warn!(
                "rdma server: tenant {:?} at {peer} denied namespace {ns}",
                self.tenant
            );
            let message = format!(
                "tenant {:?} may not use namespace {ns} (not in its grant)",
                self.tenant
            );
            return Some((code::FORBIDDEN, message));
        }
        self.over_budget(req).map(|m| (code::BUSY, m))
    }

    /// The first key of `req` whose namespace the tenant may not use.
    fn denied(&self, req: &Request) -> Option<PageKey> {
        let outside = |k: &&PageKey| !self.grant.allows(&k.namespace);
        match req {
            Request::Exists { keys } | Request::Delete { keys } => keys.iter().find(outside),
            Request::Read { pages } | Request::Lookup { pages } | Request::Allocate { pages } => {
                pages.iter().map(|p| &p.key).find(outside)
            }
            Request::Drop { pages } => pages.iter().map(|p| &p.0).find(outside),
            _ => None,
        }
        .copied()
    }

    /// Per-tenant in-flight bytes, checked per request (a tenant's concurrent requests on
    /// several connections may overshoot by at most one request each): the refusal message
    /// if `req` would take the tenant over its limit.
    fn over_budget(&self, req: &Request) -> Option<String> {
        let cap = self.shared.opts.max_tenant_inflight_bytes?;
        let wanted = match req {
            Request::Read { pages } | Request::Lookup { pages } | Request::Allocate { pages } => {
                pages.iter().fold(0u64, |a, p| a.saturating_add(p.len))
            }
            _ => 0,
        };
        if wanted == 0 {
            return None;
        }
        let used = self.in_flight();
        (used.saturating_add(wanted) > cap).then(|| {
            format!(
                "tenant {:?} holds {used} bytes in flight (reserved or being read); \
                 {wanted} more would exceed its limit of {cap} (--max-tenant-inflight)",
                self.tenant
            )
        })
    }

    /// Bytes the tenant holds in flight over all its connections.
    fn in_flight(&self) -> u64 {
        let conns = self
            .shared
            .tenant_conns
            .lock()
            .get(&self.tenant)
            .cloned()
            .unwrap_or_default();
        let ix = self.shared.index.lock();
        conns.iter().map(|c| ix.usage(*c).in_flight()).sum()
    }
}

/// Reads one handshake frame, which must be of op `want` with no payload (`wrong` names
/// another op).
async fn handshake_request(
    r: &mut Rd,
    want: u8,
    wrong: fn(u8) -> ProtocolError,
    payload_what: &'static str,
) -> Result<(FrameHead, Request), End> {
    let (head, body) = protocol::read_frame_limited(r, protocol::MAX_HANDSHAKE_BODY).await?;
    if head.op != want {
        return Err(wrong(head.op).into());
    }
    let req = Request::decode(want, &body)?;
    if head.payload_len != 0 {
        return Err(ProtocolError::Invalid {
            what: payload_what,
            value: head.payload_len,
        }
        .into());
    }
    Ok((head, req))
}

/// The tenant a client's MAC proves, its grant, and the server's proof for the client.
type Authenticated = (String, Grant, Option<[u8; MAC_LEN]>);

/// Checks the client's MAC over both nonces against the server's credentials.
fn authenticate(
    shared: &Shared,
    mac: Option<[u8; MAC_LEN]>,
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
) -> Result<Authenticated, End> {
    let fail = |message: &str| {
        shared.auth_failures.fetch_add(1, Ordering::Relaxed);
        End::Refused {
            code: code::AUTH,
            message: message.to_string(),
        }
    };
    match (&shared.opts.auth, mac) {
        (ServerAuth::InsecureNoAuth, _) => Ok(("insecure".to_string(), Grant::Any, None)),
        (ServerAuth::Tenants(_), None) => Err(fail(
            "authentication required: this server accepts only clients with a token \
             (`token` or `token_file` in the rdma extra-config)",
        )),
        (ServerAuth::Tenants(table), Some(mac)) => {
            match table.authenticate(client_nonce, server_nonce, &mac) {
                Some(t) => Ok((
                    t.name.clone(),
                    t.grant.clone(),
                    Some(auth::server_proof(&t.token, client_nonce, server_nonce)),
                )),
                None => Err(fail(
                    "authentication failed: the token is not one this server knows",
                )),
            }
        }
    }
}

/// Counts connection `conn` against its tenant's limit, refusing it beyond
/// `max_tenant_connections`.
fn admit(shared: &Shared, tenant: &str, conn: u64) -> Result<(), End> {
    let max = shared.opts.max_tenant_connections;
    let mut m = shared.tenant_conns.lock();
    let conns = m.entry(tenant.to_string()).or_default();
    if conns.len() >= max as usize {
        shared.refused_connections.fetch_add(1, Ordering::Relaxed);
        return Err(End::Refused {
            code: code::BUSY,
            message: format!(
                "tenant {tenant:?} already has {max} connections open, its limit \
                 (--max-tenant-connections); try again later"
            ),
        });
    }
    conns.push(conn);
    Ok(())
}

/// The handshake (protocol rule 1): `HELLO`, then `AUTH`; returns the connection's session.
pub(super) async fn handshake(
    shared: &Arc<Shared>,
    r: &mut Rd,
    w: &mut Wr,
    conn: u64,
    peer: SocketAddr,
) -> Result<Session, End> {
    let (head, hello) =
        handshake_request(r, op::HELLO, ProtocolError::NoHello, "HELLO payload length").await?;
    let Request::Hello {
        client,
        nonce: client_nonce,
        ..
    } = hello
    else {
        unreachable!("decode of HELLO yields Hello")
    };
    let server_nonce = auth::random_bytes::<{ NONCE_LEN }>().map_err(|e| End::Refused {
        code: code::INTERNAL,
        message: e.to_string(),
    })?;
    let hello = Reply::Hello {
        nonce: server_nonce,
        auth: shared.opts.auth != ServerAuth::InsecureNoAuth,
    };
    // Not authenticated yet: the reply carries no occupancy (the pool's totals are for
    // tenants only).
    let f = ReplyFrame::Ok(protocol::Occupancy::default(), hello);
    protocol::write_frame(w, head.id, f.op(), &f.encode(), 0).await?;
    w.flush().await?;
    let (head, auth) =
        handshake_request(r, op::AUTH, ProtocolError::NoAuth, "AUTH payload length").await?;
    let Request::Auth { mac } = auth else {
        unreachable!("decode of AUTH yields Auth")
    };
    let (tenant, grant, proof) = authenticate(shared, mac, &client_nonce, &server_nonce)?;
    admit(shared, &tenant, conn)?;
    let session = Session {
        shared: shared.clone(),
        conn,
        tenant,
        grant,
    };
    tracing::debug!(
        "rdma server: {peer} ({client:?}) authenticated as tenant {:?}",
        session.tenant
    );
    let info = shared.info.clone();
    send(shared, w, head.id, Reply::Auth { info, proof }, 0).await?;
    w.flush().await?;
    Ok(session)
}
