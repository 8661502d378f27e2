//! Who may talk to a server and which namespaces they may touch.
//!
//! # Handshake
//!
//! 1. The client sends `HELLO` with a fresh 32-byte nonce of its own.
//! 2. The server answers with a fresh 32-byte nonce and whether it requires credentials.
//! 3. The client sends `AUTH` with `HMAC-SHA256(token, CLIENT_LABEL ‖ client nonce ‖ server
//!    nonce)` ([`client_mac`]).
//! 4. The server looks for the tenant whose token gives that MAC (constant-time compare
//!    against every tenant; tokens are unique), and answers with its
//!    [`ServerInfo`](crate::protocol::ServerInfo) and its own proof,
//!    `HMAC-SHA256(token, SERVER_LABEL ‖ client nonce ‖ server nonce)` ([`server_proof`]),
//!    which the client checks before trusting the server. A failure is an `ERROR` frame with
//!    [`code::AUTH`](crate::protocol::code::AUTH) and the connection closes.
//!
//! The token never crosses the wire; both nonces are fresh per connection, so a recorded MAC
//! is useless on another connection. Without TLS the bytes that follow the handshake are
//! neither encrypted nor integrity-protected (see the crate README's threat model).
//!
//! # Authorization
//!
//! Each tenant's token is bound to a [`Grant`]: the namespace ids it may use, or every
//! namespace. The server checks the namespace of every key of every request against the
//! connection's grant before touching the index.

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;

use hicache_core::NamespaceId;
use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::Sha256;

use crate::error::{RdmaError, Result};

pub use crate::protocol::{MAC_LEN, NONCE_LEN};
/// Shortest token accepted (characters): 16 random characters are about 95 bits.
pub const MIN_TOKEN_LEN: usize = 16;
/// Largest token or tenant file read (a FIFO or `/dev/zero` cannot make a reader loop).
pub const MAX_FILE_BYTES: u64 = 1 << 20;

const CLIENT_LABEL: &[u8] = b"hicache-rdma v2 client auth\0";
const SERVER_LABEL: &[u8] = b"hicache-rdma v2 server auth\0";

/// A secret token. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// A token from its text; refused if shorter than [`MIN_TOKEN_LEN`] characters or
    /// containing whitespace or control characters. `what` names it in the error.
    pub fn new(text: &str, what: &str) -> Result<Self> {
        if text.chars().count() < MIN_TOKEN_LEN {
            return Err(RdmaError::Setup(format!(
                "{what}: a token needs at least {MIN_TOKEN_LEN} characters, this one has {}",
                text.chars().count()
            )));
        }
        if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(RdmaError::Setup(format!(
                "{what}: a token may not contain whitespace or control characters"
            )));
        }
        Ok(Self(text.to_string()))
    }

    /// Reads a token from `path` (surrounding whitespace, e.g. the final newline, trimmed).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = read_small(path)?;
        Self::new(text.trim(), &format!("token file {}", path.display()))
    }

    /// A fresh random token (64 hex characters), e.g. for a server spawned in-process.
    pub fn random() -> Result<Self> {
        Ok(Self(hex_of(&random_bytes::<32>()?)))
    }

    /// The token's text (to pass to a client in-process).
    pub fn expose(&self) -> &str {
        &self.0
    }

    fn mac(&self, label: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(self.0.as_bytes())
            .expect("HMAC accepts keys of any length");
        m.update(label);
        m.update(client_nonce);
        m.update(server_nonce);
        m
    }
}

/// The client's MAC of step 3.
pub fn client_mac(token: &Token, client_nonce: &[u8], server_nonce: &[u8]) -> [u8; MAC_LEN] {
    token
        .mac(CLIENT_LABEL, client_nonce, server_nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// The server's proof of step 4.
pub fn server_proof(token: &Token, client_nonce: &[u8], server_nonce: &[u8]) -> [u8; MAC_LEN] {
    token
        .mac(SERVER_LABEL, client_nonce, server_nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `proof` is the server's proof for `token` (constant time).
pub fn verify_server_proof(
    token: &Token,
    client_nonce: &[u8],
    server_nonce: &[u8],
    proof: &[u8],
) -> bool {
    token
        .mac(SERVER_LABEL, client_nonce, server_nonce)
        .verify_slice(proof)
        .is_ok()
}

/// `N` bytes from the operating system's CSPRNG.
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| RdmaError::Setup(format!("random bytes from the OS: {e}")))?;
    Ok(b)
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Reads at most [`MAX_FILE_BYTES`] of a regular file as UTF-8 (warning when others may read
/// it: these files hold secrets).
fn read_small(path: &Path) -> Result<String> {
    let bad = |why: String| RdmaError::Setup(format!("{}: {why}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                "{} holds secrets but is readable or writable by group or others (mode {mode:o}); \
                 chmod 600 it",
                path.display()
            );
        }
    }
    let mut buf = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut buf))
        .map_err(|e| bad(e.to_string()))?;
    if buf.len() as u64 > MAX_FILE_BYTES {
        return Err(bad(format!("larger than {MAX_FILE_BYTES} bytes")));
    }
    String::from_utf8(buf).map_err(|_| bad("not UTF-8 text".into()))
}

/// The namespaces a tenant may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Grant {
    /// Every namespace (a shared secret, or an operator's token).
    Any,
    /// Only these.
    Only(HashSet<NamespaceId>),
}

impl Grant {
    /// Whether keys of `ns` may be read, written or deleted.
    pub fn allows(&self, ns: &NamespaceId) -> bool {
        match self {
            Grant::Any => true,
            Grant::Only(set) => set.contains(ns),
        }
    }
}

/// One tenant: a name for logs and limits, a token, a grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    /// Name (unique in its table).
    pub name: String,
    /// Secret token (unique in its table).
    pub token: Token,
    /// What it may touch.
    pub grant: Grant,
}

/// The server's credentials: every tenant it lets in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantTable {
    tenants: Vec<Tenant>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTable {
    tenants: Vec<FileTenant>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTenant {
    name: String,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    token_file: Option<std::path::PathBuf>,
    namespaces: FileNamespaces,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FileNamespaces {
    Any(String),
    List(Vec<String>),
}

impl TenantTable {
    /// A table of `tenants`; refused if a name or a token repeats.
    pub fn new(tenants: Vec<Tenant>) -> Result<Self> {
        for (i, t) in tenants.iter().enumerate() {
            if t.name.is_empty() || t.name.len() > 128 {
                return Err(RdmaError::Setup(format!(
                    "tenant {i}: a name of 1 to 128 bytes is required"
                )));
            }
            for u in &tenants[..i] {
                if u.name == t.name {
                    return Err(RdmaError::Setup(format!(
                        "tenant {:?} is listed twice",
                        t.name
                    )));
                }
                if u.token == t.token {
                    return Err(RdmaError::Setup(format!(
                        "tenants {:?} and {:?} have the same token: every tenant needs its own",
                        u.name, t.name
                    )));
                }
            }
        }
        Ok(Self { tenants })
    }

    /// One tenant, `shared`, allowed every namespace: the shared-secret mode.
    pub fn shared(token: Token) -> Self {
        Self {
            tenants: vec![Tenant {
                name: "shared".into(),
                token,
                grant: Grant::Any,
            }],
        }
    }

    /// Reads a tenant file (JSON):
    ///
    /// ```json
    /// {"tenants": [
    ///   {"name": "team-a", "token_file": "/etc/hicache/team-a.token",
    ///    "namespaces": ["00112233445566778899aabbccddeeff"]},
    ///   {"name": "ops", "token": "a-long-random-secret", "namespaces": "*"}
    /// ]}
    /// ```
    ///
    /// `namespaces` is a list of 32-hex-digit namespace ids or `"*"` (every namespace).
    /// A relative `token_file` is relative to the tenant file's directory.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = read_small(path)?;
        let bad = |why: String| RdmaError::Setup(format!("tenant file {}: {why}", path.display()));
        let file: FileTable = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if file.tenants.is_empty() {
            return Err(bad("lists no tenants".into()));
        }
        let mut tenants = Vec::with_capacity(file.tenants.len());
        for t in file.tenants {
            let what = format!("tenant file {}, tenant {:?}", path.display(), t.name);
            let token = match (t.token, t.token_file) {
                (Some(s), None) => Token::new(&s, &what)?,
                (None, Some(f)) => {
                    let f = match path.parent() {
                        Some(dir) if f.is_relative() => dir.join(f),
                        _ => f,
                    };
                    Token::from_file(&f)?
                }
                _ => {
                    return Err(RdmaError::Setup(format!(
                        "{what}: give exactly one of `token` and `token_file`"
                    )));
                }
            };
            let grant = match t.namespaces {
                FileNamespaces::Any(s) if s == "*" => Grant::Any,
                FileNamespaces::Any(s) => {
                    return Err(RdmaError::Setup(format!(
                        "{what}: `namespaces` is {s:?}; expected \"*\" or a list of namespace ids"
                    )));
                }
                FileNamespaces::List(v) => {
                    let mut set = HashSet::new();
                    for s in v {
                        let ns = NamespaceId::from_hex(&s)
                            .map_err(|e| RdmaError::Setup(format!("{what}: {e}")))?;
                        set.insert(ns);
                    }
                    if set.is_empty() {
                        return Err(RdmaError::Setup(format!(
                            "{what}: `namespaces` is empty (the tenant could do nothing)"
                        )));
                    }
                    Grant::Only(set)
                }
            };
            tenants.push(Tenant {
                name: t.name,
                token,
                grant,
            });
        }
        Self::new(tenants)
    }

    /// Whether no tenant is configured.
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    /// The tenants.
    pub fn tenants(&self) -> &[Tenant] {
        &self.tenants
    }

    /// The tenant whose token gives `mac` over the nonces. Every tenant's MAC is computed and
    /// compared in constant time, so the time taken says nothing about which one (or how
    /// much of one) matched.
    pub fn authenticate(
        &self,
        client_nonce: &[u8],
        server_nonce: &[u8],
        mac: &[u8],
    ) -> Option<&Tenant> {
        let mut found = None;
        for t in &self.tenants {
            let ok = t
                .token
                .mac(CLIENT_LABEL, client_nonce, server_nonce)
                .verify_slice(mac)
                .is_ok();
            if ok && found.is_none() {
                found = Some(t);
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(s: &str) -> Token {
        Token::new(s, "test").unwrap()
    }

    #[test]
    fn macs_bind_token_and_both_nonces() {
        let t = tok("0123456789abcdef-a");
        let (c, s) = ([1u8; 32], [2u8; 32]);
        let m = client_mac(&t, &c, &s);
        let table = TenantTable::new(vec![
            Tenant {
                name: "b".into(),
                token: tok("0123456789abcdef-b"),
                grant: Grant::Any,
            },
            Tenant {
                name: "a".into(),
                token: t.clone(),
                grant: Grant::Any,
            },
        ])
        .unwrap();
        assert_eq!(table.authenticate(&c, &s, &m).unwrap().name, "a");
        assert!(
            table.authenticate(&c, &[3u8; 32], &m).is_none(),
            "other nonce"
        );
        assert!(
            table.authenticate(&[3u8; 32], &s, &m).is_none(),
            "other nonce"
        );
        assert!(table.authenticate(&c, &s, &m[..31]).is_none(), "short mac");
        assert!(table.authenticate(&c, &s, &[0u8; 32]).is_none());
        let p = server_proof(&t, &c, &s);
        assert_ne!(p, m, "the two directions differ");
        assert!(verify_server_proof(&t, &c, &s, &p));
        assert!(!verify_server_proof(&tok("0123456789abcdef-b"), &c, &s, &p));
    }

    #[test]
    fn tokens_and_tables_are_checked() {
        assert!(Token::new("short", "x").is_err());
        assert!(Token::new("has a space in the middle", "x").is_err());
        assert!(format!("{:?}", tok("0123456789abcdef")).contains("redacted"));
        let t = |n: &str, k: &str| Tenant {
            name: n.into(),
            token: tok(k),
            grant: Grant::Any,
        };
        assert!(
            TenantTable::new(vec![t("a", "0123456789abcdef"), t("a", "0123456789abcdeg")]).is_err()
        );
        assert!(
            TenantTable::new(vec![t("a", "0123456789abcdef"), t("b", "0123456789abcdef")]).is_err()
        );
        assert_ne!(Token::random().unwrap(), Token::random().unwrap());
    }

    #[test]
    fn tenant_files() {
        let dir = std::env::temp_dir().join(format!("hicache-rdma-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("b.token"), "bbbbbbbbbbbbbbbbbbbb\n").unwrap();
        let ns = "00112233445566778899aabbccddeeff";
        let f = dir.join("tenants.json");
        std::fs::write(
            &f,
            format!(
                r#"{{"tenants": [
                  {{"name": "a", "token": "aaaaaaaaaaaaaaaaaaaa", "namespaces": ["{ns}"]}},
                  {{"name": "b", "token_file": "b.token", "namespaces": "*"}}]}}"#
            ),
        )
        .unwrap();
        let table = TenantTable::from_file(&f).unwrap();
        assert_eq!(table.tenants().len(), 2);
        let a = &table.tenants()[0];
        assert!(a.grant.allows(&NamespaceId::from_hex(ns).unwrap()));
        assert!(!a.grant.allows(&NamespaceId([0; 16])));
        assert_eq!(table.tenants()[1].token, tok("bbbbbbbbbbbbbbbbbbbb"));
        assert_eq!(table.tenants()[1].grant, Grant::Any);
        for (body, needle) in [
            (r#"{"tenants": []}"#, "no tenants"),
            (
                r#"{"tenants": [{"name": "a", "namespaces": "*"}]}"#,
                "exactly one",
            ),
            (
                r#"{"tenants": [{"name": "a", "token": "aaaaaaaaaaaaaaaaaaaa", "namespaces": "all"}]}"#,
                "namespaces",
            ),
            (
                r#"{"tenants": [{"name": "a", "token": "aaaaaaaaaaaaaaaaaaaa", "namespaces": ["zz"]}]}"#,
                "namespace id",
            ),
            (
                r#"{"tenants": [{"name": "a", "token": "aaaaaaaaaaaaaaaaaaaa", "namespaces": []}]}"#,
                "empty",
            ),
            (r#"{"tenants": [], "extra": 1}"#, "unknown field"),
        ] {
            std::fs::write(&f, body).unwrap();
            let e = TenantTable::from_file(&f).unwrap_err().to_string();
            assert!(
                e.contains(needle) && e.contains("tenants.json"),
                "{body}: {e}"
            );
        }
        assert!(TenantTable::from_file(&dir).is_err(), "a directory");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
