//! Shared test helpers: a conformance harness that starts an in-process server per backend.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use hicache_backend_rdma::{
    RdmaOptions, RdmaServer, RdmaStorage, ServerAuth, ServerHandle, ServerOptions, TenantTable,
    Token,
};
use hicache_storage::conformance::Harness;
use hicache_storage::faults::FaultServer;
use hicache_storage::{PageKey, Result, StorageError, async_trait};
use parking_lot::Mutex;

/// The shared token of the test servers.
pub const TEST_TOKEN: &str = "hicache-rdma-test-token-0001";

/// [`TEST_TOKEN`] as a token.
pub fn test_token() -> Token {
    Token::new(TEST_TOKEN, "test token").unwrap()
}

/// Server options for a pool of `pool` bytes, letting in [`TEST_TOKEN`] for every namespace.
pub fn server_opts(pool: u64) -> ServerOptions {
    ServerOptions {
        pool_bytes: pool,
        region_bytes: pool.min(256 << 20),
        auth: ServerAuth::Tenants(TenantTable::shared(test_token())),
        ..ServerOptions::default()
    }
}

/// Client options for `server` with short timeouts, authenticating with [`TEST_TOKEN`].
pub fn client_opts(server: &ServerHandle) -> RdmaOptions {
    let mut o = RdmaOptions::with_token(server.local_addr().to_string(), test_token());
    o.io_timeout = Duration::from_secs(5);
    o
}

/// Opens a client of an in-process server per `open`, keeping the servers.
#[derive(Default)]
pub struct RdmaHarness {
    servers: Mutex<Vec<ServerHandle>>,
}

#[async_trait]
impl Harness for RdmaHarness {
    type Backend = RdmaStorage;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<RdmaStorage>> {
        let server = RdmaServer::start(server_opts(capacity_bytes.unwrap_or(512 << 20))).await?;
        let client = RdmaStorage::connect(client_opts(&server)).await?;
        self.servers.lock().push(server);
        Ok(Arc::new(client))
    }

    async fn corrupt(&self, backend: &RdmaStorage, key: &PageKey) -> Result<bool> {
        damage_on(&self.servers.lock(), backend, key)
    }
}

/// Damages `key`'s stored copy on the server among `servers` that `backend` is connected to
/// (the conformance harnesses' `corrupt`).
pub fn damage_on(servers: &[ServerHandle], backend: &RdmaStorage, key: &PageKey) -> Result<bool> {
    let s = servers
        .iter()
        .find(|s| s.local_addr().to_string() == backend.server_addr())
        .ok_or_else(|| StorageError::backend("rdma", "no server for this client"))?;
    Ok(s.damage_page(key))
}

/// Waits (bounded) until `cond` holds, checking every few milliseconds. For events that
/// happen asynchronously on the server (a closed connection noticed); never a timing claim.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A `hicache-rdma-server` process on a loopback port, authenticating with [`TEST_TOKEN`]
/// (from a secret file); for tests that must SIGKILL a real server.
pub struct ServerProcess {
    child: Option<std::process::Child>,
    addr: String,
    pool: u64,
    extra: Vec<String>,
    dir: tempfile::TempDir,
}

impl ServerProcess {
    /// Starts a server with a pool of `pool` bytes on a free loopback port; `extra` are more
    /// command-line arguments.
    pub fn start(pool: u64, extra: &[&str]) -> std::io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir()?;
        let secret = dir.path().join("secret");
        std::fs::write(&secret, TEST_TOKEN)?;
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600))?;
        let mut p = Self {
            child: None,
            addr: "127.0.0.1:0".into(),
            pool,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            dir,
        };
        p.spawn()?;
        Ok(p)
    }

    /// Where it listens.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Starts the process on `self.addr` and waits for its "listening on ADDR" line.
    fn spawn(&mut self) -> std::io::Result<()> {
        use std::io::BufRead;
        let pool = self.pool.to_string();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_hicache-rdma-server"))
            .args(["--listen", &self.addr, "--pool", &pool, "--region", &pool])
            .arg("--secret-file")
            .arg(self.dir.path().join("secret"))
            .args(&self.extra)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()?;
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        let mut out = std::io::BufReader::new(stdout);
        out.read_line(&mut line)?;
        // Keep draining the server's log (tracing writes to stdout), so it never meets a
        // closed pipe.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let Some(addr) = line
            .strip_prefix("hicache-rdma-server listening on ")
            .and_then(|r| r.split_whitespace().next())
        else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other(format!(
                "hicache-rdma-server did not start: {line:?}"
            )));
        };
        self.addr = addr.to_string();
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL, then waits for the process to be gone.
    pub fn kill(&mut self) -> std::io::Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Starts the server again on the same address.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.kill()?;
        self.spawn()
    }
}

/// A [`ServerProcess`] as the storage fault suite's remote server (not persistent: the pool
/// lives in the process's memory).
pub struct FaultProcess(pub ServerProcess);

/// An I/O failure of the test's server process as a storage error.
pub fn process_err(what: &str, e: std::io::Error) -> StorageError {
    StorageError::backend_caused("rdma", what, e)
}

#[async_trait]
impl FaultServer for FaultProcess {
    fn addr(&self) -> String {
        self.0.addr().to_string()
    }

    async fn kill(&mut self) -> Result<()> {
        self.0.kill().map_err(|e| process_err("kill", e))
    }

    async fn restart(&mut self) -> Result<()> {
        self.0.restart().map_err(|e| process_err("restart", e))
    }

    fn persistent(&self) -> bool {
        false
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// Test certificates made by rcgen: a CA, a server certificate for `localhost` and
/// `127.0.0.1` and a client certificate, both signed by the CA, as PEM files.
pub struct TestPki {
    _dir: tempfile::TempDir,
    /// The CA certificate.
    pub ca: std::path::PathBuf,
    /// The server's certificate and key.
    pub server_cert: std::path::PathBuf,
    /// The server's key.
    pub server_key: std::path::PathBuf,
    /// A client certificate (for servers that require one).
    pub client_cert: std::path::PathBuf,
    /// Its key.
    pub client_key: std::path::PathBuf,
}

impl TestPki {
    /// Makes a fresh CA (common name `cn`) and certificates.
    pub fn new(cn: &str) -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
            IsCa, KeyPair,
        };
        let dir = tempfile::tempdir().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, cn);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(names).unwrap();
            p.extended_key_usages = vec![usage];
            let cert = p.signed_by(&key, &ca).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (sc, sk) = leaf(
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (cc, ck) = leaf(vec!["client".into()], ExtendedKeyUsagePurpose::ClientAuth);
        let write = |name: &str, pem: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, pem).unwrap();
            p
        };
        Self {
            ca: write("ca.pem", &ca.pem()),
            server_cert: write("server.pem", &sc),
            server_key: write("server.key", &sk),
            client_cert: write("client.pem", &cc),
            client_key: write("client.key", &ck),
            _dir: dir,
        }
    }

    /// Server-side TLS with these files (requiring client certificates if `mutual`).
    pub fn server_tls(&self, mutual: bool) -> hicache_backend_rdma::tls::ServerTls {
        hicache_backend_rdma::tls::ServerTls::from_files(
            &self.server_cert,
            &self.server_key,
            mutual.then_some(self.ca.as_path()),
        )
        .unwrap()
    }

    /// Client-side TLS trusting this CA (presenting the client certificate if `mutual`).
    pub fn client_tls(&self, mutual: bool) -> hicache_backend_rdma::tls::ClientTls {
        hicache_backend_rdma::tls::ClientTls {
            ca_file: self.ca.clone(),
            server_name: None,
            client_cert: mutual.then(|| (self.client_cert.clone(), self.client_key.clone())),
        }
    }
}
