//! rustls against rustls: the SM provider, its negatives, and the combined provider.

mod common;

use std::sync::Arc;

use aether_gmtls::certs::{pem_to_cert_chain, san_uris};
use aether_gmtls::{
    CURVE_SM2_ID, DualCertResolver, TLS_SM4_GCM_SM3_ID, combined_provider, gm_provider,
    sm2_certified_key,
};
use common::*;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{CertificateError, Error, ServerConfig};

fn gm() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(gm_provider())
}

fn chain(pem: &str) -> Vec<CertificateDer<'static>> {
    pem_to_cert_chain(pem).unwrap()
}

/// A `gm` client and server from the SM2 development PKI, each trusting its CA.
fn gm_configs(pki: &common::GmPki) -> (rustls::ClientConfig, rustls::ServerConfig) {
    let roots = roots(&[&pki.ca.cert_der().unwrap()]);
    let server = server_config(
        gm(),
        roots.clone(),
        chain(&pki.server.cert_pem),
        pki.server.key_der().unwrap(),
    )
    .unwrap();
    let client = client_config(
        gm(),
        roots,
        chain(&pki.client.cert_pem),
        pki.client.key_der().unwrap(),
    )
    .unwrap();
    (client, server)
}

#[test]
fn gm_mutual_auth_handshake_and_data() {
    let pki = gm_pki();
    let (client, server) = gm_configs(&pki);
    let (mut c, mut s) = pair(client, server, "localhost");
    let outcome = handshake(&mut c, &mut s);
    assert!(outcome.ok(), "{outcome:?}");

    for conn in [&c, &s] {
        assert_eq!(
            conn.negotiated_cipher_suite().unwrap().suite(),
            TLS_SM4_GCM_SM3_ID
        );
        assert_eq!(u16::from(TLS_SM4_GCM_SM3_ID), 0x00C6);
        let group = conn.negotiated_key_exchange_group().unwrap().name();
        assert_eq!(group, CURVE_SM2_ID);
        assert_eq!(u16::from(group), 0x0029);
        assert_eq!(
            conn.protocol_version(),
            Some(rustls::ProtocolVersion::TLSv1_3)
        );
    }

    // The server sees the client's identity.
    let client_cert = &s.peer_certificates().unwrap()[0];
    assert_eq!(san_uris(client_cert).unwrap(), vec!["aether://member/m1"]);

    // Application data both ways, including a record larger than one TLS fragment.
    assert_eq!(
        send(&mut c, &mut s, b"ping from client"),
        b"ping from client"
    );
    assert_eq!(
        send(&mut s, &mut c, b"pong from server"),
        b"pong from server"
    );
    let big: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(send(&mut c, &mut s, &big), big);
}

#[test]
fn sm_only_client_against_ring_server_fails_cleanly() {
    let gm_pki = gm_pki();
    let std = std_pki();
    let server = ServerConfig::builder_with_provider(Arc::new(ring_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![std.server_der.clone()], std.server_key.clone_key())
        .unwrap();
    let client = client_config(
        gm(),
        roots(&[&gm_pki.ca.cert_der().unwrap()]),
        chain(&gm_pki.client.cert_pem),
        gm_pki.client.key_der().unwrap(),
    )
    .unwrap();
    let (mut c, mut s) = pair(client, server, "localhost");
    let outcome = handshake(&mut c, &mut s);
    assert!(
        matches!(outcome.server, Some(Error::PeerIncompatible(_))),
        "{outcome:?}"
    );
    assert!(
        matches!(outcome.client, Some(Error::AlertReceived(_))),
        "{outcome:?}"
    );
}

#[test]
fn gm_server_refuses_non_sm2_client_certificate() {
    let pki = gm_pki();
    let std = std_pki();
    let gm_roots = roots(&[&pki.ca.cert_der().unwrap()]);

    // In a handshake: the client (SM suite + ECDSA key) cannot answer the server's
    // sm2sig_sm3-only CertificateRequest, sends no certificate, and is refused.
    let server = server_config(
        gm(),
        roots(&[&pki.ca.cert_der().unwrap(), &std.ca_der]),
        chain(&pki.server.cert_pem),
        pki.server.key_der().unwrap(),
    )
    .unwrap();
    let client = client_config(
        Arc::new(combined_provider(ring_provider())),
        gm_roots,
        vec![std.client_der.clone(), std.ca_der.clone()],
        std.client_key.clone_key(),
    )
    .unwrap();
    let (mut c, mut s) = pair(client, server, "localhost");
    let outcome = handshake(&mut c, &mut s);
    assert!(
        matches!(outcome.server, Some(Error::NoCertificatesPresented)),
        "{outcome:?}"
    );
    assert!(outcome.client.is_some(), "{outcome:?}");

    // And the verifier itself refuses the ECDSA chain even when its CA is a trust anchor.
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(&[&std.ca_der]), gm())
        .build()
        .unwrap();
    let err = verifier
        .verify_client_cert(&std.client_der, &[], UnixTime::now())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidCertificate(
                CertificateError::UnsupportedSignatureAlgorithmContext { .. }
            )
        ),
        "{err:?}"
    );
}

#[test]
fn tampered_certificate_signature_is_refused() {
    let pki = gm_pki();
    let mut server_der = pki.server.cert_der().unwrap().to_vec();
    // The last byte is inside the signature's s value.
    let last = server_der.len() - 1;
    server_der[last] ^= 0x01;
    let server = server_config(
        gm(),
        roots(&[&pki.ca.cert_der().unwrap()]),
        vec![CertificateDer::from(server_der)],
        pki.server.key_der().unwrap(),
    )
    .unwrap();
    let client = client_config(
        gm(),
        roots(&[&pki.ca.cert_der().unwrap()]),
        chain(&pki.client.cert_pem),
        pki.client.key_der().unwrap(),
    )
    .unwrap();
    let (mut c, mut s) = pair(client, server, "localhost");
    let outcome = handshake(&mut c, &mut s);
    assert!(
        matches!(
            outcome.client,
            Some(Error::InvalidCertificate(CertificateError::BadSignature))
        ),
        "{outcome:?}"
    );
    assert!(outcome.server.is_some(), "{outcome:?}");

    // A tampered client certificate is refused by the server the same way.
    let mut client_der = pki.client.cert_der().unwrap().to_vec();
    let last = client_der.len() - 1;
    client_der[last] ^= 0x01;
    let verifier =
        WebPkiClientVerifier::builder_with_provider(roots(&[&pki.ca.cert_der().unwrap()]), gm())
            .build()
            .unwrap();
    let err = verifier
        .verify_client_cert(&CertificateDer::from(client_der), &[], UnixTime::now())
        .unwrap_err();
    assert_eq!(
        err,
        Error::InvalidCertificate(CertificateError::BadSignature)
    );
}

#[test]
fn server_name_mismatch_is_refused() {
    let pki = gm_pki();
    let (client, server) = gm_configs(&pki);
    let (mut c, mut s) = pair(client, server, "example.com");
    let outcome = handshake(&mut c, &mut s);
    assert!(
        matches!(
            outcome.client,
            Some(Error::InvalidCertificate(
                CertificateError::NotValidForNameContext { .. }
            ))
        ),
        "{outcome:?}"
    );
}

/// A combined server: SM2 certificate for SM clients, ECDSA for the rest, client
/// certificates of either kind.
fn combined_server(gm: &GmPki, std: &StdPki) -> ServerConfig {
    let provider = Arc::new(combined_provider(ring_provider()));
    let sm2_key = Arc::new(
        sm2_certified_key(chain(&gm.server.cert_pem), &gm.server.key_der().unwrap()).unwrap(),
    );
    let std_key = Arc::new(
        CertifiedKey::from_der(
            vec![std.server_der.clone()],
            std.server_key.clone_key(),
            &provider,
        )
        .unwrap(),
    );
    let verifier = WebPkiClientVerifier::builder_with_provider(
        roots(&[&gm.ca.cert_der().unwrap(), &std.ca_der]),
        provider.clone(),
    )
    .build()
    .unwrap();
    ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(Arc::new(DualCertResolver::new(sm2_key, std_key)))
}

#[test]
fn combined_server_serves_sm_only_client() {
    let gm_pki = gm_pki();
    let std = std_pki();
    let client = client_config(
        gm(),
        roots(&[&gm_pki.ca.cert_der().unwrap()]),
        chain(&gm_pki.client.cert_pem),
        gm_pki.client.key_der().unwrap(),
    )
    .unwrap();
    let (mut c, mut s) = pair(client, combined_server(&gm_pki, &std), "localhost");
    let outcome = handshake(&mut c, &mut s);
    assert!(outcome.ok(), "{outcome:?}");
    assert_eq!(
        s.negotiated_cipher_suite().unwrap().suite(),
        TLS_SM4_GCM_SM3_ID
    );
    assert_eq!(
        s.negotiated_key_exchange_group().unwrap().name(),
        CURVE_SM2_ID
    );
    assert_eq!(
        c.peer_certificates().unwrap()[0],
        gm_pki.server.cert_der().unwrap()
    );
    assert_eq!(
        san_uris(&s.peer_certificates().unwrap()[0]).unwrap(),
        vec!["aether://member/m1"]
    );
    assert_eq!(send(&mut c, &mut s, b"sm"), b"sm");
}

#[test]
fn combined_server_serves_standard_only_client() {
    let gm_pki = gm_pki();
    let std = std_pki();
    let client = client_config(
        Arc::new(ring_provider()),
        roots(&[&std.ca_der]),
        vec![std.client_der.clone()],
        std.client_key.clone_key(),
    )
    .unwrap();
    let (mut c, mut s) = pair(client, combined_server(&gm_pki, &std), "localhost");
    let outcome = handshake(&mut c, &mut s);
    assert!(outcome.ok(), "{outcome:?}");
    let suite = s.negotiated_cipher_suite().unwrap().suite();
    assert_ne!(suite, TLS_SM4_GCM_SM3_ID);
    assert_ne!(
        s.negotiated_key_exchange_group().unwrap().name(),
        CURVE_SM2_ID
    );
    assert_eq!(c.peer_certificates().unwrap()[0], std.server_der);
    assert_eq!(
        san_uris(&s.peer_certificates().unwrap()[0]).unwrap(),
        vec!["aether://worker/w1"]
    );
    assert_eq!(send(&mut s, &mut c, b"std"), b"std");
}

#[test]
fn combined_client_prefers_sm_with_combined_server() {
    let gm_pki = gm_pki();
    let std = std_pki();
    let client = client_config(
        Arc::new(combined_provider(ring_provider())),
        roots(&[&gm_pki.ca.cert_der().unwrap(), &std.ca_der]),
        chain(&gm_pki.client.cert_pem),
        gm_pki.client.key_der().unwrap(),
    )
    .unwrap();
    let (mut c, mut s) = pair(client, combined_server(&gm_pki, &std), "localhost");
    let outcome = handshake(&mut c, &mut s);
    assert!(outcome.ok(), "{outcome:?}");
    assert_eq!(
        c.negotiated_cipher_suite().unwrap().suite(),
        TLS_SM4_GCM_SM3_ID
    );
    assert_eq!(
        c.negotiated_key_exchange_group().unwrap().name(),
        CURVE_SM2_ID
    );
    assert_eq!(
        c.peer_certificates().unwrap()[0],
        gm_pki.server.cert_der().unwrap()
    );
}

#[test]
fn combined_provider_tables_are_shared_between_calls() {
    let a = combined_provider(ring_provider());
    let b = combined_provider(ring_provider());
    assert!(std::ptr::eq(
        a.signature_verification_algorithms.all,
        b.signature_verification_algorithms.all
    ));
    assert!(std::ptr::addr_eq(a.key_provider, b.key_provider));
    assert_eq!(a.cipher_suites[0].suite(), TLS_SM4_GCM_SM3_ID);
    assert_eq!(a.kx_groups[0].name(), CURVE_SM2_ID);
    assert_eq!(
        a.cipher_suites.len(),
        ring_provider().cipher_suites.len() + 1
    );
}

/// With rustls' default versions (TLS 1.2 too when the `tls12` feature is on elsewhere in the
/// build) the SM provider still builds configs and negotiates TLS 1.3.
#[test]
fn gm_provider_with_default_protocol_versions() {
    let pki = gm_pki();
    let roots = roots(&[&pki.ca.cert_der().unwrap()]);
    let server = ServerConfig::builder_with_provider(gm())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain(&pki.server.cert_pem), pki.server.key_der().unwrap())
        .unwrap();
    let client = rustls::ClientConfig::builder_with_provider(gm())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let (mut c, mut s) = pair(client, server, "127.0.0.1");
    let outcome = handshake(&mut c, &mut s);
    assert!(outcome.ok(), "{outcome:?}");
    assert_eq!(c.protocol_version(), Some(rustls::ProtocolVersion::TLSv1_3));
    assert_eq!(
        c.negotiated_cipher_suite().unwrap().suite(),
        TLS_SM4_GCM_SM3_ID
    );
}
