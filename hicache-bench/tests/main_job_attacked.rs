//! The main job (the `hicache-bench` binary, tiny workload) with its observability endpoints
//! on loopback, attacked while it runs, must finish with exactly the result of an unattacked
//! run (issue 28, item 7): same hit tokens per tier, same hit ratio, no L3 errors.
//!
//! - [`metrics_endpoint_attacks_change_nothing`]: many idle connections to the metrics port
//!   (far more than its cap), slowloris (headers never finished), garbage bytes; once with the
//!   normal descriptor limit and once under `ulimit -n 256`, where an endpoint without a
//!   connection cap let the idle connections take the descriptors the L3 files needed.
//! - [`zmq_endpoint_attacks_change_nothing`]: on the KV-event PUB and replay ports, a ZMTP
//!   greeting followed by a frame header claiming 2^40 bytes, and a DEALER-like peer that
//!   floods replay requests and never reads.
//!
//! Every loop and connection count is bounded; everything is on loopback; nothing asserts a
//! duration.

mod common;

use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;

const EXE: &str = env!("CARGO_BIN_EXE_hicache-bench");

/// Idle connections the flood tries to hold (the endpoint's cap is
/// `hicache::observe::DEFAULT_MAX_CONNECTIONS`, far fewer).
const IDLE_CONNECTIONS: usize = 360;
/// New connections one attacker makes per round, and in all (bounds the churn).
const CONNECTS_PER_ROUND: usize = 24;
const CONNECTS_IN_ALL: u64 = 12_000;
/// Pause between rounds of an attacker.
const ROUND: Duration = Duration::from_millis(50);
/// Slowloris connections.
const SLOW_CONNECTIONS: usize = 8;
/// Replay requests the DEALER-like peer sends in all.
const REPLAY_REQUESTS: usize = 200_000;

/// Ports the job binds, picked free beforehand.
#[derive(Clone, Copy, Debug)]
struct Ports {
    metrics: u16,
    kv_pub: u16,
    kv_replay: u16,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Ports {
    fn pick() -> Self {
        Self {
            metrics: free_port(),
            kv_pub: free_port(),
            kv_replay: free_port(),
        }
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }
}

/// The main job's arguments: a small deterministic workload (`wait_complete` prefetches, a
/// fixed seed) with both endpoints on loopback.
fn job_args(dir: &Path, ports: Ports) -> Vec<String> {
    let kv = format!(
        r#"{{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{}", "replay_endpoint": "tcp://127.0.0.1:{}", "topic": "kv"}}"#,
        ports.kv_pub, ports.kv_replay
    );
    let own = [
        "--quiet",
        "--seed",
        "7",
        "--metrics-addr",
        &format!("127.0.0.1:{}", ports.metrics),
        "--kv-events",
        &kv,
        "--report-dir",
        &dir.display().to_string(),
    ];
    own.iter()
        .chain(common::TINY_WORKLOAD.iter())
        .map(|s| s.to_string())
        .collect()
}

/// Runs the job binary (under `ulimit -n nofile` when given) and waits for it.
fn spawn_job(dir: &Path, ports: Ports, nofile: Option<u32>) -> std::process::Child {
    let args = job_args(dir, ports);
    let mut c = match nofile {
        Some(n) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                .arg(EXE)
                .args(&args);
            c
        }
        None => {
            let mut c = Command::new(EXE);
            c.args(&args);
            c
        }
    };
    c.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// What is compared between runs, per configuration: label, hit tokens per tier, prompt
/// tokens, hit ratio (as its exact bits), and the L3 errors.
#[derive(Debug, PartialEq)]
struct Outcome {
    label: String,
    hits: [u64; 3],
    prompt_tokens: u64,
    hit_ratio_bits: u64,
    l3_errors: [u64; 2],
}

fn outcomes(dir: &Path, out: &Output) -> Vec<Outcome> {
    assert!(
        out.status.success(),
        "the job failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    let mut all = vec![v["baseline"].clone()];
    all.extend(v["runs"].as_array().unwrap().iter().cloned());
    all.iter()
        .map(|s| {
            let n = |v: &Value| v.as_u64().unwrap();
            let hits = [
                n(&s["hits"]["l1"]),
                n(&s["hits"]["l2"]),
                n(&s["hits"]["l3"]),
            ];
            let prompt_tokens = n(&s["prompt_tokens"]);
            let ratio = hits.iter().sum::<u64>() as f64 / prompt_tokens as f64;
            Outcome {
                label: s["label"].as_str().unwrap().to_string(),
                hits,
                prompt_tokens,
                hit_ratio_bits: ratio.to_bits(),
                l3_errors: [
                    n(&s["cache"]["l3_write_failures"]),
                    n(&s["cache"]["l3_read_failures"]),
                ],
            }
        })
        .collect()
}

/// Runs the job once (no attack) and returns its outcomes.
fn run_plain(nofile: Option<u32>) -> Vec<Outcome> {
    let dir = tempfile::tempdir().unwrap();
    let out = spawn_job(dir.path(), Ports::pick(), nofile)
        .wait_with_output()
        .unwrap();
    outcomes(dir.path(), &out)
}

/// Attackers running against a job until stopped.
struct Attack {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// Connections the attackers made.
    connects: Arc<AtomicU64>,
}

impl Attack {
    fn new() -> Self {
        Self {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
            connects: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Runs `round` every [`ROUND`] until stopped (`round` makes at most
    /// [`CONNECTS_PER_ROUND`] connections; every attacker's connections are bounded by
    /// [`CONNECTS_IN_ALL`]).
    fn spawn(&mut self, mut round: impl FnMut(&dyn Fn() -> bool) + Send + 'static) {
        let stop = self.stop.clone();
        self.threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                round(&|| stop.load(Ordering::Relaxed));
                std::thread::sleep(ROUND);
            }
        }));
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        self.connects.load(Ordering::Relaxed)
    }
}

fn connect(addr: SocketAddr) -> Option<TcpStream> {
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()
}

/// Whether the peer closed `s` (non-blocking peek).
fn is_closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    match s.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// Holds up to [`IDLE_CONNECTIONS`] idle connections to `port`, replacing those closed.
fn idle_flood(attack: &mut Attack, port: u16) {
    let connects = attack.connects.clone();
    let mut held: Vec<TcpStream> = Vec::new();
    let mut made = 0u64;
    attack.spawn(move |_| {
        held.retain(|s| !is_closed(s));
        let mut n = 0;
        while held.len() < IDLE_CONNECTIONS && n < CONNECTS_PER_ROUND && made < CONNECTS_IN_ALL {
            let Some(s) = connect(Ports::addr(port)) else {
                break;
            };
            s.set_nonblocking(true).unwrap();
            held.push(s);
            n += 1;
            made += 1;
            connects.fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// Slowloris: connections whose request headers never end (one more header byte per round).
fn slowloris(attack: &mut Attack, port: u16) {
    let mut held: Vec<TcpStream> = Vec::new();
    let mut made = 0u64;
    attack.spawn(move |_| {
        held.retain_mut(|s| s.write_all(b"x").is_ok());
        while held.len() < SLOW_CONNECTIONS && made < CONNECTS_IN_ALL {
            let Some(mut s) = connect(Ports::addr(port)) else {
                break;
            };
            made += 1;
            if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                .is_ok()
            {
                held.push(s);
            }
        }
    });
}

/// Connections that send bytes that are no protocol at all, then close.
fn garbage(attack: &mut Attack, port: u16) {
    let mut made = 0u64;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    attack.spawn(move |_| {
        for _ in 0..4 {
            if made >= CONNECTS_IN_ALL {
                return;
            }
            let Some(mut s) = connect(Ports::addr(port)) else {
                return;
            };
            made += 1;
            let bytes: Vec<u8> = (0..2048)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = s.write_all(&bytes);
            let _ = s.shutdown(Shutdown::Both);
        }
    });
}

/// A ZMTP 3.1 greeting (NULL mechanism, as client).
fn zmtp_greeting() -> Vec<u8> {
    let mut g = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F, 3, 1];
    let mut mech = b"NULL".to_vec();
    mech.resize(20, 0);
    g.extend(mech);
    g.push(0); // as-server
    g.extend([0u8; 31]);
    g
}

/// Connections that greet correctly, then send a frame header claiming 2^40 bytes (long
/// frame, no more frames) and a few bytes of it, and stay open.
fn zmtp_huge_frame(attack: &mut Attack, port: u16) {
    let mut held: Vec<TcpStream> = Vec::new();
    let mut made = 0u64;
    attack.spawn(move |_| {
        held.retain(|s| !is_closed(s));
        if held.len() >= 8 || made >= 64 {
            return;
        }
        let Some(mut s) = connect(Ports::addr(port)) else {
            return;
        };
        made += 1;
        let mut msg = zmtp_greeting();
        msg.push(0x02);
        msg.extend((1u64 << 40).to_be_bytes());
        msg.extend([0xAB; 64]);
        if s.write_all(&msg).is_ok() {
            s.set_nonblocking(true).unwrap();
            held.push(s);
        }
    });
}

/// A DEALER-like peer on the replay port: handshakes, then sends replay requests (`["",
/// seq 0]`) up to [`REPLAY_REQUESTS`] and never reads the replies.
fn replay_flood(attack: &mut Attack, port: u16) {
    let mut peer: Option<TcpStream> = None;
    let mut sent = 0usize;
    let mut made = 0u64;
    attack.spawn(move |stopped| {
        if sent >= REPLAY_REQUESTS {
            return;
        }
        if peer.is_none() {
            if made >= 64 {
                return;
            }
            let Some(mut s) = connect(Ports::addr(port)) else {
                return;
            };
            made += 1;
            let mut hello = zmtp_greeting();
            // READY command: Socket-Type = DEALER.
            let mut body = vec![5];
            body.extend(b"READY");
            body.push(11);
            body.extend(b"Socket-Type");
            body.extend(6u32.to_be_bytes());
            body.extend(b"DEALER");
            hello.push(0x04);
            hello.push(body.len() as u8);
            hello.extend(body);
            // The server's greeting and READY are left unread too.
            if s.write_all(&hello).is_err() {
                return;
            }
            s.set_write_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            peer = Some(s);
        }
        let Some(s) = peer.as_mut() else { return };
        // One round: a burst of requests, each [empty delimiter (more), 8-byte seq 0].
        let mut req = vec![0x01, 0x00, 0x00, 0x08];
        req.extend(0u64.to_be_bytes());
        let burst: Vec<u8> = req.repeat(1000);
        for _ in 0..10 {
            if stopped() || sent >= REPLAY_REQUESTS {
                return;
            }
            match s.write_all(&burst) {
                Ok(()) => sent += 1000,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    return;
                }
                Err(_) => {
                    peer = None;
                    return;
                }
            }
        }
    });
}

/// Attacks the metrics port while the job runs (under `ulimit -n nofile` when given);
/// returns the job's outcomes and the connections the attackers made.
fn run_metrics_attacked(nofile: Option<u32>) -> (Vec<Outcome>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let ports = Ports::pick();
    let child = spawn_job(dir.path(), ports, nofile);
    let mut attack = Attack::new();
    idle_flood(&mut attack, ports.metrics);
    slowloris(&mut attack, ports.metrics);
    garbage(&mut attack, ports.metrics);
    let out = child.wait_with_output().unwrap();
    let connects = attack.finish();
    (outcomes(dir.path(), &out), connects)
}

#[test]
fn metrics_endpoint_attacks_change_nothing() {
    // The workload is deterministic: two plain runs agree.
    let plain = run_plain(None);
    assert_eq!(plain, run_plain(None), "two unattacked runs differ");
    let l3 = plain.iter().find(|o| o.label == "L1+L2+L3").unwrap();
    assert!(l3.hits[2] > 0, "the workload hits no L3: {plain:?}");
    assert!(plain.iter().all(|o| o.l3_errors == [0, 0]), "{plain:?}");

    let (attacked, connects) = run_metrics_attacked(None);
    assert_eq!(attacked, plain, "the attacked run differs");
    assert!(
        connects > hicache::observe::DEFAULT_MAX_CONNECTIONS as u64,
        "the flood made only {connects} connections"
    );

    // The failure of item 7: idle connections took the descriptors the L3 files needed.
    let (limited, connects) = run_metrics_attacked(Some(256));
    assert_eq!(
        limited, plain,
        "the attacked run under ulimit -n 256 differs"
    );
    assert!(
        connects > hicache::observe::DEFAULT_MAX_CONNECTIONS as u64,
        "the flood made only {connects} connections"
    );
}

/// Fails until the ZMQ implementation is replaced: the `zeromq` crate aborts the process on a
/// frame header claiming 2^40 bytes ("memory allocation of 1099511693385 bytes failed",
/// SIGABRT). Remove the `ignore` when the replacement lands.
#[test]
fn zmq_endpoint_attacks_change_nothing() {
    let plain = run_plain(None);
    let dir = tempfile::tempdir().unwrap();
    let ports = Ports::pick();
    let child = spawn_job(dir.path(), ports, None);
    let mut attack = Attack::new();
    zmtp_huge_frame(&mut attack, ports.kv_pub);
    zmtp_huge_frame(&mut attack, ports.kv_replay);
    replay_flood(&mut attack, ports.kv_replay);
    let out = child.wait_with_output().unwrap();
    attack.finish();
    assert_eq!(
        outcomes(dir.path(), &out),
        plain,
        "the attacked run differs"
    );
}

/// The huge-frame peer reads nothing; make sure its greeting is well formed.
#[test]
fn the_zmtp_greeting_is_64_bytes() {
    let g = zmtp_greeting();
    assert_eq!(g.len(), 64);
    assert_eq!(&g[..10], &[0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F]);
    assert_eq!(&g[10..12], &[3, 1]);
    assert_eq!(&g[12..16], b"NULL");
}
