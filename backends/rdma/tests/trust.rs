//! The server's trust model against hostile clients: authentication, authorization by
//! namespace, timeouts, connection limits, and a pool the protocol cannot describe.

mod common;

use std::time::Duration;

use common::{client_opts, eventually, server_opts, test_token};
use hicache_backend_rdma::protocol::{
    self, MAGIC, PageReq, Reply, ReplyFrame, Request, VERSION, code, op,
};
use hicache_backend_rdma::{
    Connection, Grant, RdmaOptions, RdmaServer, RdmaStorage, ServerAuth, ServerHandle,
    ServerOptions, Tenant, TenantTable, Token, auth,
};
use hicache_storage::{LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Storage, pattern};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const L: LayoutKind = LayoutKind::PageFirst;

fn key(ns: u64, i: u64) -> PageKey {
    pattern::page_key(pattern::namespace(ns), 51, i)
}

fn token(s: &str) -> Token {
    Token::new(s, "test").unwrap()
}

/// Tenant `a` may use namespace 1, tenant `b` namespace 2.
fn two_tenants() -> ServerAuth {
    let t = |name: &str, tok: &str, ns: u64| Tenant {
        name: name.into(),
        token: token(tok),
        grant: Grant::Only([pattern::namespace(ns)].into_iter().collect()),
    };
    ServerAuth::Tenants(
        TenantTable::new(vec![
            t("a", "tenant-a-token-0123456789", 1),
            t("b", "tenant-b-token-0123456789", 2),
        ])
        .unwrap(),
    )
}

async fn client(server: &ServerHandle, tok: &str) -> RdmaStorage {
    let o = RdmaOptions {
        connections: 1,
        ..RdmaOptions::with_token(server.local_addr().to_string(), token(tok))
    };
    RdmaStorage::connect(o).await.unwrap()
}

async fn put(
    s: &RdmaStorage,
    keys: &[PageKey],
    len: usize,
) -> hicache_storage::Result<Vec<PageOutcome>> {
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| pattern::page_bytes(k, len)).collect();
    let bufs: Vec<PageBuf<'_>> = pages.iter().map(|p| PageBuf::contiguous(L, p)).collect();
    s.batch_set(keys, &bufs).await
}

async fn get(
    s: &RdmaStorage,
    keys: &[PageKey],
    len: usize,
) -> hicache_storage::Result<(Vec<PageOutcome>, Vec<Vec<u8>>)> {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::contiguous(L, b))
            .collect();
        s.batch_get(keys, &mut dst).await?
    };
    Ok((out, bufs))
}

fn assert_forbidden<T: std::fmt::Debug>(r: hicache_storage::Result<T>, what: &str) {
    let e = r.expect_err(what).to_string();
    assert!(
        e.contains("may not use namespace") && e.contains(&format!("code {}", code::FORBIDDEN)),
        "{what}: {e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_a_cannot_read_overwrite_or_delete_tenant_b_pages() {
    let server = RdmaServer::start(ServerOptions {
        auth: two_tenants(),
        ..server_opts(16 << 20)
    })
    .await
    .unwrap();
    let a = client(&server, "tenant-a-token-0123456789").await;
    let b = client(&server, "tenant-b-token-0123456789").await;
    let theirs: Vec<PageKey> = (0..4).map(|i| key(2, i)).collect();
    let mine: Vec<PageKey> = (0..4).map(|i| key(1, i)).collect();
    assert!(
        put(&b, &theirs, 5000)
            .await
            .unwrap()
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    assert!(
        put(&a, &mine, 5000)
            .await
            .unwrap()
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    // A may not probe, read, overwrite (with its own bytes) or delete B's pages, nor mix one
    // of B's keys into a batch of its own.
    assert_forbidden(a.batch_exists(&theirs).await, "exists");
    assert_forbidden(get(&a, &theirs, 5000).await, "get");
    let forged: Vec<Vec<u8>> = theirs.iter().map(|_| vec![0xee; 5000]).collect();
    let bufs: Vec<PageBuf<'_>> = forged.iter().map(|p| PageBuf::contiguous(L, p)).collect();
    assert_forbidden(a.batch_set(&theirs, &bufs).await, "overwrite");
    assert_forbidden(a.delete(&theirs).await, "delete");
    assert_forbidden(a.batch_exists(&[mine[0], theirs[0]]).await, "mixed batch");
    // Nor DROP them by checksum, on a raw connection.
    let mut raw = Connection::connect(
        &server.local_addr().to_string(),
        "raw-a",
        Some(&token("tenant-a-token-0123456789")),
        Duration::from_secs(5),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let sum = hicache_storage::checksum::checksum_page(&PageBuf::contiguous(
        L,
        &pattern::page_bytes(&theirs[0], 5000),
    ));
    let e = raw
        .call(&Request::Drop {
            pages: vec![(theirs[0], sum)],
        })
        .await
        .unwrap_err();
    assert!(e.to_string().contains("may not use namespace"), "{e}");
    // The connection stays usable for A's own pages.
    let (_, r) = raw
        .call(&Request::Exists { keys: mine.clone() })
        .await
        .unwrap();
    assert_eq!(r, Reply::Exists { run: 4 });
    // B's pages are all there, bit-exact; A's own pages work for A.
    let (out, bytes) = get(&b, &theirs, 5000).await.unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Hit), "{out:?}");
    for (k, got) in theirs.iter().zip(&bytes) {
        assert_eq!(got, &pattern::page_bytes(k, 5000));
    }
    let (out, _) = get(&a, &mine, 5000).await.unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Hit));
    assert_eq!(a.delete(&mine).await.unwrap(), 4);
    assert!(server.stats().forbidden >= 6);
}

/// Sends HELLO on a raw socket; returns the server's nonce and whether it requires auth.
async fn raw_hello(s: &mut TcpStream, client_nonce: [u8; 32]) -> ([u8; 32], bool) {
    let hello = Request::Hello {
        magic: MAGIC,
        version: VERSION,
        client: "raw".into(),
        nonce: client_nonce,
    };
    protocol::write_frame(s, 1, op::HELLO, &hello.encode(), 0)
        .await
        .unwrap();
    match read_reply(s).await {
        ReplyFrame::Ok(_, Reply::Hello { nonce, auth }) => (nonce, auth),
        other => panic!("{other:?}"),
    }
}

async fn read_reply(s: &mut TcpStream) -> ReplyFrame {
    let (head, body) = protocol::read_frame(s).await.expect("a reply frame");
    ReplyFrame::decode(head.op, &body).expect("a valid reply")
}

async fn expect_error(s: &mut TcpStream, want: u16, needle: &str) {
    match read_reply(s).await {
        ReplyFrame::Error { code: c, message } => {
            assert_eq!(c, want, "{message}");
            assert!(message.contains(needle), "{message}");
        }
        other => panic!("expected an error, got {other:?}"),
    }
}

async fn expect_closed(s: &mut TcpStream) {
    let mut b = [0u8; 64];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut b))
            .await
            .expect("the server closes the connection")
            .unwrap_or(0);
        if n == 0 {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_valid_credentials_gets_nothing() {
    let server = RdmaServer::start(server_opts(4 << 20)).await.unwrap();
    let addr = server.local_addr();
    let k = key(3, 0);
    let owner = RdmaStorage::connect(client_opts(&server)).await.unwrap();
    put(&owner, &[k], 4096).await.unwrap();
    // No token: the client refuses before sending anything further, naming the fields.
    let e = RdmaStorage::connect(RdmaOptions::new(addr.to_string()))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("requires authentication") && e.contains("token_file"),
        "{e}"
    );
    // A wrong token: refused by the server.
    let e = RdmaStorage::connect(RdmaOptions::with_token(
        addr.to_string(),
        token("not-the-right-token-at-all"),
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("authentication failed"), "{e}");
    // Raw: AUTH without a MAC, with a wrong MAC, with a MAC for other nonces (a replay), and
    // a request in place of AUTH: an error each, then the connection closes.
    let mut s = TcpStream::connect(addr).await.unwrap();
    raw_hello(&mut s, [1; 32]).await;
    let req = Request::Auth { mac: None };
    protocol::write_frame(&mut s, 2, op::AUTH, &req.encode(), 0)
        .await
        .unwrap();
    expect_error(&mut s, code::AUTH, "authentication required").await;
    expect_closed(&mut s).await;
    for mac in [
        [0u8; 32],
        auth::client_mac(&test_token(), &[1; 32], &[2; 32]),
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        raw_hello(&mut s, [1; 32]).await;
        let req = Request::Auth { mac: Some(mac) };
        protocol::write_frame(&mut s, 2, op::AUTH, &req.encode(), 0)
            .await
            .unwrap();
        expect_error(&mut s, code::AUTH, "authentication failed").await;
        expect_closed(&mut s).await;
    }
    let mut s = TcpStream::connect(addr).await.unwrap();
    raw_hello(&mut s, [1; 32]).await;
    let req = Request::Read {
        pages: vec![PageReq {
            key: k,
            len: 4096,
            layout: L.tag(),
        }],
    };
    protocol::write_frame(&mut s, 2, op::READ, &req.encode(), 0)
        .await
        .unwrap();
    expect_error(&mut s, code::PROTOCOL, "expected AUTH").await;
    expect_closed(&mut s).await;
    // Garbage before the handshake.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    expect_error(&mut s, code::PROTOCOL, "").await;
    expect_closed(&mut s).await;
    // A HELLO announcing a 1 MiB body: refused before anything is allocated or read.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = protocol::FrameHead {
        body_len: 1 << 20,
        payload_len: 0,
        id: 1,
        op: op::HELLO,
    };
    s.write_all(&head.encode()).await.unwrap();
    expect_error(&mut s, code::PROTOCOL, "exceeds the limit of 8192").await;
    expect_closed(&mut s).await;
    let st = server.stats();
    assert_eq!(st.auth_failures, 4, "{st:?}");
    // The page is untouched and the owner still reads it.
    let (out, bytes) = get(&owner, &[k], 4096).await.unwrap();
    assert_eq!(out, vec![PageOutcome::Hit]);
    assert_eq!(bytes[0], pattern::page_bytes(&k, 4096));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insecure_mode_needs_the_explicit_flag_and_loopback() {
    let e = RdmaServer::start(ServerOptions {
        pool_bytes: 1 << 20,
        ..ServerOptions::default()
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no credentials configured") && e.contains("--insecure-no-auth"),
        "{e}"
    );
    let e = RdmaServer::start(ServerOptions {
        pool_bytes: 1 << 20,
        listen: "0.0.0.0:0".into(),
        auth: ServerAuth::InsecureNoAuth,
        ..ServerOptions::default()
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("not a loopback address"), "{e}");
    let server = RdmaServer::start(ServerOptions {
        auth: ServerAuth::InsecureNoAuth,
        ..server_opts(1 << 20)
    })
    .await
    .unwrap();
    let c = RdmaStorage::connect(RdmaOptions::new(server.local_addr().to_string()))
        .await
        .unwrap();
    assert_eq!(
        put(&c, &[key(4, 0)], 4096).await.unwrap(),
        vec![PageOutcome::Stored]
    );
    // A client with a token does not trust a server that cannot prove it knows it.
    let e = RdmaStorage::connect(client_opts(&server))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("runs without authentication"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_open_connections_are_closed() {
    let server = RdmaServer::start(ServerOptions {
        handshake_ms: 300,
        idle_ms: 300,
        ..server_opts(1 << 20)
    })
    .await
    .unwrap();
    let addr = server.local_addr();
    // Connected, silent: the handshake times out, with an error saying so.
    let mut s = TcpStream::connect(addr).await.unwrap();
    expect_error(&mut s, code::TIMEOUT, "the handshake").await;
    expect_closed(&mut s).await;
    // HELLO, then nothing: same.
    let mut s = TcpStream::connect(addr).await.unwrap();
    raw_hello(&mut s, [5; 32]).await;
    expect_error(&mut s, code::TIMEOUT, "the handshake").await;
    expect_closed(&mut s).await;
    // Authenticated, then idle: closed.
    let mut c = Connection::connect(
        &addr.to_string(),
        "idle",
        Some(&test_token()),
        Duration::from_secs(5),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let e = tokio::time::timeout(Duration::from_secs(20), c.recv(99))
        .await
        .expect("the server closes an idle connection")
        .unwrap_err();
    assert!(e.to_string().contains("closed"), "{e}");
    // Half a frame head, then nothing: closed.
    let mut c = Connection::connect(
        &addr.to_string(),
        "half-open",
        Some(&test_token()),
        Duration::from_secs(5),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let head = protocol::FrameHead {
        body_len: 100,
        payload_len: 0,
        id: 1,
        op: op::EXISTS,
    }
    .encode();
    c.write_payload(&head[..10]).await.unwrap();
    c.flush().await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_secs(20), c.recv(1))
            .await
            .expect("the server closes a stalled connection")
            .is_err()
    );
    assert!(server.stats().timed_out_connections >= 4);
    // A storage client whose pooled connection was closed for idleness just reconnects.
    let mut o = client_opts(&server);
    o.connections = 1;
    let s = RdmaStorage::connect(o).await.unwrap();
    let before = server.stats().timed_out_connections;
    eventually("the pooled connection is closed for idleness", || {
        server.stats().timed_out_connections > before
    })
    .await;
    assert_eq!(s.batch_exists(&[key(5, 0)]).await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconsumed_read_lease_expires_and_the_page_can_be_evicted() {
    // Room for one 32 MiB page: a second one needs the first evicted.
    const BIG: usize = 32 << 20;
    let server = RdmaServer::start(ServerOptions {
        lease_ms: 300,
        region_bytes: 48 << 20,
        ..server_opts(48 << 20)
    })
    .await
    .unwrap();
    let writer = RdmaStorage::connect(client_opts(&server)).await.unwrap();
    let (first, second) = (key(6, 0), key(6, 1));
    assert_eq!(
        put(&writer, &[first], BIG).await.unwrap(),
        vec![PageOutcome::Stored]
    );
    // A reader asks for the page and never reads the reply: its receive buffer is fixed
    // small (no autotuning), so the server's send blocks with the page pinned.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut stalled = sock.connect(server.local_addr()).await.unwrap();
    let (server_nonce, _) = raw_hello(&mut stalled, [8; 32]).await;
    let mac = auth::client_mac(&test_token(), &[8; 32], &server_nonce);
    let req = Request::Auth { mac: Some(mac) };
    protocol::write_frame(&mut stalled, 2, op::AUTH, &req.encode(), 0)
        .await
        .unwrap();
    assert!(matches!(
        read_reply(&mut stalled).await,
        ReplyFrame::Ok(_, Reply::Auth { .. })
    ));
    let req = Request::Read {
        pages: vec![PageReq {
            key: first,
            len: BIG as u64,
            layout: L.tag(),
        }],
    };
    protocol::write_frame(&mut stalled, 3, op::READ, &req.encode(), 0)
        .await
        .unwrap();
    eventually("the pin is taken (or already expired)", || {
        let s = server.stats();
        s.leases == 1 || s.timed_out_connections >= 1
    })
    .await;
    // The lease runs out: the connection is closed and the pin released.
    eventually("the unconsumed lease expires", || {
        let s = server.stats();
        s.leases == 0 && s.timed_out_connections >= 1
    })
    .await;
    // Now the page can be evicted for a new one.
    assert_eq!(
        put(&writer, &[second], BIG).await.unwrap(),
        vec![PageOutcome::Stored]
    );
    assert_eq!(server.stats().occupancy.evicted_pages, 1);
    assert_eq!(writer.batch_exists(&[second]).await.unwrap(), 1);
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_caps_refuse_politely() {
    let server = RdmaServer::start(ServerOptions {
        max_connections: 3,
        max_tenant_connections: 2,
        ..server_opts(1 << 20)
    })
    .await
    .unwrap();
    let addr = server.local_addr().to_string();
    let open = || async {
        Connection::connect(
            &addr,
            "cap",
            Some(&test_token()),
            Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .await
    };
    let a = open().await.unwrap();
    let b = open().await.unwrap();
    // The tenant's third connection: refused after authentication.
    let e = open().await.unwrap_err().to_string();
    assert!(
        e.contains(&format!("code {}", code::BUSY)) && e.contains("tenant"),
        "{e}"
    );
    eventually("the refused connection is gone", || {
        server.stats().open_connections == 2
    })
    .await;
    // A raw, unauthenticated connection fills the server's cap; the next is refused before
    // any handshake, with an error frame (not a reset).
    let _raw = TcpStream::connect(&addr).await.unwrap();
    eventually("three connections open", || {
        server.stats().open_connections == 3
    })
    .await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    expect_error(&mut s, code::BUSY, "--max-connections").await;
    expect_closed(&mut s).await;
    let e = open().await.unwrap_err().to_string();
    assert!(e.contains("server busy"), "{e}");
    assert!(server.stats().refused_connections >= 3);
    // Capacity comes back when connections close.
    drop((a, b));
    drop(_raw);
    let mut c = None;
    for _ in 0..2000 {
        match open().await {
            Ok(x) => {
                c = Some(x);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let mut c = c.expect("a connection once others closed");
    assert!(matches!(
        c.call(&Request::Stats).await.unwrap().1,
        Reply::Stats(_)
    ));
}

/// Issue 28, item "config values that size memory": a pool larger than the machine's memory
/// is refused before anything is mapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_larger_than_the_machine_is_refused() {
    let e = RdmaServer::start(ServerOptions {
        pool_bytes: 1 << 50,
        region_bytes: 1 << 48,
        ..server_opts(1 << 20)
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("pool_bytes") && e.contains("physical memory"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_the_protocol_cannot_describe_is_refused() {
    let e = RdmaServer::start(ServerOptions {
        pool_bytes: 100 << 40,
        region_bytes: 1 << 30,
        ..server_opts(1 << 20)
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("pool_bytes") && e.contains("102400 regions"),
        "{e}"
    );
    // The binary says the same and exits with status 2, before mapping anything.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hicache-rdma-server"))
        .args([
            "--pool",
            "100TiB",
            "--insecure-no-auth",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("the protocol can describe"), "{err}");
    // And without credentials it does not start at all.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hicache-rdma-server"))
        .args(["--pool", "1MiB", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("no credentials configured"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_hold_more_than_its_in_flight_bytes() {
    let server = RdmaServer::start(ServerOptions {
        auth: two_tenants(),
        max_tenant_inflight_bytes: Some(64 << 10),
        ..server_opts(1 << 20)
    })
    .await
    .unwrap();
    let addr = server.local_addr().to_string();
    let open = |tok: &'static str| {
        let addr = addr.clone();
        async move {
            Connection::connect(
                &addr,
                "inflight",
                Some(&token(tok)),
                Duration::from_secs(5),
                Duration::from_secs(5),
            )
            .await
            .unwrap()
        }
    };
    let alloc = |ns: u64, from: u64, n: u64| Request::Allocate {
        pages: (from..from + n)
            .map(|i| PageReq {
                key: key(ns, i),
                len: 4096,
                layout: L.tag(),
            })
            .collect(),
    };
    // Tenant a reserves 48 KiB and never writes; its second connection may not add 32 KiB.
    let mut a1 = open("tenant-a-token-0123456789").await;
    let mut a2 = open("tenant-a-token-0123456789").await;
    let (_, r) = a1.call(&alloc(1, 0, 12)).await.unwrap();
    let Reply::Allocate(slots) = r else { panic!() };
    let ids: Vec<u64> = slots
        .iter()
        .map(|s| match s {
            protocol::AllocStatus::Slot { id, .. } => *id,
            other => panic!("{other:?}"),
        })
        .collect();
    let e = a2.call(&alloc(1, 100, 8)).await.unwrap_err().to_string();
    assert!(
        e.contains(&format!("code {}", code::BUSY)) && e.contains("in flight"),
        "{e}"
    );
    // Tenant b is not affected.
    let mut b = open("tenant-b-token-0123456789").await;
    assert!(matches!(
        b.call(&alloc(2, 0, 8)).await.unwrap().1,
        Reply::Allocate(_)
    ));
    // Once a gives its reservations back, it may reserve again.
    a1.call(&Request::Abort { slots: ids }).await.unwrap();
    assert!(matches!(
        a2.call(&alloc(1, 100, 8)).await.unwrap().1,
        Reply::Allocate(_)
    ));
}

/// A client of protocol version 1 (HELLO without a nonce) gets an error naming both versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_client_gets_a_clear_version_error() {
    let server = RdmaServer::start(server_opts(1 << 20)).await.unwrap();
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    let mut body = MAGIC.to_vec();
    body.extend_from_slice(&1u16.to_le_bytes());
    body.extend_from_slice(&6u32.to_le_bytes());
    body.extend_from_slice(b"old-v1");
    protocol::write_frame(&mut s, 1, op::HELLO, &body, 0)
        .await
        .unwrap();
    expect_error(
        &mut s,
        code::VERSION,
        &format!("unsupported protocol version 1 (this side speaks {VERSION})"),
    )
    .await;
    expect_closed(&mut s).await;
}
