//! The server's options ([`ServerOptions`], [`ServerAuth`]) and their validation.

use hicache_storage::EvictionPolicy;

use crate::auth::TenantTable;
use crate::error::{RdmaError, Result};
use crate::protocol;
use crate::tls::ServerTls;

/// Who may connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerAuth {
    /// Clients authenticate with one of these tenants' tokens and may touch only the
    /// namespaces granted to it. An empty table is refused at start.
    Tenants(TenantTable),
    /// Anyone who reaches the port may do anything (`--insecure-no-auth`). Only accepted on
    /// a loopback listen address; for tests.
    InsecureNoAuth,
}

impl Default for ServerAuth {
    /// No tenants: a server must be given credentials, or told explicitly to run insecure.
    fn default() -> Self {
        ServerAuth::Tenants(TenantTable::default())
    }
}

/// Options of a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerOptions {
    /// Address to listen on (`127.0.0.1:7470`; port 0 picks a free one).
    pub listen: String,
    /// Credentials; the default (none) is refused at start.
    pub auth: ServerAuth,
    /// Time a new connection has to complete the handshake.
    pub handshake_ms: u32,
    /// A connection that sends nothing for this long (or stalls mid-frame) is closed.
    pub idle_ms: u32,
    /// Most connections open at once; further ones are refused with [`protocol::code::BUSY`].
    pub max_connections: u32,
    /// Most connections of one tenant open at once.
    pub max_tenant_connections: u32,
    /// Most bytes one tenant may hold in flight: reserved for writes not yet committed plus
    /// pinned by reads (checked per `READ`, `LOOKUP` and `ALLOCATE` against the bytes it
    /// names; a request that would exceed it is refused with [`protocol::code::BUSY`]). `None`: no limit.
    pub max_tenant_inflight_bytes: Option<u64>,
    /// Bytes of the whole pool.
    pub pool_bytes: u64,
    /// Bytes of one region (one mapping, one RDMA registration); a page never spans two.
    pub region_bytes: u64,
    /// Allocation granule ("page class"): every page occupies a whole number of granules.
    pub granule: u64,
    /// Largest page accepted (never more than a region).
    pub max_page_bytes: u64,
    /// Eviction under capacity pressure; `None` refuses new pages when full.
    pub eviction: Option<EvictionPolicy>,
    /// Lifetime of a `LOOKUP` lease.
    pub lease_ms: u32,
    /// Lifetime of an uncommitted reservation.
    pub alloc_ttl_ms: u32,
    /// Largest list in one request.
    pub max_batch: u32,
    /// Pre-fault the regions at start (`MAP_POPULATE`).
    pub populate: bool,
    /// Register the regions for RDMA when built with `verbs` and a device is present.
    pub verbs: bool,
    /// TLS on every connection (`None`: plain TCP). See [`crate::tls`].
    pub tls: Option<ServerTls>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
            auth: ServerAuth::default(),
            handshake_ms: 5_000,
            idle_ms: 300_000,
            max_connections: 1024,
            max_tenant_connections: 256,
            max_tenant_inflight_bytes: None,
            pool_bytes: 1 << 30,
            region_bytes: 1 << 30,
            granule: 4096,
            max_page_bytes: 256 << 20,
            eviction: Some(EvictionPolicy::Lru),
            lease_ms: 10_000,
            alloc_ttl_ms: 30_000,
            max_batch: 4096,
            populate: false,
            verbs: true,
            tls: None,
        }
    }
}

impl ServerOptions {
    /// Checks the options, naming the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, why: String| Err(RdmaError::Setup(format!("{what}: {why}")));
        if self.granule == 0 || !self.granule.is_power_of_two() {
            return bad("granule", format!("{} is not a power of two", self.granule));
        }
        if self.pool_bytes < self.granule {
            return bad(
                "pool_bytes",
                format!("{} is below one granule", self.pool_bytes),
            );
        }
        if self.region_bytes < self.granule {
            return bad(
                "region_bytes",
                format!("{} is below one granule", self.region_bytes),
            );
        }
        if self.max_page_bytes == 0 {
            return bad("max_page_bytes", "must be at least 1".into());
        }
        if self.lease_ms == 0 || self.alloc_ttl_ms == 0 {
            return bad("lease_ms / alloc_ttl_ms", "must be at least 1 ms".into());
        }
        if let ServerAuth::Tenants(t) = &self.auth
            && t.is_empty()
        {
            return bad(
                "auth",
                "no credentials configured: give tenants (--tenants FILE) or a shared secret \
                 (--secret-file FILE), or explicitly --insecure-no-auth (loopback tests only)"
                    .into(),
            );
        }
        if self.handshake_ms == 0 || self.idle_ms == 0 {
            return bad("handshake_ms / idle_ms", "must be at least 1 ms".into());
        }
        if self.max_connections == 0 || self.max_tenant_connections == 0 {
            return bad(
                "max_connections / max_tenant_connections",
                "must be at least 1".into(),
            );
        }
        let regions = self
            .pool_bytes
            .div_ceil(self.region_bytes / self.granule * self.granule);
        if regions > protocol::MAX_REGIONS as u64 {
            return bad(
                "pool_bytes",
                format!(
                    "{} bytes in regions of {} bytes make {regions} regions, more than the {} \
                     the protocol can describe to clients (raise --region or lower --pool)",
                    self.pool_bytes,
                    self.region_bytes,
                    protocol::MAX_REGIONS
                ),
            );
        }
        let limits = hicache_storage::machine::MemoryLimits::of_this_process();
        if let Some((limit, which)) = limits.smallest()
            && self.pool_bytes > limit
        {
            return bad(
                "pool_bytes",
                format!(
                    "{} bytes is more than this process may hold in memory: {which} is \
                     {limit} bytes (the smallest of the machine's physical memory, the cgroup \
                     memory limit, RLIMIT_AS and RLIMIT_DATA); the pool is held in memory",
                    self.pool_bytes
                ),
            );
        }
        if self.max_batch < 128 {
            return bad(
                "max_batch",
                format!("{} is below the controller's 128", self.max_batch),
            );
        }
        Ok(())
    }

    /// Region lengths: `pool_bytes` cut into `region_bytes` pieces, rounded down to granules.
    pub(super) fn region_lens(&self) -> Vec<u64> {
        let mut left = self.pool_bytes / self.granule * self.granule;
        let per = self.region_bytes / self.granule * self.granule;
        let mut v = Vec::new();
        while left > 0 {
            let n = left.min(per);
            v.push(n);
            left -= n;
        }
        v
    }
}
