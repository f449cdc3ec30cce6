//! Mutual TLS for the gateway's gRPC endpoints: the server accepts only clients whose
//! certificate chains to the configured CA, and clients present their member or worker
//! certificate.
//!
//! Two ways to serve, both with mandatory client certificates:
//!
//! * [`ServerTls::incoming`] (recommended): our own TLS 1.3-only acceptor; pass the
//!   stream to `tonic::transport::Server::builder()...serve_with_incoming(..)` and do
//!   **not** also set `.tls_config(..)` (that would wrap TLS in TLS).
//! * [`ServerTls::tonic_config`] / [`server_tls_config`]: tonic's own `ServerTlsConfig`
//!   (`client_ca_root`, client auth mandatory). tonic picks rustls' default protocol
//!   versions, which include TLS 1.2 whenever rustls' `tls12` feature is on anywhere in
//!   the build (it is, via sqlx/reqwest), so it cannot promise TLS 1.3 only.
//!
//! Either way `Request::peer_certs()` returns the verified chain, which
//! [`crate::identity`] turns into a member or worker identity.
//!
//! Loading checks everything up front — file readable, PEM present, key matches
//! certificate, CA usable as a trust anchor — and names the file at fault.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::server::TlsStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_stream::Stream;
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig, Uri,
};

use crate::certs::PkiLayout;
use crate::coalesce::Coalesced;
use crate::identity::Role;

/// How long a client may take to complete the TLS handshake before it is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; accepting pauses beyond this (backpressure against
/// connection floods).
const MAX_CONCURRENT_HANDSHAKES: usize = 1024;

/// Installs rustls' ring provider as the process default. tonic's own TLS (client
/// side and `ServerTlsConfig`) asks rustls for the process default, which panics when
/// both ring and aws-lc-rs are compiled in (deltalake pulls in the latter) and none
/// was installed. Call first thing in `main` and in tests; repeated calls are harmless.
pub fn install_default_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// PEM file paths of one TLS identity plus the CA that peers must chain to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsPaths {
    /// CA certificate(s) (PEM) that the peer's certificate must chain to.
    pub ca: PathBuf,
    /// Own certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// Own private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

impl TlsPaths {
    /// The gateway server's files in a dev PKI (see [`crate::certs`]).
    pub fn server(layout: &PkiLayout) -> Self {
        let server = layout.server();
        TlsPaths {
            ca: layout.ca().cert,
            cert: server.cert,
            key: server.key,
        }
    }

    /// A member's or worker's client files in a dev PKI.
    pub fn client(layout: &PkiLayout, role: Role, id: &str) -> Self {
        let pair = layout.client(role, id);
        TlsPaths {
            ca: layout.ca().cert,
            cert: pair.cert,
            key: pair.key,
        }
    }
}

/// Which of the three files a [`TlsError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsFile {
    /// The CA certificate file.
    Ca,
    /// The own certificate file.
    Cert,
    /// The private key file.
    Key,
}

impl std::fmt::Display for TlsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TlsFile::Ca => "CA certificate",
            TlsFile::Cert => "certificate",
            TlsFile::Key => "private key",
        })
    }
}

/// Why TLS material could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("cannot read {file} file {path}: {source}")]
    Read {
        /// Which file.
        file: TlsFile,
        /// Its path.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// The file is not PEM of the expected kind.
    #[error("{file} file {path} is not usable: {reason}")]
    Pem {
        /// Which file.
        file: TlsFile,
        /// Its path.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// The CA file holds a certificate that cannot be a trust anchor.
    #[error(
        "CA certificate file {path}: certificate #{index} is not a usable trust anchor: {source}"
    )]
    TrustAnchor {
        /// Its path.
        path: PathBuf,
        /// 1-based position in the file.
        index: usize,
        /// Why.
        source: rustls::Error,
    },
    /// Building the rustls configuration failed — typically the key does not belong
    /// to the certificate, or the key type is unsupported.
    #[error("certificate {cert} with key {key} rejected: {source}")]
    Identity {
        /// Certificate path.
        cert: PathBuf,
        /// Key path.
        key: PathBuf,
        /// Why.
        source: rustls::Error,
    },
    /// The suite needs an identity that was not given.
    #[error("--tls-suite {suite} needs {which} server certificate, key and CA")]
    MissingIdentity {
        /// The suite asked for.
        suite: TlsSuite,
        /// `a standard` or `an SM2`.
        which: &'static str,
    },
    /// The client-certificate verifier could not be built from the CA file.
    #[error("CA certificate file {path} cannot verify client certificates: {source}")]
    Verifier {
        /// CA path.
        path: PathBuf,
        /// Why.
        source: rustls::server::VerifierBuilderError,
    },
}

/// The three files, read and parsed.
#[derive(Debug)]
struct Material {
    paths: TlsPaths,
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    roots: RootCertStore,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Material {
    fn load(paths: &TlsPaths) -> Result<Self, TlsError> {
        let read = |file: TlsFile, path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                file,
                path: path.to_owned(),
                source,
            })
        };
        let ca_pem = read(TlsFile::Ca, &paths.ca)?;
        let cert_pem = read(TlsFile::Cert, &paths.cert)?;
        let key_pem = read(TlsFile::Key, &paths.key)?;

        let ca_certs = parse_certs(TlsFile::Ca, &paths.ca, &ca_pem)?;
        let mut roots = RootCertStore::empty();
        for (i, cert) in ca_certs.into_iter().enumerate() {
            roots.add(cert).map_err(|source| TlsError::TrustAnchor {
                path: paths.ca.clone(),
                index: i + 1,
                source,
            })?;
        }
        let chain = parse_certs(TlsFile::Cert, &paths.cert, &cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
            file: TlsFile::Key,
            path: paths.key.clone(),
            reason: match e {
                rustls::pki_types::pem::Error::NoItemsFound => {
                    "no PRIVATE KEY block (PKCS#8, RSA or EC) found".to_owned()
                }
                other => other.to_string(),
            },
        })?;
        Ok(Material {
            paths: paths.clone(),
            ca_pem,
            cert_pem,
            key_pem,
            roots,
            chain,
            key,
        })
    }

    fn identity_error(&self, source: rustls::Error) -> TlsError {
        TlsError::Identity {
            cert: self.paths.cert.clone(),
            key: self.paths.key.clone(),
            source,
        }
    }
}

fn parse_certs(
    file: TlsFile,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_err = |reason: String| TlsError::Pem {
        file,
        path: path.to_owned(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem_err("no CERTIFICATE block found".into()));
    }
    Ok(certs)
}

fn ring_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The TLS 1.3 suites a connection offers: the standard ones (AES-GCM and ChaCha20 with
/// X25519/P-256 and ECDSA/RSA certificates), the ShangMi ones of RFC 8998
/// (`TLS_SM4_GCM_SM3` with curveSM2 and SM2 certificates, [`aether_gmtls`]), or both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TlsSuite {
    #[default]
    Standard,
    Gm,
    Both,
}

impl TlsSuite {
    pub const NAMES: [&'static str; 3] = ["standard", "gm", "both"];

    pub fn name(self) -> &'static str {
        match self {
            TlsSuite::Standard => "standard",
            TlsSuite::Gm => "gm",
            TlsSuite::Both => "both",
        }
    }

    fn provider(self) -> Arc<rustls::crypto::CryptoProvider> {
        match self {
            TlsSuite::Standard => ring_provider(),
            TlsSuite::Gm => Arc::new(aether_gmtls::gm_provider()),
            TlsSuite::Both => Arc::new(aether_gmtls::combined_provider(
                rustls::crypto::ring::default_provider(),
            )),
        }
    }

    /// Which development PKIs a party of this suite uses: the ECDSA one, the SM2 one or
    /// both ([`crate::certs::KeyAlgorithm`]).
    pub fn algorithms(self) -> &'static [crate::certs::KeyAlgorithm] {
        use crate::certs::KeyAlgorithm::{EcdsaP256, Sm2};
        match self {
            TlsSuite::Standard => &[EcdsaP256],
            TlsSuite::Gm => &[Sm2],
            TlsSuite::Both => &[EcdsaP256, Sm2],
        }
    }
}

impl std::fmt::Display for TlsSuite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TlsSuite {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "standard" => Ok(TlsSuite::Standard),
            "gm" => Ok(TlsSuite::Gm),
            "both" => Ok(TlsSuite::Both),
            other => Err(format!(
                "unknown TLS suite {other:?}; expected one of {}",
                TlsSuite::NAMES.join(", ")
            )),
        }
    }
}

/// A server's identities for a [`TlsSuite`]: the standard certificate for `standard`, the
/// SM2 one for `gm`, both for `both` (the client's hello picks, [`aether_gmtls::DualCertResolver`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerIdentities {
    pub standard: Option<TlsPaths>,
    pub sm2: Option<TlsPaths>,
}

impl ServerIdentities {
    /// The development PKI's server files for `suite` under `<dir>/certs` (and `certs/sm2`).
    pub fn dev(dir: &Path, suite: TlsSuite) -> Self {
        let wants = suite.algorithms();
        let standard = wants
            .contains(&crate::certs::KeyAlgorithm::EcdsaP256)
            .then(|| TlsPaths::server(&PkiLayout::new(dir)));
        let sm2 = wants
            .contains(&crate::certs::KeyAlgorithm::Sm2)
            .then(|| TlsPaths::server(&PkiLayout::sm2(dir)));
        ServerIdentities { standard, sm2 }
    }
}

/// Server-side mTLS material, loaded and checked.
#[derive(Debug, Clone)]
pub struct ServerTls {
    material: Arc<Material>,
    config: Arc<ServerConfig>,
}

impl ServerTls {
    /// Reads and checks the CA, server certificate and key. Builds the TLS 1.3-only
    /// rustls configuration at once so that a bad key or CA fails here, not at the
    /// first connection.
    pub fn load(paths: &TlsPaths) -> Result<Self, TlsError> {
        Self::load_suite(
            TlsSuite::Standard,
            &ServerIdentities {
                standard: Some(paths.clone()),
                sm2: None,
            },
        )
    }

    /// As [`load`](Self::load), offering `suite`'s TLS 1.3 suites with the identities it
    /// needs. Clients are accepted whose certificate chains to any of the identities' CAs
    /// with an algorithm the suite verifies: SM2 only under `gm`, ECDSA/RSA only under
    /// `standard`, either under `both`.
    pub fn load_suite(suite: TlsSuite, identities: &ServerIdentities) -> Result<Self, TlsError> {
        let missing = |which| TlsError::MissingIdentity { suite, which };
        let standard = match suite {
            TlsSuite::Standard | TlsSuite::Both => Some(Material::load(
                identities.standard.as_ref().ok_or(missing("a standard"))?,
            )?),
            TlsSuite::Gm => None,
        };
        let sm2 = match suite {
            TlsSuite::Gm | TlsSuite::Both => Some(Material::load(
                identities.sm2.as_ref().ok_or(missing("an SM2"))?,
            )?),
            TlsSuite::Standard => None,
        };
        let provider = suite.provider();
        let mut roots = RootCertStore::empty();
        for material in [&standard, &sm2].into_iter().flatten() {
            roots.roots.extend(material.roots.roots.iter().cloned());
        }
        let ca = [&standard, &sm2]
            .into_iter()
            .flatten()
            .map(|m| m.paths.ca.clone())
            .next()
            .unwrap_or_default();
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
            .build()
            .map_err(|source| TlsError::Verifier { path: ca, source })?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Identity {
                cert: PathBuf::new(),
                key: PathBuf::new(),
                source: e,
            })?
            .with_client_cert_verifier(verifier);
        let (mut config, material) = match (standard, sm2) {
            (Some(standard), Some(sm2)) => {
                let sm2_key = certified_key(&sm2, &provider)?;
                let standard_key = certified_key(&standard, &provider)?;
                let resolver = aether_gmtls::DualCertResolver::new(sm2_key, standard_key);
                (builder.with_cert_resolver(Arc::new(resolver)), standard)
            }
            (Some(material), None) | (None, Some(material)) => {
                let config = builder
                    .with_single_cert(material.chain.clone(), material.key.clone_key())
                    .map_err(|e| material.identity_error(e))?;
                (config, material)
            }
            (None, None) => return Err(missing("a")),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(ServerTls {
            material: Arc::new(material),
            config: Arc::new(config),
        })
    }

    /// The TLS 1.3-only rustls server configuration (client certificate mandatory,
    /// ALPN `h2`), for callers that run their own acceptor.
    pub fn rustls_config(&self) -> Arc<ServerConfig> {
        self.config.clone()
    }

    /// tonic's `ServerTlsConfig`: server identity plus `client_ca_root` with client
    /// auth mandatory. See the module docs on protocol versions; needs
    /// [`install_default_crypto_provider`].
    pub fn tonic_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(
                &self.material.cert_pem,
                &self.material.key_pem,
            ))
            .client_ca_root(Certificate::from_pem(&self.material.ca_pem))
            .client_auth_optional(false)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// Accepts TCP connections from `listener` and yields those that completed a TLS
    /// 1.3 handshake with a client certificate from the CA. Handshakes run
    /// concurrently; failed ones are logged (debug) and dropped. Stops accepting, and
    /// closes the listener, when the stream is dropped.
    pub fn incoming(&self, listener: TcpListener) -> TlsIncoming {
        TlsIncoming::new(listener, self.config.clone())
    }
}

/// tonic's `ServerTlsConfig` for the given files (mandatory client certificates from
/// the CA). Prefer [`ServerTls::incoming`] where TLS 1.3 only matters.
pub fn server_tls_config(paths: &TlsPaths) -> Result<ServerTlsConfig, TlsError> {
    Ok(ServerTls::load(paths)?.tonic_config())
}

/// tonic's `ClientTlsConfig` that trusts `paths.ca` and presents `paths.cert`/`key`.
/// The files are checked (including that the key matches the certificate) before the
/// config is returned. The server name checked defaults to the endpoint URI's host;
/// override with `.domain_name(..)`. Needs [`install_default_crypto_provider`].
pub fn client_tls_config(paths: &TlsPaths) -> Result<ClientTlsConfig, TlsError> {
    let material = Material::load(paths)?;
    // Built only to check the files: tonic makes its own from the PEM below.
    rustls_client_config(&material)?;
    Ok(ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&material.ca_pem))
        .identity(Identity::from_pem(&material.cert_pem, &material.key_pem))
        .timeout(HANDSHAKE_TIMEOUT))
}

/// The material's chain and key, the key loaded by `provider` and checked to match.
fn certified_key(
    material: &Material,
    provider: &rustls::crypto::CryptoProvider,
) -> Result<Arc<rustls::sign::CertifiedKey>, TlsError> {
    let key = provider
        .key_provider
        .load_private_key(material.key.clone_key())
        .map_err(|e| material.identity_error(e))?;
    let certified = rustls::sign::CertifiedKey::new(material.chain.clone(), key);
    certified
        .keys_match()
        .map_err(|e| material.identity_error(e))?;
    Ok(Arc::new(certified))
}

/// TLS 1.3 only, trusting the material's CA and presenting its certificate.
fn rustls_client_config(material: &Material) -> Result<rustls::ClientConfig, TlsError> {
    rustls_client_config_with(material, TlsSuite::Standard, RootCertStore::empty())
}

/// As [`rustls_client_config`] with `suite`'s suites, trusting `more_roots` too.
fn rustls_client_config_with(
    material: &Material,
    suite: TlsSuite,
    mut more_roots: RootCertStore,
) -> Result<rustls::ClientConfig, TlsError> {
    more_roots
        .roots
        .extend(material.roots.roots.iter().cloned());
    rustls::ClientConfig::builder_with_provider(suite.provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| material.identity_error(e))?
        .with_root_certificates(more_roots)
        .with_client_auth_cert(material.chain.clone(), material.key.clone_key())
        .map_err(|e| material.identity_error(e))
}

/// A client identity for gRPC over TLS 1.3 with our own connector: the connection's writes
/// are [`Coalesced`] as on the server, so the requests a member's tasks queue in one turn of
/// the scheduler leave in one TLS record and one system call rather than one each (a
/// streaming client otherwise spends about a fifth of its time in `writev`). tonic's own
/// TLS ([`client_tls_config`]) offers no way to wrap the stream.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
}

/// Why a channel could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("cannot connect to {endpoint}: {reason}")]
pub struct ConnectError {
    /// The endpoint as given.
    pub endpoint: String,
    /// What failed, with its causes.
    pub reason: String,
}

impl ClientTls {
    /// Trusts `paths.ca` and presents `paths.cert`/`key`; the files are checked (the key
    /// must match the certificate) before anything connects.
    pub fn load(paths: &TlsPaths) -> Result<Self, TlsError> {
        Self::load_suite(TlsSuite::Standard, paths, &[])
    }

    /// As [`load`](Self::load), offering `suite`'s TLS 1.3 suites and trusting the CA
    /// files in `more_cas` too (under `both`, the CA of the server's other certificate).
    /// The certificate in `paths` must be one the suite can sign with: SM2 under `gm`.
    pub fn load_suite(
        suite: TlsSuite,
        paths: &TlsPaths,
        more_cas: &[PathBuf],
    ) -> Result<Self, TlsError> {
        let material = Material::load(paths)?;
        let mut roots = RootCertStore::empty();
        for ca in more_cas {
            let pem = std::fs::read(ca).map_err(|source| TlsError::Read {
                file: TlsFile::Ca,
                path: ca.clone(),
                source,
            })?;
            for (i, cert) in parse_certs(TlsFile::Ca, ca, &pem)?.into_iter().enumerate() {
                roots.add(cert).map_err(|source| TlsError::TrustAnchor {
                    path: ca.clone(),
                    index: i + 1,
                    source,
                })?;
            }
        }
        let mut config = rustls_client_config_with(&material, suite, roots)?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(ClientTls {
            config: Arc::new(config),
        })
    }

    /// A member's or worker's client TLS from the development PKI under `<dir>/certs`:
    /// the SM2 identity under `gm`, the standard one otherwise (trusting the SM2 CA too
    /// under `both`, for a server that answers with its SM2 certificate).
    pub fn dev(dir: &Path, suite: TlsSuite, role: Role, id: &str) -> Result<Self, TlsError> {
        match suite {
            TlsSuite::Gm => Self::load_suite(
                suite,
                &TlsPaths::client(&PkiLayout::sm2(dir), role, id),
                &[],
            ),
            TlsSuite::Standard => Self::load(&TlsPaths::client(&PkiLayout::new(dir), role, id)),
            TlsSuite::Both => Self::load_suite(
                suite,
                &TlsPaths::client(&PkiLayout::new(dir), role, id),
                &[PkiLayout::sm2(dir).ca().cert],
            ),
        }
    }

    /// An HTTP/2 channel to `endpoint` (`https://host:port`), the server's certificate
    /// checked against the endpoint's host. Connects (TCP, then the TLS handshake within
    /// [`HANDSHAKE_TIMEOUT`]) before it returns, and again after a lost connection.
    pub async fn connect(&self, endpoint: &str) -> Result<Channel, ConnectError> {
        let fail = |reason: String| ConnectError {
            endpoint: endpoint.to_owned(),
            reason,
        };
        let uri: Uri = endpoint
            .parse()
            .map_err(|e| fail(format!("not a URI: {e}")))?;
        if uri.scheme_str() != Some("https") {
            return Err(fail("the endpoint must be https://host:port".into()));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| fail("the endpoint names no host".into()))?
            .clone();
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = authority.port_u16().unwrap_or(443);
        let name = ServerName::try_from(host.clone())
            .map_err(|e| fail(format!("{host} is not a server name: {e}")))?;
        let tls = TlsConnector::from(self.config.clone());
        let connector = tower::service_fn(move |_: Uri| {
            let (tls, name, host) = (tls.clone(), name.clone(), host.clone());
            async move {
                let tcp = TcpStream::connect((host.as_str(), port)).await?;
                tcp.set_nodelay(true)?;
                let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.connect(name, tcp))
                    .await
                    .map_err(|_| {
                        io::Error::new(io::ErrorKind::TimedOut, "the TLS handshake timed out")
                    })??;
                Ok::<_, io::Error>(TokioIo::new(Coalesced::new(stream)))
            }
        });
        // tonic would add TLS of its own to an https:// URI: the connection is made from a
        // plain one, and requests still name the https origin.
        Endpoint::from_shared(format!("http://{authority}"))
            .map_err(|e| fail(e.to_string()))?
            .origin(uri)
            .connect_with_connector(connector)
            .await
            .map_err(|e| fail(crate::errors::error_chain(&e)))
    }
}

/// Stream of TLS 1.3 connections with verified client certificates, for
/// `Server::serve_with_incoming`. Yields `TlsStream<TcpStream>` with coalesced writes
/// ([`Coalesced`]); its connect info makes `Request::peer_certs()` work.
pub struct TlsIncoming {
    rx: mpsc::Receiver<TlsStream<TcpStream>>,
    local_addr: Option<std::net::SocketAddr>,
}

impl TlsIncoming {
    fn new(listener: TcpListener, config: Arc<ServerConfig>) -> Self {
        let local_addr = listener.local_addr().ok();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(accept_loop(listener, TlsAcceptor::from(config), tx));
        TlsIncoming { rx, local_addr }
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.local_addr
    }
}

impl Stream for TlsIncoming {
    type Item = Result<Coalesced<TlsStream<TcpStream>>, io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx
            .poll_recv(cx)
            .map(|conn| conn.map(|tls| Ok(Coalesced::new(tls))))
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    tx: mpsc::Sender<TlsStream<TcpStream>>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_CONCURRENT_HANDSHAKES));
    loop {
        let permit = tokio::select! {
            _ = tx.closed() => return,
            permit = handshakes.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        let (tcp, remote) = tokio::select! {
            _ = tx.closed() => return,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a TCP connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let started = std::time::SystemTime::now();
            let span = |outcome| {
                crate::telemetry::handshake_span(
                    started,
                    std::time::SystemTime::now(),
                    remote,
                    outcome,
                )
            };
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => {
                    if crate::telemetry::exporting() {
                        let connection = tls.get_ref().1;
                        let version = match connection.protocol_version() {
                            Some(rustls::ProtocolVersion::TLSv1_3) => "1.3",
                            Some(rustls::ProtocolVersion::TLSv1_2) => "1.2",
                            _ => "unknown",
                        };
                        let cipher = connection.negotiated_cipher_suite().map_or("unknown", |s| {
                            match u16::from(s.suite()) {
                                // RFC 8998's suites, which rustls does not name.
                                0x00C6 => "TLS_SM4_GCM_SM3",
                                0x00C7 => "TLS_SM4_CCM_SM3",
                                _ => s.suite().as_str().unwrap_or("unknown"),
                            }
                        });
                        span(Ok((version, cipher)));
                    }
                    let _ = tx.send(tls).await;
                }
                Ok(Err(e)) => {
                    tracing::debug!(%remote, error = %e, "TLS handshake failed");
                    span(Err(format!("TLS handshake failed: {e}")));
                }
                Err(_) => {
                    tracing::debug!(%remote, "TLS handshake timed out");
                    span(Err(format!(
                        "TLS handshake timed out after {} s",
                        HANDSHAKE_TIMEOUT.as_secs()
                    )));
                }
            }
        });
    }
}
