//! Development PKI for `aether certs init` (and for `aether serve` on first start): a CA,
//! a gateway server certificate, and one client certificate per member and per worker.
//!
//! Layout under `<dir>/certs/`:
//!
//! | file | what |
//! |---|---|
//! | `ca.pem`, `ca.key.pem` | the dev CA (ECDSA P-256, 10 years) |
//! | `server.pem`, `server.key.pem` | gateway server cert; SANs `localhost`, `127.0.0.1`, `::1` + extra names |
//! | `member-<id>.pem`, `member-<id>.key.pem` | member client cert: SAN URI `aether://member/<id>`, CN `<id>` |
//! | `worker-<id>.pem`, `worker-<id>.key.pem` | worker client cert: SAN URI `aether://worker/<id>`, CN `<id>` |
//!
//! Private keys are PKCS#8 PEM, mode 0600. Leaf certificates are valid for 825 days;
//! ids follow [`crate::identity::validate_id`]. See [`crate::identity`] for how the
//! gateway reads the identity back.
//!
//! An existing PKI is never overwritten without `force`: running init again reuses the
//! CA and only issues the certificates that are missing (for example a new member), so
//! certificates already handed out stay valid.

use std::collections::BTreeSet;
use std::fs;
use std::io::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::identity::{IdError, Role, identity_uri, validate_id};

/// Subject CN of the dev CA.
const CA_COMMON_NAME: &str = "Aether development CA";
/// Subject CN of the gateway server certificate.
const SERVER_COMMON_NAME: &str = "aether-gateway";
/// Names every dev server certificate carries, so local clients verify out of the box.
pub const DEFAULT_SERVER_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
const LEAF_VALIDITY: Duration = Duration::from_secs(825 * 24 * 3600);
/// Back-dating of `notBefore`, so a peer whose clock is slightly behind accepts new certs.
const CLOCK_SKEW: Duration = Duration::from_secs(3600);

/// The key and signature algorithm of a development PKI.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KeyAlgorithm {
    /// ECDSA P-256 keys, ECDSA-with-SHA256 signatures: the standard TLS 1.3 suites.
    #[default]
    EcdsaP256,
    /// SM2 keys, SM2-with-SM3 signatures (GB/T 32918, OID 1.2.156.10197.1.501): the RFC
    /// 8998 suites (`--tls-suite gm`). Kept apart, under `<dir>/certs/sm2/`.
    Sm2,
}

/// What to issue.
#[derive(Debug, Clone, Default)]
pub struct DevPkiSpec {
    /// Member ids, one client certificate each.
    pub members: Vec<String>,
    /// Worker ids, one client certificate each.
    pub workers: Vec<String>,
    /// Extra server names (DNS names or IP addresses) beyond [`DEFAULT_SERVER_NAMES`].
    /// Only used when `server.pem` is issued (new PKI, or `force`).
    pub server_names: Vec<String>,
    /// Replace an existing PKI (new CA; every previously issued certificate stops
    /// verifying).
    pub force: bool,
    /// ECDSA (`<dir>/certs/`) or SM2 (`<dir>/certs/sm2/`).
    pub algorithm: KeyAlgorithm,
}

/// Paths of one certificate and its private key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PemPair {
    /// PEM certificate.
    pub cert: PathBuf,
    /// PEM PKCS#8 private key (mode 0600).
    pub key: PathBuf,
}

/// File names inside `<dir>/certs/`, so callers never spell them by hand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PkiLayout {
    /// `<dir>/certs`.
    pub certs_dir: PathBuf,
}

impl PkiLayout {
    /// The layout under `<dir>/certs/`.
    pub fn new(dir: impl AsRef<Path>) -> Self {
        PkiLayout {
            certs_dir: dir.as_ref().join("certs"),
        }
    }

    /// The SM2 PKI's layout, under `<dir>/certs/sm2/` (the same file names).
    pub fn sm2(dir: impl AsRef<Path>) -> Self {
        PkiLayout {
            certs_dir: dir.as_ref().join("certs").join("sm2"),
        }
    }

    /// The layout of a PKI of `algorithm` under `<dir>`.
    pub fn of(dir: impl AsRef<Path>, algorithm: KeyAlgorithm) -> Self {
        match algorithm {
            KeyAlgorithm::EcdsaP256 => Self::new(dir),
            KeyAlgorithm::Sm2 => Self::sm2(dir),
        }
    }

    fn pair(&self, stem: &str) -> PemPair {
        PemPair {
            cert: self.certs_dir.join(format!("{stem}.pem")),
            key: self.certs_dir.join(format!("{stem}.key.pem")),
        }
    }

    /// `ca.pem` / `ca.key.pem`.
    pub fn ca(&self) -> PemPair {
        self.pair("ca")
    }

    /// `server.pem` / `server.key.pem`.
    pub fn server(&self) -> PemPair {
        self.pair("server")
    }

    /// `member-<id>.pem` / `worker-<id>.pem` and their keys.
    pub fn client(&self, role: Role, id: &str) -> PemPair {
        self.pair(&format!("{}-{id}", role.as_str()))
    }

    /// `member-<id>.pem` / `member-<id>.key.pem`.
    pub fn member(&self, id: &str) -> PemPair {
        self.client(Role::Member, id)
    }

    /// `worker-<id>.pem` / `worker-<id>.key.pem`.
    pub fn worker(&self, id: &str) -> PemPair {
        self.client(Role::Worker, id)
    }
}

/// What [`init_dev_pki`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitOutcome {
    /// No PKI was there (or `force`): a new CA and every certificate were written.
    Created,
    /// A PKI was there and already had every requested certificate; nothing written.
    Exists,
    /// A PKI was there; its CA issued the certificates that were missing.
    Extended,
}

/// Result of [`init_dev_pki`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitReport {
    /// Created, already there, or extended.
    pub outcome: InitOutcome,
    /// Where the files are.
    pub layout: PkiLayout,
    /// Files written by this call (certificates and keys), in order.
    pub written: Vec<PathBuf>,
}

/// Why the PKI could not be initialised. Nothing is overwritten on error.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    /// An id does not match `[a-z0-9][a-z0-9._-]{0,62}`.
    #[error("invalid {role} id: {source}")]
    InvalidId {
        /// Member or worker.
        role: Role,
        /// Why.
        source: IdError,
    },
    /// A server name is neither a DNS name nor an IP address rcgen can encode.
    #[error("invalid server name {name:?}: {source}")]
    InvalidServerName {
        /// The name given.
        name: String,
        /// Why.
        source: rcgen::Error,
    },
    /// One half of the CA is there without the other: refuse to guess.
    #[error(
        "incomplete PKI in {dir}: {present} exists but {missing} does not; restore it or re-run with force"
    )]
    IncompleteCa {
        /// The certs directory.
        dir: PathBuf,
        /// The CA file found.
        present: PathBuf,
        /// The CA file missing.
        missing: PathBuf,
    },
    /// A leaf certificate exists without its key, or the other way round.
    #[error(
        "incomplete certificate: {present} exists but {missing} does not; remove it or re-run with force"
    )]
    IncompletePair {
        /// The file found.
        present: PathBuf,
        /// The file missing.
        missing: PathBuf,
    },
    /// The existing CA cannot be loaded to issue missing certificates.
    #[error("cannot use existing CA {path}: {source}")]
    ExistingCa {
        /// ca.pem or ca.key.pem.
        path: PathBuf,
        /// Why.
        source: rcgen::Error,
    },
    /// SM2 certificate generation, signing or loading failed.
    #[error("cannot generate {what}: {source}")]
    Sm2 {
        /// Which certificate.
        what: String,
        /// Why.
        source: aether_gmtls::Error,
    },
    /// Certificate generation or signing failed.
    #[error("cannot generate {what}: {source}")]
    Generate {
        /// Which certificate.
        what: String,
        /// Why.
        source: rcgen::Error,
    },
    /// File system error.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CertsError {
    move |source| CertsError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

/// Creates (or completes) the development PKI under `<dir>/certs/`.
///
/// * no PKI there, or `spec.force`: new CA, server cert, all client certs
///   ([`InitOutcome::Created`]);
/// * PKI there with everything requested: nothing written ([`InitOutcome::Exists`]);
/// * PKI there, some requested certs missing: the existing CA issues just those
///   ([`InitOutcome::Extended`]); existing files are never touched.
pub fn init_dev_pki(dir: impl AsRef<Path>, spec: &DevPkiSpec) -> Result<InitReport, CertsError> {
    let layout = PkiLayout::of(dir, spec.algorithm);
    let clients = validated_clients(spec)?;
    let server_names = server_names(&spec.server_names);
    let server_sans = server_sans(&server_names)?;

    fs::create_dir_all(&layout.certs_dir).map_err(io_err("create directory", &layout.certs_dir))?;

    let ca_files = layout.ca();
    let ca_present = (ca_files.cert.exists(), ca_files.key.exists());
    let mut written = Vec::new();

    let (issuer, outcome) = match ca_present {
        (true, true) if !spec.force => (CaIssuer::load(spec.algorithm, &ca_files)?, None),
        (true, false) | (false, true) if !spec.force => {
            let (present, missing) = if ca_present.0 {
                (ca_files.cert, ca_files.key)
            } else {
                (ca_files.key, ca_files.cert)
            };
            return Err(CertsError::IncompleteCa {
                dir: layout.certs_dir,
                present,
                missing,
            });
        }
        _ => {
            if spec.force {
                remove_issued_files(&layout)?;
            }
            let (issuer, cert_pem, key_pem) = CaIssuer::generate(spec.algorithm)?;
            write_pair(&ca_files, &cert_pem, &key_pem, &mut written)?;
            (issuer, Some(InitOutcome::Created))
        }
    };

    let server = layout.server();
    if needs_issuing(&server)? {
        let (cert, key) = issuer.issue_server(server_sans, &server_names)?;
        write_pair(&server, &cert, &key, &mut written)?;
    }
    for (role, id) in &clients {
        let files = layout.client(*role, id);
        if needs_issuing(&files)? {
            let (cert, key) = issuer.issue_client(*role, id)?;
            write_pair(&files, &cert, &key, &mut written)?;
        }
    }

    let outcome = outcome.unwrap_or(if written.is_empty() {
        InitOutcome::Exists
    } else {
        InitOutcome::Extended
    });
    Ok(InitReport {
        outcome,
        layout,
        written,
    })
}

fn validated_clients(spec: &DevPkiSpec) -> Result<BTreeSet<(Role, String)>, CertsError> {
    let members = spec.members.iter().map(|id| (Role::Member, id));
    let workers = spec.workers.iter().map(|id| (Role::Worker, id));
    members
        .chain(workers)
        .map(|(role, id)| {
            validate_id(id)
                .map(|()| (role, id.clone()))
                .map_err(|source| CertsError::InvalidId { role, source })
        })
        .collect()
}

/// The default server names and `extra`, once each.
fn server_names(extra: &[String]) -> Vec<String> {
    let mut names: Vec<String> = DEFAULT_SERVER_NAMES.map(str::to_owned).to_vec();
    for name in extra {
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
    names
}

fn server_sans(names: &[String]) -> Result<Vec<SanType>, CertsError> {
    names
        .iter()
        .map(String::as_str)
        .map(|name| match name.parse::<IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => name.try_into().map(SanType::DnsName).map_err(|source| {
                CertsError::InvalidServerName {
                    name: name.to_owned(),
                    source,
                }
            }),
        })
        .collect()
}

/// A pair must be issued when neither file exists; half a pair is an error.
fn needs_issuing(pair: &PemPair) -> Result<bool, CertsError> {
    match (pair.cert.exists(), pair.key.exists()) {
        (true, true) => Ok(false),
        (false, false) => Ok(true),
        (true, false) => Err(CertsError::IncompletePair {
            present: pair.cert.clone(),
            missing: pair.key.clone(),
        }),
        (false, true) => Err(CertsError::IncompletePair {
            present: pair.key.clone(),
            missing: pair.cert.clone(),
        }),
    }
}

fn validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = SystemTime::now();
    params.not_before = (now - CLOCK_SKEW).into();
    params.not_after = (now + lifetime).into();
}

fn new_ca() -> Result<(CertificateParams, KeyPair, String), CertsError> {
    let generate = |source| CertsError::Generate {
        what: "CA certificate".into(),
        source,
    };
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, CA_COMMON_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, CA_VALIDITY);
    let key = KeyPair::generate().map_err(generate)?;
    let cert = params.self_signed(&key).map_err(generate)?;
    Ok((params, key, cert.pem()))
}

fn load_ca(files: &PemPair) -> Result<Issuer<'static, KeyPair>, CertsError> {
    let cert_pem = fs::read_to_string(&files.cert).map_err(io_err("read", &files.cert))?;
    let key_pem = fs::read_to_string(&files.key).map_err(io_err("read", &files.key))?;
    let key = KeyPair::from_pem(&key_pem).map_err(|source| CertsError::ExistingCa {
        path: files.key.clone(),
        source,
    })?;
    Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|source| CertsError::ExistingCa {
        path: files.cert.clone(),
        source,
    })
}

fn leaf_params(
    common_name: &str,
    sans: Vec<SanType>,
    usage: ExtendedKeyUsagePurpose,
) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.subject_alt_names = sans;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, LEAF_VALIDITY);
    params
}

/// The CA that issues a PKI's certificates: rcgen's for ECDSA, `aether_gmtls`'s for SM2.
enum CaIssuer {
    Ecdsa(Box<Issuer<'static, KeyPair>>),
    Sm2(Box<aether_gmtls::certs::DevCa>),
}

impl CaIssuer {
    /// A new CA: the issuer, its certificate and its key (PEM).
    fn generate(algorithm: KeyAlgorithm) -> Result<(CaIssuer, String, String), CertsError> {
        match algorithm {
            KeyAlgorithm::EcdsaP256 => {
                let (params, key, cert_pem) = new_ca()?;
                let key_pem = key.serialize_pem();
                Ok((
                    CaIssuer::Ecdsa(Box::new(Issuer::new(params, key))),
                    cert_pem,
                    key_pem,
                ))
            }
            KeyAlgorithm::Sm2 => {
                let ca = aether_gmtls::certs::DevCa::generate(CA_COMMON_NAME)
                    .map_err(sm2_error("CA certificate"))?;
                let pem = ca.pem().clone();
                Ok((CaIssuer::Sm2(Box::new(ca)), pem.cert_pem, pem.key_pem))
            }
        }
    }

    /// The CA already in `files`.
    fn load(algorithm: KeyAlgorithm, files: &PemPair) -> Result<CaIssuer, CertsError> {
        match algorithm {
            KeyAlgorithm::EcdsaP256 => Ok(CaIssuer::Ecdsa(Box::new(load_ca(files)?))),
            KeyAlgorithm::Sm2 => {
                let cert_pem =
                    fs::read_to_string(&files.cert).map_err(io_err("read", &files.cert))?;
                let key_pem = fs::read_to_string(&files.key).map_err(io_err("read", &files.key))?;
                aether_gmtls::certs::DevCa::from_pem(&cert_pem, &key_pem)
                    .map(|ca| CaIssuer::Sm2(Box::new(ca)))
                    .map_err(sm2_error(&format!("CA from {}", files.cert.display())))
            }
        }
    }

    /// The gateway's server certificate and key (PEM).
    fn issue_server(
        &self,
        sans: Vec<SanType>,
        names: &[String],
    ) -> Result<(String, String), CertsError> {
        let what = "server certificate";
        match self {
            CaIssuer::Ecdsa(issuer) => {
                let params = leaf_params(
                    SERVER_COMMON_NAME,
                    sans,
                    ExtendedKeyUsagePurpose::ServerAuth,
                );
                signed(&params, issuer, what)
            }
            CaIssuer::Sm2(ca) => {
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let pair = ca
                    .issue_server(SERVER_COMMON_NAME, &names)
                    .map_err(sm2_error(what))?;
                Ok((pair.cert_pem, pair.key_pem))
            }
        }
    }

    /// A member's or worker's client certificate and key (PEM): SAN URI, CN the id.
    fn issue_client(&self, role: Role, id: &str) -> Result<(String, String), CertsError> {
        let uri = identity_uri(role, id);
        let what = format!("{role} certificate for {id}");
        match self {
            CaIssuer::Ecdsa(issuer) => {
                let san = SanType::URI(uri.clone().try_into().map_err(|source| {
                    CertsError::Generate {
                        what: format!("identity URI {uri}"),
                        source,
                    }
                })?);
                let params = leaf_params(id, vec![san], ExtendedKeyUsagePurpose::ClientAuth);
                signed(&params, issuer, &what)
            }
            CaIssuer::Sm2(ca) => {
                let pair = ca.issue_client(id, &uri).map_err(sm2_error(&what))?;
                Ok((pair.cert_pem, pair.key_pem))
            }
        }
    }
}

fn sm2_error(what: &str) -> impl FnOnce(aether_gmtls::Error) -> CertsError {
    let what = what.to_owned();
    move |source| CertsError::Sm2 { what, source }
}

/// A new key and its certificate from `params`, signed by `issuer` (PEM).
fn signed(
    params: &CertificateParams,
    issuer: &Issuer<'_, KeyPair>,
    what: &str,
) -> Result<(String, String), CertsError> {
    let generate = |source| CertsError::Generate {
        what: what.to_owned(),
        source,
    };
    let key = KeyPair::generate().map_err(generate)?;
    let cert = params.signed_by(&key, issuer).map_err(generate)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Writes the key first (0600 from creation, never world-readable for an instant), then
/// the certificate, each through a temporary file renamed into place.
fn write_pair(
    files: &PemPair,
    cert_pem: &str,
    key_pem: &str,
    written: &mut Vec<PathBuf>,
) -> Result<(), CertsError> {
    write_file(&files.key, key_pem.as_bytes(), 0o600)?;
    written.push(files.key.clone());
    write_file(&files.cert, cert_pem.as_bytes(), 0o644)?;
    written.push(files.cert.clone());
    Ok(())
}

fn write_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), CertsError> {
    let tmp = path.with_extension("pem.tmp");
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut file = options.open(&tmp).map_err(io_err("create", &tmp))?;
    // The mode passed to open() only applies to new files and is reduced by the umask;
    // set it explicitly so a leftover temporary file cannot widen it.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        file.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(io_err("set permissions on", &tmp))?;
    }
    file.write_all(contents).map_err(io_err("write", &tmp))?;
    file.sync_all().map_err(io_err("sync", &tmp))?;
    drop(file);
    fs::rename(&tmp, path).map_err(io_err("rename into place", path))
}

/// With `force`, removes what a previous init wrote (CA, server and every
/// `member-*`/`worker-*` pair), so no certificate of the old CA lingers next to the new one.
fn remove_issued_files(layout: &PkiLayout) -> Result<(), CertsError> {
    let dir = &layout.certs_dir;
    let entries = fs::read_dir(dir).map_err(io_err("list", dir))?;
    for entry in entries {
        let entry = entry.map_err(io_err("list", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let ours = matches!(
            name,
            "ca.pem" | "ca.key.pem" | "server.pem" | "server.key.pem"
        ) || ((name.starts_with("member-") || name.starts_with("worker-"))
            && name.ends_with(".pem"));
        if ours {
            let path = entry.path();
            fs::remove_file(&path).map_err(io_err("remove", &path))?;
        }
    }
    Ok(())
}
