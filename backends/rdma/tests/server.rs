//! Server behaviour through real clients: sharing, capacity with leases, crashed writers,
//! a dead server, protocol errors, configuration through the registry.

mod common;

use std::time::Duration;

use common::{TEST_TOKEN, client_opts, eventually, server_opts, test_token};
use hicache_backend_rdma::protocol::{
    self, AllocStatus, MAGIC, PageReq, ReadStatus, Reply, Request, VERSION, code, op,
};
use hicache_backend_rdma::{Connection, RdmaServer, RdmaStorage, ServerOptions, register};
use hicache_storage::{
    BackendContext, LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Registry, Storage,
    StorageConfig, StorageError, pattern,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const L: LayoutKind = LayoutKind::PageFirst;

fn key(ns: u64, i: u64) -> PageKey {
    pattern::page_key(pattern::namespace(ns), 77, i)
}

async fn put(s: &RdmaStorage, keys: &[PageKey], len: usize) -> Vec<PageOutcome> {
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| pattern::page_bytes(k, len)).collect();
    let bufs: Vec<PageBuf<'_>> = pages.iter().map(|p| PageBuf::contiguous(L, p)).collect();
    s.batch_set(keys, &bufs).await.expect("batch_set")
}

async fn get(s: &RdmaStorage, keys: &[PageKey], len: usize) -> (Vec<PageOutcome>, Vec<Vec<u8>>) {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::contiguous(L, b))
            .collect();
        s.batch_get(keys, &mut dst).await.expect("batch_get")
    };
    (out, bufs)
}

async fn raw(server: &hicache_backend_rdma::ServerHandle) -> Connection {
    Connection::connect(
        &server.local_addr().to_string(),
        "raw-test",
        Some(&test_token()),
        Duration::from_secs(5),
        Duration::from_secs(5),
    )
    .await
    .expect("raw connection")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_clients_share_a_server_bit_exact() {
    let server = RdmaServer::start(server_opts(256 << 20)).await.unwrap();
    let writer = RdmaStorage::connect(client_opts(&server)).await.unwrap();
    let reader = RdmaStorage::connect(client_opts(&server)).await.unwrap();
    // A batch big enough to be striped over several connections, of an odd page size.
    let keys: Vec<PageKey> = (0..64).map(|i| key(1, i)).collect();
    let len = 300_001;
    assert!(
        put(&writer, &keys, len)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    assert_eq!(reader.batch_exists(&keys).await.unwrap(), 64);
    let (out, bufs) = get(&reader, &keys, len).await;
    for (i, (o, b)) in out.iter().zip(&bufs).enumerate() {
        assert_eq!(*o, PageOutcome::Hit, "page {i}");
        assert_eq!(*b, pattern::page_bytes(&keys[i], len), "page {i} bit-exact");
    }
    // Scattered destination parts on the reader.
    let mut whole = vec![0u8; len];
    {
        let (a, b) = whole.split_at_mut(12_345);
        let mut dst = [PageBufMut::from_parts(L, [a, b])];
        assert_eq!(
            reader.batch_get(&keys[..1], &mut dst).await.unwrap(),
            vec![PageOutcome::Hit]
        );
    }
    assert_eq!(whole, pattern::page_bytes(&keys[0], len));
    // Another namespace with the same hashes sees nothing; the reader's stats see the
    // server's occupancy.
    let other: Vec<PageKey> = keys
        .iter()
        .map(|k| PageKey::new(pattern::namespace(2), k.hash))
        .collect();
    assert_eq!(reader.batch_exists(&other).await.unwrap(), 0);
    assert_eq!(reader.stats().pages, 64);
    // The second client re-setting the same pages is harmless.
    assert!(
        put(&reader, &keys, len)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Present)
    );
    assert_eq!(server.stats().occupancy.pages, 64);
}

/// A read in flight (the server is still sending the page) holds a lease: capacity pressure
/// from another client evicts other pages but never the leased one, whose bytes arrive intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_protects_an_in_flight_read_under_eviction() {
    const LEN: usize = 32 << 20;
    // The reply below is held unread while eight pages are written: on a loaded machine that
    // can take longer than the default lease (10 s), whose expiry is another test's subject.
    let server = RdmaServer::start(ServerOptions {
        lease_ms: 600_000,
        ..server_opts(4 * LEN as u64)
    })
    .await
    .unwrap();
    let client = RdmaStorage::connect(client_opts(&server)).await.unwrap();
    let k0 = key(3, 0);
    assert_eq!(put(&client, &[k0], LEN).await, vec![PageOutcome::Stored]);
    // k0 is now the least recently used page once three more arrive.
    let more: Vec<PageKey> = (1..4).map(|i| key(3, i)).collect();
    put(&client, &more, LEN).await;
    // Start a READ of k0 by hand and take only the reply head: the server pinned k0 before
    // sending it, and cannot finish sending 32 MiB until we read it.
    let mut c = raw(&server).await;
    let id = c
        .send(
            &Request::Read {
                pages: vec![PageReq {
                    key: k0,
                    len: LEN as u64,
                    layout: L.tag(),
                }],
            },
            0,
        )
        .await
        .unwrap();
    c.flush().await.unwrap();
    let (_, reply, payload) = c.recv(id).await.unwrap();
    let Reply::Read(st) = reply else {
        panic!("{reply:?}")
    };
    let ReadStatus::Hit { checksum } = st[0] else {
        panic!("{st:?}")
    };
    assert_eq!(payload, LEN as u64);
    assert_eq!(server.stats().leases, 1, "the in-flight read holds a lease");
    // Pressure: eight new pages through a four-page pool.
    for b in 0..4 {
        let ks: Vec<PageKey> = (0..2).map(|j| key(3, 10 + b * 2 + j)).collect();
        let out = put(&client, &ks, LEN).await;
        assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    }
    let st = server.stats();
    assert!(st.occupancy.evicted_pages >= 6, "{st:?}");
    assert_eq!(
        client.batch_exists(&[k0]).await.unwrap(),
        1,
        "leased page not evicted"
    );
    // Finish the read: bytes intact.
    let mut back = vec![0u8; LEN];
    c.read_payload(&mut back).await.unwrap();
    assert_eq!(xxhash_rust::xxh3::xxh3_64(&back), checksum);
    assert!(
        back == pattern::page_bytes(&k0, LEN),
        "in-flight read is bit-exact"
    );
    eventually("the lease is released after the send", || {
        server.stats().leases == 0
    })
    .await;
    // Deleting a page while it is being read: invisible at once, memory freed after the read.
    let id = c
        .send(
            &Request::Read {
                pages: vec![PageReq {
                    key: k0,
                    len: LEN as u64,
                    layout: L.tag(),
                }],
            },
            0,
        )
        .await
        .unwrap();
    c.flush().await.unwrap();
    c.recv(id).await.unwrap();
    assert_eq!(client.delete(&[k0]).await.unwrap(), 1);
    assert_eq!(client.batch_exists(&[k0]).await.unwrap(), 0);
    c.read_payload(&mut back).await.unwrap();
    assert!(
        back == pattern::page_bytes(&k0, LEN),
        "a deleted page still reads whole"
    );
}

/// A client that allocates and writes but dies before committing: the page never becomes
/// visible, and its space comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uncommitted_pages_of_a_dead_client_are_never_visible() {
    const LEN: usize = 1 << 20;
    let server = RdmaServer::start(server_opts(8 * LEN as u64))
        .await
        .unwrap();
    let observer = RdmaStorage::connect(client_opts(&server)).await.unwrap();
    let keys: Vec<PageKey> = (0..8).map(|i| key(4, i)).collect();
    {
        let mut c = raw(&server).await;
        let pages: Vec<PageReq> = keys
            .iter()
            .map(|k| PageReq {
                key: *k,
                len: LEN as u64,
                layout: L.tag(),
            })
            .collect();
        let (_, reply) = c.call(&Request::Allocate { pages }).await.unwrap();
        let Reply::Allocate(st) = reply else { panic!() };
        let slots: Vec<(u64, u64)> = st
            .iter()
            .map(|s| match s {
                AllocStatus::Slot { id, .. } => (*id, LEN as u64),
                other => panic!("{other:?}"),
            })
            .collect();
        // Write every byte, then "crash" before COMMIT.
        let id = c
            .send(
                &Request::Write {
                    slots: slots.clone(),
                },
                (8 * LEN) as u64,
            )
            .await
            .unwrap();
        for k in &keys {
            c.write_payload(&pattern::page_bytes(k, LEN)).await.unwrap();
        }
        c.flush().await.unwrap();
        let (_, reply, _) = c.recv(id).await.unwrap();
        assert_eq!(reply, Reply::Write(vec![true; 8]));
        assert_eq!(server.stats().reservations, 8);
        assert_eq!(
            observer.batch_exists(&keys).await.unwrap(),
            0,
            "written, not committed"
        );
    } // connection dropped
    eventually("the dead client's reservations are reclaimed", || {
        server.stats().reservations == 0
    })
    .await;
    let st = server.stats();
    assert_eq!(st.reclaimed_reservations, 8);
    assert_eq!(st.reserved_bytes, 0);
    assert_eq!(observer.batch_exists(&keys).await.unwrap(), 0);
    let (out, _) = get(&observer, &keys, LEN).await;
    assert!(out.iter().all(|o| *o == PageOutcome::Miss));
    // The whole pool is free again: eight other pages fit without evicting anything.
    let others: Vec<PageKey> = (100..108).map(|i| key(4, i)).collect();
    assert!(
        put(&observer, &others, LEN)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    assert_eq!(server.stats().occupancy.evicted_pages, 0);
}

/// A reservation whose client stays connected but never commits expires after its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_reservations_expire() {
    let server = RdmaServer::start(ServerOptions {
        alloc_ttl_ms: 20,
        ..server_opts(1 << 20)
    })
    .await
    .unwrap();
    let mut c = raw(&server).await;
    let k = key(5, 0);
    let (_, reply) = c
        .call(&Request::Allocate {
            pages: vec![PageReq {
                key: k,
                len: 4096,
                layout: L.tag(),
            }],
        })
        .await
        .unwrap();
    let Reply::Allocate(st) = reply else { panic!() };
    let AllocStatus::Slot { id, .. } = st[0] else {
        panic!()
    };
    eventually("the reservation expires", || {
        server.stats().reservations == 0
    })
    .await;
    let (_, reply) = c
        .call(&Request::Commit {
            slots: vec![(id, 1)],
        })
        .await
        .unwrap();
    assert_eq!(
        reply,
        Reply::Commit(vec![false]),
        "an expired slot cannot commit"
    );
    let (_, reply) = c.call(&Request::Exists { keys: vec![k] }).await.unwrap();
    assert_eq!(reply, Reply::Exists { run: 0 });
}

/// A server that goes away: calls fail with an error naming it, quickly, and never hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_server_gives_errors_not_hangs() {
    let server = RdmaServer::start(server_opts(16 << 20)).await.unwrap();
    let addr = server.local_addr().to_string();
    let mut o = client_opts(&server);
    o.io_timeout = Duration::from_millis(500);
    o.connect_timeout = Duration::from_millis(500);
    let client = RdmaStorage::connect(o).await.unwrap();
    let k = key(6, 0);
    put(&client, &[k], 4096).await;
    server.shutdown().await;
    let bound = Duration::from_secs(10);
    let mut buf = vec![0u8; 4096];
    let r = tokio::time::timeout(bound, async {
        let mut dst = [PageBufMut::contiguous(L, &mut buf)];
        client.batch_get(&[k], &mut dst).await
    })
    .await
    .expect("batch_get must not hang");
    let e = r.expect_err("a dead server is an error");
    assert!(matches!(e, StorageError::Unavailable { .. }), "{e}");
    assert!(e.to_string().contains(&addr), "{e}");
    for _ in 0..3 {
        let r = tokio::time::timeout(bound, client.batch_exists(&[k]))
            .await
            .expect("batch_exists must not hang");
        assert!(r.is_err());
        let r = tokio::time::timeout(bound, async {
            let p = vec![1u8; 4096];
            client.batch_set(&[k], &[PageBuf::contiguous(L, &p)]).await
        })
        .await
        .expect("batch_set must not hang");
        assert!(r.is_err());
    }
    assert!(client.stats().get_errors >= 1);
}

/// A peer that accepts and never answers: connect fails with a timeout, not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_server_times_out() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    let mut o = hicache_backend_rdma::RdmaOptions::new(addr);
    o.io_timeout = Duration::from_millis(100);
    let e = tokio::time::timeout(Duration::from_secs(10), RdmaStorage::connect(o))
        .await
        .expect("connect must not hang")
        .expect_err("a silent peer is an error");
    assert!(e.to_string().contains("timed out after 100 ms"), "{e}");
}

/// The whole handshake on a raw socket, with [`TEST_TOKEN`].
async fn raw_handshake(s: &mut TcpStream) {
    let client_nonce = [9u8; 32];
    let hello = Request::Hello {
        magic: MAGIC,
        version: VERSION,
        client: "t".into(),
        nonce: client_nonce,
    };
    protocol::write_frame(s, 1, op::HELLO, &hello.encode(), 0)
        .await
        .unwrap();
    let protocol::ReplyFrame::Ok(_, Reply::Hello { nonce, auth: true }) = read_reply(s).await
    else {
        panic!("HELLO answered with a nonce, authentication required")
    };
    let mac = hicache_backend_rdma::auth::client_mac(&test_token(), &client_nonce, &nonce);
    let req = Request::Auth { mac: Some(mac) };
    protocol::write_frame(s, 2, op::AUTH, &req.encode(), 0)
        .await
        .unwrap();
    assert!(matches!(
        read_reply(s).await,
        protocol::ReplyFrame::Ok(_, Reply::Auth { .. })
    ));
}

/// Reads one frame from a raw socket and decodes it as a reply.
async fn read_reply(s: &mut TcpStream) -> protocol::ReplyFrame {
    let (head, body) = protocol::read_frame(s).await.expect("a reply frame");
    protocol::ReplyFrame::decode(head.op, &body).expect("a valid reply")
}

async fn expect_closed(s: &mut TcpStream) {
    let mut b = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut b))
        .await
        .expect("the server closes the connection")
        .unwrap_or(0);
    assert_eq!(n, 0, "connection closed after a protocol error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_errors_are_answered_clearly() {
    let server = RdmaServer::start(server_opts(1 << 20)).await.unwrap();
    let addr = server.local_addr();
    // Garbage: a head announcing a 4 GiB body.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&[0xff; 21]).await.unwrap();
    match read_reply(&mut s).await {
        protocol::ReplyFrame::Error { code: c, message } => {
            assert_eq!(c, code::PROTOCOL);
            assert!(
                message.contains("frame body") && message.contains("exceeds"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    expect_closed(&mut s).await;
    // Wrong version.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let hello = Request::Hello {
        magic: MAGIC,
        version: 99,
        client: "old".into(),
        nonce: [0; 32],
    };
    protocol::write_frame(&mut s, 1, op::HELLO, &hello.encode(), 0)
        .await
        .unwrap();
    match read_reply(&mut s).await {
        protocol::ReplyFrame::Error { code: c, message } => {
            assert_eq!(c, code::VERSION);
            assert!(
                message.contains("unsupported protocol version 99"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    expect_closed(&mut s).await;
    // Bad magic.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut body = hello.encode();
    body[..8].copy_from_slice(b"GET / HT");
    protocol::write_frame(&mut s, 1, op::HELLO, &body, 0)
        .await
        .unwrap();
    match read_reply(&mut s).await {
        protocol::ReplyFrame::Error { message, .. } => {
            assert!(message.contains("bad magic"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // A request before the handshake.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let ex = Request::Exists { keys: vec![] };
    protocol::write_frame(&mut s, 1, op::EXISTS, &ex.encode(), 0)
        .await
        .unwrap();
    match read_reply(&mut s).await {
        protocol::ReplyFrame::Error { message, .. } => {
            assert!(message.contains("expected HELLO"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // After a good handshake: an unknown op, and a truncated body.
    for (opcode, body, needle) in [
        (0x42u8, vec![], "unknown op 0x42"),
        (op::EXISTS, vec![5, 0, 0, 0, 1], "truncated"),
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        raw_handshake(&mut s).await;
        protocol::write_frame(&mut s, 2, opcode, &body, 0)
            .await
            .unwrap();
        match read_reply(&mut s).await {
            protocol::ReplyFrame::Error { message, .. } => {
                assert!(message.contains(needle), "{message}")
            }
            other => panic!("{other:?}"),
        }
        expect_closed(&mut s).await;
    }
    assert!(server.stats().protocol_errors >= 6);
    // The server still serves well-behaved clients.
    let c = RdmaStorage::connect(client_opts(&server)).await.unwrap();
    assert_eq!(c.batch_exists(&[key(7, 0)]).await.unwrap(), 0);
}

/// A client talking to something that is not a hicache-rdma server gets a protocol error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_rejects_a_non_server() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let _ = s
                .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\nnot for you, go away")
                .await;
        }
    });
    let e = RdmaStorage::connect(hicache_backend_rdma::RdmaOptions::new(addr))
        .await
        .expect_err("not a server");
    assert!(e.to_string().contains("protocol error"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_opens_and_checks_config() {
    let r = Registry::with_builtins();
    register(&r).unwrap();
    let ctx = BackendContext::default();
    // spawn_server: an in-process server sized by `capacity`.
    let cfg = StorageConfig::parse(
        Some("rdma"),
        Some(r#"{"spawn_server": true, "capacity": "32MiB", "connections": 2}"#),
    )
    .unwrap();
    let s = r.open(&cfg, &ctx).await.unwrap();
    assert_eq!(s.info().name, "rdma");
    assert_eq!(s.info().capacity_bytes, Some(32 << 20));
    let k = key(8, 0);
    let p = pattern::page_bytes(&k, 5000);
    assert_eq!(
        s.batch_set(&[k], &[PageBuf::contiguous(L, &p)])
            .await
            .unwrap(),
        vec![PageOutcome::Stored]
    );
    // Bad fields name themselves.
    for (json, field) in [
        (r#"{"transport": "tcp"}"#, "server"),
        (
            r#"{"server": "127.0.0.1:1", "connections": "4"}"#,
            "connections",
        ),
        (r#"{"server": "127.0.0.1:1", "colour": "blue"}"#, "colour"),
    ] {
        let cfg = StorageConfig::parse(Some("rdma"), Some(json)).unwrap();
        let e = r.open(&cfg, &ctx).await.err().expect(json).to_string();
        assert!(e.contains(&format!("`{field}`")), "{json}: {e}");
    }
    // A client batch limit above the server's is refused at open, naming both.
    let small = RdmaServer::start(ServerOptions {
        max_batch: 128,
        ..server_opts(1 << 20)
    })
    .await
    .unwrap();
    let cfg = StorageConfig::parse(
        Some("rdma"),
        Some(&format!(
            r#"{{"server": "{}", "max_batch": 256, "token": "{TEST_TOKEN}"}}"#,
            small.local_addr()
        )),
    )
    .unwrap();
    let e = r.open(&cfg, &ctx).await.err().unwrap().to_string();
    assert!(
        e.contains("`max_batch`") && e.contains("limit of 128"),
        "{e}"
    );
    // Nothing listening: a clear, quick error naming the address.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let free = l.local_addr().unwrap().to_string();
    drop(l);
    let cfg =
        StorageConfig::parse(Some("rdma"), Some(&format!(r#"{{"server": "{free}"}}"#))).unwrap();
    let e = r.open(&cfg, &ctx).await.err().unwrap().to_string();
    assert!(e.contains(&free) && e.contains("connect"), "{e}");
}

#[cfg(not(feature = "verbs"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_transport_needs_the_feature() {
    let server = RdmaServer::start(server_opts(1 << 20)).await.unwrap();
    let mut o = client_opts(&server);
    o.transport = hicache_backend_rdma::Transport::Verbs;
    let e = RdmaStorage::connect(o).await.unwrap_err().to_string();
    assert!(e.contains("`verbs` cargo feature"), "{e}");
}

#[cfg(feature = "verbs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_transport_fails_cleanly_without_a_device() {
    let server = RdmaServer::start(server_opts(1 << 20)).await.unwrap();
    let mut o = client_opts(&server);
    o.transport = hicache_backend_rdma::Transport::Verbs;
    match RdmaStorage::connect(o).await {
        // On a machine with a device this would connect; ours have none.
        Ok(_) => eprintln!("an RDMA device is present; verbs transport opened"),
        Err(e) => {
            let e = e.to_string();
            eprintln!("verbs open: {e}");
            assert!(e.contains("no RDMA device found"), "{e}");
        }
    }
}

/// A server restarted on the same address: the client's pooled connections are stale, and the
/// next call goes through on a fresh connection instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_costs_no_failed_call() {
    let first = RdmaServer::start(server_opts(8 << 20)).await.unwrap();
    let addr = first.local_addr();
    let mut o = client_opts(&first);
    o.connections = 1;
    let client = RdmaStorage::connect(o).await.unwrap();
    let k = key(9, 0);
    put(&client, &[k], 4096).await;
    assert_eq!(client.batch_exists(&[k]).await.unwrap(), 1);
    first.shutdown().await;
    let second = RdmaServer::start(ServerOptions {
        listen: addr.to_string(),
        ..server_opts(8 << 20)
    })
    .await
    .unwrap();
    // The new server is empty (the pool is not persistent), and the call succeeds.
    assert_eq!(client.batch_exists(&[k]).await.unwrap(), 0);
    assert_eq!(put(&client, &[k], 4096).await, vec![PageOutcome::Stored]);
    assert_eq!(second.stats().occupancy.pages, 1);
}
