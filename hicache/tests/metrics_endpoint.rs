//! The metrics endpoint when the process runs out of descriptors (issue 28 item 7): `accept`
//! fails with `EMFILE` while connections wait; the endpoint must back off (not spin a core)
//! and serve again once descriptors are free.
//!
//! The scenario runs in a child process (this test binary run again with
//! `HICACHE_EMFILE_CHILD` set), since it lowers `RLIMIT_NOFILE` and exhausts descriptors.
//! The parent makes the waiting connections (its own descriptors are not limited).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use hicache::observe::MetricsServer;

const CHILD_ENV: &str = "HICACHE_EMFILE_CHILD";
const TEST: &str = "metrics_endpoint_backs_off_when_out_of_descriptors";
/// Most descriptors the child opens to exhaust its limit.
const MAX_FILLER: usize = 4096;
/// Connections the parent leaves waiting in the endpoint's backlog.
const WAITING: usize = 4;

/// The process's CPU time (user + system).
fn cpu_time() -> Duration {
    // SAFETY: `getrusage` writes a `rusage` into the zeroed struct we own; RUSAGE_SELF is valid.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, &mut ru), 0);
        ru
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn scrape(addr: std::net::SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn child() {
    let m = MetricsServer::start("127.0.0.1:0", Arc::new(|| "up 1\n".into())).unwrap();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit`/`setrlimit` read/write the `rlimit` we own; RLIMIT_NOFILE is valid.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl), 0);
        rl.rlim_cur = open + 8;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &rl), 0);
    }
    let mut filler = Vec::new();
    while filler.len() < MAX_FILLER {
        match std::fs::File::open("/dev/null") {
            Ok(f) => filler.push(f),
            Err(_) => break,
        }
    }
    assert!(filler.len() < MAX_FILLER, "the limit did not bind");
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "addr {}", m.addr()).unwrap();
    stdout.flush().unwrap();
    // The parent connects; every accept now fails with EMFILE.
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let before = cpu_time();
    std::thread::sleep(Duration::from_secs(1));
    let spent = cpu_time() - before;
    writeln!(stdout, "cpu {spent:?}").unwrap();
    // A busy `accept` loop would burn about the whole second.
    assert!(
        spent < Duration::from_millis(500),
        "{spent:?} of CPU in 1 s"
    );
    drop(filler);
    // Descriptors are back: the waiting connections are accepted, and a scrape succeeds
    // (bounded retries while the backoff pause ends).
    let mut ok = false;
    for _ in 0..100 {
        if scrape(m.addr()).starts_with("HTTP/1.1 200") {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(ok, "no scrape succeeded once descriptors were free");
    writeln!(stdout, "scrape ok").unwrap();
}

#[test]
fn metrics_endpoint_backs_off_when_out_of_descriptors() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child();
        return;
    }
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut addr = None;
    let mut line = String::new();
    // The harness prints its own text first (on the same line); bounded by the child's output.
    while out.read_line(&mut line).unwrap() > 0 {
        if let Some(at) = line.find("addr ") {
            addr = line[at + 5..].trim().parse::<std::net::SocketAddr>().ok();
            break;
        }
        line.clear();
    }
    let Some(addr) = addr else {
        let _ = c.kill();
        let _ = c.wait();
        panic!("the child printed no address: {line}");
    };
    let waiting: Vec<TcpStream> = (0..WAITING)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    c.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let status = c.wait().unwrap();
    let mut err = String::new();
    let _ = c.stderr.take().unwrap().read_to_string(&mut err);
    drop(waiting);
    eprintln!("child: {}", rest.trim());
    assert!(status.success(), "child failed: {status:?}\n{rest}\n{err}");
    assert!(rest.contains("scrape ok"), "{rest}\n{err}");
}
