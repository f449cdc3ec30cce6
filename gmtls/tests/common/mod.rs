//! Shared test helpers: in-memory handshakes, configs, a standard (ECDSA P-256) PKI.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::sync::Arc;

use aether_gmtls::certs::{DevCa, PemPair};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection,
};

/// An SM2 development PKI: CA, a server cert for localhost/127.0.0.1, a member client cert.
pub struct GmPki {
    pub ca: DevCa,
    pub server: PemPair,
    pub client: PemPair,
}

pub fn gm_pki() -> GmPki {
    let ca = DevCa::generate("Aether test CA").unwrap();
    let server = ca
        .issue_server("aether-gateway", &["localhost", "127.0.0.1", "::1"])
        .unwrap();
    let client = ca.issue_client("m1", "aether://member/m1").unwrap();
    GmPki { ca, server, client }
}

/// An ECDSA P-256 PKI made by rcgen: CA, server cert for localhost, client cert.
pub struct StdPki {
    pub ca_der: CertificateDer<'static>,
    pub server_der: CertificateDer<'static>,
    pub server_key: PrivateKeyDer<'static>,
    pub client_der: CertificateDer<'static>,
    pub client_key: PrivateKeyDer<'static>,
}

pub fn std_pki() -> StdPki {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose, SanType,
    };
    let mut ca_params = CertificateParams::default();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "Standard test CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);

    let leaf = |sans: Vec<SanType>, eku: ExtendedKeyUsagePurpose| {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, "leaf");
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![eku];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        (
            cert.der().clone(),
            PrivateKeyDer::from(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    };
    let (server_der, server_key) = leaf(
        vec![SanType::DnsName("localhost".try_into().unwrap())],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_der, client_key) = leaf(
        vec![SanType::URI("aether://worker/w1".try_into().unwrap())],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    StdPki {
        ca_der: ca_cert.der().clone(),
        server_der,
        server_key,
        client_der,
        client_key,
    }
}

pub fn roots(cas: &[&CertificateDer<'static>]) -> Arc<RootCertStore> {
    let mut store = RootCertStore::empty();
    for ca in cas {
        store.add((*ca).clone()).unwrap();
    }
    Arc::new(store)
}

/// A TLS 1.3 server requiring client certificates from `client_roots`.
pub fn server_config(
    provider: Arc<CryptoProvider>,
    client_roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<ServerConfig, rustls::Error> {
    let verifier = WebPkiClientVerifier::builder_with_provider(client_roots, provider.clone())
        .build()
        .map_err(|e| rustls::Error::General(e.to_string()))?;
    ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
}

/// A TLS 1.3 client trusting `roots`, presenting `chain`/`key`.
pub fn client_config(
    provider: Arc<CryptoProvider>,
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<ClientConfig, rustls::Error> {
    let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| rustls::Error::General(e.to_string()))?;
    ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_webpki_verifier(verifier)
        .with_client_auth_cert(chain, key)
}

/// How a handshake ended: the first error each side saw.
#[derive(Debug, Default)]
pub struct Outcome {
    pub client: Option<rustls::Error>,
    pub server: Option<rustls::Error>,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.client.is_none() && self.server.is_none()
    }
}

/// Connections for `server_name` ("localhost" by default in the tests).
pub fn pair(
    client: ClientConfig,
    server: ServerConfig,
    server_name: &str,
) -> (Connection, Connection) {
    let name = ServerName::try_from(server_name.to_owned()).unwrap();
    let client = ClientConnection::new(Arc::new(client), name).unwrap();
    let server = ServerConnection::new(Arc::new(server)).unwrap();
    (Connection::from(client), Connection::from(server))
}

/// Moves records between the two until both finish the handshake or one fails (its alert is
/// still delivered, so the other side's error is seen too).
pub fn handshake(client: &mut Connection, server: &mut Connection) -> Outcome {
    let mut outcome = Outcome::default();
    for _ in 0..32 {
        let sent_c = transfer(client, server, &mut outcome.server);
        let sent_s = transfer(server, client, &mut outcome.client);
        if outcome.client.is_some() || outcome.server.is_some() {
            // One more round so the alert of the failing side reaches the other.
            transfer(client, server, &mut outcome.server);
            transfer(server, client, &mut outcome.client);
            return outcome;
        }
        if sent_c == 0 && sent_s == 0 && !client.is_handshaking() && !server.is_handshaking() {
            return outcome;
        }
    }
    panic!("handshake did not settle");
}

fn transfer(
    from: &mut Connection,
    to: &mut Connection,
    to_err: &mut Option<rustls::Error>,
) -> usize {
    let mut buf = Vec::new();
    while from.wants_write() {
        from.write_tls(&mut buf).unwrap();
    }
    if buf.is_empty() || to_err.is_some() {
        return buf.len();
    }
    let mut slice = &buf[..];
    while !slice.is_empty() {
        match to.read_tls(&mut slice) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => panic!("read_tls: {e}"),
        }
        if let Err(e) = to.process_new_packets() {
            *to_err = Some(e);
            break;
        }
    }
    buf.len()
}

/// Sends `data` from `a` to `b` and returns what `b` read (in as many records and reads
/// as it takes: `b` buffers at most 16 KiB of plaintext).
pub fn send(a: &mut Connection, b: &mut Connection, data: &[u8]) -> Vec<u8> {
    a.writer().write_all(data).unwrap();
    let mut wire = Vec::new();
    while a.wants_write() {
        a.write_tls(&mut wire).unwrap();
    }
    let mut wire = &wire[..];
    let mut out = Vec::new();
    while out.len() < data.len() {
        if !wire.is_empty() {
            b.read_tls(&mut (&mut wire).take(4096)).unwrap();
            b.process_new_packets().unwrap();
        }
        let mut chunk = [0u8; 4096];
        match b.reader().read(&mut chunk) {
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(!wire.is_empty(), "ran out of records");
            }
            Err(e) => panic!("read: {e}"),
        }
    }
    out
}

/// rustls' ring provider (deprecated in favour of a post-quantum default; fine for tests).
#[allow(deprecated)]
pub fn ring_provider() -> CryptoProvider {
    rustls::crypto::ring::default_provider()
}
