//! The fault suite's cases for a **remote** backend: a client of a server process the backend
//! does not own on the local disk (the `rdma` memory pool, a network store).
//!
//! A remote backend owns no directory, so the directory faults of the suite do not apply to
//! it; `fault_tests!(module, target, remote)` generates them ignored, each with the reason
//! and where its remote counterpart is checked, and runs these cases instead:
//!
//! - [`RemoteFault::ServerKill`]: the server process is SIGKILLed while a writer and a reader
//!   are mid-batch, then restarted on the same address. Every batch in flight ends (an error
//!   or per-page outcomes), no read is ever a wrong page, the **same** client recovers without
//!   being reopened, pages acknowledged after the restart are all intact, and pages
//!   acknowledged before it are intact if the server persists (a miss otherwise, never wrong).
//! - [`RemoteFault::PortGarbage`]: hostile bytes on the server's port while an honest client
//!   writes and reads: random bytes, a valid opening (the target's
//!   [`RemoteFaultTarget::greeting`]) followed by garbage, oversized length prefixes, frames
//!   cut short, connections that never send. Every page the honest client was acknowledged
//!   reads back intact, every round, and a fresh client still connects afterwards.
//!
//! The invariant is the suite's: every acknowledged page intact or a counted miss, never a
//! wrong page.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use hicache_core::PageKey;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{PAGES, Tally, key, read_back, write_pages};
use crate::backend::Storage;
use crate::error::Result;

/// A server process the suite can kill and restart.
#[async_trait]
pub trait FaultServer: Send + Sync {
    /// The address clients connect to (`host:port`); the same after [`restart`](Self::restart).
    fn addr(&self) -> String;

    /// Kills the server process with SIGKILL (no shutdown code runs) and waits until it is
    /// gone.
    async fn kill(&mut self) -> Result<()>;

    /// Starts the server again on the same address after [`kill`](Self::kill).
    async fn restart(&mut self) -> Result<()>;

    /// Whether pages stored before a kill are served after the restart.
    fn persistent(&self) -> bool;
}

/// How the remote cases start servers and connect clients.
#[async_trait]
pub trait RemoteFaultTarget: Send + Sync + 'static {
    /// Starts a server **process** (SIGKILL must be real) with room for `capacity_bytes` of
    /// pages, listening on loopback.
    async fn start_server(&self, capacity_bytes: u64) -> Result<Box<dyn FaultServer>>;

    /// Opens a client of the server at `addr`.
    async fn connect(&self, addr: &str) -> Result<Arc<dyn Storage>>;

    /// Bytes per page the suite writes (default 16 KiB).
    fn page_bytes(&self) -> usize {
        16 << 10
    }

    /// A valid opening of the backend's protocol (a client's first message), which
    /// [`RemoteFault::PortGarbage`] sends before garbage so that the garbage reaches past the
    /// first parser. Empty (the default) sends garbage only.
    fn greeting(&self) -> Vec<u8> {
        Vec::new()
    }
}

/// One remote fault case.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum RemoteFault {
    /// SIGKILL of the server mid-batch, then a restart on the same address.
    ServerKill,
    /// Hostile bytes on the server's port while an honest client works.
    PortGarbage,
}

impl RemoteFault {
    /// Every remote fault.
    pub const ALL: [RemoteFault; 2] = [RemoteFault::ServerKill, RemoteFault::PortGarbage];
}

/// Runs one remote case on a fresh multi-threaded tokio runtime; panics naming the broken
/// invariant.
pub fn run_remote_fault<T: RemoteFaultTarget>(target: &T, fault: RemoteFault) {
    runtime().block_on(remote_fault_async(target, fault));
}

/// Runs one remote case inside the caller's (multi-threaded) runtime.
pub async fn remote_fault_async<T: RemoteFaultTarget>(target: &T, fault: RemoteFault) {
    match fault {
        RemoteFault::ServerKill => server_kill(target).await,
        RemoteFault::PortGarbage => port_garbage(target).await,
    }
}

/// Checks a `remote` declaration: the target's server is shared by its clients (a page one
/// client stores, another reads back intact) and the backend does not claim to be local.
/// The directory cases of a remote `fault_tests!` run this when forced (`--ignored`).
pub fn assert_remote<T: RemoteFaultTarget>(target: &T) {
    runtime().block_on(async {
        let server = start(target).await;
        let a = connect(target, &server.addr()).await;
        let b = connect(target, &server.addr()).await;
        let keys: Vec<PageKey> = (0..4).map(|i| key(60, i)).collect();
        let pb = target.page_bytes();
        assert_eq!(
            write_pages(&*a, &keys, pb).await.len(),
            keys.len(),
            "declared remote: a client of a fresh server stored nothing"
        );
        let t = read_back(&*b, &keys, pb).await;
        assert_eq!(
            t.intact,
            keys.len() as u64,
            "declared remote, but a second client of the same server does not see the first \
             one's pages ({t:?})"
        );
        assert!(
            a.info().shared,
            "declared remote, but the backend reports shared: false"
        );
    });
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Capacity of the servers the remote cases start.
const CAPACITY: u64 = 64 << 20;
/// Failure detector for anything that must end (a batch, a recovery): never a timing claim,
/// only the bound after which a hang is reported instead of hanging the test run.
const HANG: Duration = Duration::from_secs(120);

async fn start<T: RemoteFaultTarget>(t: &T) -> Box<dyn FaultServer> {
    t.start_server(CAPACITY)
        .await
        .unwrap_or_else(|e| panic!("could not start the server: {e}"))
}

async fn connect<T: RemoteFaultTarget>(t: &T, addr: &str) -> Arc<dyn Storage> {
    t.connect(addr)
        .await
        .unwrap_or_else(|e| panic!("could not connect to the server at {addr}: {e}"))
}

async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(HANG, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: still not done after {HANG:?} (a hang)"))
}

/// Progress of the writer of [`RemoteFault::ServerKill`].
#[derive(Default)]
struct Progress {
    ok: AtomicU64,
    failed: AtomicU64,
    stop: AtomicBool,
}

/// Waits until `cond` holds, polling; `what` names it in the hang report.
async fn until(what: &str, cond: impl Fn() -> bool) {
    bounded(what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

async fn server_kill<T: RemoteFaultTarget>(t: &T) {
    let pb = t.page_bytes();
    let mut server = start(t).await;
    let addr = server.addr();
    let client = connect(t, &addr).await;
    let before: Vec<PageKey> = (0..PAGES).map(|i| key(70, i)).collect();
    assert_eq!(
        write_pages(&*client, &before, pb).await.len(),
        before.len(),
        "a fresh server refused pages"
    );

    // A writer of new pages and a reader of the first ones, both looping until stopped.
    let progress = Arc::new(Progress::default());
    let writer = tokio::spawn(write_until_stopped(client.clone(), progress.clone(), pb));
    let reader = tokio::spawn(read_until_stopped(
        client.clone(),
        progress.clone(),
        before.clone(),
        pb,
    ));

    // Kill mid-batch: the writer has finished batches and keeps starting new ones.
    until("the writer's first batches", || {
        progress.ok.load(Ordering::Acquire) >= 3
    })
    .await;
    bounded("SIGKILL of the server", server.kill())
        .await
        .unwrap_or_else(|e| panic!("could not kill the server: {e}"));
    until("a failed write while the server is dead", || {
        progress.failed.load(Ordering::Acquire) >= 1
    })
    .await;
    let ok_at_restart = progress.ok.load(Ordering::Acquire);
    bounded("restart of the server", server.restart())
        .await
        .unwrap_or_else(|e| panic!("could not restart the server on {addr}: {e}"));
    until(
        "the same client storing pages again after the restart",
        || progress.ok.load(Ordering::Acquire) >= ok_at_restart + 3,
    )
    .await;
    progress.stop.store(true, Ordering::Release);
    let acked = bounded("the writer's last batch", writer)
        .await
        .expect("the writer task");
    let seen = bounded("the reader's last batch", reader)
        .await
        .expect("the reader task");
    assert_eq!(
        seen.wrong, 0,
        "reads during the kill and restart returned WRONG pages ({seen:?})"
    );

    check_after_restart(&*client, &before, &acked, server.persistent(), pb).await;
}

/// The writer of [`RemoteFault::ServerKill`]: stores batches of new pages until stopped;
/// returns every acknowledged page with the epoch it was acknowledged in (the count of
/// failed batches then: 0 before the kill).
async fn write_until_stopped(
    client: Arc<dyn Storage>,
    progress: Arc<Progress>,
    pb: usize,
) -> Vec<(u64, PageKey)> {
    let mut acked: Vec<(u64, PageKey)> = Vec::new();
    let mut batch = 0u64;
    while !progress.stop.load(Ordering::Acquire) && batch < 100_000 {
        let keys: Vec<PageKey> = (0..8).map(|i| key(71, batch * 8 + i)).collect();
        let got = write_pages(&*client, &keys, pb).await;
        // The epoch a page was acknowledged in: before or after the restart.
        let epoch = progress.failed.load(Ordering::Acquire);
        if got.len() == keys.len() {
            progress.ok.fetch_add(1, Ordering::AcqRel);
        } else {
            progress.failed.fetch_add(1, Ordering::AcqRel);
            // Back off a little while the server is down (pacing, not a sync).
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        acked.extend(got.into_iter().map(|k| (epoch, k)));
        batch += 1;
    }
    acked
}

/// The reader of [`RemoteFault::ServerKill`]: reads `before` back until stopped; returns what
/// it saw.
async fn read_until_stopped(
    client: Arc<dyn Storage>,
    progress: Arc<Progress>,
    before: Vec<PageKey>,
    pb: usize,
) -> Tally {
    let mut seen = Tally::default();
    let mut rounds = 0u64;
    while !progress.stop.load(Ordering::Acquire) && rounds < 100_000 {
        let r = read_back(&*client, &before, pb).await;
        seen.intact += r.intact;
        seen.lost += r.lost;
        seen.wrong += r.wrong;
        rounds += 1;
        if r.lost > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    seen
}

/// The end of [`RemoteFault::ServerKill`]: nothing reads back wrong, pages acknowledged after
/// the restart are intact (earlier ones too if the server persists), and the same client
/// stores and serves new pages.
async fn check_after_restart(
    client: &dyn Storage,
    before: &[PageKey],
    acked: &[(u64, PageKey)],
    persistent: bool,
    pb: usize,
) {
    // After the restart: nothing wrong; pages acknowledged after it intact; earlier ones
    // intact if the server persists.
    let what = "after a SIGKILL and restart of the server";
    let all: Vec<PageKey> = before
        .iter()
        .copied()
        .chain(acked.iter().map(|(_, k)| *k))
        .collect();
    let r = read_back(client, &all, pb).await;
    assert_eq!(r.wrong, 0, "{what}: pages read back WRONG ({r:?})");
    // Pages of batches acknowledged once the writer had seen a failure were written to the
    // restarted server (a batch in flight at the kill fails, so it is not among them).
    let late: Vec<PageKey> = acked
        .iter()
        .filter(|(epoch, _)| *epoch >= 1)
        .map(|(_, k)| *k)
        .collect();
    assert!(
        !late.is_empty(),
        "{what}: no page acknowledged after the restart"
    );
    let r = read_back(client, &late, pb).await;
    assert_eq!(
        r.intact,
        late.len() as u64,
        "{what}: pages acknowledged by the restarted server do not read back ({r:?})"
    );
    if persistent {
        let early: Vec<PageKey> = before
            .iter()
            .copied()
            .chain(acked.iter().filter(|(e, _)| *e == 0).map(|(_, k)| *k))
            .collect();
        let r = read_back(client, &early, pb).await;
        assert_eq!(
            r.intact,
            early.len() as u64,
            "{what}: a persistent server lost pages acknowledged before the kill ({r:?})"
        );
    }
    // The same client (never reopened) stores and serves new pages.
    let fresh: Vec<PageKey> = (0..4).map(|i| key(72, i)).collect();
    assert_eq!(
        write_pages(client, &fresh, pb).await.len(),
        fresh.len(),
        "{what}: the client no longer stores pages"
    );
    let r = read_back(client, &fresh, pb).await;
    assert_eq!(r.intact, fresh.len() as u64, "{what}: {r:?}");
}

/// Hostile connections of [`RemoteFault::PortGarbage`], one kind per index.
async fn hostile_connection(addr: &str, greeting: &[u8], n: u64, rng: &mut ChaCha8Rng) {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return;
    };
    let mut junk = vec![0u8; rng.random_range(1..4096)];
    rng.fill(&mut junk[..]);
    let _ = match n % 5 {
        // Random bytes.
        0 => s.write_all(&junk).await,
        // A valid opening, then random bytes.
        1 => {
            let _ = s.write_all(greeting).await;
            s.write_all(&junk).await
        }
        // Length prefixes of every plausible width claiming the largest sizes.
        2 => s.write_all(&[0xff; 64]).await,
        // A valid opening cut short.
        3 => {
            let cut = rng.random_range(0..=greeting.len());
            s.write_all(&greeting[..cut]).await
        }
        // Nothing at all (the connection is closed at once).
        _ => Ok(()),
    };
    // Read whatever the server answers, briefly (it may close, answer an error, or wait).
    let mut buf = [0u8; 256];
    let _ = tokio::time::timeout(Duration::from_millis(20), s.read(&mut buf)).await;
}

async fn port_garbage<T: RemoteFaultTarget>(t: &T) {
    let pb = t.page_bytes();
    let server = start(t).await;
    let addr = server.addr();
    let greeting = t.greeting();
    let client = connect(t, &addr).await;
    // Connections that connect and never send, held open through the whole case.
    let mut silent = Vec::new();
    for _ in 0..16 {
        if let Ok(s) = TcpStream::connect(&addr).await {
            silent.push(s);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let mut hostile = Vec::new();
    for worker in 0..2u64 {
        let (addr, greeting, stop, sent) =
            (addr.clone(), greeting.clone(), stop.clone(), sent.clone());
        hostile.push(tokio::spawn(async move {
            let mut rng = ChaCha8Rng::seed_from_u64(0x6a7b + worker);
            let mut n = worker;
            while n < 20_000 && (n < 40 || !stop.load(Ordering::Acquire)) {
                hostile_connection(&addr, &greeting, n, &mut rng).await;
                sent.fetch_add(1, Ordering::AcqRel);
                n += 2;
            }
        }));
    }
    let mut acked = Vec::new();
    for round in 0..20u64 {
        let keys: Vec<PageKey> = (0..8).map(|i| key(80, round * 8 + i)).collect();
        let got = write_pages(&*client, &keys, pb).await;
        assert_eq!(
            got.len(),
            keys.len(),
            "round {round}: garbage on the port cost the honest client a write"
        );
        acked.extend(got);
        let r = read_back(&*client, &acked, pb).await;
        assert_eq!(
            r.intact,
            acked.len() as u64,
            "round {round}: garbage on the port cost the honest client a page ({r:?})"
        );
    }
    stop.store(true, Ordering::Release);
    for h in hostile {
        bounded("the hostile connections", h)
            .await
            .expect("a hostile task");
    }
    assert!(
        sent.load(Ordering::Acquire) >= 40,
        "the hostile connections never ran"
    );
    drop(silent);
    let r = read_back(&*client, &acked, pb).await;
    assert_eq!(
        r.intact,
        acked.len() as u64,
        "after garbage on the port ({r:?})"
    );
    let late = connect(t, &addr).await;
    let r = read_back(&*late, &acked, pb).await;
    assert_eq!(
        r.intact,
        acked.len() as u64,
        "a fresh client after garbage on the port ({r:?})"
    );
}
