//! The SUB and DEALER clients against our own PUB and ROUTER servers (loopback, in process),
//! against hostile servers (an oversized frame header, garbage, a stall), and against libzmq
//! (pyzmq, when `HICACHE_SGLANG_PYTHON` names a python that has it).
//!
//! Every loop is bounded; every timeout is a failure bound or the deadline under test.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use hicache_zmtp::{
    ClientOptions, DealerClient, PubSocket, RouterSocket, ServerLimits, SubClient, ZmtpError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A failure bound for anything that should happen at once.
const BOUND: Duration = Duration::from_secs(20);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn loopback() -> std::net::TcpListener {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap()
}

fn endpoint(a: SocketAddr) -> String {
    format!("tcp://{a}")
}

/// Sends `frames` on `pubs` until `sub` receives a message (a PUB drops messages until the
/// subscription has arrived); returns it.
async fn sync(pubs: &PubSocket, sub: &mut SubClient, frames: &[Bytes]) -> Vec<Bytes> {
    for _ in 0..200 {
        pubs.send(frames);
        if let Ok(m) = sub.recv_timeout(Duration::from_millis(100)).await {
            return m;
        }
    }
    panic!("no message reached the subscriber in 200 rounds");
}

#[test]
fn the_sub_client_receives_what_our_pub_sends_filtered_by_topic() {
    rt().block_on(async {
        let l = loopback();
        let ep = endpoint(l.local_addr().unwrap());
        let pubs = PubSocket::bind(l).unwrap();
        let mut sub = SubClient::connect(&ep, &[b"kv"], ClientOptions::default())
            .await
            .unwrap();
        let probe = [Bytes::from_static(b"kv"), Bytes::from_static(b"probe")];
        assert_eq!(sync(&pubs, &mut sub, &probe).await, probe.to_vec());
        // Drain the probes still in flight: a marker ends them.
        let marker = [Bytes::from_static(b"kv"), Bytes::from_static(b"marker")];
        pubs.send(&marker);
        while sub.recv_timeout(BOUND).await.unwrap() != marker.to_vec() {}
        // A big multipart message (5 MB, a long-context KV batch), one of another topic
        // (filtered out), then a small one.
        let big = Bytes::from(vec![7u8; 5 << 20]);
        let msgs = [
            vec![
                Bytes::from_static(b"kv"),
                Bytes::from_static(&[0; 8]),
                big.clone(),
            ],
            vec![Bytes::from_static(b"other"), Bytes::from_static(b"x")],
            vec![Bytes::from_static(b"kv2"), Bytes::new()],
        ];
        for m in &msgs {
            pubs.send(m);
        }
        assert_eq!(sub.recv_timeout(BOUND).await.unwrap(), msgs[0]);
        assert_eq!(sub.recv_timeout(BOUND).await.unwrap(), msgs[2]);
        // Nothing else: a deadline passes and the connection is kept.
        assert!(matches!(
            sub.recv_timeout(Duration::from_millis(100)).await,
            Err(ZmtpError::Timeout(_))
        ));
        assert!(!sub.is_lost());
        pubs.send(&msgs[2]);
        assert_eq!(sub.recv_timeout(BOUND).await.unwrap(), msgs[2]);
        // Unsubscribing stops the flow (a marker on a second topic shows it was applied).
        sub.subscribe(b"mark").await.unwrap();
        sub.unsubscribe(b"kv").await.unwrap();
        let mark = [Bytes::from_static(b"mark")];
        for _ in 0..200 {
            pubs.send(&msgs[2]);
            pubs.send(&mark);
            let m = sub.recv_timeout(BOUND).await.unwrap();
            if m == mark.to_vec() {
                // The unsubscription is ordered before the marker subscription's effect only
                // if both arrived; once a marker came alone, kv is gone for good.
                if let Err(ZmtpError::Timeout(_)) =
                    sub.recv_timeout(Duration::from_millis(50)).await
                {
                    break;
                }
            }
        }
        pubs.send(&msgs[2]);
        pubs.send(&mark);
        assert_eq!(sub.recv_timeout(BOUND).await.unwrap(), mark.to_vec());
        assert_eq!(pubs.stats_handle().snapshot().closed_for_errors, 0);
    });
}

#[test]
fn the_dealer_client_round_trips_with_our_router() {
    rt().block_on(async {
        let l = loopback();
        let ep = endpoint(l.local_addr().unwrap());
        let mut router = RouterSocket::bind(l).unwrap();
        // An echo server: each request answered twice, the second with its routing id.
        tokio::spawn(async move {
            while let Some(req) = router.recv().await {
                let _ = req.reply(&req.frames).await;
                let _ = req.reply(std::slice::from_ref(&req.identity)).await;
            }
        });
        let opts = ClientOptions {
            identity: Some(Bytes::from_static(b"me")),
            ..ClientOptions::default()
        };
        let mut d = DealerClient::connect(&ep, opts).await.unwrap();
        let mut other = DealerClient::connect(&ep, ClientOptions::default())
            .await
            .unwrap();
        assert_ne!(d.connection_id(), other.connection_id());
        let req = vec![Bytes::new(), Bytes::copy_from_slice(&5u64.to_be_bytes())];
        d.send(&req).await.unwrap();
        other.send(&[Bytes::from_static(b"hi")]).await.unwrap();
        assert_eq!(d.recv_timeout(BOUND).await.unwrap(), req);
        assert_eq!(
            d.recv_timeout(BOUND).await.unwrap(),
            vec![Bytes::from_static(b"me")]
        );
        assert_eq!(
            other.recv_timeout(BOUND).await.unwrap(),
            vec![Bytes::from_static(b"hi")]
        );
        let generated = other.recv_timeout(BOUND).await.unwrap();
        assert_eq!(generated[0][0], 0, "a generated routing id");
        // Nothing more: the deadline passes, the connection is kept and still works.
        assert!(matches!(
            d.recv_timeout(Duration::from_millis(100)).await,
            Err(ZmtpError::Timeout(_))
        ));
        d.send(&req).await.unwrap();
        assert_eq!(d.recv_timeout(BOUND).await.unwrap(), req);
    });
}

/// A server that accepts one connection and runs `script` on it.
async fn fake_server<F, Fut>(script: F) -> String
where
    F: FnOnce(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ep = endpoint(l.local_addr().unwrap());
    tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        script(s).await;
    });
    ep
}

/// A ZMTP 3.1 greeting (NULL) and READY as `socket_type`, written here independently.
fn greeting_and_ready(socket_type: &str) -> Vec<u8> {
    let mut g = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 1];
    g.extend_from_slice(b"NULL");
    g.resize(64, 0);
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    g.extend_from_slice(&[0x04, body.len() as u8]);
    g.extend_from_slice(&body);
    g
}

/// Plays a PUB's handshake, then writes `then`, then holds the connection (reading and
/// discarding) for the failure bound.
async fn pub_then(then: Vec<u8>) -> String {
    fake_server(move |mut s| async move {
        s.write_all(&greeting_and_ready("PUB")).await.unwrap();
        let _ = s.write_all(&then).await;
        let mut buf = [0u8; 4096];
        let _ = tokio::time::timeout(BOUND, async {
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
    })
    .await
}

#[test]
fn hostile_servers_cost_the_client_a_bounded_error() {
    rt().block_on(async {
        let quick = ClientOptions {
            handshake_timeout: Duration::from_millis(300),
            heartbeat_interval: Some(Duration::from_millis(100)),
            heartbeat_timeout: Duration::from_millis(300),
            max_frame: 1 << 20,
            max_message: 1 << 20,
            ..ClientOptions::default()
        };
        // A frame header claiming 2**40 bytes: refused from the header.
        let mut huge = vec![0x02];
        huge.extend_from_slice(&(1u64 << 40).to_be_bytes());
        let ep = pub_then(huge).await;
        let mut sub = SubClient::connect(&ep, &[b""], quick.clone())
            .await
            .unwrap();
        let e = sub.recv().await.unwrap_err();
        assert!(
            matches!(e, ZmtpError::TooLong { len, .. } if len == 1 << 40),
            "{e}"
        );
        assert!(sub.is_lost());
        assert!(matches!(sub.recv().await, Err(ZmtpError::Closed)));
        // Just over the frame limit, and a message whose frames together are over it.
        let mut over = vec![0x02];
        over.extend_from_slice(&((1u64 << 20) + 1).to_be_bytes());
        let ep = pub_then(over).await;
        let mut sub = SubClient::connect(&ep, &[b""], quick.clone())
            .await
            .unwrap();
        assert!(matches!(sub.recv().await, Err(ZmtpError::TooLong { .. })));
        let mut parts = Vec::new();
        for more in [true, false] {
            parts.push(0x02 | u8::from(more));
            parts.extend_from_slice(&(600u64 << 10).to_be_bytes());
            parts.extend(std::iter::repeat_n(0u8, 600 << 10));
        }
        let ep = pub_then(parts).await;
        let mut sub = SubClient::connect(&ep, &[b""], quick.clone())
            .await
            .unwrap();
        let e = sub.recv().await.unwrap_err();
        assert!(
            matches!(e, ZmtpError::TooLong { len, .. } if len == 600 << 10),
            "{e}"
        );
        // Too many frames in one message.
        let ep = pub_then([0x01, 0x00].repeat(17)).await;
        let mut sub = SubClient::connect(&ep, &[b""], quick.clone())
            .await
            .unwrap();
        assert!(matches!(
            sub.recv().await,
            Err(ZmtpError::TooManyFrames(16))
        ));
        // Garbage instead of a greeting.
        let ep = fake_server(|mut s| async move {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await;
            tokio::time::sleep(BOUND).await;
        })
        .await;
        let e = SubClient::connect(&ep, &[b""], quick.clone())
            .await
            .err()
            .unwrap();
        assert!(matches!(e, ZmtpError::BadSignature), "{e}");
        // A server that accepts and says nothing: the handshake deadline.
        let ep = fake_server(|s| async move {
            tokio::time::sleep(BOUND).await;
            drop(s);
        })
        .await;
        let e = SubClient::connect(&ep, &[b""], quick.clone())
            .await
            .err()
            .unwrap();
        assert!(matches!(e, ZmtpError::HandshakeTimeout(_)), "{e}");
        // The wrong socket type (a ROUTER where a PUB is expected).
        let ep = fake_server(|mut s| async move {
            let _ = s.write_all(&greeting_and_ready("ROUTER")).await;
            tokio::time::sleep(BOUND).await;
        })
        .await;
        let e = SubClient::connect(&ep, &[b""], quick.clone())
            .await
            .err()
            .unwrap();
        assert!(matches!(e, ZmtpError::SocketType(..)), "{e}");
        // A server that stalls after the handshake (never answers our PINGs): declared dead.
        let ep = pub_then(Vec::new()).await;
        let mut sub = SubClient::connect(&ep, &[b""], quick.clone())
            .await
            .unwrap();
        let e = sub.recv().await.unwrap_err();
        assert!(matches!(e, ZmtpError::DeadPeer(_)), "{e}");
        // Without heartbeats, the caller's deadline is what bounds the wait.
        let ep = pub_then(Vec::new()).await;
        let no_beat = ClientOptions {
            heartbeat_interval: None,
            ..quick.clone()
        };
        let mut sub = SubClient::connect(&ep, &[b""], no_beat).await.unwrap();
        assert!(matches!(
            sub.recv_timeout(Duration::from_millis(200)).await,
            Err(ZmtpError::Timeout(_))
        ));
        // A bad endpoint.
        let e = SubClient::connect("ipc:///tmp/x", &[b""], quick)
            .await
            .err()
            .unwrap();
        assert!(matches!(e, ZmtpError::Endpoint(_)), "{e}");
    });
}

#[test]
fn a_quiet_publisher_that_answers_pings_is_alive_and_a_dead_one_is_a_new_connection() {
    rt().block_on(async {
        let l = loopback();
        let ep = endpoint(l.local_addr().unwrap());
        let pubs = PubSocket::bind(l).unwrap();
        let opts = ClientOptions {
            heartbeat_interval: Some(Duration::from_millis(50)),
            heartbeat_timeout: Duration::from_millis(2000),
            ..ClientOptions::default()
        };
        let mut sub = SubClient::connect(&ep, &[b""], opts.clone()).await.unwrap();
        let m = [Bytes::from_static(b"t")];
        sync(&pubs, &mut sub, &m).await;
        // Many heartbeat intervals of silence: our PUB answers every PING, nothing is lost.
        assert!(matches!(
            sub.recv_timeout(Duration::from_millis(600)).await,
            Err(ZmtpError::Timeout(_))
        ));
        assert!(!sub.is_lost());
        let first = sub.connection_id();
        let mut again = SubClient::connect(&ep, &[b""], opts).await.unwrap();
        assert_ne!(again.connection_id(), first, "a new connection, a new id");
        sync(&pubs, &mut again, &m).await;
    });
}

/// Issue 38.2 at the socket level: the queues of many peers that never read stay within the
/// socket's byte budget (smaller here than the peers' budgets together) and are released when
/// the peers go.
#[test]
fn queues_of_peers_that_never_read_stay_within_the_socket_budget() {
    rt().block_on(async {
        let limits = ServerLimits {
            peer_queue_bytes: 1 << 20,
            max_queued_bytes: 3 << 20,
            ..ServerLimits::default()
        };
        let l = loopback();
        let addr = l.local_addr().unwrap();
        let mut router = RouterSocket::bind_with(l, limits).unwrap();
        let stats = router.stats_handle();
        // Every request is answered with 40 shared chunks of 256 KiB (10 MiB).
        let chunk = Bytes::from(vec![1u8; 256 << 10]);
        tokio::spawn(async move {
            while let Some(req) = router.recv().await {
                let chunk = chunk.clone();
                tokio::spawn(async move {
                    for _ in 0..40 {
                        if req.reply(std::slice::from_ref(&chunk)).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        // Eight raw DEALERs ask and never read.
        let mut deaf = Vec::new();
        for _ in 0..8 {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(&greeting_and_ready("DEALER")).await.unwrap();
            s.write_all(&[0x00, 0x01, b'?']).await.unwrap();
            deaf.push(s);
        }
        let t0 = tokio::time::Instant::now();
        while stats.snapshot().queued_bytes < 2 << 20 {
            assert!(t0.elapsed() < BOUND, "{:?}", stats.snapshot());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let s = stats.snapshot();
        assert!(s.queued_bytes_peak <= 3 << 20, "{s:?}");
        drop(deaf);
        let t0 = tokio::time::Instant::now();
        while stats.snapshot().queued_bytes > 0 {
            assert!(t0.elapsed() < BOUND, "{:?}", stats.snapshot());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(stats.snapshot().queued_bytes_peak <= 3 << 20);
    });
}

/// libzmq's PUB and ROUTER (pyzmq, from `HICACHE_SGLANG_PYTHON`; skipped when unset unless
/// `HICACHE_REQUIRE_SGLANG=1`) as the servers of our clients.
#[test]
fn our_clients_talk_to_libzmq_servers() {
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
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/pyzmq_servers.py");
    let mut child = std::process::Command::new(&python)
        .arg(script)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The script prints its two endpoints on its first line.
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let eps: serde_json::Value = serde_json::from_str(line.trim()).unwrap_or_else(|e| {
        let _ = child.kill();
        panic!("no endpoints from the pyzmq script ({e}): {line:?}")
    });
    let (pub_ep, router_ep) = (
        eps["pub"].as_str().unwrap().to_string(),
        eps["router"].as_str().unwrap().to_string(),
    );
    let r = rt().block_on(async {
        let opts = ClientOptions {
            heartbeat_interval: Some(Duration::from_millis(100)),
            heartbeat_timeout: Duration::from_secs(5),
            ..ClientOptions::default()
        };
        let mut sub = SubClient::connect(&pub_ep, &[b"kv"], opts.clone()).await?;
        // The script publishes [b"kv", seq, 1 MB] every 10 ms and [b"zz", ...] between them.
        let mut seqs = Vec::new();
        while seqs.len() < 20 {
            let m = sub.recv_timeout(BOUND).await?;
            assert_eq!(m.len(), 3);
            assert_eq!(&m[0][..], b"kv");
            assert_eq!(m[2].len(), 1 << 20);
            seqs.push(u64::from_be_bytes(m[1][..].try_into().unwrap()));
        }
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
        // Silence past many heartbeat intervals would kill the connection if libzmq did not
        // answer our PINGs; it does (the stream keeps flowing, the connection is not lost).
        tokio::time::sleep(Duration::from_millis(500)).await;
        sub.recv_timeout(BOUND).await?;
        let mut d = DealerClient::connect(&router_ep, opts).await?;
        d.send(&[Bytes::new(), Bytes::copy_from_slice(&7u64.to_be_bytes())])
            .await?;
        let reply = d.recv_timeout(BOUND).await?;
        assert_eq!(
            reply,
            vec![
                Bytes::new(),
                Bytes::copy_from_slice(&7u64.to_be_bytes()),
                Bytes::from_static(b"ok")
            ]
        );
        Ok::<(), ZmtpError>(())
    });
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    r.unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
}
