//! TLS on the rdma backend's TCP channel, on loopback, with certificates made by rcgen in the
//! test: the storage contract holds over TLS (the conformance suite, and the fault suite's
//! remote cases on a TLS server process); a client must verify the server (wrong CA, wrong
//! name, plain TCP to a TLS server and TLS to a plain server all fail at connect, and nothing
//! is served); with a client CA the server lets in only clients with a certificate it signed;
//! the protocol's own authentication still runs inside the session.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{FaultProcess, ServerProcess, TestPki, process_err, server_opts, test_token};
use hicache_backend_rdma::tls::ClientTls;
use hicache_backend_rdma::{RdmaOptions, RdmaServer, RdmaStorage, ServerHandle, ServerOptions};
use hicache_storage::conformance::Harness;
use hicache_storage::faults::{FaultServer, RemoteFaultTarget};
use hicache_storage::{
    LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Result, Storage, StorageConfig,
    async_trait, pattern,
};
use parking_lot::Mutex;

const L: LayoutKind = LayoutKind::PageFirst;

fn opts(addr: &str, tls: Option<ClientTls>) -> RdmaOptions {
    let mut o = RdmaOptions::with_token(addr, test_token());
    o.io_timeout = Duration::from_secs(5);
    o.retry_backoff = Duration::from_millis(20);
    o.tls = tls;
    o
}

async fn tls_server(pki: &TestPki, mutual: bool) -> ServerHandle {
    RdmaServer::start(ServerOptions {
        tls: Some(pki.server_tls(mutual)),
        handshake_ms: 2_000,
        ..server_opts(64 << 20)
    })
    .await
    .unwrap()
}

async fn round_trip(client: &RdmaStorage, seed: u64) {
    let keys: Vec<PageKey> = (0..16)
        .map(|i| pattern::page_key(pattern::namespace(3), seed, i))
        .collect();
    let pages: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| pattern::page_bytes(k, 64 << 10))
        .collect();
    let src: Vec<PageBuf<'_>> = pages.iter().map(|p| PageBuf::contiguous(L, p)).collect();
    let out = client.batch_set(&keys, &src).await.unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    let mut back = vec![vec![0u8; 64 << 10]; keys.len()];
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = back
            .iter_mut()
            .map(|b| PageBufMut::contiguous(L, b))
            .collect();
        client.batch_get(&keys, &mut dst).await.unwrap()
    };
    assert!(out.iter().all(|o| *o == PageOutcome::Hit), "{out:?}");
    assert_eq!(back, pages, "bytes over TLS differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_round_trip_over_tls_and_a_client_must_verify_the_server() {
    let pki = TestPki::new("hicache test CA");
    let server = tls_server(&pki, false).await;
    let addr = server.local_addr().to_string();
    let client = RdmaStorage::connect(opts(&addr, Some(pki.client_tls(false))))
        .await
        .unwrap();
    round_trip(&client, 1).await;

    // A CA that did not sign the server's certificate: refused at connect.
    let other = TestPki::new("another CA");
    let e = RdmaStorage::connect(opts(&addr, Some(other.client_tls(false))))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("TLS handshake failed"), "{e}");
    // A name the certificate is not valid for.
    let mut wrong_name = pki.client_tls(false);
    wrong_name.server_name = Some("pool.example".into());
    let e = RdmaStorage::connect(opts(&addr, Some(wrong_name)))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("TLS handshake failed"), "{e}");
    // Plain TCP to a TLS server: its HELLO is not TLS; nothing is served.
    let before = server.stats().auth_failures;
    assert!(RdmaStorage::connect(opts(&addr, None)).await.is_err());
    common::eventually("the failed TLS handshake is counted", || {
        server.stats().auth_failures > before
    })
    .await;
    // TLS to a plain server: the client refuses to go on without TLS.
    let plain = RdmaServer::start(server_opts(16 << 20)).await.unwrap();
    let e = RdmaStorage::connect(opts(
        &plain.local_addr().to_string(),
        Some(pki.client_tls(false)),
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("TLS"), "{e}");
    // The working client was never disturbed.
    round_trip(&client, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_a_client_ca_lets_in_only_clients_with_its_certificates() {
    let pki = TestPki::new("hicache test CA");
    let server = tls_server(&pki, true).await;
    let addr = server.local_addr().to_string();
    // Without a client certificate: refused (rustls reports it at the first read under
    // TLS 1.3, so at the protocol handshake at the latest).
    assert!(
        RdmaStorage::connect(opts(&addr, Some(pki.client_tls(false))))
            .await
            .is_err()
    );
    // With a certificate of another CA: refused.
    let other = TestPki::new("another CA");
    let mut foreign = pki.client_tls(true);
    foreign.client_cert = Some((other.client_cert.clone(), other.client_key.clone()));
    assert!(
        RdmaStorage::connect(opts(&addr, Some(foreign)))
            .await
            .is_err()
    );
    // With its certificate: served; the token is still checked inside the session.
    let client = RdmaStorage::connect(opts(&addr, Some(pki.client_tls(true))))
        .await
        .unwrap();
    round_trip(&client, 3).await;
    let mut no_token = opts(&addr, Some(pki.client_tls(true)));
    no_token.token =
        Some(hicache_backend_rdma::Token::new("not-the-right-token-0001", "t").unwrap());
    let e = RdmaStorage::connect(no_token)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.to_lowercase().contains("auth"), "{e}");
}

#[test]
fn tls_extra_config_is_strict() {
    let parse = |json: &str| {
        let c = StorageConfig::parse(Some("rdma"), Some(json))?;
        RdmaOptions::from_config(&c.common, c.backend_fields)
    };
    let o = parse(
        r#"{"server": "127.0.0.1:7470", "tls_ca_file": "/ca.pem", "tls_server_name": "pool",
            "tls_cert_file": "/c.pem", "tls_key_file": "/c.key"}"#,
    )
    .unwrap();
    let t = o.tls.unwrap();
    assert_eq!(t.ca_file, std::path::Path::new("/ca.pem"));
    assert_eq!(t.server_name.as_deref(), Some("pool"));
    assert!(t.client_cert.is_some());
    for (json, field) in [
        (
            r#"{"server": "h:1", "tls_server_name": "pool"}"#,
            "tls_server_name",
        ),
        (
            r#"{"server": "h:1", "tls_ca_file": "/ca", "tls_cert_file": "/c"}"#,
            "tls_key_file",
        ),
        (
            r#"{"spawn_server": true, "tls_ca_file": "/ca"}"#,
            "tls_ca_file",
        ),
    ] {
        let e = parse(json).unwrap_err().to_string();
        assert!(e.contains(field), "{json}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_files_are_clear_errors() {
    let pki = TestPki::new("hicache test CA");
    let e = RdmaServer::start(ServerOptions {
        tls: Some(hicache_backend_rdma::tls::ServerTls {
            cert_pem: b"not a certificate".to_vec(),
            key_pem: std::fs::read(&pki.server_key).unwrap(),
            client_ca_pem: None,
        }),
        ..server_opts(16 << 20)
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("TLS certificate"), "{e}");
    // A key that is not the certificate's.
    let other = TestPki::new("another CA");
    let e = RdmaServer::start(ServerOptions {
        tls: Some(hicache_backend_rdma::tls::ServerTls {
            cert_pem: std::fs::read(&pki.server_cert).unwrap(),
            key_pem: std::fs::read(&other.server_key).unwrap(),
            client_ca_pem: None,
        }),
        ..server_opts(16 << 20)
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("do not go together"), "{e}");
    let e = RdmaStorage::connect(opts(
        "127.0.0.1:1",
        Some(ClientTls {
            ca_file: "/nonexistent/ca.pem".into(),
            ..ClientTls::default()
        }),
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("tls_ca_file") && e.contains("/nonexistent/ca.pem"),
        "{e}"
    );
    // The binary names the bad file too.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hicache-rdma-server"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--insecure-no-auth",
            "--pool",
            "16MiB",
        ])
        .args(["--tls-cert", "/nonexistent/cert.pem", "--tls-key"])
        .arg(&pki.server_key)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/cert.pem"));
}

/// The conformance suite over TLS: an in-process TLS server per open.
struct TlsHarness {
    pki: TestPki,
    servers: Mutex<Vec<ServerHandle>>,
}

impl TlsHarness {
    fn new() -> Self {
        Self {
            pki: TestPki::new("hicache test CA"),
            servers: Mutex::new(Vec::new()),
        }
    }
}

#[async_trait]
impl Harness for TlsHarness {
    type Backend = RdmaStorage;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<RdmaStorage>> {
        let server = RdmaServer::start(ServerOptions {
            tls: Some(self.pki.server_tls(false)),
            ..server_opts(capacity_bytes.unwrap_or(512 << 20))
        })
        .await?;
        let addr = server.local_addr().to_string();
        let client = RdmaStorage::connect(opts(&addr, Some(self.pki.client_tls(false)))).await?;
        self.servers.lock().push(server);
        Ok(Arc::new(client))
    }

    async fn corrupt(&self, backend: &RdmaStorage, key: &PageKey) -> Result<bool> {
        common::damage_on(&self.servers.lock(), backend, key)
    }
}

hicache_storage::conformance_tests!(tls_conformance, TlsHarness::new(), not_persistent);

/// The fault suite's remote cases on a TLS `hicache-rdma-server` process.
struct TlsTarget {
    pki: TestPki,
}

#[async_trait]
impl RemoteFaultTarget for TlsTarget {
    async fn start_server(&self, capacity_bytes: u64) -> Result<Box<dyn FaultServer>> {
        let cert = self.pki.server_cert.to_string_lossy().into_owned();
        let key = self.pki.server_key.to_string_lossy().into_owned();
        let p = ServerProcess::start(
            capacity_bytes,
            &[
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
                "--handshake-ms",
                "2000",
            ],
        )
        .map_err(|e| process_err("start hicache-rdma-server with TLS", e))?;
        Ok(Box::new(FaultProcess(p)))
    }

    async fn connect(&self, addr: &str) -> Result<Arc<dyn Storage>> {
        Ok(Arc::new(
            RdmaStorage::connect(opts(addr, Some(self.pki.client_tls(false)))).await?,
        ))
    }
}

hicache_storage::fault_tests!(
    tls_faults,
    TlsTarget {
        pki: TestPki::new("hicache test CA")
    },
    remote
);
