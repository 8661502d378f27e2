//! The backend's extra-config fields ([`RedisOptions`]), parsed strictly.

use std::path::PathBuf;
use std::time::Duration;

use hicache_storage::{ConfigFields, Result, StorageError};

/// Default key prefix.
pub const DEFAULT_KEY_PREFIX: &str = "hicache:";

/// How the backend reaches and uses the cluster. Every field has an extra-config field of the
/// same name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    /// Seed addresses, `host:port`; the first one that answers gives the slot map.
    pub nodes: Vec<String>,
    /// `true` (default): a Redis / Valkey Cluster; `false`: one standalone server (the first
    /// seed). A mismatch with what the server is fails at open.
    pub cluster: bool,
    /// ACL user name (`AUTH username password`); `None` with a password: the `default` user.
    pub username: Option<String>,
    /// Password (ACL or `requirepass`).
    pub password: Option<String>,
    /// TLS (rustls) on every connection.
    pub tls: bool,
    /// PEM file of the CA that signed the servers' certificates; `None`: the system roots.
    pub tls_ca_file: Option<PathBuf>,
    /// Prefix of every key this backend writes. Braces are refused: a hash tag would pin pages
    /// to one shard.
    pub key_prefix: String,
    /// Expiry of stored pages in seconds; `None`: pages live until the cluster evicts them.
    pub ttl_s: Option<u64>,
    /// `0`: acknowledge a set once the primary has it (asynchronous replication); `n ≥ 1`:
    /// only after `WAIT n` confirmed that `n` replicas have it.
    pub min_replicas_acked: u32,
    /// Budget of one call: everything the call does (connecting, redirections, slot-map
    /// re-reads, retries and their pauses, `WAIT`, each `SCAN` round of `clear`) ends within
    /// it ([`Budget`](crate::deadline::Budget)); open, all seeds together, too.
    pub timeout: Duration,
    /// Bytes of page values in flight at once over all shards and calls.
    pub max_inflight_bytes: u64,
    /// A page value longer than this is read as `GETRANGE`s of at most this many bytes in
    /// one `MULTI` / `EXEC` (atomic: one version of the value) instead of one `GET`
    /// ([`exec`](crate::exec)); `0`: always `GET`. Redis copies a `GET` reply into one
    /// buffer of the value's size, which from 8 MiB on (jemalloc's `oversize_threshold`) is
    /// fresh memory every time: page faults, zeroing and a purge per read took two thirds
    /// of the server's time for 8 MiB pages. Uses `MULTI`, `EXEC`, `STRLEN`, `GETRANGE`:
    /// where the ACL user may not run one of them (`NOPERM`, e.g. `+@read +@write` without
    /// `+@transaction`), the first refusal turns ranged reads off for the rest of the
    /// backend's life (one warning) and the page is read again with one `GET`, so the
    /// caller sees a normal hit; `0` reads with `GET` from the start, without the warning.
    pub read_chunk_bytes: u64,
    /// Most keys per node the client-side presence cache of `batch_exists` holds
    /// ([`presence`](crate::presence)); `0` (default): no cache, every `batch_exists` asks
    /// the servers. Needs `CLIENT` and `SUBSCRIBE` (channel `__redis__:invalidate`) for the
    /// ACL user; without them the cache turns itself off at its first refusal (one warning).
    pub presence_cache_keys: u64,
}

/// Largest [`RedisOptions::presence_cache_keys`].
pub const MAX_PRESENCE_CACHE_KEYS: u64 = 1 << 26;

/// Default of [`RedisOptions::read_chunk_bytes`].
pub const DEFAULT_READ_CHUNK: u64 = 1 << 20;

/// Smallest [`RedisOptions::read_chunk_bytes`] other than `0`: the first range holds the
/// whole value header.
pub const MIN_READ_CHUNK: u64 = 4096;

impl RedisOptions {
    /// Options for `nodes` with every other field at its default.
    pub fn new(nodes: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            nodes: nodes.into_iter().map(Into::into).collect(),
            cluster: true,
            username: None,
            password: None,
            tls: false,
            tls_ca_file: None,
            key_prefix: DEFAULT_KEY_PREFIX.to_string(),
            ttl_s: None,
            min_replicas_acked: 0,
            timeout: Duration::from_millis(10_000),
            max_inflight_bytes: 256 << 20,
            read_chunk_bytes: DEFAULT_READ_CHUNK,
            presence_cache_keys: 0,
        }
    }

    /// Reads the backend's fields and refuses unknown ones.
    pub fn from_fields(mut f: ConfigFields) -> Result<Self> {
        let nodes = match f.opt_value("nodes") {
            None => {
                return Err(StorageError::config(
                    f.scope(),
                    "nodes",
                    "<missing>",
                    "required field: seed addresses, e.g. [\"10.0.0.1:6379\"]",
                ));
            }
            Some(serde_json::Value::String(s)) => vec![s],
            Some(serde_json::Value::Array(a)) => {
                let mut v = Vec::with_capacity(a.len());
                for item in &a {
                    match item.as_str() {
                        Some(s) => v.push(s.to_string()),
                        None => {
                            return Err(f.error(
                                "nodes",
                                &serde_json::Value::Array(a.clone()),
                                "expected strings \"host:port\"",
                            ));
                        }
                    }
                }
                v
            }
            Some(other) => {
                return Err(f.error("nodes", &other, "expected a list of \"host:port\""));
            }
        };
        let mut o = Self::new(nodes);
        for n in &o.nodes {
            if split_addr(n).is_none() {
                return Err(StorageError::config(
                    f.scope(),
                    "nodes",
                    format!("{n:?}"),
                    "expected \"host:port\" with a port between 1 and 65535",
                ));
            }
        }
        if o.nodes.is_empty() {
            return Err(StorageError::config(
                f.scope(),
                "nodes",
                "[]",
                "at least one seed address is required",
            ));
        }
        o.cluster = f.bool("cluster", true)?;
        o.username = f.opt_string("username")?;
        o.password = f.opt_string("password")?;
        if o.username.is_some() && o.password.is_none() {
            return Err(StorageError::config(
                f.scope(),
                "password",
                "<missing>",
                "`username` needs a `password`",
            ));
        }
        o.tls = f.bool("tls", false)?;
        o.tls_ca_file = f.opt_path("tls_ca_file")?;
        if o.tls_ca_file.is_some() && !o.tls {
            return Err(StorageError::config(
                f.scope(),
                "tls_ca_file",
                "<set>",
                "only meaningful with \"tls\": true",
            ));
        }
        if let Some(p) = f.opt_value("key_prefix") {
            let s = p.as_str().unwrap_or_default();
            if !p.is_string() || s.contains(['{', '}']) {
                return Err(f.error("key_prefix", &p, "expected a string without braces (a hash tag would pin every page to one shard)"));
            }
            o.key_prefix = s.to_string();
        }
        o.ttl_s = f.opt_u64("ttl_s", 1..=u32::MAX as u64)?;
        o.min_replicas_acked = f.u64("min_replicas_acked", 0, 0..=64)? as u32;
        o.timeout = Duration::from_millis(f.u64("timeout_ms", 10_000, 10..=3_600_000)?);
        o.max_inflight_bytes = f
            .opt_bytes("max_inflight_bytes", 1 << 20)?
            .unwrap_or(256 << 20);
        // The in-flight budget is page bytes held in memory at once.
        hicache_storage::machine::check_memory_size(
            f.scope(),
            "max_inflight_bytes",
            o.max_inflight_bytes,
        )?;
        o.read_chunk_bytes = f
            .opt_bytes("read_chunk_bytes", 0)?
            .unwrap_or(DEFAULT_READ_CHUNK);
        if o.read_chunk_bytes != 0 && o.read_chunk_bytes < MIN_READ_CHUNK {
            return Err(StorageError::config(
                f.scope(),
                "read_chunk_bytes",
                o.read_chunk_bytes.to_string(),
                format!("0 (always GET) or at least {MIN_READ_CHUNK} bytes"),
            ));
        }
        o.presence_cache_keys = f.u64("presence_cache_keys", 0, 0..=MAX_PRESENCE_CACHE_KEYS)?;
        f.finish()?;
        Ok(o)
    }
}

/// Splits `host:port` (IPv6 as `[::1]:port`).
pub fn split_addr(addr: &str) -> Option<(String, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return None;
    }
    Some((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> Result<RedisOptions> {
        let serde_json::Value::Object(m) = v else {
            panic!()
        };
        RedisOptions::from_fields(ConfigFields::new("backend redis", m))
    }

    #[test]
    fn fields_parse_and_bad_ones_name_themselves() {
        let o = parse(json!({"nodes": ["127.0.0.1:7000", "[::1]:7001"], "min_replicas_acked": 1, "ttl_s": 60, "timeout_ms": 500, "max_inflight_bytes": "64MiB", "key_prefix": "fleet:", "username": "u", "password": "p", "read_chunk_bytes": "1MiB"})).unwrap();
        assert_eq!(o.read_chunk_bytes, 1 << 20);
        assert_eq!(o.presence_cache_keys, 0);
        let cached = parse(json!({"nodes": ["h:1"], "presence_cache_keys": 4096})).unwrap();
        assert_eq!(cached.presence_cache_keys, 4096);
        for bad in [json!(-1), json!("many"), json!(MAX_PRESENCE_CACHE_KEYS + 1)] {
            let e = parse(json!({"nodes": ["h:1"], "presence_cache_keys": bad})).unwrap_err();
            assert!(e.to_string().contains("presence_cache_keys"), "{e}");
        }
        let plain = parse(json!({"nodes": ["h:1"], "read_chunk_bytes": 0})).unwrap();
        assert_eq!(plain.read_chunk_bytes, 0);
        assert_eq!(
            parse(json!({"nodes": ["h:1"]})).unwrap().read_chunk_bytes,
            DEFAULT_READ_CHUNK
        );
        assert_eq!(o.nodes.len(), 2);
        assert_eq!(o.min_replicas_acked, 1);
        assert_eq!(o.ttl_s, Some(60));
        assert_eq!(o.timeout, Duration::from_millis(500));
        assert_eq!(o.max_inflight_bytes, 64 << 20);
        assert_eq!(split_addr("[::1]:7001"), Some(("::1".into(), 7001)));
        for (bad, field) in [
            (json!({}), "nodes"),
            (json!({"nodes": []}), "nodes"),
            (json!({"nodes": ["nohost"]}), "nodes"),
            (json!({"nodes": [7000]}), "nodes"),
            (
                json!({"nodes": ["h:1"], "key_prefix": "{tag}"}),
                "key_prefix",
            ),
            (json!({"nodes": ["h:1"], "username": "u"}), "password"),
            (
                json!({"nodes": ["h:1"], "min_replicas_acked": -1}),
                "min_replicas_acked",
            ),
            (
                json!({"nodes": ["h:1"], "tls_ca_file": "/x"}),
                "tls_ca_file",
            ),
            (json!({"nodes": ["h:1"], "bogus": 1}), "bogus"),
            (
                json!({"nodes": ["h:1"], "read_chunk_bytes": 100}),
                "read_chunk_bytes",
            ),
            (
                json!({"nodes": ["h:1"], "max_inflight_bytes": "100000tb"}),
                "physical memory",
            ),
        ] {
            let e = parse(bad.clone()).unwrap_err().to_string();
            assert!(e.contains(field), "{bad}: {e}");
        }
    }
}
