//! TLS against a real `redis-server` started with TLS on loopback (`--tls-port`, certificates
//! made by rcgen in the test): pages round-trip bit-exact over TLS with the CA given in
//! `tls_ca_file`; a plain client on the TLS port, a TLS client on the plain port and a client
//! trusting another CA are clear errors at open.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hicache_backend_redis::testing::{RedisServer, redis_available};
use hicache_backend_redis::{RedisOptions, RedisStorage};
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Storage};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};

/// A CA and a server certificate for 127.0.0.1 signed by it, as PEM files in `dir`.
fn pki(dir: &Path, cn: &str) -> (PathBuf, PathBuf, PathBuf) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, cn);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()]).unwrap();
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = p.signed_by(&key, &ca).unwrap();
    let write = |name: &str, pem: &str| {
        let f = dir.join(name);
        std::fs::write(&f, pem).unwrap();
        f
    };
    (
        write(&format!("{cn}-ca.pem"), &ca.pem()),
        write(&format!("{cn}-server.pem"), &cert.pem()),
        write(&format!("{cn}-server.key"), &key.serialize_pem()),
    )
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn opts(addr: String, tls: bool, ca: Option<&Path>) -> RedisOptions {
    let mut o = RedisOptions::new([addr]);
    o.cluster = false;
    o.tls = tls;
    o.tls_ca_file = ca.map(Path::to_path_buf);
    o.timeout = Duration::from_secs(3);
    o
}

#[test]
fn pages_round_trip_over_tls_to_a_real_redis_server() {
    if !redis_available("pages_round_trip_over_tls_to_a_real_redis_server") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = pki(dir.path(), "hicache-test");
    let tls_port = free_port();
    let p = |f: &PathBuf| f.to_string_lossy().into_owned();
    // The plain port stays open for the harness's readiness probe; pages go to the TLS port.
    let server = RedisServer::start(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &p(&cert),
        "--tls-key-file",
        &p(&key),
        "--tls-ca-cert-file",
        &p(&ca),
        "--tls-auth-clients",
        "no",
    ]);
    let tls_addr = format!("127.0.0.1:{tls_port}");
    let s = rt
        .block_on(RedisStorage::open(opts(tls_addr.clone(), true, Some(&ca))))
        .unwrap_or_else(|e| panic!("TLS open of {tls_addr}: {e}"));
    let keys: Vec<PageKey> = (0..64).map(|i| page_key(namespace(5), 1, i)).collect();
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, 64 << 10)).collect();
    let src: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|d| PageBuf::contiguous(LayoutKind::PageFirst, d))
        .collect();
    let out = rt.block_on(s.batch_set(&keys, &src)).unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    assert_eq!(rt.block_on(s.batch_exists(&keys)).unwrap(), 64);
    let mut back = vec![vec![0u8; 64 << 10]; keys.len()];
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = back
            .iter_mut()
            .map(|d| PageBufMut::contiguous(LayoutKind::PageFirst, d))
            .collect();
        rt.block_on(s.batch_get(&keys, &mut dst)).unwrap()
    };
    assert!(out.iter().all(PageOutcome::is_hit), "{out:?}");
    assert_eq!(back, pages, "bytes over TLS differ");

    // A plain client on the TLS port: a clear error, not a hang.
    let e = rt
        .block_on(RedisStorage::open(opts(tls_addr.clone(), false, None)))
        .unwrap_err()
        .to_string();
    assert!(e.contains(&tls_addr), "{e}");
    // A TLS client on the plain port.
    let e = rt
        .block_on(RedisStorage::open(opts(server.addr(), true, Some(&ca))))
        .unwrap_err()
        .to_string();
    assert!(e.contains(&server.addr()) || e.contains("tls"), "{e}");
    // A client trusting another CA: the server's certificate is refused.
    let (other_ca, _, _) = pki(dir.path(), "another");
    let e = rt
        .block_on(RedisStorage::open(opts(
            tls_addr.clone(),
            true,
            Some(&other_ca),
        )))
        .unwrap_err()
        .to_string();
    assert!(
        e.to_lowercase().contains("certificate") || e.to_lowercase().contains("tls"),
        "{e}"
    );
    // The working TLS client is unaffected.
    assert_eq!(rt.block_on(s.batch_exists(&keys)).unwrap(), 64);
}
