//! TLS on the TCP channel (control plane, and the data plane with `transport: "tcp"`):
//! rustls (ring provider) through tokio-rustls, optional per server and per client.
//!
//! - Server ([`ServerTls`]): a certificate chain and its private key (PEM); optionally a
//!   client CA, and then every client must present a certificate signed by it (mutual TLS).
//!   With TLS on, every connection is TLS from its first byte: a plain-TCP peer fails the TLS
//!   handshake (bounded by the handshake timeout) and never reaches the protocol.
//! - Client ([`ClientTls`]): the CA (PEM) that signed the server's certificate, the name to
//!   verify it for (default: the host of `server`), and for mutual TLS its own certificate and
//!   key.
//!
//! TLS is the channel's confidentiality and integrity; authentication of tenants and
//! authorisation of keys stay the protocol's HMAC handshake and namespace grants
//! ([`crate::auth`]), which run inside the TLS session unchanged. RDMA READ/WRITE (verbs) is
//! not encrypted by TLS (it bypasses the socket).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::error::{RdmaError, Result};

/// The read half of a connection (plain TCP or TLS).
pub type BoxRead = Box<dyn AsyncRead + Send + Unpin>;
/// The write half of a connection (plain TCP or TLS).
pub type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// Splits a stream into boxed halves.
pub(crate) fn split<S: AsyncRead + AsyncWrite + Send + 'static>(s: S) -> (BoxRead, BoxWrite) {
    let (r, w) = tokio::io::split(s);
    (Box::new(r), Box::new(w))
}

/// Splits a plain TCP stream into boxed halves (without the lock of [`split`]).
pub(crate) fn split_tcp(s: tokio::net::TcpStream) -> (BoxRead, BoxWrite) {
    let (r, w) = s.into_split();
    (Box::new(r), Box::new(w))
}

/// Server-side TLS: PEM bytes of the certificate chain, its key, and optionally the CA that
/// client certificates must chain to.
#[derive(Clone, PartialEq, Eq)]
pub struct ServerTls {
    /// The server's certificate chain (PEM, leaf first).
    pub cert_pem: Vec<u8>,
    /// The private key of the leaf certificate (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_pem: Vec<u8>,
    /// If set, clients must present a certificate signed by this CA (PEM).
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &"<redacted>")
            .field("client_ca", &self.client_ca_pem.is_some())
            .finish()
    }
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| RdmaError::Setup(format!("{what} {}: {e}", path.display())))
}

fn certs(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let v = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| RdmaError::Setup(format!("{what}: not PEM certificates: {e}")))?;
    if v.is_empty() {
        return Err(RdmaError::Setup(format!(
            "{what}: no certificate (expected PEM \"BEGIN CERTIFICATE\" blocks)"
        )));
    }
    Ok(v)
}

fn key(pem: &[u8], what: &str) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| RdmaError::Setup(format!("{what}: no usable PEM private key: {e}")))
}

fn roots(pem: &[u8], what: &str) -> Result<rustls::RootCertStore> {
    let mut store = rustls::RootCertStore::empty();
    for c in certs(pem, what)? {
        store
            .add(c)
            .map_err(|e| RdmaError::Setup(format!("{what}: unusable CA certificate: {e}")))?;
    }
    Ok(store)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl ServerTls {
    /// Reads the PEM files (the client CA only if given).
    pub fn from_files(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Self> {
        Ok(Self {
            cert_pem: read(cert, "TLS certificate")?,
            key_pem: read(key, "TLS key")?,
            client_ca_pem: client_ca.map(|p| read(p, "TLS client CA")).transpose()?,
        })
    }

    /// Builds the acceptor; errors name the piece that is wrong.
    #[cfg(feature = "server")]
    pub(crate) fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor> {
        let chain = certs(&self.cert_pem, "TLS certificate")?;
        let key = key(&self.key_pem, "TLS key")?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| RdmaError::Setup(format!("TLS: {e}")))?;
        let builder = match &self.client_ca_pem {
            Some(ca) => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots(ca, "TLS client CA")?),
                    provider(),
                )
                .build()
                .map_err(|e| RdmaError::Setup(format!("TLS client CA: {e}")))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let config = builder.with_single_cert(chain, key).map_err(|e| {
            RdmaError::Setup(format!("TLS certificate and key do not go together: {e}"))
        })?;
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

/// Client-side TLS: where the trusted CA is, the name to verify, and an optional client
/// certificate (mutual TLS).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// `tls_ca_file`: PEM file of the CA that signed the server's certificate.
    pub ca_file: PathBuf,
    /// `tls_server_name`: the name (DNS name or IP address) the server's certificate must be
    /// valid for (default: the host part of `server`).
    pub server_name: Option<String>,
    /// `tls_cert_file` + `tls_key_file`: this client's certificate chain and key (PEM), for a
    /// server that requires client certificates.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

/// A ready client TLS configuration: connector plus the name to verify.
#[derive(Clone)]
pub struct TlsClient {
    connector: tokio_rustls::TlsConnector,
    name: ServerName<'static>,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient")
            .field("name", &self.name)
            .finish()
    }
}

impl TlsClient {
    /// Builds the connector for a server at `addr` (`host:port`).
    pub fn new(tls: &ClientTls, addr: &str) -> Result<Self> {
        let ca = read(&tls.ca_file, "tls_ca_file")?;
        let roots = roots(&ca, "tls_ca_file")?;
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| RdmaError::Setup(format!("TLS: {e}")))?
            .with_root_certificates(roots);
        let config = match &tls.client_cert {
            Some((cert, key_file)) => {
                let chain = certs(&read(cert, "tls_cert_file")?, "tls_cert_file")?;
                let key = key(&read(key_file, "tls_key_file")?, "tls_key_file")?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| RdmaError::Setup(format!("tls_cert_file / tls_key_file: {e}")))?
            }
            None => builder.with_no_client_auth(),
        };
        let host = match &tls.server_name {
            Some(n) => n.clone(),
            None => host_of(addr).to_string(),
        };
        let name = ServerName::try_from(host.clone()).map_err(|e| {
            RdmaError::Setup(format!(
                "TLS server name {host:?} is neither a DNS name nor an IP address: {e}"
            ))
        })?;
        Ok(Self {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            name,
        })
    }

    /// Runs the TLS handshake on `tcp`.
    pub(crate) async fn connect(
        &self,
        tcp: tokio::net::TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        self.connector.connect(self.name.clone(), tcp).await
    }
}

/// The host of `host:port` (brackets of an IPv6 literal removed).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn host_of_strips_port_and_brackets() {
        assert_eq!(host_of("10.0.0.5:7470"), "10.0.0.5");
        assert_eq!(host_of("[::1]:7470"), "::1");
        assert_eq!(host_of("pool.example:1"), "pool.example");
    }
}
