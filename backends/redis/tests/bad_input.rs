//! Bad input and a cluster under pressure, on real standalone servers (and one cluster for
//! sharing between nodes): unreachable seeds, wrong credentials, a standalone server where a
//! cluster is configured, values over `proto-max-bulk-len`, OOM replies from a full server,
//! garbage under a page's key, and eviction by `allkeys-lru`. Each is a clear error or a
//! per-page outcome; nothing is acknowledged that is not stored, and no wrong byte is a hit.
//!
//! Hostile servers (issue 28), fake servers on loopback answering what each test wants: a
//! `SCAN` answered slowly with a non-zero cursor for ever, `MOVED` for ever with a slot map
//! never answered after open, a 1 TB bulk streamed as a reply, garbage at open and mid-call, a
//! connection closed instead of a reply, a `MOVED` loop. Each call keeps its budget (checked
//! with generous upper bounds only: budget + 3 s), memory does not grow with what a reply
//! claims, and each cause has its own message.

use std::time::Duration;

use hicache_backend_redis::testing::{RedisCluster, RedisServer, cli, redis_available};
use hicache_backend_redis::{RedisOptions, RedisStorage};
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageBuf, PageBufMut, PageError, PageKey, PageOutcome, Storage};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn standalone(addr: String) -> RedisOptions {
    let mut o = RedisOptions::new([addr]);
    o.cluster = false;
    o.timeout = Duration::from_secs(3);
    o
}

async fn set(s: &RedisStorage, keys: &[PageKey], len: usize) -> Vec<PageOutcome> {
    let data: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, len)).collect();
    let bufs: Vec<PageBuf<'_>> = data
        .iter()
        .map(|d| PageBuf::contiguous(LayoutKind::PageFirst, d))
        .collect();
    s.batch_set(keys, &bufs).await.unwrap()
}

async fn get(s: &RedisStorage, keys: &[PageKey], len: usize) -> Vec<PageOutcome> {
    let mut data: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let mut bufs: Vec<PageBufMut<'_>> = data
        .iter_mut()
        .map(|d| PageBufMut::contiguous(LayoutKind::PageFirst, d))
        .collect();
    let out = s.batch_get(keys, &mut bufs).await.unwrap();
    drop(bufs);
    for ((k, o), d) in keys.iter().zip(&out).zip(&data) {
        if o.is_hit() {
            assert!(check_page(k, d), "a hit must hold the page's bytes");
        }
    }
    out
}

fn keys(ns: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(ns), 3, i)).collect()
}

#[test]
fn unreachable_wrong_password_and_wrong_mode_are_clear_errors() {
    if !redis_available("unreachable_wrong_password_and_wrong_mode_are_clear_errors") {
        return;
    }
    let rt = rt();
    // Nothing listens on port 1 of loopback.
    let e = rt
        .block_on(RedisStorage::open(standalone("127.0.0.1:1".into())))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no seed node reachable") && e.contains("127.0.0.1:1"),
        "{e}"
    );

    let server = RedisServer::start(&["--requirepass", "s3cret"]);
    let mut o = standalone(server.addr());
    o.password = Some("wrong".into());
    let e = rt
        .block_on(RedisStorage::open(o.clone()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("authentication failed"), "{e}");
    o.password = None;
    let e = rt
        .block_on(RedisStorage::open(o.clone()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("authentication failed"), "{e}");
    o.password = Some("s3cret".into());
    let s = rt
        .block_on(RedisStorage::open(o.clone()))
        .expect("the right password opens");
    assert!(
        rt.block_on(set(&s, &keys(1, 2), 4096))
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );

    // A standalone server where a cluster is configured.
    o.cluster = true;
    let e = rt.block_on(RedisStorage::open(o)).unwrap_err().to_string();
    assert!(e.contains("cluster_enabled:0"), "{e}");
}

#[test]
fn oversized_values_oom_and_garbage_are_per_page_outcomes() {
    if !redis_available("oversized_values_oom_and_garbage_are_per_page_outcomes") {
        return;
    }
    let rt = rt();
    let server = RedisServer::start(&[
        "--proto-max-bulk-len",
        "1mb",
        "--maxmemory",
        "4mb",
        "--maxmemory-policy",
        "noeviction",
    ]);
    let s = rt
        .block_on(RedisStorage::open(standalone(server.addr())))
        .unwrap();
    // Over proto-max-bulk-len: TooLarge alone; the neighbour is stored.
    let ks = keys(2, 2);
    let data = [page_bytes(&ks[0], 2 << 20), page_bytes(&ks[1], 4096)];
    let bufs: Vec<PageBuf<'_>> = data
        .iter()
        .map(|d| PageBuf::contiguous(LayoutKind::PageFirst, d))
        .collect();
    let out = rt.block_on(s.batch_set(&ks, &bufs)).unwrap();
    assert!(
        matches!(out[0], PageOutcome::Failed(PageError::TooLarge { .. })),
        "{:?}",
        out[0]
    );
    assert_eq!(out[1], PageOutcome::Stored);

    // Fill the server past maxmemory (noeviction): OOM replies are NoSpace, and every page
    // acknowledged Stored reads back exact.
    let ks = keys(3, 64);
    let out = rt.block_on(set(&s, &ks, 256 << 10));
    assert!(
        out.iter()
            .any(|o| matches!(o, PageOutcome::Failed(PageError::NoSpace))),
        "{out:?}"
    );
    let stored: Vec<PageKey> = ks
        .iter()
        .zip(&out)
        .filter(|(_, o)| **o == PageOutcome::Stored)
        .map(|(k, _)| *k)
        .collect();
    assert!(!stored.is_empty());
    let back = rt.block_on(get(&s, &stored, 256 << 10));
    assert!(
        back.iter().all(PageOutcome::is_hit),
        "every acknowledged page is stored: {back:?}"
    );

    // Garbage and a wrong type under a page's key: Corrupt (counted), never a hit.
    let g = keys(4, 2);
    let name0 = String::from_utf8(s.redis_key(&g[0])).unwrap();
    let name1 = String::from_utf8(s.redis_key(&g[1])).unwrap();
    cli(server.port, &["set", &name0, "not a page"]);
    cli(server.port, &["hset", &name1, "f", "v"]);
    let out = rt.block_on(get(&s, &g, 4096));
    assert_eq!(out[0], PageOutcome::Corrupt);
    assert!(!out[1].is_hit(), "{:?}", out[1]);
    assert!(s.stats().get_corrupt >= 1);
}

#[test]
fn evicted_pages_are_misses_never_wrong() {
    if !redis_available("evicted_pages_are_misses_never_wrong") {
        return;
    }
    let rt = rt();
    let server = RedisServer::start(&["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"]);
    let s = rt
        .block_on(RedisStorage::open(standalone(server.addr())))
        .unwrap();
    let ks = keys(5, 96);
    for chunk in ks.chunks(16) {
        let out = rt.block_on(set(&s, chunk, 256 << 10));
        assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    }
    let out = rt.block_on(get(&s, &ks, 256 << 10));
    let hits = out.iter().filter(|o| o.is_hit()).count();
    assert!(
        out.iter()
            .all(|o| matches!(o, PageOutcome::Hit | PageOutcome::Miss)),
        "{out:?}"
    );
    assert!(
        hits > 0 && hits < ks.len(),
        "24 MiB through 8 MiB: some pages evicted, some kept ({hits})"
    );
    assert!(rt.block_on(s.batch_exists(&ks)).unwrap() < ks.len());
}

/// An ACL user that may not run the commands of a ranged read (`MULTI`/`EXEC` refused
/// outright, `EXEC` alone refused, `GETRANGE` refused as it is queued) reads pages longer
/// than `read_chunk_bytes` all the same: the first refusal turns ranged reads off and the
/// page is read again with one `GET` (a hit, never an error or a miss), and no later read
/// tries ranges again; a user allowed everything keeps ranged reads.
#[test]
fn ranged_reads_fall_back_to_get_for_users_without_their_commands() {
    if !redis_available("ranged_reads_fall_back_to_get_for_users_without_their_commands") {
        return;
    }
    let rt = rt();
    let server = RedisServer::start(&[]);
    let users = [
        ("notx", "-@transaction"),
        ("noexec", "-exec"),
        ("norange", "-getrange"),
        ("all", "+@all"),
    ];
    for (i, (user, minus)) in users.into_iter().enumerate() {
        let acl = cli(
            server.port,
            &["ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", minus],
        );
        assert_eq!(acl.trim(), "OK", "{acl}");
        let mut o = standalone(server.addr());
        o.username = Some(user.into());
        o.password = Some("pw".into());
        o.read_chunk_bytes = 4096;
        let s = rt.block_on(RedisStorage::open(o)).unwrap();
        // Pages over the range size, and small ones (one GET either way), in one batch.
        let ks = keys(20 + i as u64, 24);
        let pages: Vec<Vec<u8>> = ks
            .iter()
            .enumerate()
            .map(|(j, k)| page_bytes(k, if j % 4 == 3 { 1024 } else { 64 << 10 }))
            .collect();
        let bufs: Vec<PageBuf<'_>> = pages
            .iter()
            .map(|d| PageBuf::contiguous(LayoutKind::PageFirst, d))
            .collect();
        let out = rt.block_on(s.batch_set(&ks, &bufs)).unwrap();
        assert!(
            out.iter().all(|o| *o == PageOutcome::Stored),
            "{user}: {out:?}"
        );
        for round in 0..2 {
            cli(server.port, &["CONFIG", "RESETSTAT"]);
            let mut back: Vec<Vec<u8>> = pages.iter().map(|p| vec![0u8; p.len()]).collect();
            let mut dst: Vec<PageBufMut<'_>> = back
                .iter_mut()
                .map(|d| PageBufMut::contiguous(LayoutKind::PageFirst, d))
                .collect();
            let out = rt.block_on(s.batch_get(&ks, &mut dst)).unwrap();
            drop(dst);
            assert!(
                out.iter().all(PageOutcome::is_hit),
                "{user}, round {round}: {out:?}"
            );
            assert!(back == pages, "{user}, round {round}: bytes differ");
            let stats = cli(server.port, &["INFO", "commandstats"]);
            let ranged = stats.contains("cmdstat_getrange:") || stats.contains("cmdstat_multi:");
            if user == "all" {
                let refused = stats
                    .lines()
                    .any(|l| l.starts_with("cmdstat_") && !l.contains("rejected_calls=0,"));
                assert!(ranged && !refused, "{stats}");
            } else if round == 1 {
                assert!(
                    !ranged,
                    "{user}: ranges tried again after a refusal: {stats}"
                );
            }
        }
        assert_eq!(s.stats().get_corrupt, 0, "{user}");
    }
}

#[test]
fn two_backends_on_different_nodes_share_pages() {
    if !redis_available("two_backends_on_different_nodes_share_pages") {
        return;
    }
    let rt = rt();
    let cluster = RedisCluster::start(3, 0, &[]);
    let seeds = cluster.seeds();
    let a = rt
        .block_on(RedisStorage::open(RedisOptions::new([seeds[0].clone()])))
        .unwrap();
    let b = rt
        .block_on(RedisStorage::open(RedisOptions::new([seeds[2].clone()])))
        .unwrap();
    let ks = keys(6, 128);
    assert!(
        rt.block_on(set(&a, &ks, 8192))
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    assert_eq!(rt.block_on(b.batch_exists(&ks)).unwrap(), 128);
    assert!(
        rt.block_on(get(&b, &ks, 8192))
            .iter()
            .all(PageOutcome::is_hit)
    );
    // Pages spread over every shard (no hash tag).
    assert_eq!(b.primaries().len(), 3);
    for srv in &cluster.servers {
        let n: u64 = cli(srv.port, &["dbsize"]).trim().parse().unwrap();
        assert!(n > 0, "every shard holds some of the 128 pages");
    }
}

// ---------------------------------------------------------------------------------------
// Hostile servers: a fake server on loopback answers each command with what the test wants
// (slowly, never, with garbage, with a huge bulk, by closing the connection). Every wait is
// bounded; the only timing assertions are generous upper bounds ("the budget was kept").
// ---------------------------------------------------------------------------------------

mod fake {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use hicache_backend_redis::resp::{self, Frame, Limits};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// What the fake server does with one command.
    pub enum Act {
        /// Sends these bytes.
        Reply(Vec<u8>),
        /// Sends these bytes after a pause.
        Slow(Duration, Vec<u8>),
        /// Never answers (keeps the connection open).
        Hang,
        /// Closes the connection.
        Close,
        /// Sends `head`, then zeros for as long as the client reads them.
        Stream(Vec<u8>),
    }

    /// The command's arguments, as text.
    pub type Args = Vec<String>;

    /// A fake server: its address and what it saw.
    pub struct Fake {
        /// `127.0.0.1:port`.
        pub addr: String,
        /// Bytes of `Act::Stream` sent, per connection, the largest.
        pub streamed_max: Arc<AtomicU64>,
    }

    /// Starts a fake server on the current runtime; `answer(args)` decides each reply.
    pub async fn start(answer: impl Fn(&Args) -> Act + Send + Sync + 'static) -> Fake {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let answer = Arc::new(answer);
        let streamed_max = Arc::new(AtomicU64::new(0));
        let sm = streamed_max.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(serve(s, answer.clone(), sm.clone()));
            }
        });
        Fake { addr, streamed_max }
    }

    async fn serve(
        mut s: TcpStream,
        answer: Arc<dyn Fn(&Args) -> Act + Send + Sync>,
        streamed_max: Arc<AtomicU64>,
    ) {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            while let Ok(Some((f, n))) = resp::parse(&buf, &Limits::default()) {
                buf.drain(..n);
                let Frame::Array(items) = f else { return };
                let args: Args = items
                    .iter()
                    .map(|a| match a {
                        Frame::Bulk(b) => String::from_utf8_lossy(b).into_owned(),
                        other => format!("{other:?}"),
                    })
                    .collect();
                match answer(&args) {
                    Act::Reply(b) => {
                        if s.write_all(&b).await.is_err() {
                            return;
                        }
                    }
                    Act::Slow(d, b) => {
                        tokio::time::sleep(d).await;
                        if s.write_all(&b).await.is_err() {
                            return;
                        }
                    }
                    Act::Hang => {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        return;
                    }
                    Act::Close => return,
                    Act::Stream(head) => {
                        if s.write_all(&head).await.is_err() {
                            return;
                        }
                        let zeros = vec![0u8; 1 << 20];
                        let mut sent = 0u64;
                        while s.write_all(&zeros).await.is_ok() {
                            sent += zeros.len() as u64;
                            streamed_max.fetch_max(sent, Ordering::Relaxed);
                        }
                        return;
                    }
                }
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// A bulk string reply.
    pub fn bulk(s: &str) -> Vec<u8> {
        let mut out = Vec::new();
        resp::put_bulk(&mut out, s.as_bytes());
        out
    }

    /// The answers of an honest node to the commands of open (`INFO`, `CONFIG GET`, `CLUSTER
    /// SLOTS` mapping every slot to `owner_port`), `None` for the others.
    pub fn open_replies(args: &Args, cluster: bool, max_bulk: u64, owner_port: u16) -> Option<Act> {
        let cmd = args.first()?.to_ascii_uppercase();
        Some(Act::Reply(match cmd.as_str() {
            "INFO" => bulk(&format!(
                "# Cluster\r\ncluster_enabled:{}\r\n",
                u8::from(cluster)
            )),
            "CONFIG" => {
                let mut out = b"*2\r\n".to_vec();
                out.extend(bulk("proto-max-bulk-len"));
                out.extend(bulk(&max_bulk.to_string()));
                out
            }
            // Sent by other clients at connect (redis-rs), not by the backend.
            "CLIENT" => b"+OK\r\n".to_vec(),
            "CLUSTER" => {
                let mut out = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n".to_vec();
                out.extend(bulk("127.0.0.1"));
                out.extend(format!(":{owner_port}\r\n").as_bytes());
                out
            }
            _ => return None,
        }))
    }

    /// The port of `addr`.
    pub fn port(addr: &str) -> u16 {
        addr.rsplit_once(':').unwrap().1.parse().unwrap()
    }
}

/// A port on loopback nothing listens on now (bound, then released).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Resident memory of this process, in KiB.
fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

fn fast(addr: String, cluster: bool, timeout_ms: u64) -> RedisOptions {
    let mut o = RedisOptions::new([addr]);
    o.cluster = cluster;
    o.timeout = Duration::from_millis(timeout_ms);
    o
}

/// Generous bound for "the budget was kept": the budget plus 3 s of scheduling margin.
const MARGIN: Duration = Duration::from_secs(3);

/// Issue 28 item 4: each SCAN answered slowly with a non-zero cursor. `clear` returns a
/// timeout error naming the round and the node within its budget (before the fix it ran for
/// as long as the server liked).
#[test]
fn clear_keeps_its_budget_against_an_endless_slow_scan() {
    use fake::Act;
    let rt = rt();
    rt.block_on(async {
        let f = fake::start(|args| {
            if let Some(a) = fake::open_replies(args, false, 512 << 20, 0) {
                return a;
            }
            match args[0].as_str() {
                "SCAN" => Act::Slow(Duration::from_millis(150), {
                    let mut out = b"*2\r\n".to_vec();
                    out.extend(fake::bulk("37"));
                    out.extend(b"*0\r\n");
                    out
                }),
                _ => Act::Reply(b"+OK\r\n".to_vec()),
            }
        })
        .await;
        let s = RedisStorage::open(fast(f.addr.clone(), false, 1000))
            .await
            .unwrap();
        let t0 = std::time::Instant::now();
        let e = tokio::time::timeout(Duration::from_secs(30), s.clear(namespace(9)))
            .await
            .expect("clear must return: it has a 1000 ms budget")
            .unwrap_err()
            .to_string();
        let took = t0.elapsed();
        assert!(took < Duration::from_millis(1000) + MARGIN, "{took:?}");
        assert!(
            e.contains("clear: SCAN round")
                && e.contains(&format!("on node {}", f.addr))
                && e.contains("not answered within the 1000 ms budget"),
            "{e}"
        );
    });
}

/// Issue 28 item 5: five seeds answering `MOVED` to every page command, and the slot map
/// never answered after open. One call keeps its one budget, refreshes included (before the
/// fix: 2 × timeout per seed).
#[test]
fn moved_forever_with_a_silent_slot_map_keeps_one_budget() {
    use fake::Act;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let rt = rt();
    use std::sync::atomic::AtomicU16;
    rt.block_on(async {
        // Every slot belongs to the first fake; every fake answers MOVED naming it. The first
        // answers CLUSTER SLOTS once (at open), never again; the others never.
        let owner = Arc::new(AtomicU16::new(0));
        let mut seeds = Vec::new();
        for n in 0..5 {
            let answered = Arc::new(AtomicBool::new(n != 0));
            let owner_cell = owner.clone();
            let f = fake::start(move |args| {
                let cmd = args[0].to_ascii_uppercase();
                if cmd == "CLUSTER" && answered.swap(true, Ordering::SeqCst) {
                    return Act::Hang;
                }
                let port = owner_cell.load(Ordering::SeqCst);
                if let Some(a) = fake::open_replies(args, true, 512 << 20, port) {
                    return a;
                }
                Act::Reply(format!("-MOVED 1 127.0.0.1:{port}\r\n").into_bytes())
            })
            .await;
            if n == 0 {
                owner.store(fake::port(&f.addr), Ordering::SeqCst);
            }
            seeds.push(f);
        }
        let mut o = fast(seeds[0].addr.clone(), true, 1000);
        o.nodes = seeds.iter().map(|f| f.addr.clone()).collect();
        let s = RedisStorage::open(o).await.unwrap();
        let ks = keys(20, 8);
        for call in 0..2 {
            let t0 = std::time::Instant::now();
            let out = tokio::time::timeout(Duration::from_secs(30), get(&s, &ks, 4096))
                .await
                .expect("batch_get must return: it has a 1000 ms budget");
            let took = t0.elapsed();
            assert!(
                took < Duration::from_millis(1000) + MARGIN,
                "call {call}: {took:?}"
            );
            for o in &out {
                let PageOutcome::Failed(e) = o else {
                    panic!("{o:?}")
                };
                assert!(e.to_string().contains("within the 1000 ms budget"), "{e}");
            }
            let t0 = std::time::Instant::now();
            tokio::time::timeout(Duration::from_secs(30), s.batch_exists(&ks))
                .await
                .expect("batch_exists must return")
                .unwrap();
            assert!(t0.elapsed() < Duration::from_millis(1000) + MARGIN);
        }
    });
}

/// Issue 28 item 6: a server announcing a 1 TB `proto-max-bulk-len` and streaming a huge bulk
/// as the reply to `EXISTS` and `SET`. The reply is refused by its bound before memory is
/// reserved: the connection is closed after a few MiB, counted, memory does not grow, and
/// the error names the bound (before the fix the client grew to GBs).
#[test]
fn a_huge_bulk_is_refused_by_its_bound_not_buffered() {
    use fake::Act;
    let rt = rt();
    rt.block_on(async {
        let f = fake::start(|args| {
            if let Some(a) = fake::open_replies(args, false, 1 << 40, 0) {
                return a;
            }
            Act::Stream(b"$1000000000000\r\n".to_vec())
        })
        .await;
        let s = RedisStorage::open(fast(f.addr.clone(), false, 1000))
            .await
            .unwrap();
        let before = rss_kib();
        let ks = keys(21, 4);
        let n = tokio::time::timeout(Duration::from_secs(30), s.batch_exists(&ks))
            .await
            .expect("batch_exists must return")
            .unwrap();
        assert_eq!(n, 0);
        assert!(s.protocol_errors() >= 1, "the refused reply is counted");
        let out = tokio::time::timeout(Duration::from_secs(30), set(&s, &ks, 4096))
            .await
            .expect("batch_set must return");
        for o in &out {
            let PageOutcome::Failed(e) = o else {
                panic!("{o:?}")
            };
            let e = e.to_string();
            assert!(
                e.contains(&format!("node {}: reply to SET refused", f.addr))
                    && e.contains("1000000000000 exceeds the limit of 1048576"),
                "{e}"
            );
        }
        let grown = rss_kib().saturating_sub(before);
        assert!(grown < 256 << 10, "RSS grew by {grown} KiB");
        let streamed = f.streamed_max.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            streamed < 256 << 20,
            "a connection was read for {streamed} bytes before it was closed"
        );
    });
}

/// Low items of issue 28: garbage at open is named as such (not "no seed node reachable");
/// a dropped connection, garbage mid-call and a MOVED loop each have their own message.
#[test]
fn garbage_dropped_connections_and_redirection_loops_are_told_apart() {
    use fake::Act;
    let rt = rt();
    rt.block_on(async {
        // Garbage at open.
        let g = fake::start(|_| Act::Reply(b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec())).await;
        let e = RedisStorage::open(fast(g.addr.clone(), true, 1000))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "node {} answered something that is not RESP",
                g.addr
            )) && e.contains("0x48"),
            "{e}"
        );
        assert!(!e.contains("no seed node reachable"), "{e}");
        // Garbage at open from the second seed, the first unreachable: still named.
        let e = RedisStorage::open({
            let mut o = fast(format!("127.0.0.1:{}", free_port()), true, 1000);
            o.nodes.push(g.addr.clone());
            o
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(e.contains("answered something that is not RESP"), "{e}");

        // A dropped connection, then garbage, as the reply to GET.
        let drop_get = fake::start(|args| {
            if let Some(a) = fake::open_replies(args, false, 512 << 20, 0) {
                return a;
            }
            Act::Close
        })
        .await;
        let s = RedisStorage::open(fast(drop_get.addr.clone(), false, 1000))
            .await
            .unwrap();
        let out = get(&s, &keys(22, 2), 4096).await;
        let PageOutcome::Failed(e) = &out[0] else {
            panic!("{out:?}")
        };
        let e = e.to_string();
        assert!(
            e.contains(&format!(
                "node {} closed the connection while we read the reply to GET",
                drop_get.addr
            )) && e.contains("within the 1000 ms budget"),
            "{e}"
        );
        let garbage_get = fake::start(|args| {
            if let Some(a) = fake::open_replies(args, false, 512 << 20, 0) {
                return a;
            }
            Act::Reply(b"?garbage\r\n".to_vec())
        })
        .await;
        let s = RedisStorage::open(fast(garbage_get.addr.clone(), false, 1000))
            .await
            .unwrap();
        let out = get(&s, &keys(22, 2), 4096).await;
        let PageOutcome::Failed(e) = &out[0] else {
            panic!("{out:?}")
        };
        assert!(
            e.to_string()
                .contains("answered something that is not RESP (reading the reply to GET)"),
            "{e}"
        );
        assert!(s.protocol_errors() >= 1);

        // A MOVED loop: the node owning every slot (its slot map says so, every time)
        // answers MOVED naming itself.
        let own = std::sync::Arc::new(std::sync::atomic::AtomicU16::new(0));
        let looping = {
            let own = own.clone();
            fake::start(move |args| {
                let port = own.load(std::sync::atomic::Ordering::SeqCst);
                if let Some(a) = fake::open_replies(args, true, 512 << 20, port) {
                    return a;
                }
                Act::Reply(format!("-MOVED 866 127.0.0.1:{port}\r\n").into_bytes())
            })
            .await
        };
        own.store(
            fake::port(&looping.addr),
            std::sync::atomic::Ordering::SeqCst,
        );
        let s = RedisStorage::open(fast(looping.addr.clone(), true, 20_000))
            .await
            .unwrap();
        let t0 = std::time::Instant::now();
        let out = tokio::time::timeout(Duration::from_secs(60), get(&s, &keys(23, 1), 4096))
            .await
            .expect("batch_get must return");
        let PageOutcome::Failed(e) = &out[0] else {
            panic!("{out:?}")
        };
        assert!(
            e.to_string().contains("too many redirections") && e.to_string().contains("MOVED"),
            "{e}"
        );
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    });
}

/// Servers before Redis 6.2 answer an `EXEC` the ACL refuses with a bare `NOPERM` and keep
/// the transaction open (what follows on the connection is queued). A fake of such a server
/// (pages kept as `SET`): the pipeline that met it fails, its connection is closed, ranged
/// reads are turned off and every page is read again with one `GET`: all hits, and no later
/// read sends `MULTI`.
#[test]
fn an_exec_refused_with_the_transaction_left_open_falls_back_to_get() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use hicache_backend_redis::resp::{self, Frame, Limits};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    type Store = Arc<Mutex<HashMap<Vec<u8>, Vec<u8>>>>;
    /// One connection: a server that keeps a refused transaction open.
    async fn serve(mut s: tokio::net::TcpStream, store: Store, multis: Arc<AtomicU64>, port: u16) {
        let (mut buf, mut chunk, mut in_multi) = (Vec::new(), vec![0u8; 64 << 10], false);
        loop {
            while let Ok(Some((f, n))) = resp::parse(&buf, &Limits::default()) {
                buf.drain(..n);
                let Frame::Array(items) = f else { return };
                let args: Vec<Vec<u8>> = items
                    .into_iter()
                    .map(|a| match a {
                        Frame::Bulk(b) => b,
                        _ => Vec::new(),
                    })
                    .collect();
                let text: Vec<String> = args
                    .iter()
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                let cmd = text[0].to_ascii_uppercase();
                let reply = match fake::open_replies(&text, false, 512 << 20, port) {
                    Some(fake::Act::Reply(r)) => r,
                    _ if cmd == "EXEC" => {
                        b"-NOPERM this user has no permissions to run the 'exec' command\r\n"
                            .to_vec()
                    }
                    _ if in_multi => b"+QUEUED\r\n".to_vec(),
                    _ => match cmd.as_str() {
                        "MULTI" => {
                            multis.fetch_add(1, Ordering::Relaxed);
                            in_multi = true;
                            b"+OK\r\n".to_vec()
                        }
                        "SET" => {
                            store
                                .lock()
                                .unwrap()
                                .insert(args[1].clone(), args[2].clone());
                            b"+OK\r\n".to_vec()
                        }
                        "GET" => match store.lock().unwrap().get(&args[1]) {
                            Some(v) => {
                                let mut out = Vec::new();
                                resp::put_bulk(&mut out, v);
                                out
                            }
                            None => b"$-1\r\n".to_vec(),
                        },
                        _ => b"-ERR unknown command\r\n".to_vec(),
                    },
                };
                if s.write_all(&reply).await.is_err() {
                    return;
                }
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    let rt = rt();
    rt.block_on(async {
        let store = Store::default();
        let multis = Arc::new(AtomicU64::new(0));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let port = fake::port(&addr);
        let (st, m) = (store.clone(), multis.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(serve(s, st.clone(), m.clone(), port));
            }
        });
        let mut o = fast(addr, false, 5000);
        o.read_chunk_bytes = 4096;
        let s = RedisStorage::open(o).await.unwrap();
        let ks = keys(23, 8);
        let out = set(&s, &ks, 64 << 10).await;
        assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
        let out = get(&s, &ks, 64 << 10).await;
        assert!(out.iter().all(PageOutcome::is_hit), "{out:?}");
        let tried = multis.load(Ordering::Relaxed);
        assert!(tried >= 1, "the first read was ranged");
        let out = get(&s, &ks, 64 << 10).await;
        assert!(out.iter().all(PageOutcome::is_hit), "{out:?}");
        assert_eq!(
            multis.load(Ordering::Relaxed),
            tried,
            "no MULTI after the refusal"
        );
    });
}
