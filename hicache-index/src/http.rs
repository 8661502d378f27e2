//! The HTTP API (HTTP/1.1, hyper; JSON bodies).
//!
//! | method, path | body | answer |
//! |---|---|---|
//! | `POST /register` | a [`Registration`] | `{"id", "new"}` |
//! | `POST /unregister` | `{"instance"}` | `{"removed": [ids]}` |
//! | `GET /instances` | | every stream's state (last sequence, gaps, replays, fenced restarts …) |
//! | `POST /query` | `{"model", "token_ids"}` | `{"instances": {ID: {"longest_matched", "l1", "l2", "l3"}}, "l3_stores": {STORE: tokens}}` |
//! | `GET /metrics` | | Prometheus text |
//! | `GET /health` | | `{"status": "ok", "streams", "models"}` |
//! | `GET /dump` | | the state as a snapshot file (see [`crate::snapshot`]) |
//! | `POST /route` | `{"model", "token_ids", "request"?: u64, "session"?: u64}` | `{"instance": ID, "request", "policy", "fallback", "overlap": {"l1", "l2", "l3"}, "expected_ttft_ms"?}` (see [`crate::routing::RouteAnswer`]) |
//! | `POST /finished` | `{"request": u64}` | `{"released": bool, "instance"?: ID}`: always 200; an unknown request is `released: false` and counted |
//! | `POST /load` | `{"instance": ID, "queued_prefill_tokens", "requests", "running_tokens", "prefetching_requests" (optional, 0)}` | `{}`; 404 for an unknown instance, 503 for one dropped as dead |
//!
//! `/route` chooses among the model's registered instances with the `--router` policy (one
//! router per model, [`crate::routing`]): 404 when no instance of the model is registered, 503
//! when every one was dropped as dead, 400 for an empty `token_ids`. The request counts as load
//! on the chosen instance until `/finished` names it; without a `request` id the service gives
//! one (returned as `request`). `overlap` is what the router credited on the chosen instance
//! (tokens; zero for `round-robin`, `least-load`, `sglang-cache-aware` and fallbacks);
//! `expected_ttft_ms` is the `hicache` policy's estimate. `fallback: true`: the index answered
//! past the deadline and `least-load` decided.
//!
//! Limits (invariants): at most [`HttpLimits::max_connections`] connections open at once (one
//! beyond is closed unread); request headers within `header_timeout`; a whole connection within
//! `connection_timeout`; request bodies of at most [`HttpLimits::max_body`] bytes (413 beyond,
//! unread); malformed JSON, wrong types, unknown fields: 400 with the parser's message; any
//! other path 404, method 405. Garbage on the port is a 400 from hyper and a closed connection.

use crate::driver::Hub;
use crate::registry::Registration;
use crate::router::LoadReport;
use crate::service::ServiceError;
use crate::transport::Transport;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Deserialize;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The server's bounds.
#[derive(Copy, Clone, Debug)]
pub struct HttpLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Largest request body (bytes).
    pub max_body: usize,
    /// Headers must arrive within this.
    pub header_timeout: Duration,
    /// A connection is closed after this, whatever it does.
    pub connection_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_body: 4 << 20,
            header_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(60),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Unregister {
    instance: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Route {
    model: String,
    token_ids: Vec<u32>,
    #[serde(default)]
    request: Option<u64>,
    #[serde(default)]
    session: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Finished {
    request: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Load {
    instance: String,
    queued_prefill_tokens: u64,
    requests: u64,
    running_tokens: u64,
    /// Requests waiting for their L3 prefetch before admission (optional: 0 when not
    /// reported).
    #[serde(default)]
    prefetching_requests: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Query {
    model: String,
    token_ids: Vec<u32>,
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body.into()))
        .expect("static headers are valid")
}

fn json(status: StatusCode, v: &impl serde::Serialize) -> Response<Full<Bytes>> {
    match serde_json::to_vec(v) {
        Ok(b) => reply(status, "application/json", b),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

fn error(status: StatusCode, msg: &str) -> Response<Full<Bytes>> {
    json_raw(status, &serde_json::json!({ "error": msg }))
}

fn json_raw(status: StatusCode, v: &serde_json::Value) -> Response<Full<Bytes>> {
    reply(status, "application/json", v.to_string())
}

fn service_error(e: &ServiceError) -> Response<Full<Bytes>> {
    let status = match e {
        ServiceError::Registration(_) | ServiceError::BadRequest(_) => StatusCode::BAD_REQUEST,
        ServiceError::NoLiveInstance(_) | ServiceError::DeadInstance(_) => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        ServiceError::PageSize { .. } => StatusCode::CONFLICT,
        ServiceError::UnknownInstance(_) | ServiceError::UnknownModel(_) => StatusCode::NOT_FOUND,
        ServiceError::Index(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(status, &e.to_string())
}

async fn body_json<T: serde::de::DeserializeOwned>(
    req: Request<Incoming>,
    max: usize,
) -> Result<T, Response<Full<Bytes>>> {
    let body = Limited::new(req.into_body(), max)
        .collect()
        .await
        .map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("request body larger than {max} bytes"),
                )
            } else {
                error(StatusCode::BAD_REQUEST, &format!("reading the body: {e}"))
            }
        })?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| error(StatusCode::BAD_REQUEST, &format!("body: {e}")))
}

async fn handle<T: Transport>(
    hub: Arc<Hub<T>>,
    limits: HttpLimits,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    if let Some(len) = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > limits.max_body as u64
    {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body larger than {} bytes", limits.max_body),
        );
    }
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (path.as_str(), method) {
        ("/register", Method::POST) => {
            match body_json::<Registration>(req, limits.max_body).await {
                Err(r) => r,
                Ok(reg) => match hub.register(reg) {
                    Ok((id, new)) => {
                        json_raw(StatusCode::OK, &serde_json::json!({ "id": id, "new": new }))
                    }
                    Err(e) => service_error(&e),
                },
            }
        }
        ("/unregister", Method::POST) => {
            match body_json::<Unregister>(req, limits.max_body).await {
                Err(r) => r,
                Ok(u) => match hub.unregister(&u.instance) {
                    Ok(ids) => json_raw(StatusCode::OK, &serde_json::json!({ "removed": ids })),
                    Err(e) => service_error(&e),
                },
            }
        }
        ("/query", Method::POST) => match body_json::<Query>(req, limits.max_body).await {
            Err(r) => r,
            Ok(q) => match hub.service().lock().query(&q.model, &q.token_ids) {
                Ok(a) => json(StatusCode::OK, &a),
                Err(e) => service_error(&e),
            },
        },
        ("/instances", Method::GET) => json(StatusCode::OK, &hub.service().lock().instances()),
        ("/metrics", Method::GET) => reply(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            hub.service().lock().render_metrics(),
        ),
        ("/health", Method::GET) => {
            let svc = hub.service().lock();
            json_raw(
                StatusCode::OK,
                &serde_json::json!({
                    "status": "ok",
                    "streams": svc.stream_ids().len(),
                    "models": svc.models.len(),
                }),
            )
        }
        ("/dump", Method::GET) => {
            let bytes = crate::snapshot::encode(&hub.service().lock());
            reply(StatusCode::OK, "application/octet-stream", bytes)
        }
        ("/route", Method::POST) => match body_json::<Route>(req, limits.max_body).await {
            Err(r) => r,
            Ok(r) => match hub
                .service()
                .lock()
                .route(&r.model, &r.token_ids, r.request, r.session)
            {
                Ok(a) => json(StatusCode::OK, &a),
                Err(e) => service_error(&e),
            },
        },
        ("/finished", Method::POST) => match body_json::<Finished>(req, limits.max_body).await {
            Err(r) => r,
            Ok(f) => {
                let v = match hub.service().lock().finished(f.request) {
                    Some(id) => serde_json::json!({ "released": true, "instance": id }),
                    None => serde_json::json!({ "released": false }),
                };
                json_raw(StatusCode::OK, &v)
            }
        },
        ("/load", Method::POST) => match body_json::<Load>(req, limits.max_body).await {
            Err(r) => r,
            Ok(l) => {
                let report = LoadReport {
                    queued_prefill_tokens: l.queued_prefill_tokens,
                    requests: l.requests,
                    running_tokens: l.running_tokens,
                    prefetching_requests: l.prefetching_requests,
                };
                match hub.service().lock().report_load(&l.instance, report) {
                    Ok(()) => json_raw(StatusCode::OK, &serde_json::json!({})),
                    Err(e) => service_error(&e),
                }
            }
        },
        ("/register" | "/unregister" | "/query" | "/route" | "/finished" | "/load", _)
        | ("/instances" | "/metrics" | "/health" | "/dump", _) => {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        _ => error(StatusCode::NOT_FOUND, &format!("no such path: {path}")),
    }
}

/// Serves the API on `listener` until the task is dropped.
pub async fn serve<T: Transport>(listener: TcpListener, hub: Arc<Hub<T>>, limits: HttpLimits) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            tracing::warn!(%peer, "connection refused: {} open already", limits.max_connections);
            drop(stream);
            continue;
        };
        let hub = Arc::clone(&hub);
        tokio::spawn(async move {
            let _permit = permit;
            let svc = hyper::service::service_fn(move |req| {
                let hub = Arc::clone(&hub);
                async move { Ok::<_, Infallible>(handle(hub, limits, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(64 * 1024)
                .serve_connection(TokioIo::new(stream), svc);
            match tokio::time::timeout(limits.connection_timeout, conn).await {
                Ok(Err(e)) => tracing::debug!(%peer, "connection ended: {e}"),
                Err(_) => tracing::debug!(%peer, "connection closed: timeout"),
                Ok(Ok(())) => {}
            }
        });
    }
}
