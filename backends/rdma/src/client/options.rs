//! The client's extra-config fields (scope `backend rdma`), parsed strictly.

use std::time::Duration;

use hicache_storage::{CommonConfig, ConfigFields, Result, StorageError};

use crate::auth::Token;
use crate::tls::ClientTls;

/// Which data plane moves page bytes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// Page bytes travel on the TCP control connections. Always available.
    #[default]
    Tcp,
    /// One-sided RDMA READ/WRITE (feature `verbs` and an RDMA device required).
    Verbs,
}

/// Client options. Defaults are those of an empty extra-config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaOptions {
    /// `server`: the server's `host:port`. Required unless `spawn_server` is set.
    pub server: Option<String>,
    /// `spawn_server`: start an in-process server on `127.0.0.1:0` (pool = `capacity`, default
    /// 1 GiB) and connect to it over loopback TCP. For single-node tests and benches.
    pub spawn_server: bool,
    /// `spawn_populate`: pre-fault a spawned server's pool at start, as a long-running
    /// server's memory is (default false).
    pub spawn_populate: bool,
    /// `token` or `token_file`: the tenant's secret token (the file's content, surrounding
    /// whitespace trimmed). Required by every server not started with `--insecure-no-auth`;
    /// a spawned server gets a fresh random one when none is given.
    pub token: Option<Token>,
    /// `transport`: `tcp` (default) or `verbs`.
    pub transport: Transport,
    /// `connections`: connections in the pool; a batch is striped over them (default 4).
    pub connections: usize,
    /// `connect_timeout_ms`: limit of one connection attempt (default 1000).
    pub connect_timeout: Duration,
    /// `io_timeout_ms`: longest wait for any progress on a socket (default 10000).
    pub io_timeout: Duration,
    /// `retry_backoff_ms`: after a failed connection attempt, calls fail fast for this long
    /// instead of trying again (default 200; 0 disables).
    pub retry_backoff: Duration,
    /// `max_batch`: pages per call (default 256, at least 128).
    pub max_batch: usize,
    /// `stripe_bytes`: a batch is split over connections in stripes of at least this many
    /// bytes (default 2 MiB).
    pub stripe_bytes: u64,
    /// `client_name`: name sent at the handshake (default `hicache-<pid>`).
    pub client_name: String,
    /// `device`: RDMA device name for `verbs` (default: the first device).
    pub device: Option<String>,
    /// `ib_port`: RDMA port number for `verbs` (default 1).
    pub ib_port: u8,
    /// `gid_index`: GID index for RoCE (default 0).
    pub gid_index: u8,
    /// Pool size of a spawned server: the common field `capacity` (default 1 GiB).
    pub spawn_pool_bytes: u64,
    /// TLS to the server: `tls_ca_file` (turns it on), `tls_server_name`, and for a server
    /// that requires client certificates `tls_cert_file` + `tls_key_file` (see [`crate::tls`]).
    pub tls: Option<ClientTls>,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        Self {
            server: None,
            spawn_server: false,
            spawn_populate: false,
            token: None,
            transport: Transport::Tcp,
            connections: 4,
            connect_timeout: Duration::from_millis(1000),
            io_timeout: Duration::from_millis(10_000),
            retry_backoff: Duration::from_millis(200),
            max_batch: 256,
            stripe_bytes: 2 << 20,
            client_name: format!("hicache-{}", std::process::id()),
            device: None,
            ib_port: 1,
            gid_index: 0,
            spawn_pool_bytes: 1 << 30,
            tls: None,
        }
    }
}

impl RdmaOptions {
    /// Options pointing at `server` with every other field at its default (no token: only
    /// for a server started with `--insecure-no-auth`).
    pub fn new(server: impl Into<String>) -> Self {
        Self {
            server: Some(server.into()),
            ..Self::default()
        }
    }

    /// Options pointing at `server`, authenticating with `token`.
    pub fn with_token(server: impl Into<String>, token: Token) -> Self {
        Self {
            token: Some(token),
            ..Self::new(server)
        }
    }

    /// Reads the options from the common config and the backend's own fields (strict: unknown
    /// fields, wrong types and out-of-range values are errors naming the field).
    pub fn from_config(common: &CommonConfig, mut f: ConfigFields) -> Result<Self> {
        let d = Self::default();
        let server = f.opt_string("server")?;
        let spawn_server = f.bool("spawn_server", false)?;
        let spawn_populate = f.bool("spawn_populate", false)?;
        if spawn_populate && !spawn_server {
            return Err(StorageError::config(
                f.scope(),
                "spawn_populate",
                "true",
                "only applies with \"spawn_server\": true",
            ));
        }
        if let Some(s) = &server
            && !valid_host_port(s)
        {
            return Err(StorageError::config(
                f.scope(),
                "server",
                format!("\"{s}\""),
                "expected \"host:port\" (e.g. \"10.0.0.5:7470\" or \"[::1]:7470\")",
            ));
        }
        match (&server, spawn_server) {
            (None, false) => {
                return Err(StorageError::config(
                    f.scope(),
                    "server",
                    "<missing>",
                    "required: the server's \"host:port\" (or set \"spawn_server\": true)",
                ));
            }
            (Some(_), true) => {
                return Err(StorageError::config(
                    f.scope(),
                    "spawn_server",
                    "true",
                    "conflicts with `server`: give one or the other",
                ));
            }
            _ => {}
        }
        let token = match (f.opt_string("token")?, f.opt_string("token_file")?) {
            (Some(_), Some(_)) => {
                return Err(StorageError::config(
                    f.scope(),
                    "token_file",
                    "<set>",
                    "conflicts with `token`: give one or the other",
                ));
            }
            (Some(t), None) => Some(Token::new(&t, "token").map_err(|e| {
                StorageError::config(f.scope(), "token", "<redacted>", e.to_string())
            })?),
            (None, Some(p)) => Some(Token::from_file(std::path::Path::new(&p)).map_err(|e| {
                StorageError::config(f.scope(), "token_file", format!("\"{p}\""), e.to_string())
            })?),
            (None, None) => None,
        };
        let transport = match f.choice("transport", "tcp", &["tcp", "verbs"])? {
            "verbs" => Transport::Verbs,
            _ => Transport::Tcp,
        };
        let ms = |f: &mut ConfigFields, name: &'static str, def: Duration, min: u64| {
            f.u64(name, def.as_millis() as u64, min..=3_600_000)
                .map(Duration::from_millis)
        };
        let o = Self {
            server,
            spawn_server,
            spawn_populate,
            token,
            transport,
            connections: f.u64("connections", d.connections as u64, 1..=64)? as usize,
            connect_timeout: ms(&mut f, "connect_timeout_ms", d.connect_timeout, 1)?,
            io_timeout: ms(&mut f, "io_timeout_ms", d.io_timeout, 1)?,
            retry_backoff: ms(&mut f, "retry_backoff_ms", d.retry_backoff, 0)?,
            max_batch: f.u64("max_batch", d.max_batch as u64, 128..=65_536)? as usize,
            stripe_bytes: f.opt_bytes("stripe_bytes", 4096)?.unwrap_or(d.stripe_bytes),
            client_name: f.opt_string("client_name")?.unwrap_or(d.client_name),
            device: f.opt_string("device")?,
            ib_port: f.u64("ib_port", d.ib_port as u64, 1..=255)? as u8,
            gid_index: f.u64("gid_index", d.gid_index as u64, 0..=255)? as u8,
            spawn_pool_bytes: common.capacity_bytes.unwrap_or(d.spawn_pool_bytes),
            tls: Self::tls_fields(&mut f, spawn_server)?,
        };
        f.finish()?;
        Ok(o)
    }
}

impl RdmaOptions {
    /// The `tls_*` fields: `None` without `tls_ca_file`; the others need it, and
    /// `tls_cert_file` / `tls_key_file` go together.
    fn tls_fields(f: &mut ConfigFields, spawn_server: bool) -> Result<Option<ClientTls>> {
        let ca = f.opt_path("tls_ca_file")?;
        let name = f.opt_string("tls_server_name")?;
        let cert = f.opt_path("tls_cert_file")?;
        let key = f.opt_path("tls_key_file")?;
        let Some(ca_file) = ca else {
            for (field, set) in [
                ("tls_server_name", name.is_some()),
                ("tls_cert_file", cert.is_some()),
                ("tls_key_file", key.is_some()),
            ] {
                if set {
                    return Err(StorageError::config(
                        f.scope(),
                        field,
                        "<set>",
                        "only meaningful with \"tls_ca_file\" (which turns TLS on)",
                    ));
                }
            }
            return Ok(None);
        };
        if spawn_server {
            return Err(StorageError::config(
                f.scope(),
                "tls_ca_file",
                "<set>",
                "a spawned in-process server listens on loopback without TLS; TLS is for \
                 \"server\"",
            ));
        }
        let client_cert = match (cert, key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => {
                return Err(StorageError::config(
                    f.scope(),
                    "tls_key_file",
                    "<one of tls_cert_file / tls_key_file>",
                    "tls_cert_file and tls_key_file go together (a client certificate and its \
                     key)",
                ));
            }
        };
        Ok(Some(ClientTls {
            ca_file,
            server_name: name,
            client_cert,
        }))
    }
}

/// `host:port` with a non-empty host and a port number.
fn valid_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_storage::StorageConfig;

    fn parse(json: &str) -> Result<RdmaOptions> {
        let c = StorageConfig::parse(Some("rdma"), Some(json))?;
        RdmaOptions::from_config(&c.common, c.backend_fields)
    }

    #[test]
    fn defaults_and_fields() {
        let o = parse(r#"{"server": "10.0.0.5:7470"}"#).unwrap();
        assert_eq!(o.server.as_deref(), Some("10.0.0.5:7470"));
        assert_eq!(o.transport, Transport::Tcp);
        assert_eq!(o.connections, 4);
        let o = parse(
            r#"{"server": "[::1]:9", "transport": "verbs", "connections": 8, "io_timeout_ms": 50,
                "connect_timeout_ms": 20, "retry_backoff_ms": 0, "max_batch": 1024,
                "stripe_bytes": "4MiB", "client_name": "tp3", "device": "mlx5_0",
                "ib_port": 2, "gid_index": 3}"#,
        )
        .unwrap();
        assert_eq!(o.transport, Transport::Verbs);
        assert_eq!(o.connections, 8);
        assert_eq!(o.io_timeout, Duration::from_millis(50));
        assert_eq!(o.retry_backoff, Duration::ZERO);
        assert_eq!(o.stripe_bytes, 4 << 20);
        assert_eq!((o.ib_port, o.gid_index), (2, 3));
        assert_eq!(o.token, None);
        let o = parse(r#"{"server": "h:1", "token": "0123456789abcdef"}"#).unwrap();
        assert_eq!(o.token.unwrap().expose(), "0123456789abcdef");
        let o = parse(r#"{"spawn_server": true, "capacity": "64MiB"}"#).unwrap();
        assert!(o.spawn_server);
        assert_eq!(o.spawn_pool_bytes, 64 << 20);
    }

    #[test]
    fn errors_name_the_field() {
        for (json, field) in [
            (r#"{}"#, "server"),
            (r#"{"server": ""}"#, "server"),
            (r#"{"server": "nohost"}"#, "server"),
            (r#"{"server": "h:0"}"#, "server"),
            (r#"{"server": "h:70000"}"#, "server"),
            (r#"{"server": 7470}"#, "server"),
            (r#"{"server": "h:1", "spawn_server": true}"#, "spawn_server"),
            (r#"{"spawn_server": "yes"}"#, "spawn_server"),
            (
                r#"{"server": "h:1", "spawn_populate": true}"#,
                "spawn_populate",
            ),
            (r#"{"server": "h:1", "transport": "udp"}"#, "transport"),
            (r#"{"server": "h:1", "connections": 0}"#, "connections"),
            (r#"{"server": "h:1", "connections": 65}"#, "connections"),
            (r#"{"server": "h:1", "io_timeout_ms": 0}"#, "io_timeout_ms"),
            (
                r#"{"server": "h:1", "connect_timeout_ms": -1}"#,
                "connect_timeout_ms",
            ),
            (r#"{"server": "h:1", "max_batch": 64}"#, "max_batch"),
            (
                r#"{"server": "h:1", "stripe_bytes": "1kb"}"#,
                "stripe_bytes",
            ),
            (r#"{"server": "h:1", "ib_port": 0}"#, "ib_port"),
            (r#"{"server": "h:1", "gid_index": 256}"#, "gid_index"),
            (r#"{"server": "h:1", "bogus": 1}"#, "bogus"),
            (r#"{"server": "h:1", "token": "short"}"#, "token"),
            (r#"{"server": "h:1", "token": 5}"#, "token"),
            (
                r#"{"server": "h:1", "token": "0123456789abcdef", "token_file": "/x"}"#,
                "token_file",
            ),
            (
                r#"{"server": "h:1", "token_file": "/nonexistent/hicache.token"}"#,
                "token_file",
            ),
            (
                r#"{"server": "h:1", "token_file": "/dev/zero"}"#,
                "token_file",
            ),
        ] {
            let e = parse(json).expect_err(json).to_string();
            assert!(
                e.contains(&format!("`{field}`")) && e.contains("backend rdma"),
                "{json}: {e}"
            );
        }
    }
}
