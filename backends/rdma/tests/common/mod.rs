//! Shared test helpers: a conformance harness that starts an in-process server per backend.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use hicache_backend_rdma::{
    RdmaOptions, RdmaServer, RdmaStorage, ServerAuth, ServerHandle, ServerOptions, TenantTable,
    Token,
};
use hicache_storage::conformance::Harness;
use hicache_storage::{PageKey, Result, StorageError, async_trait};
use parking_lot::Mutex;

/// The shared token of the test servers.
pub const TEST_TOKEN: &str = "hicache-rdma-test-token-0001";

/// [`TEST_TOKEN`] as a token.
pub fn test_token() -> Token {
    Token::new(TEST_TOKEN, "test token").unwrap()
}

/// Server options for a pool of `pool` bytes, letting in [`TEST_TOKEN`] for every namespace.
pub fn server_opts(pool: u64) -> ServerOptions {
    ServerOptions {
        pool_bytes: pool,
        region_bytes: pool.min(256 << 20),
        auth: ServerAuth::Tenants(TenantTable::shared(test_token())),
        ..ServerOptions::default()
    }
}

/// Client options for `server` with short timeouts, authenticating with [`TEST_TOKEN`].
pub fn client_opts(server: &ServerHandle) -> RdmaOptions {
    let mut o = RdmaOptions::with_token(server.local_addr().to_string(), test_token());
    o.io_timeout = Duration::from_secs(5);
    o
}

/// Opens a client of an in-process server per `open`, keeping the servers.
#[derive(Default)]
pub struct RdmaHarness {
    servers: Mutex<Vec<ServerHandle>>,
}

#[async_trait]
impl Harness for RdmaHarness {
    type Backend = RdmaStorage;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<RdmaStorage>> {
        let server = RdmaServer::start(server_opts(capacity_bytes.unwrap_or(512 << 20))).await?;
        let client = RdmaStorage::connect(client_opts(&server)).await?;
        self.servers.lock().push(server);
        Ok(Arc::new(client))
    }

    async fn corrupt(&self, backend: &RdmaStorage, key: &PageKey) -> Result<bool> {
        let servers = self.servers.lock();
        let s = servers
            .iter()
            .find(|s| s.local_addr().to_string() == backend.server_addr())
            .ok_or_else(|| StorageError::Backend {
                backend: "rdma".into(),
                reason: "no server for this client".into(),
            })?;
        Ok(s.damage_page(key))
    }
}

/// Waits (bounded) until `cond` holds, checking every few milliseconds. For events that
/// happen asynchronously on the server (a closed connection noticed); never a timing claim.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
