//! `hicache-rdma-server`: the memory-pool server of the `rdma` L3 backend.
//!
//! ```text
//! hicache-rdma-server --listen 10.0.0.5:7470 --pool 64GiB --tenants /etc/hicache/tenants.json
//! ```
//! Clients then use `--storage-backend rdma` with extra-config
//! `{"server": "10.0.0.5:7470", "token_file": "/etc/hicache/team-a.token"}`. Without
//! `--tenants` or `--secret-file` the server refuses to start unless told
//! `--insecure-no-auth` (loopback addresses only).

use clap::Parser;
use std::path::PathBuf;

use hicache_backend_rdma::tls::ServerTls;
use hicache_backend_rdma::{RdmaServer, ServerAuth, ServerOptions, TenantTable, Token};
use hicache_storage::{EvictionPolicy, parse_byte_size};

/// Memory-pool server of the hicache-rs `rdma` L3 backend.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address to listen on (loopback by default; give the interface clients reach).
    #[arg(long, default_value = "127.0.0.1:7470")]
    listen: String,
    /// Tenant file (JSON): each tenant's name, token (or token file) and namespaces.
    #[arg(long, conflicts_with_all = ["secret_file", "insecure_no_auth"])]
    tenants: Option<PathBuf>,
    /// A file holding one shared token that may use every namespace.
    #[arg(long, conflicts_with = "insecure_no_auth")]
    secret_file: Option<PathBuf>,
    /// Let anyone who reaches the port read, write and delete every page. Loopback only;
    /// for tests.
    #[arg(long)]
    insecure_no_auth: bool,
    /// Time a new connection has to authenticate, in milliseconds.
    #[arg(long, default_value_t = 5_000)]
    handshake_ms: u32,
    /// Close a connection that sends nothing for this long, in milliseconds.
    #[arg(long, default_value_t = 300_000)]
    idle_ms: u32,
    /// Most connections open at once (further ones are refused with a "busy" error).
    #[arg(long, default_value_t = 1024)]
    max_connections: u32,
    /// Most connections of one tenant open at once.
    #[arg(long, default_value_t = 256)]
    max_tenant_connections: u32,
    /// Most bytes one tenant may hold in flight (reserved for writes plus pinned by reads);
    /// default: half the pool.
    #[arg(long, value_parser = bytes)]
    max_tenant_inflight: Option<u64>,
    /// Bytes of the pool (e.g. `64GiB`, `100gb`, or a plain number).
    #[arg(long, default_value = "1GiB", value_parser = bytes)]
    pool: u64,
    /// Bytes of one region (one mapping and RDMA registration; a page never spans two).
    #[arg(long, default_value = "1GiB", value_parser = bytes)]
    region: u64,
    /// Allocation granule ("page class"): pages occupy whole granules (power of two).
    #[arg(long, default_value = "4KiB", value_parser = bytes)]
    granule: u64,
    /// Largest page accepted.
    #[arg(long, default_value = "256MiB", value_parser = bytes)]
    max_page: u64,
    /// Eviction when full: `lru`, `fifo`, or `none` (refuse new pages).
    #[arg(long, default_value = "lru")]
    eviction: String,
    /// Lifetime of a read lease, in milliseconds: a verbs `LOOKUP` lease, and the time a
    /// client has to consume a TCP `READ` reply.
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u32,
    /// Lifetime of an uncommitted reservation, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    alloc_ttl_ms: u32,
    /// Largest list in one request.
    #[arg(long, default_value_t = 4096)]
    max_batch: u32,
    /// Pre-fault the pool at start (slower start, no page faults later).
    #[arg(long)]
    populate: bool,
    /// Do not register the pool for RDMA even when a device is present.
    #[arg(long)]
    no_verbs: bool,
    /// TLS on every connection: the server's certificate chain (PEM). Needs `--tls-key`.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of `--tls-cert` (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// With TLS: clients must present a certificate signed by this CA (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
}

fn bytes(s: &str) -> Result<u64, String> {
    parse_byte_size(s).ok_or_else(|| format!("{s:?} is not a byte size (e.g. 4GiB, 512MiB)"))
}

fn main() {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let eviction = match args.eviction.as_str() {
        "none" => None,
        s => match EvictionPolicy::parse(s) {
            Some(p) => Some(p),
            None => {
                eprintln!("error: --eviction {s:?}: expected lru, fifo or none");
                std::process::exit(2);
            }
        },
    };
    let auth = match (&args.tenants, &args.secret_file, args.insecure_no_auth) {
        (Some(f), _, _) => TenantTable::from_file(f).map(ServerAuth::Tenants),
        (None, Some(f), _) => {
            Token::from_file(f).map(|t| ServerAuth::Tenants(TenantTable::shared(t)))
        }
        (None, None, true) => Ok(ServerAuth::InsecureNoAuth),
        (None, None, false) => Ok(ServerAuth::default()),
    };
    let auth = match auth {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(c), Some(k)) => match ServerTls::from_files(c, k, args.tls_client_ca.as_deref()) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        },
        _ => None,
    };
    let opts = ServerOptions {
        listen: args.listen,
        auth,
        handshake_ms: args.handshake_ms,
        idle_ms: args.idle_ms,
        max_connections: args.max_connections,
        max_tenant_connections: args.max_tenant_connections,
        max_tenant_inflight_bytes: Some(args.max_tenant_inflight.unwrap_or(args.pool / 2)),
        pool_bytes: args.pool,
        region_bytes: args.region,
        granule: args.granule,
        max_page_bytes: args.max_page,
        eviction,
        lease_ms: args.lease_ms,
        alloc_ttl_ms: args.alloc_ttl_ms,
        max_batch: args.max_batch,
        populate: args.populate,
        verbs: !args.no_verbs,
        tls,
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    rt.block_on(async {
        let handle = match RdmaServer::start(opts).await {
            Ok(h) => h,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        };
        println!(
            "hicache-rdma-server listening on {} (pool {} bytes, verbs {})",
            handle.local_addr(),
            handle.info().pool_bytes,
            if handle.info().verbs { "on" } else { "off" }
        );
        let _ = tokio::signal::ctrl_c().await;
        eprintln!("shutting down");
        handle.shutdown().await;
    });
}
