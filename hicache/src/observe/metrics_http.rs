//! A Prometheus scrape endpoint: `GET /metrics` over HTTP/1.1 (hyper), served from a thread
//! with its own small runtime, so scrapes never run on the engine thread.
//!
//! The listener is bound when the cache is built (a bad address or a port in use is a build
//! error). Every other path answers 404, every other method 405, a request with a body larger
//! than [`MAX_REQUEST_BODY_BYTES`] (or of unknown length) 413, and the connection is closed.
//!
//! Whatever a peer does, the endpoint holds a bounded share of the process's descriptors and
//! CPU ([`MetricsLimits`]); invariants:
//! 1. **Connection cap.** At most `max_connections` accepted connections are open at once
//!    (a permit of a semaphore is held for each connection's lifetime); a connection accepted
//!    beyond the cap is closed at once, without a byte read. The descriptors held by the
//!    endpoint are the listener plus at most `max_connections`, plus one for the instant a
//!    surplus connection is accepted and closed.
//! 2. **Timeouts.** A request's headers must arrive within `header_read_timeout` of the
//!    connection starting to wait for them (hyper's timer: slowloris, idle keep-alive); a
//!    connection on which no byte moves either way for `idle_timeout` is closed (a peer that
//!    stops reading its response, or trickles a body).
//! 3. **Accept errors never spin.** A failing `accept` (out of descriptors: `EMFILE`,
//!    `ENFILE`; out of memory) is retried after a growing pause ([`AcceptBackoff`], up to
//!    [`ACCEPT_BACKOFF_MAX`]), logged at warn once per burst of errors, never in a loop
//!    without a pause. Errors that concern one aborted connection are retried at once.
//! 4. Bounded requests: headers are parsed within [`MAX_HEADER_BUF_BYTES`] and at most
//!    [`MAX_HEADERS`] headers; request bodies are never read.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;

use crate::error::{HiCacheError, Result};

/// What a scrape renders (the Prometheus text exposition).
pub type RenderFn = Arc<dyn Fn() -> String + Send + Sync>;

/// Default of [`MetricsLimits::max_connections`]: a Prometheus server scrapes over one
/// connection; a few dashboards or `curl`s beside it fit many times over, and the process
/// keeps its descriptors for L3 page files even under a flood of idle connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 32;
/// Default of [`MetricsLimits::header_read_timeout`].
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Default of [`MetricsLimits::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest request body accepted (a scrape has none); a larger or unsized one is answered 413
/// without being read, and the connection is closed.
pub const MAX_REQUEST_BODY_BYTES: u64 = 0;
/// hyper's read buffer for one connection (its minimum, 8 KiB, bounds a request's headers).
pub const MAX_HEADER_BUF_BYTES: usize = 8192;
/// Most headers of one request.
pub const MAX_HEADERS: usize = 64;
/// First pause after a failed `accept`.
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause between `accept` retries while they keep failing.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Bounds of the endpoint (see the module's invariants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricsLimits {
    /// Most connections open at once; more are closed as soon as they are accepted. At least 1.
    pub max_connections: usize,
    /// Longest wait for a request's complete headers (a new connection's, or the next one on
    /// a kept-alive connection).
    pub header_read_timeout: Duration,
    /// A connection on which no byte moves either way for this long is closed.
    pub idle_timeout: Duration,
}

impl Default for MetricsLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// The running endpoint; dropping it stops the server and closes its connections.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl MetricsServer {
    /// Binds `addr` (`IP:PORT`; port 0 picks one) and serves `render()` at `/metrics`, with
    /// the default [`MetricsLimits`].
    pub fn start(addr: &str, render: RenderFn) -> Result<Self> {
        Self::start_with_limits(addr, render, MetricsLimits::default())
    }

    /// [`MetricsServer::start`] with explicit `limits` (a zero connection cap or timeout is a
    /// configuration error).
    pub fn start_with_limits(addr: &str, render: RenderFn, limits: MetricsLimits) -> Result<Self> {
        if limits.max_connections == 0
            || limits.header_read_timeout.is_zero()
            || limits.idle_timeout.is_zero()
        {
            return Err(HiCacheError::config(
                "metrics_addr",
                addr,
                format!("the endpoint's limits must be positive: {limits:?}"),
            ));
        }
        let parsed: SocketAddr = addr.parse().map_err(|e| {
            HiCacheError::config("metrics_addr", addr, format!("must be IP:PORT: {e}"))
        })?;
        let listener = std::net::TcpListener::bind(parsed)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| HiCacheError::config("metrics_addr", addr, format!("cannot bind: {e}")))?;
        let bound = listener
            .local_addr()
            .map_err(|e| HiCacheError::config("metrics_addr", addr, e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(HiCacheError::Runtime)?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("hicache-metrics-http".into())
            .spawn(move || runtime.block_on(serve(listener, render, limits, stopped)))
            .map_err(HiCacheError::Runtime)?;
        tracing::info!(addr = %bound, ?limits, "serving Prometheus metrics at /metrics");
        Ok(Self {
            addr: bound,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The bound address (the port resolved when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            // The runtime, and with it every connection task, is dropped when the thread ends.
            let _ = t.join();
        }
    }
}

/// The pause policy of a failing `accept` (invariant 3): the first error of a burst pauses
/// [`ACCEPT_BACKOFF_MIN`], each further one twice as long, up to [`ACCEPT_BACKOFF_MAX`]; a
/// successful accept ends the burst.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    /// Errors since the last successful accept (0: not in a burst).
    errors: u64,
    /// The pause after the last error.
    pause: Duration,
}

/// What to do after a failed `accept`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptRetry {
    /// Pause this long before accepting again (zero: at once).
    pub pause: Duration,
    /// This error starts a burst: log it (later ones of the burst are not logged).
    pub log: bool,
}

impl AcceptBackoff {
    /// Whether `e` concerns one connection that went away before it was accepted (retry at
    /// once) rather than the listener or the process (pause).
    pub fn is_per_connection(e: &io::Error) -> bool {
        matches!(
            e.kind(),
            io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::Interrupted
        )
    }

    /// Records a failed accept and says how long to pause.
    pub fn on_error(&mut self, e: &io::Error) -> AcceptRetry {
        if Self::is_per_connection(e) {
            return AcceptRetry {
                pause: Duration::ZERO,
                log: false,
            };
        }
        self.errors += 1;
        self.pause = if self.errors == 1 {
            ACCEPT_BACKOFF_MIN
        } else {
            (self.pause * 2).min(ACCEPT_BACKOFF_MAX)
        };
        AcceptRetry {
            pause: self.pause,
            log: self.errors == 1,
        }
    }

    /// Records a successful accept; returns the number of errors of the burst it ends (0
    /// when none was under way).
    pub fn on_success(&mut self) -> u64 {
        self.pause = Duration::ZERO;
        std::mem::take(&mut self.errors)
    }
}

async fn serve(
    listener: std::net::TcpListener,
    render: RenderFn,
    limits: MetricsLimits,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "metrics endpoint cannot listen");
            return;
        }
    };
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut backoff = AcceptBackoff::default();
    // Connections closed for the cap since the last warning (one warning per burst).
    let mut refused: u64 = 0;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = &mut stopped => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                let burst = backoff.on_success();
                if burst > 0 {
                    tracing::info!(errors = burst, "metrics endpoint accepts connections again");
                }
                stream
            }
            Err(e) => {
                let retry = backoff.on_error(&e);
                if retry.log {
                    tracing::warn!(
                        error = %e,
                        "metrics endpoint cannot accept connections; retrying with a backoff \
                         of up to {ACCEPT_BACKOFF_MAX:?}"
                    );
                }
                if !retry.pause.is_zero() {
                    tokio::select! {
                        () = tokio::time::sleep(retry.pause) => {}
                        _ = &mut stopped => return,
                    }
                }
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Invariant 1: beyond the cap the connection is closed at once.
            drop(stream);
            refused += 1;
            if refused == 1 {
                tracing::warn!(
                    max_connections = limits.max_connections,
                    "metrics endpoint at its connection cap; closing new connections"
                );
            }
            continue;
        };
        if permits.available_permits() > limits.max_connections / 2 && refused > 0 {
            tracing::info!(
                closed = refused,
                "metrics endpoint below its connection cap again"
            );
            refused = 0;
        }
        let render = render.clone();
        tokio::spawn(async move {
            serve_connection(stream, render, limits).await;
            drop(permit);
        });
    }
}

/// Serves one connection until the peer closes it, an error, or a timeout (invariant 2).
async fn serve_connection(stream: tokio::net::TcpStream, render: RenderFn, limits: MetricsLimits) {
    let started = Instant::now();
    let activity = Arc::new(AtomicU64::new(0));
    let io = TokioIo::new(Watched {
        inner: stream,
        started,
        activity: activity.clone(),
    });
    let service = hyper::service::service_fn(move |req| answer(req, render.clone()));
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_HEADER_BUF_BYTES)
        .max_headers(MAX_HEADERS)
        .serve_connection(io, service);
    tokio::select! {
        r = conn => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "metrics connection ended with an error");
            }
        }
        () = idle_watch(started, &activity, limits.idle_timeout) => {
            tracing::debug!("metrics connection closed: idle for {:?}", limits.idle_timeout);
        }
    }
}

/// Returns once no byte moved on the connection for `idle` (`activity`: milliseconds since
/// `started` of the last transfer).
async fn idle_watch(started: Instant, activity: &AtomicU64, idle: Duration) {
    loop {
        let last = Duration::from_millis(activity.load(Ordering::Relaxed));
        let deadline = started + last + idle;
        if Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

/// A stream that records when bytes last moved (for the idle bound).
struct Watched {
    inner: tokio::net::TcpStream,
    started: Instant,
    activity: Arc<AtomicU64>,
}

impl Watched {
    fn touch(&self) {
        let ms = self.started.elapsed().as_millis();
        self.activity
            .store(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

async fn answer(
    req: Request<Incoming>,
    render: RenderFn,
) -> std::result::Result<Response<Full<Bytes>>, Infallible> {
    // A body is never read: one larger than the bound (or of unknown length) is refused and
    // the connection closed, so hyper does not drain it either.
    let body_ok = req
        .body()
        .size_hint()
        .upper()
        // `n ≤ MAX_REQUEST_BODY_BYTES`, written so that it holds for a bound of 0 too.
        .is_some_and(|n| MAX_REQUEST_BODY_BYTES.checked_sub(n).is_some());
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        _ if !body_ok => (
            StatusCode::PAYLOAD_TOO_LARGE,
            "text/plain",
            "request bodies are not accepted\n".into(),
        ),
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            render(),
        ),
        (_, "/metrics") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET\n".into(),
        ),
        _ => (StatusCode::NOT_FOUND, "text/plain", "see /metrics\n".into()),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    if !body_ok {
        resp.headers_mut().insert(
            hyper::header::CONNECTION,
            hyper::header::HeaderValue::from_static("close"),
        );
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    fn server(limits: MetricsLimits) -> MetricsServer {
        MetricsServer::start_with_limits("127.0.0.1:0", Arc::new(|| "up 1\n".into()), limits)
            .unwrap()
    }

    /// One whole request on a fresh connection; the response (closed by the server after it).
    fn request(addr: SocketAddr, req: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    fn scrape(addr: SocketAddr) -> String {
        request(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
    }

    /// Whether the server closed `s` (EOF or reset) within `limit`, reading and discarding
    /// whatever it sent before.
    fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
        s.set_read_timeout(Some(limit)).unwrap();
        let mut buf = [0u8; 4096];
        let end = Instant::now() + limit;
        while Instant::now() < end {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
        false
    }

    #[test]
    fn connections_beyond_the_cap_are_closed_and_scrapes_still_work() {
        let cap = 4;
        let m = server(MetricsLimits {
            max_connections: cap,
            ..MetricsLimits::default()
        });
        let addr = m.addr();
        // `cap` idle connections hold every permit (each sends a byte so it is surely
        // accepted and served before the next is made).
        let mut held: Vec<TcpStream> = (0..cap)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(b"G").unwrap();
                s
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        // Every further one is closed at once, whatever it sends.
        for _ in 0..8 {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
            assert!(closed_within(&mut s, Duration::from_secs(20)));
        }
        // The held ones still work, and once they go a new scrape succeeds.
        held[0]
            .write_all(b"ET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        held[0].read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(out.contains("up 1"), "{out}");
        held.clear();
        let mut ok = false;
        for _ in 0..200 {
            // The server frees a permit when it sees the close: retry while it has not yet.
            let out = scrape(addr);
            if out.starts_with("HTTP/1.1 200") {
                assert!(out.contains("up 1"), "{out}");
                ok = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(ok, "no scrape succeeded after the held connections closed");
    }

    #[test]
    fn idle_and_slow_connections_time_out() {
        let m = server(MetricsLimits {
            max_connections: 8,
            header_read_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(300),
        });
        let addr = m.addr();
        // Idle: never sends a byte.
        let mut idle = TcpStream::connect(addr).unwrap();
        // Slowloris: headers never finished.
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-a: ")
            .unwrap();
        // Kept alive after a request, then idle.
        let mut kept = TcpStream::connect(addr).unwrap();
        kept.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        for s in [&mut idle, &mut slow, &mut kept] {
            assert!(closed_within(s, Duration::from_secs(30)));
        }
        assert!(scrape(addr).starts_with("HTTP/1.1 200"));
    }

    #[test]
    fn other_paths_methods_and_bodies_are_refused() {
        let m = server(MetricsLimits::default());
        let addr = m.addr();
        let r = request(
            addr,
            "GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        let r = request(
            addr,
            "DELETE /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        assert!(r.starts_with("HTTP/1.1 405"), "{r}");
        // A huge declared body is refused without being read, and the connection closed.
        let r = request(
            addr,
            "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1099511627776\r\n\r\nabc",
        );
        assert!(r.starts_with("HTTP/1.1 413"), "{r}");
        let r = request(
            addr,
            "POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffff\r\n",
        );
        assert!(r.starts_with("HTTP/1.1 413"), "{r}");
        // Garbage is answered 400 or dropped; the endpoint still serves.
        let _ = request(addr, "\u{0}\u{1}garbage\r\n\r\n");
        assert!(scrape(addr).starts_with("HTTP/1.1 200"));
    }

    #[test]
    fn zero_limits_are_refused() {
        let e = MetricsServer::start_with_limits(
            "127.0.0.1:0",
            Arc::new(String::new),
            MetricsLimits {
                max_connections: 0,
                ..MetricsLimits::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("metrics_addr"), "{e}");
    }

    #[test]
    fn accept_errors_back_off_up_to_the_bound_and_log_once_per_burst() {
        let mut b = AcceptBackoff::default();
        let emfile = io::Error::from_raw_os_error(24); // EMFILE
        let first = b.on_error(&emfile);
        assert_eq!(
            first,
            AcceptRetry {
                pause: ACCEPT_BACKOFF_MIN,
                log: true
            }
        );
        let mut last = first.pause;
        for _ in 0..20 {
            let r = b.on_error(&emfile);
            assert!(!r.log);
            assert!(r.pause >= last && r.pause <= ACCEPT_BACKOFF_MAX);
            last = r.pause;
        }
        assert_eq!(last, ACCEPT_BACKOFF_MAX);
        // An aborted connection is retried at once and changes nothing.
        let aborted = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(b.on_error(&aborted).pause, Duration::ZERO);
        assert_eq!(b.on_success(), 21);
        assert_eq!(b.on_success(), 0);
        // A new burst starts small and is logged again.
        assert_eq!(b.on_error(&emfile), first);
    }
}
