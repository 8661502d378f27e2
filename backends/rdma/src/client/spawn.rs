//! Where the client connects: the `server` option, or with `spawn_server` an in-process server
//! this client starts (needs the `server` cargo feature, on by default). The only place the
//! client touches the server module, so a client built without `server` has no server code.

use hicache_storage::{Result, StorageError};

use super::RdmaOptions;

/// A server this client started; it lives as long as the client holds it.
#[cfg(feature = "server")]
pub type Spawned = crate::server::ServerHandle;

/// Nothing: a build without the `server` feature cannot spawn a server.
#[cfg(not(feature = "server"))]
#[derive(Debug)]
pub enum Spawned {}

/// The address to connect to, and the server started for it if `spawn_server` is set. A
/// spawned server listens on loopback and lets in only this client's token (a fresh random
/// one unless the caller gave one, stored into `opts`), so other local users cannot use it.
pub async fn server_addr(opts: &mut RdmaOptions) -> Result<(String, Option<Spawned>)> {
    if opts.spawn_server {
        let (addr, server) = spawn(opts).await?;
        return Ok((addr, Some(server)));
    }
    let addr = opts.server.clone().ok_or_else(|| {
        StorageError::config("backend rdma", "server", "<missing>", "required field")
    })?;
    Ok((addr, None))
}

#[cfg(feature = "server")]
async fn spawn(opts: &mut RdmaOptions) -> Result<(String, Spawned)> {
    use crate::auth::{TenantTable, Token};
    use crate::server::{RdmaServer, ServerAuth, ServerOptions};

    let token = match &opts.token {
        Some(t) => t.clone(),
        None => Token::random()?,
    };
    opts.token = Some(token.clone());
    let h = RdmaServer::start(ServerOptions {
        pool_bytes: opts.spawn_pool_bytes,
        region_bytes: opts.spawn_pool_bytes.min(1 << 30),
        populate: opts.spawn_populate,
        auth: ServerAuth::Tenants(TenantTable::shared(token)),
        ..ServerOptions::default()
    })
    .await?;
    Ok((h.local_addr().to_string(), h))
}

#[cfg(not(feature = "server"))]
async fn spawn(_opts: &mut RdmaOptions) -> Result<(String, Spawned)> {
    Err(StorageError::config(
        "backend rdma",
        "spawn_server",
        "true",
        "needs hicache-backend-rdma built with its `server` cargo feature (on by default)",
    ))
}

#[cfg(all(test, not(feature = "server")))]
mod tests {
    use super::*;

    #[test]
    fn a_client_without_the_server_feature_refuses_spawn_server() {
        let mut opts = RdmaOptions {
            spawn_server: true,
            ..RdmaOptions::default()
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let e = rt.block_on(server_addr(&mut opts)).unwrap_err().to_string();
        assert!(e.contains("spawn_server") && e.contains("`server`"), "{e}");
    }
}
