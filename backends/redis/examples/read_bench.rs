//! A driver for profiling the read path against a running cluster (`perf record -g` on it):
//! `batch_set` of `PAGES` pages once, then `ITERS` timed `batch_get`s of all of them (every
//! page checked) and `50 × ITERS` timed `batch_exists` of up to 128 keys, each `exists`
//! figure printed beside a reference measured in the same run: the same `EXISTS` pipelines,
//! one per node, on plain blocking sockets.
//!
//! ```sh
//! cargo run --release -p hicache-backend-redis --example read_bench -- \
//!     127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002 8388608 128 5 [all|get|exists]
//! ```
//!
//! Environment: `RC` sets `read_chunk_bytes`, `IB` `max_inflight_bytes`.
use std::time::Instant;

use hicache_backend_redis::{RedisOptions, RedisStorage};
use hicache_core::LayoutKind;
use hicache_storage::{PageBuf, PageBufMut, Storage, pattern};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        eprintln!("usage: read_bench NODES(host:port,…) PAGE_BYTES PAGES ITERS [all|get|exists]");
        std::process::exit(2);
    }
    let nodes: Vec<String> = a[1].split(',').map(str::to_string).collect();
    let page_bytes: usize = a[2].parse().unwrap();
    let pages: usize = a[3].parse().unwrap();
    let iters: usize = a[4].parse().unwrap();
    let mode = a.get(5).cloned().unwrap_or_else(|| "all".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut opts = RedisOptions::new(nodes);
    opts.key_prefix = format!("gb{}:", std::process::id());
    if let Ok(c) = std::env::var("IB") {
        opts.max_inflight_bytes = c.parse().unwrap();
    }
    if let Ok(c) = std::env::var("RC") {
        opts.read_chunk_bytes = c.parse().unwrap();
    }
    let s = rt.block_on(RedisStorage::open(opts)).unwrap();
    let ns = pattern::namespace(std::process::id() as u64);
    let keys: Vec<_> = (0..pages as u64)
        .map(|i| pattern::page_key(ns, 1, i))
        .collect();
    let mut src = vec![0u8; pages * page_bytes];
    for (k, c) in keys.iter().zip(src.chunks_mut(page_bytes)) {
        pattern::fill_page(k, c);
    }
    let mut dst = vec![1u8; pages * page_bytes];
    let l = LayoutKind::PageFirst;
    let bufs: Vec<PageBuf<'_>> = src
        .chunks(page_bytes)
        .map(|c| PageBuf::contiguous(l, c))
        .collect();
    let t = Instant::now();
    let o = rt.block_on(s.batch_set(&keys, &bufs)).unwrap();
    assert!(o.iter().all(|o| o.is_ok()), "{:?}", &o[..2]);
    eprintln!(
        "set {:.3} GB/s",
        (pages * page_bytes) as f64 / t.elapsed().as_secs_f64() / 1e9
    );
    if mode == "all" || mode == "get" {
        let mut v = Vec::new();
        for _ in 0..iters {
            let mut d: Vec<PageBufMut<'_>> = dst
                .chunks_mut(page_bytes)
                .map(|c| PageBufMut::contiguous(l, c))
                .collect();
            let t = Instant::now();
            let o = rt.block_on(s.batch_get(&keys, &mut d)).unwrap();
            let e = t.elapsed().as_secs_f64();
            assert!(o.iter().all(|o| o.is_hit()), "{:?}", &o[..2]);
            v.push((pages * page_bytes) as f64 / e / 1e9);
        }
        assert_eq!(src, dst);
        v.sort_by(f64::total_cmp);
        println!(
            "get GB/s median {:.3} max {:.3} all {:?}",
            v[v.len() / 2],
            v[v.len() - 1],
            v.iter()
                .map(|x| (x * 100.0).round() / 100.0)
                .collect::<Vec<_>>()
        );
    }
    if mode == "all" || mode == "exists" {
        let ek = &keys[..keys.len().min(128)];
        let mut v = Vec::new();
        for _ in 0..iters.max(1) * 50 {
            let t = Instant::now();
            let n = rt.block_on(s.batch_exists(ek)).unwrap();
            v.push(t.elapsed().as_secs_f64() * 1e6);
            assert_eq!(n, ek.len());
        }
        v.sort_by(f64::total_cmp);
        println!(
            "exists128 us median {:.1} p10 {:.1} p90 {:.1} mean {:.1}",
            v[v.len() / 2],
            v[v.len() / 10],
            v[v.len() * 9 / 10],
            v.iter().sum::<f64>() / v.len() as f64
        );
    }
    if mode == "all" || mode == "exists" || mode == "raw" {
        raw_exists(&s, &keys[..keys.len().min(128)], iters.max(1) * 50);
    }
    rt.block_on(s.delete(&keys)).unwrap();
}

/// Reference: the same EXISTS pipelines on plain blocking sockets, one per node.
fn raw_exists(s: &RedisStorage, keys: &[hicache_core::PageKey], iters: usize) {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let mut conns: Vec<(String, TcpStream)> = s
        .primaries()
        .into_iter()
        .map(|a| {
            let c = TcpStream::connect(&a).unwrap();
            c.set_nodelay(true).unwrap();
            (a, c)
        })
        .collect();
    let mut bufs: Vec<(Vec<u8>, usize)> = vec![(Vec::new(), 0); conns.len()];
    let mut rd = vec![0u8; 1 << 16];
    for k in keys {
        let name = s.redis_key(k);
        let mut cmd = Vec::new();
        hicache_backend_redis::resp::put_command(&mut cmd, &[b"EXISTS", &name]);
        // Find the owner: ask node 0, follow MOVED.
        conns[0].1.write_all(&cmd).unwrap();
        let n = conns[0].1.read(&mut rd).unwrap();
        let r = String::from_utf8_lossy(&rd[..n]).to_string();
        let i = if r.starts_with("-MOVED") {
            let a = r.trim().split(' ').nth(2).unwrap().to_string();
            conns.iter().position(|(x, _)| *x == a).unwrap()
        } else {
            0
        };
        bufs[i].0.extend_from_slice(&cmd);
        bufs[i].1 += 1;
    }
    let mut v = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        for (i, (b, _)) in bufs.iter().enumerate() {
            if !b.is_empty() {
                conns[i].1.write_all(b).unwrap();
            }
        }
        for (i, (_, n)) in bufs.iter().enumerate() {
            let mut lines = 0;
            while lines < *n {
                let got = conns[i].1.read(&mut rd).unwrap();
                lines += rd[..got].iter().filter(|b| **b == b'\n').count();
            }
        }
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    v.sort_by(f64::total_cmp);
    println!(
        "raw exists128 us median {:.1} p10 {:.1} p90 {:.1} mean {:.1}",
        v[v.len() / 2],
        v[v.len() / 10],
        v[v.len() * 9 / 10],
        v.iter().sum::<f64>() / v.len() as f64
    );
}
