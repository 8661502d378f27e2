//! Faults of a remote memory pool, under the invariant of the storage fault suite: every
//! acknowledged page reads back intact or, if its own bytes were damaged, as a counted miss;
//! never a wrong page.
//!
//! - `hicache_storage::fault_tests!(…, remote)` on a real `hicache-rdma-server` process:
//!   SIGKILL and restart of the server mid-batch, garbage on its port; the directory faults
//!   are declared not applicable (the pool has no files) with their reasons.
//! - Here, what only this backend has: many flipped pages in the pool's memory (the
//!   conformance `corruption` case damages one), and authenticated hostile tenants and
//!   forged handshakes beside an honest client. A SIGKILLed *client* is
//!   `hicache-bench/tests/storage_rdma.rs`.

mod common;

use std::time::Duration;

use common::{FaultProcess, client_opts, process_err, server_opts};
use hicache_backend_rdma::protocol::{self, FrameHead, MAGIC, PageReq, Request, VERSION, op};
use hicache_backend_rdma::{
    Connection, Grant, RdmaOptions, RdmaServer, RdmaStorage, ServerAuth, ServerOptions, Tenant,
    TenantTable, Token,
};
use hicache_storage::faults::{FaultServer, RemoteFaultTarget};
use hicache_storage::{
    LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Result, Storage, async_trait, pattern,
};
use tokio::net::TcpStream;

/// The fault suite's remote target: `hicache-rdma-server` processes (shared-secret auth), TCP
/// clients.
struct RdmaTarget;

#[async_trait]
impl RemoteFaultTarget for RdmaTarget {
    async fn start_server(&self, capacity_bytes: u64) -> Result<Box<dyn FaultServer>> {
        let p = common::ServerProcess::start(capacity_bytes, &[])
            .map_err(|e| process_err("start hicache-rdma-server", e))?;
        Ok(Box::new(FaultProcess(p)))
    }

    async fn connect(&self, addr: &str) -> Result<std::sync::Arc<dyn Storage>> {
        let mut o = RdmaOptions::with_token(addr, common::test_token());
        o.io_timeout = Duration::from_secs(5);
        o.retry_backoff = Duration::from_millis(20);
        Ok(std::sync::Arc::new(RdmaStorage::connect(o).await?))
    }

    fn greeting(&self) -> Vec<u8> {
        let hello = Request::Hello {
            magic: MAGIC,
            version: VERSION,
            client: "fault-suite".into(),
            nonce: [7; 32],
        };
        let body = hello.encode();
        let head = FrameHead {
            body_len: body.len() as u32,
            payload_len: 0,
            id: 1,
            op: op::HELLO,
        };
        [&head.encode()[..], &body].concat()
    }
}

hicache_storage::fault_tests!(process, RdmaTarget, remote);

const L: LayoutKind = LayoutKind::PageFirst;
const LEN: usize = 16 << 10;

fn key(ns: u64, seed: u64, i: u64) -> PageKey {
    pattern::page_key(pattern::namespace(ns), seed, i)
}

async fn put(s: &RdmaStorage, keys: &[PageKey]) -> Vec<PageOutcome> {
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| pattern::page_bytes(k, LEN)).collect();
    let bufs: Vec<PageBuf<'_>> = pages.iter().map(|p| PageBuf::contiguous(L, p)).collect();
    s.batch_set(keys, &bufs).await.expect("batch_set")
}

/// Reads `keys` back; returns (intact, lost, wrong) under the suite's invariant.
async fn tally(s: &RdmaStorage, keys: &[PageKey]) -> (usize, usize, usize) {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; LEN]).collect();
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::contiguous(L, b))
            .collect();
        s.batch_get(keys, &mut dst).await.expect("batch_get")
    };
    let (mut intact, mut lost, mut wrong) = (0, 0, 0);
    for ((k, o), b) in keys.iter().zip(&out).zip(&bufs) {
        match o {
            PageOutcome::Hit if pattern::check_page(k, b) => intact += 1,
            PageOutcome::Hit => wrong += 1,
            _ => lost += 1,
        }
    }
    (intact, lost, wrong)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bit_flips_in_server_memory_are_counted_misses_never_wrong_pages() {
    let server = RdmaServer::start(server_opts(16 << 20)).await.unwrap();
    let client = RdmaStorage::connect(client_opts(&server)).await.unwrap();
    let keys: Vec<PageKey> = (0..64).map(|i| key(1, 7, i)).collect();
    assert!(
        put(&client, &keys)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    // Every fourth page gets a flipped byte in the pool's memory.
    let damaged: Vec<PageKey> = keys.iter().step_by(4).copied().collect();
    for k in &damaged {
        assert!(server.damage_page(k), "page present and unpinned");
    }
    let (intact, lost, wrong) = tally(&client, &keys).await;
    assert_eq!(wrong, 0, "a damaged page must never be a hit");
    assert_eq!((intact, lost), (keys.len() - damaged.len(), damaged.len()));
    assert_eq!(client.stats().get_corrupt, damaged.len() as u64, "counted");
    // The bad copies were dropped; the pages can be stored again and read back intact.
    assert_eq!(client.batch_exists(&damaged[..1]).await.unwrap(), 0);
    assert!(
        put(&client, &damaged)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    assert_eq!(tally(&client, &keys).await, (keys.len(), 0, 0));
}

/// Hostile peers on the port (forged handshakes, another tenant's deletes and
/// overwrites, readers that never read) while an honest client writes and reads: every page
/// the honest client was acknowledged reads back intact, every round.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_peers_never_cost_an_honest_client_a_page() {
    let honest = Token::new("honest-tenant-token-0001", "t").unwrap();
    let other = Token::new("hostile-tenant-token-0001", "t").unwrap();
    let server = RdmaServer::start(ServerOptions {
        auth: ServerAuth::Tenants(
            TenantTable::new(vec![
                Tenant {
                    name: "honest".into(),
                    token: honest.clone(),
                    grant: Grant::Only([pattern::namespace(1)].into_iter().collect()),
                },
                Tenant {
                    name: "hostile".into(),
                    token: other.clone(),
                    grant: Grant::Only([pattern::namespace(2)].into_iter().collect()),
                },
            ])
            .unwrap(),
        ),
        lease_ms: 200,
        handshake_ms: 500,
        ..server_opts(64 << 20)
    })
    .await
    .unwrap();
    let addr = server.local_addr().to_string();
    let client = RdmaStorage::connect(RdmaOptions::with_token(addr.clone(), honest))
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut hostile = Vec::new();
    // Forged handshakes (plain garbage on the port is the fault suite's `port_garbage`).
    {
        let (addr, stop) = (addr.clone(), stop.clone());
        hostile.push(tokio::spawn(async move {
            let mut n = 0u64;
            while n < 10_000 && (n < 5 || !stop.load(std::sync::atomic::Ordering::Relaxed)) {
                n += 1;
                let Ok(mut s) = TcpStream::connect(&addr).await else {
                    continue;
                };
                let hello = Request::Hello {
                    magic: MAGIC,
                    version: VERSION,
                    client: "forger".into(),
                    nonce: [n as u8; 32],
                };
                let _ = protocol::write_frame(&mut s, 1, op::HELLO, &hello.encode(), 0).await;
                let _ = protocol::read_frame(&mut s).await;
                let auth = Request::Auth {
                    mac: Some([n as u8; 32]),
                };
                let _ = protocol::write_frame(&mut s, 2, op::AUTH, &auth.encode(), 0).await;
                let _ = protocol::read_frame(&mut s).await;
            }
        }));
    }
    // An authenticated tenant of another namespace deleting, overwriting and reading the
    // honest client's keys (without waiting for the last reply).
    {
        let (addr, stop) = (addr.clone(), stop.clone());
        hostile.push(tokio::spawn(async move {
            let mut n = 0u64;
            while n < 10_000 && (n < 5 || !stop.load(std::sync::atomic::Ordering::Relaxed)) {
                n += 1;
                let Ok(mut c) = Connection::connect(
                    &addr,
                    "hostile",
                    Some(&other),
                    Duration::from_secs(5),
                    Duration::from_secs(5),
                )
                .await
                else {
                    continue;
                };
                let theirs: Vec<PageKey> = (0..8).map(|i| key(1, 9, i)).collect();
                let _ = c
                    .call(&Request::Delete {
                        keys: theirs.clone(),
                    })
                    .await;
                let pages: Vec<PageReq> = theirs
                    .iter()
                    .map(|k| PageReq {
                        key: *k,
                        len: LEN as u64,
                        layout: L.tag(),
                    })
                    .collect();
                let _ = c
                    .call(&Request::Allocate {
                        pages: pages.clone(),
                    })
                    .await;
                let _ = c.send(&Request::Read { pages }, 0).await;
                let _ = c.flush().await;
            }
        }));
    }
    for round in 0..20u64 {
        let keys: Vec<PageKey> = (0..8).map(|i| key(1, 9, round * 8 + i)).collect();
        assert!(
            put(&client, &keys)
                .await
                .iter()
                .all(|o| *o == PageOutcome::Stored)
        );
        let (intact, lost, wrong) = tally(&client, &keys).await;
        assert_eq!((intact, lost, wrong), (8, 0, 0), "round {round}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in hostile {
        h.await.unwrap();
    }
    let all: Vec<PageKey> = (0..160).map(|i| key(1, 9, i)).collect();
    assert_eq!(tally(&client, &all).await, (160, 0, 0));
    let st = server.stats();
    assert!(
        st.forbidden > 0 && st.auth_failures + st.protocol_errors > 0,
        "{st:?}"
    );
}
