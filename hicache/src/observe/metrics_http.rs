//! A Prometheus scrape endpoint: `GET /metrics` over HTTP/1.1 (hyper), served from a thread
//! with its own small runtime, so scrapes never run on the engine thread.
//!
//! The listener is bound when the cache is built (a bad address or a port in use is a build
//! error). Every other path answers 404, every other method 405.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use crate::error::{HiCacheError, Result};

/// What a scrape renders (the Prometheus text exposition).
pub type RenderFn = Arc<dyn Fn() -> String + Send + Sync>;

/// The running endpoint; dropping it stops the server.
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
    /// Binds `addr` (`IP:PORT`; port 0 picks one) and serves `render()` at `/metrics`.
    pub fn start(addr: &str, render: RenderFn) -> Result<Self> {
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
            .spawn(move || runtime.block_on(serve(listener, render, stopped)))
            .map_err(HiCacheError::Runtime)?;
        tracing::info!(addr = %bound, "serving Prometheus metrics at /metrics");
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
            let _ = t.join();
        }
    }
}

async fn serve(
    listener: std::net::TcpListener,
    render: RenderFn,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "metrics endpoint cannot listen");
            return;
        }
    };
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = &mut stopped => return,
        };
        let Ok((stream, _)) = accepted else { continue };
        let render = render.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| answer(req, render.clone()));
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "metrics connection ended with an error");
            }
        });
    }
}

async fn answer(
    req: Request<Incoming>,
    render: RenderFn,
) -> std::result::Result<Response<Full<Bytes>>, Infallible> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
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
    Ok(resp)
}
