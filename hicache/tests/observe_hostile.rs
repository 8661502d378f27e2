//! The KV-event sockets facing hostile or broken peers (issues 28 and 38): a frame header
//! claiming 2**40 bytes, garbage, wrong greetings, silent peers, a replay client that floods
//! requests and never reads, idle peers holding every place, replays to peers that never read,
//! malformed replay requests, a queue size tokio cannot hold. Each closes that connection only: an honest
//! subscriber (the `zeromq` crate, an independent ZMTP implementation) keeps receiving every
//! batch in order, an honest replay completes, and dropping the publisher returns.
//!
//! Loopback only; every loop is bounded and every timeout is a failure bound, not a timing
//! assertion.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hicache::observe::wire::WireEvent;
use hicache::observe::{KvEventPublisher, KvEventsConfig};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const TOPIC: &str = "kv";
/// A failure bound for anything that should happen at once.
const BOUND: Duration = Duration::from_secs(20);

fn publisher(buffer_steps: usize) -> KvEventPublisher {
    let cfg = KvEventsConfig {
        publisher: "zmq".into(),
        endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: TOPIC.into(),
        buffer_steps,
        ..Default::default()
    };
    KvEventPublisher::start(&cfg).unwrap().unwrap()
}

/// One batch of `tokens` token ids (5 msgpack bytes each).
fn batch(i: u64, tokens: usize) -> Vec<WireEvent> {
    vec![WireEvent::BlockStored {
        block_hashes: vec![i as i64],
        parent_block_hash: None,
        token_ids: (0..tokens as u32).map(|t| 100_000 + t).collect(),
        block_size: tokens as u32,
        lora_id: None,
        medium: "GPU",
    }]
}

fn addr(endpoint: &str) -> SocketAddr {
    endpoint.strip_prefix("tcp://").unwrap().parse().unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// An honest subscriber through the `zeromq` crate.
struct Sub {
    rt: tokio::runtime::Runtime,
    sock: SubSocket,
    last: Option<u64>,
}

impl Sub {
    fn connect(endpoint: &str) -> Self {
        let rt = rt();
        let mut sock = SubSocket::new();
        rt.block_on(async {
            sock.connect(endpoint).await.unwrap();
            sock.subscribe(TOPIC).await.unwrap();
        });
        Self {
            rt,
            sock,
            last: None,
        }
    }

    fn recv(&mut self, limit: Duration) -> Option<u64> {
        let msg = self
            .rt
            .block_on(async { tokio::time::timeout(limit, self.sock.recv()).await })
            .ok()?
            .unwrap();
        let frames = msg.into_vec();
        assert_eq!(frames.len(), 3);
        assert_eq!(&frames[0][..], TOPIC.as_bytes());
        Some(u64::from_be_bytes(frames[1][..].try_into().unwrap()))
    }

    /// Publishes probes (bounded) until one arrives: a PUB drops batches until the
    /// subscription has arrived.
    fn sync(&mut self, p: &KvEventPublisher) {
        for i in 0..100 {
            p.publish(batch(i, 4));
            if let Some(seq) = self.recv(Duration::from_millis(200)) {
                self.last = Some(seq);
                return;
            }
        }
        panic!("no batch reached the subscriber in 100 rounds");
    }

    /// Publishes `n` batches in rounds of at most 100 (fewer than a subscriber's queue) and
    /// checks that every one arrives, in order, right after the last one seen.
    fn expect_every(&mut self, p: &KvEventPublisher, n: u64, tokens: usize) {
        let mut done = 0;
        while done < n {
            let round = (n - done).min(100);
            for i in 0..round {
                p.publish(batch(done + i, tokens));
            }
            for _ in 0..round {
                let seq = self.recv(BOUND).expect("a live batch within the bound");
                let want = self.last.map_or(0, |l| l + 1);
                assert_eq!(seq, want, "batches arrive in order, none missing");
                self.last = Some(seq);
            }
            done += round;
        }
    }
}

/// Every buffered batch from `start` on through the replay socket (the `zeromq` crate's
/// DEALER); the sequence numbers.
fn replay(endpoint: &str, start: u64) -> Vec<u64> {
    rt().block_on(async {
        let mut dealer = DealerSocket::new();
        dealer.connect(endpoint).await.unwrap();
        let req = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&start.to_be_bytes()),
        ])
        .unwrap();
        dealer.send(req).await.unwrap();
        let mut out = Vec::new();
        loop {
            let msg = tokio::time::timeout(BOUND, dealer.recv())
                .await
                .expect("the replay answers within the bound")
                .unwrap();
            let frames = msg.into_vec();
            assert_eq!(frames.len(), 4, "[b\"\", topic, seq, payload]");
            if frames[2][..] == (-1i64).to_be_bytes() {
                return out;
            }
            out.push(u64::from_be_bytes(frames[2][..].try_into().unwrap()));
        }
    })
}

/// A ZMTP 3.0 greeting with the NULL mechanism, written here independently of the crate.
fn greeting() -> Vec<u8> {
    let mut g = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 0];
    g.extend_from_slice(b"NULL");
    g.resize(64, 0);
    g
}

fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut f = vec![0x04, body.len() as u8];
    f.extend_from_slice(&body);
    f
}

fn connect(to: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    s.set_write_timeout(Some(BOUND)).unwrap();
    s
}

/// A raw connection that did the handshake as `socket_type` (our greeting and READY read).
fn handshaken(to: SocketAddr, socket_type: &str) -> TcpStream {
    let mut s = connect(to);
    s.write_all(&greeting()).unwrap();
    s.write_all(&ready(socket_type)).unwrap();
    let mut g = [0u8; 64];
    s.read_exact(&mut g).unwrap();
    assert_eq!((g[0], g[9], g[10]), (0xFF, 0x7F, 3), "a ZMTP 3 greeting");
    let mut head = [0u8; 2];
    s.read_exact(&mut head).unwrap();
    assert_eq!(head[0], 0x04, "a short command: READY");
    let mut body = vec![0u8; usize::from(head[1])];
    s.read_exact(&mut body).unwrap();
    assert_eq!(&body[..6], b"\x05READY");
    s
}

/// Reads until the server closes the connection; fails if it is still open after the bound.
fn expect_closed(mut s: TcpStream) {
    let t0 = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return,
            Err(e) => panic!("the connection is still open after {:?}: {e}", t0.elapsed()),
        }
        assert!(t0.elapsed() < BOUND * 2, "the server keeps sending");
    }
}

/// Waits (bounded) until `ok` holds.
fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < BOUND * 2, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Drops the publisher on a thread and fails if that does not return within the bound.
fn drop_within_bound(p: KvEventPublisher) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(p);
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("dropping the publisher returns within 10 s");
}

/// The packet of issue 28: a greeting, then a long frame header claiming 2**40 bytes.
fn terabyte_packet() -> Vec<u8> {
    let mut p = greeting();
    p.push(0x02);
    p.extend_from_slice(&(1u64 << 40).to_be_bytes());
    assert_eq!(p.len(), 73);
    p
}

#[test]
fn a_frame_claiming_a_terabyte_closes_that_connection_only() {
    let p = publisher(1000);
    let pub_addr = addr(p.endpoint());
    let replay_ep = p.replay_endpoint().unwrap().to_string();
    let replay_addr = addr(&replay_ep);
    let mut sub = Sub::connect(p.endpoint());
    sub.sync(&p);
    for to in [pub_addr, replay_addr] {
        // During the handshake, in place of READY.
        let mut s = connect(to);
        s.write_all(&terabyte_packet()).unwrap();
        expect_closed(s);
        sub.expect_every(&p, 5, 4);
    }
    // After a whole handshake, as a message frame and as a command frame.
    for (to, ty) in [(pub_addr, "SUB"), (replay_addr, "DEALER")] {
        for flags in [0x02u8, 0x06] {
            let mut s = handshaken(to, ty);
            s.write_all(&[flags]).unwrap();
            s.write_all(&(1u64 << 40).to_be_bytes()).unwrap();
            expect_closed(s);
            sub.expect_every(&p, 5, 4);
        }
    }
    // Just over the limit is refused too.
    let mut s = handshaken(pub_addr, "SUB");
    s.write_all(&[0x02]).unwrap();
    s.write_all(&(KvEventPublisher::MAX_FRAME as u64 + 1).to_be_bytes())
        .unwrap();
    expect_closed(s);
    sub.expect_every(&p, 50, 16);
    let seqs = replay(&replay_ep, 0);
    assert_eq!(seqs, (0..=sub.last.unwrap()).collect::<Vec<_>>());
    eventually("every bad connection counted", || {
        p.pub_stats().closed_for_errors >= 4 && p.replay_stats().closed_for_errors >= 3
    });
    drop_within_bound(p);
}

#[test]
fn garbage_wrong_greetings_wrong_types_and_silent_peers_are_closed() {
    let p = publisher(1000);
    let pub_addr = addr(p.endpoint());
    let replay_addr = addr(p.replay_endpoint().unwrap());
    let mut sub = Sub::connect(p.endpoint());
    sub.sync(&p);
    let mut bad_version = greeting();
    bad_version[10] = 2;
    let mut plain = greeting();
    plain[12..17].copy_from_slice(b"PLAIN");
    let mut reserved_flags = greeting();
    reserved_flags.extend_from_slice(&[0xF0, 0]);
    let garbage = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    let noise: Vec<u8> = (0..10_000u32).map(|i| (i * 7919 % 251) as u8).collect();
    for to in [pub_addr, replay_addr] {
        for bytes in [&garbage, &noise, &bad_version, &plain, &reserved_flags] {
            let mut s = connect(to);
            // The server may close before reading everything; that is the point.
            let _ = s.write_all(bytes);
            expect_closed(s);
        }
        // A socket type that cannot talk to this one (PUB to PUB, PUB to ROUTER).
        let mut s = connect(to);
        s.write_all(&greeting()).unwrap();
        s.write_all(&ready("PUB")).unwrap();
        expect_closed(s);
        sub.expect_every(&p, 5, 4);
    }
    // A peer that connects and says nothing is dropped after the handshake timeout; so is one
    // that stops in the middle of its greeting.
    let silent = connect(pub_addr);
    let mut half = connect(replay_addr);
    half.write_all(&greeting()[..20]).unwrap();
    sub.expect_every(&p, 20, 4);
    expect_closed(silent);
    expect_closed(half);
    sub.expect_every(&p, 20, 4);
    drop_within_bound(p);
}

/// A raw DEALER that writes replay requests without ever reading, until its writes stop
/// going through (the server stopped reading it) or `max` requests.
fn flood_replay_requests(s: &mut TcpStream, max: usize) -> usize {
    s.set_write_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut req = vec![0x01, 0x00, 0x00, 0x08];
    req.extend_from_slice(&0u64.to_be_bytes());
    let chunk: Vec<u8> = req.iter().copied().cycle().take(req.len() * 256).collect();
    let mut sent = 0;
    while sent < max {
        match s.write(&chunk) {
            Ok(n) if n == chunk.len() => sent += 256,
            // A partial write leaves the stream mid-request; stop there (the server never
            // reads that far).
            Ok(_) | Err(_) => break,
        }
    }
    sent
}

#[test]
fn a_replay_client_that_floods_and_never_reads_stalls_nobody() {
    let p = publisher(2000);
    let replay_ep = p.replay_endpoint().unwrap().to_string();
    let mut sub = Sub::connect(p.endpoint());
    sub.sync(&p);
    // 2000 batches of ~10 KB: one replay of them is far more than the socket buffers hold.
    sub.expect_every(&p, 2000, 2000);
    let mut flooder = handshaken(addr(&replay_ep), "DEALER");
    let sent = flood_replay_requests(&mut flooder, 1_000_000);
    assert!(sent > 0);
    // A subscriber that never reads either.
    let mut deaf_sub = handshaken(addr(p.endpoint()), "SUB");
    deaf_sub.write_all(&[0x00, 0x01, 0x01]).unwrap(); // subscribe to everything (3.0 form)
    // Live batches still arrive at once and in order, the honest replay completes.
    sub.expect_every(&p, 300, 2000);
    let last = sub.last.unwrap();
    let seqs = replay(&replay_ep, last - 10);
    assert_eq!(seqs, (last - 10..=last).collect::<Vec<_>>());
    sub.expect_every(&p, 300, 2000);
    // The flooder is disconnected once its replies found no room for the stall timeout.
    eventually("the flooder disconnected", || {
        p.replay_stats().stalled_peers >= 1
    });
    sub.expect_every(&p, 100, 2000);
    // The deaf subscriber misses batches once its queue is full, or is disconnected once it
    // read nothing for the stall timeout (either counted); the honest one misses none.
    let deaf_handled =
        |s: hicache::observe::SocketStats| s.dropped_messages > 0 || s.stalled_peers > 0;
    for _ in 0..100 {
        if deaf_handled(p.pub_stats()) {
            break;
        }
        sub.expect_every(&p, 100, 2000);
    }
    assert!(deaf_handled(p.pub_stats()), "{:?}", p.pub_stats());
    // Whatever the deaf subscriber's state, the drop is bounded.
    drop_within_bound(p);
    drop((flooder, deaf_sub));
}

#[test]
fn dropping_the_publisher_is_bounded_with_attackers_connected() {
    let p = publisher(2000);
    let replay_ep = p.replay_endpoint().unwrap().to_string();
    let mut sub = Sub::connect(p.endpoint());
    sub.sync(&p);
    sub.expect_every(&p, 1000, 2000);
    let mut flooder = handshaken(addr(&replay_ep), "DEALER");
    flood_replay_requests(&mut flooder, 1_000_000);
    let mut deaf_sub = handshaken(addr(p.endpoint()), "SUB");
    deaf_sub.write_all(&[0x00, 0x01, 0x01]).unwrap();
    let _silent = connect(addr(p.endpoint()));
    for i in 0..3000 {
        p.publish(batch(i, 2000));
    }
    drop_within_bound(p);
    drop((flooder, deaf_sub));
}

/// A raw connection that sends its greeting and READY and then nothing (its own bytes are
/// never read, so it does not matter whether the server kept it).
fn idle_peer(to: SocketAddr, socket_type: &str) -> TcpStream {
    let mut s = connect(to);
    s.write_all(&greeting()).unwrap();
    s.write_all(&ready(socket_type)).unwrap();
    s
}

/// Issue 38.1: 256 connections per socket that complete the handshake and then send nothing
/// used to hold every place; an honest subscriber got nothing, an honest replay client was
/// reset. Now the stalest peer (an idle one first) makes room for a newer connection.
#[test]
fn idle_peers_cannot_lock_out_honest_subscribers_or_replay_clients() {
    let p = publisher(100);
    let pub_addr = addr(p.endpoint());
    let replay_ep = p.replay_endpoint().unwrap().to_string();
    let replay_addr = addr(&replay_ep);
    let mut idle = Vec::new();
    for (to, ty) in [(pub_addr, "SUB"), (replay_addr, "DEALER")] {
        for _ in 0..KvEventPublisher::MAX_PEERS {
            idle.push(idle_peer(to, ty));
        }
    }
    // Every place was taken (the handshakes are done before the honest ones arrive).
    eventually("the idle peers admitted", || {
        p.pub_stats().peers > 0 && p.replay_stats().peers > 0
    });
    let mut sub = Sub::connect(p.endpoint());
    sub.sync(&p);
    sub.expect_every(&p, 50, 4);
    let seqs = replay(&replay_ep, 0);
    assert_eq!(seqs, (0..=sub.last.unwrap()).collect::<Vec<_>>());
    // 256 more idle connections: they evict idle ones, never the subscriber that reads.
    drop(idle);
    let idle: Vec<_> = (0..KvEventPublisher::MAX_PEERS)
        .map(|_| idle_peer(pub_addr, "SUB"))
        .collect();
    sub.expect_every(&p, 50, 4);
    let (ps, rs) = (p.pub_stats(), p.replay_stats());
    assert!(ps.peers <= KvEventPublisher::MAX_PEERS, "{ps:?}");
    assert!(
        ps.evicted_peers >= 1 && rs.evicted_peers >= 1,
        "{ps:?} {rs:?}"
    );
    drop_within_bound(p);
    drop(idle);
}

/// A replay request `[b"", start]` as a raw DEALER writes it.
fn replay_request(start: u64) -> Vec<u8> {
    let mut req = vec![0x01, 0x00, 0x00, 0x08];
    req.extend_from_slice(&start.to_be_bytes());
    req
}

/// Issue 38.2: each replay used to copy the buffered batches into the peer's queue, bounded in
/// messages only (~108 MiB per 10-byte request with long batches, never returned). Now the
/// queues share the buffer's bytes and hold at most `PEER_QUEUE_BYTES` each, and what they
/// held is released when the peer disconnects.
#[test]
fn replays_to_peers_that_never_read_stay_within_the_byte_bound() {
    const PEERS: usize = 8;
    let p = publisher(192);
    let replay_ep = p.replay_endpoint().unwrap().to_string();
    let mut sub = Sub::connect(p.endpoint());
    sub.sync(&p);
    // 192 batches of ~500 KB: one replay of them (~96 MB) is more than a peer may hold.
    for _ in 0..12 {
        sub.expect_every(&p, 16, 100_000);
    }
    let deaf: Vec<TcpStream> = (0..PEERS)
        .map(|_| {
            let mut s = handshaken(addr(&replay_ep), "DEALER");
            s.write_all(&replay_request(0)).unwrap();
            s
        })
        .collect();
    // The queues fill up to their byte bound (and not past it).
    let bound = (PEERS * KvEventPublisher::PEER_QUEUE_BYTES) as u64;
    eventually("the deaf peers' queues full", || {
        p.replay_stats().queued_bytes >= bound / 2
    });
    let rs = p.replay_stats();
    assert!(rs.queued_bytes_peak <= bound, "{rs:?}");
    assert!(
        rs.queued_bytes_peak <= KvEventPublisher::MAX_QUEUED_BYTES as u64,
        "{rs:?}"
    );
    // An honest replay is served meanwhile, live batches flow.
    let last = sub.last.unwrap();
    assert_eq!(
        replay(&replay_ep, last - 3),
        (last - 3..=last).collect::<Vec<_>>()
    );
    sub.expect_every(&p, 10, 4);
    // Disconnecting returns what they held.
    drop(deaf);
    eventually("the queued bytes released", || {
        p.replay_stats().queued_bytes == 0
    });
    // The peak since the honest replay may include that client's own queue (one more peer,
    // bounded like the others), never more.
    let with_honest = ((PEERS + 1) * KvEventPublisher::PEER_QUEUE_BYTES) as u64;
    let rs = p.replay_stats();
    assert!(rs.queued_bytes_peak <= with_honest, "{rs:?}");
    drop_within_bound(p);
}

/// Issue 38.3: a malformed replay request used to get no reply (and a warning each): it gets
/// the end-of-replay marker, and the same connection still gets a good replay.
#[test]
fn malformed_replay_requests_get_the_end_marker() {
    let p = publisher(100);
    let mut sub = Sub::connect(p.endpoint());
    sub.sync(&p);
    sub.expect_every(&p, 5, 4);
    let replay_ep = p.replay_endpoint().unwrap().to_string();
    let last = sub.last.unwrap();
    rt().block_on(async {
        let mut dealer = DealerSocket::new();
        dealer.connect(&replay_ep).await.unwrap();
        let seq = Bytes::copy_from_slice(&last.to_be_bytes());
        let bad: [Vec<Bytes>; 4] = [
            vec![Bytes::from_static(b"x")],
            vec![Bytes::new(), Bytes::from_static(b"short")],
            vec![Bytes::from_static(b"not empty"), seq.clone()],
            vec![Bytes::new(), seq.clone(), Bytes::from_static(b"extra")],
        ];
        for frames in bad.iter().chain(std::iter::once(&vec![Bytes::new(), seq])) {
            dealer
                .send(ZmqMessage::try_from(frames.clone()).unwrap())
                .await
                .unwrap();
            let mut got = Vec::new();
            loop {
                let msg = tokio::time::timeout(BOUND, dealer.recv())
                    .await
                    .expect("every request is answered within the bound")
                    .unwrap();
                let frames = msg.into_vec();
                assert_eq!(frames.len(), 4);
                if frames[2][..] == (-1i64).to_be_bytes() {
                    break;
                }
                got.push(u64::from_be_bytes(frames[2][..].try_into().unwrap()));
            }
            let good = frames.len() == 2 && frames[0].is_empty() && frames[1].len() == 8;
            assert_eq!(got, if good { vec![last] } else { vec![] }, "{frames:?}");
        }
    });
    assert_eq!(p.malformed_replay_requests(), 4);
    drop_within_bound(p);
}

/// Issue 38.7: a `max_queue_size` above 2^61 - 1 passed validation and panicked inside tokio
/// when the publisher started.
#[test]
fn a_queue_size_tokio_cannot_hold_is_a_config_error() {
    for size in [1usize << 61, usize::MAX] {
        let cfg = KvEventsConfig {
            publisher: "zmq".into(),
            endpoint: "tcp://127.0.0.1:0".into(),
            max_queue_size: size,
            ..Default::default()
        };
        let e = cfg.validate().unwrap_err();
        assert!(e.to_string().contains("max_queue_size"), "{e}");
        let e = KvEventPublisher::start(&cfg).unwrap_err();
        assert!(e.to_string().contains("max_queue_size"), "{e}");
    }
    let ok = KvEventsConfig {
        publisher: "zmq".into(),
        endpoint: "tcp://127.0.0.1:0".into(),
        max_queue_size: (1usize << 61) - 1,
        ..Default::default()
    };
    ok.validate().unwrap();
}

/// libzmq (pyzmq, from `HICACHE_SGLANG_PYTHON`, whose venv has it; skipped when unset unless
/// `HICACHE_REQUIRE_SGLANG=1`, as CI sets) as the client: a SUB and a DEALER with ZMTP heartbeats on, so our PONGs are checked too.
#[test]
fn libzmq_clients_interoperate() {
    let python = match std::env::var("HICACHE_SGLANG_PYTHON") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            assert!(
                std::env::var("HICACHE_REQUIRE_SGLANG").as_deref() != Ok("1"),
                "HICACHE_REQUIRE_SGLANG=1 but HICACHE_SGLANG_PYTHON is not set"
            );
            eprintln!("skipped: set HICACHE_SGLANG_PYTHON to a python with pyzmq");
            return;
        }
    };
    let p = publisher(10_000);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/pyzmq_clients.py");
    let mut child = std::process::Command::new(&python)
        .args([script, p.endpoint(), p.replay_endpoint().unwrap(), TOPIC])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Publish (bounded) until the client is done.
    let t0 = Instant::now();
    let mut i = 0;
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > BOUND * 3 {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the pyzmq client never finished: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        p.publish(batch(i, 16));
        i += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!(line["live"], 30);
    assert!(line["replays"][0].as_u64().unwrap() >= 30, "{line}");
    assert_eq!(p.pub_stats().closed_for_errors, 0);
    assert_eq!(p.replay_stats().closed_for_errors, 0);
    drop_within_bound(p);
}

/// One frame from a raw connection: (flags, body).
fn read_frame(s: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut flags = [0u8; 1];
    s.read_exact(&mut flags).unwrap();
    let len = if flags[0] & 0x02 != 0 {
        let mut b = [0u8; 8];
        s.read_exact(&mut b).unwrap();
        u64::from_be_bytes(b) as usize
    } else {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).unwrap();
        usize::from(b[0])
    };
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    (flags[0], body)
}

/// A short command frame.
fn command(name: &str, data: &[u8]) -> Vec<u8> {
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    let mut f = vec![0x04, body.len() as u8];
    f.extend_from_slice(&body);
    f
}

/// Sends PING and reads until its PONG: everything sent before it was handled.
fn ping(s: &mut TcpStream, context: &[u8]) {
    let mut data = vec![0, 0];
    data.extend_from_slice(context);
    s.write_all(&command("PING", &data)).unwrap();
    let (flags, body) = read_frame(s);
    assert_eq!(flags, 0x04, "a command, not a message");
    let mut want = vec![4u8];
    want.extend_from_slice(b"PONG");
    want.extend_from_slice(context);
    assert_eq!(body, want);
}

/// Publishes one batch and waits until the publisher handed it to the PUB socket; its sequence
/// number.
fn publish_one(p: &KvEventPublisher) -> u64 {
    let seq = p.published_batches();
    p.publish(batch(seq, 4));
    eventually("the batch published", || p.published_batches() > seq);
    seq
}

/// The next message's sequence number (a raw subscriber).
fn next_seq(s: &mut TcpStream) -> u64 {
    let (f0, topic) = read_frame(s);
    let (f1, seq) = read_frame(s);
    let (f2, _payload) = read_frame(s);
    assert_eq!(
        (f0, f1, f2),
        (0x01, 0x01, 0x00),
        "three frames, MORE on the first two"
    );
    assert_eq!(topic, TOPIC.as_bytes());
    u64::from_be_bytes(seq.try_into().unwrap())
}

#[test]
fn subscriptions_filter_by_prefix_in_both_protocol_forms_and_pings_are_answered() {
    let p = publisher(100);
    let mut s = handshaken(addr(p.endpoint()), "SUB");
    // ZMTP 3.1 SUBSCRIBE to another topic: nothing matches.
    s.write_all(&command("SUBSCRIBE", b"zz")).unwrap();
    ping(&mut s, b"1");
    publish_one(&p);
    // ZMTP 3.0 subscription message (0x01 + prefix): "k" matches "kv".
    s.write_all(&[0x00, 0x02, 0x01, b'k']).unwrap();
    ping(&mut s, b"2");
    let b = publish_one(&p);
    assert_eq!(
        next_seq(&mut s),
        b,
        "the batch before the subscription was not sent"
    );
    // ZMTP 3.1 CANCEL: nothing matches again.
    s.write_all(&command("CANCEL", b"k")).unwrap();
    ping(&mut s, b"3");
    publish_one(&p);
    // Subscribing twice needs two cancels (a multiset, as libzmq counts them).
    s.write_all(&command("SUBSCRIBE", b"kv")).unwrap();
    s.write_all(&[0x00, 0x03, 0x01, b'k', b'v']).unwrap();
    s.write_all(&[0x00, 0x03, 0x00, b'k', b'v']).unwrap(); // 3.0 cancel
    ping(&mut s, b"4");
    let d = publish_one(&p);
    assert_eq!(next_seq(&mut s), d, "one of the two subscriptions is left");
    s.write_all(&[0x00, 0x03, 0x00, b'k', b'v']).unwrap();
    ping(&mut s, b"5");
    publish_one(&p);
    // The empty prefix matches everything.
    s.write_all(&[0x00, 0x01, 0x01]).unwrap();
    ping(&mut s, b"6");
    let f = publish_one(&p);
    assert_eq!(next_seq(&mut s), f);
    // More subscriptions than the cap close the connection.
    for i in 0..100u8 {
        if s.write_all(&command("SUBSCRIBE", &[b'x', i])).is_err() {
            break;
        }
    }
    expect_closed(s);
    drop_within_bound(p);
}
