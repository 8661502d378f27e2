//! The crash test on the `rdma` backend: the client (`storage-write --backend rdma`) is
//! SIGKILLed at random moments, mid-batch included, against one in-process
//! `hicache-rdma-server`; after each round every page the client acknowledged reads back
//! bit-exact from the server and none reads back wrong: pages the dead client reserved but
//! never committed stay invisible (harness in `durability/`).
#![cfg(feature = "rdma")]

mod durability;

use hicache_backend_rdma::{RdmaServer, ServerAuth, ServerOptions, TenantTable, Token};

/// The token the server lets in and the killed clients authenticate with.
const TOKEN: &str = "durability-test-token-5e1f";

#[test]
fn rdma_client_crash_rounds_never_lose_acknowledged_pages() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // No eviction: a page missing after a round can only be a lost acknowledged page. The
    // pool is mapped lazily; a round writes at most a few hundred MiB.
    let server = rt
        .block_on(RdmaServer::start(ServerOptions {
            pool_bytes: 4 << 30,
            eviction: None,
            auth: ServerAuth::Tenants(TenantTable::shared(Token::new(TOKEN, "test").unwrap())),
            ..ServerOptions::default()
        }))
        .unwrap();
    let extra = format!(
        r#"{{"server": "{}", "token": "{TOKEN}"}}"#,
        server.local_addr()
    );
    let extra_few = format!(
        r#"{{"server": "{}", "connections": 1, "token": "{TOKEN}"}}"#,
        server.local_addr()
    );
    durability::crash_rounds(
        "rdma",
        None,
        0x7d3a,
        3000,
        &[
            (100_000, extra.as_str()),
            (65_536, extra.as_str()),
            (30_000, extra_few.as_str()),
            (131_072, extra.as_str()),
        ],
    );
    rt.block_on(server.shutdown());
}
