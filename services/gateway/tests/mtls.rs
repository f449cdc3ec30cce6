//! Mutual TLS with real handshakes over loopback: who may call the clearing service,
//! with which certificate, and what the dev PKI writes to disk.

use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use aether_gateway::certs::{DevPkiSpec, InitOutcome, PkiLayout, init_dev_pki};
use aether_gateway::identity::{Role, require_member};
use aether_gateway::pb::FILE_DESCRIPTOR_SET;
use aether_gateway::pb::v1::clearing_service_client::ClearingServiceClient;
use aether_gateway::pb::v1::clearing_service_server::{ClearingService, ClearingServiceServer};
use aether_gateway::pb::v1::{
    KeyExchangeRequest, KeyExchangeResponse, SealedBatchRequest, SealedBatchResponse,
    SealedRequest, SealedResponse,
};
use aether_gateway::tls::{
    ClientTls, ServerTls, TlsPaths, client_tls_config, install_default_crypto_provider,
};
use tokio::net::TcpListener;
use tokio_stream::Stream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Server};
use tonic::{Code, Request, Response, Status, Streaming};

/// Answers Submit with the identity it authenticated; everything else is unimplemented.
struct WhoAmI;

#[tonic::async_trait]
impl ClearingService for WhoAmI {
    async fn key_exchange(
        &self,
        _: Request<KeyExchangeRequest>,
    ) -> Result<Response<KeyExchangeResponse>, Status> {
        Err(Status::unimplemented("test server"))
    }

    async fn submit(
        &self,
        request: Request<SealedRequest>,
    ) -> Result<Response<SealedResponse>, Status> {
        let peer = require_member(&request, &request.get_ref().member_id)?;
        Ok(Response::new(SealedResponse {
            request_id: request.get_ref().request_id.clone(),
            nonce: Vec::new(),
            ciphertext: peer.to_string().into_bytes(),
            issued_at: 0,
            error: None,
        }))
    }

    async fn submit_batch(
        &self,
        _: Request<SealedBatchRequest>,
    ) -> Result<Response<SealedBatchResponse>, Status> {
        Err(Status::unimplemented("test server"))
    }

    type SubmitStreamStream =
        Pin<Box<dyn Stream<Item = Result<SealedResponse, Status>> + Send + 'static>>;

    async fn submit_stream(
        &self,
        _: Request<Streaming<SealedRequest>>,
    ) -> Result<Response<Self::SubmitStreamStream>, Status> {
        Err(Status::unimplemented("test server"))
    }
}

struct Pki {
    _dir: tempfile::TempDir,
    layout: PkiLayout,
}

fn new_pki(members: &[&str], workers: &[&str]) -> Pki {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = DevPkiSpec {
        members: members.iter().map(|s| s.to_string()).collect(),
        workers: workers.iter().map(|s| s.to_string()).collect(),
        ..DevPkiSpec::default()
    };
    let report = init_dev_pki(dir.path(), &spec).expect("init dev pki");
    assert_eq!(report.outcome, InitOutcome::Created);
    Pki {
        layout: report.layout,
        _dir: dir,
    }
}

fn standard_pki() -> Pki {
    new_pki(&["bank-a", "bank-b"], &["gpu-1"])
}

/// Serves `WhoAmI` through our TLS 1.3 acceptor; the server task lives as long as the
/// test's runtime.
async fn serve(pki: &Pki) -> SocketAddr {
    let tls = ServerTls::load(&TlsPaths::server(&pki.layout)).expect("server tls");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let incoming = tls.incoming(listener);
    tokio::spawn(
        Server::builder()
            .add_service(ClearingServiceServer::new(WhoAmI))
            .serve_with_incoming(incoming),
    );
    addr
}

async fn connect(
    addr: SocketAddr,
    tls: ClientTlsConfig,
) -> Result<ClearingServiceClient<Channel>, tonic::transport::Error> {
    let channel = Endpoint::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(ClearingServiceClient::new(channel))
}

fn client_tls(pki: &Pki, role: Role, id: &str) -> ClientTlsConfig {
    client_tls_config(&TlsPaths::client(&pki.layout, role, id)).expect("client tls")
}

fn sealed(member_id: &str) -> SealedRequest {
    SealedRequest {
        member_id: member_id.into(),
        request_id: "req-1".into(),
        ..SealedRequest::default()
    }
}

/// Submits as `member_id`; Err(None) when the connection itself failed.
async fn submit(
    addr: SocketAddr,
    tls: ClientTlsConfig,
    member_id: &str,
) -> Result<String, Option<Status>> {
    let mut client = connect(addr, tls).await.map_err(|_| None)?;
    let response = client.submit(sealed(member_id)).await.map_err(Some)?;
    Ok(String::from_utf8_lossy(&response.get_ref().ciphertext).into_owned())
}

/// The TLS layer, not the service, must turn the caller away: either the connection
/// fails, or the first RPC fails with a transport error (UNAVAILABLE / UNKNOWN) — never
/// an answer or an identity error from the handler.
fn assert_refused_before_the_service(result: Result<String, Option<Status>>) {
    match result {
        Ok(answer) => panic!("refused client got an answer: {answer}"),
        Err(None) => {}
        Err(Some(status)) => assert!(
            matches!(status.code(), Code::Unavailable | Code::Unknown),
            "expected a transport failure, got {status:?}"
        ),
    }
}

#[tokio::test]
async fn a_member_certificate_can_call_and_is_identified() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let addr = serve(&pki).await;

    let seen = submit(addr, client_tls(&pki, Role::Member, "bank-a"), "bank-a").await;
    assert_eq!(seen.as_deref().ok(), Some("member/bank-a"), "{seen:?}");
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let addr = serve(&pki).await;

    let ca = std::fs::read(pki.layout.ca().cert).expect("ca");
    let no_identity = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    // With TLS 1.3 the client may believe it is connected; the first RPC must fail.
    let result = submit(addr, no_identity, "bank-a").await;
    assert_refused_before_the_service(result);
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let other = new_pki(&["bank-a"], &[]);
    let addr = serve(&pki).await;

    // Trusts the real server CA, but presents a bank-a certificate from another CA.
    let paths = TlsPaths {
        ca: pki.layout.ca().cert,
        ..TlsPaths::client(&other.layout, Role::Member, "bank-a")
    };
    let tls = client_tls_config(&paths).expect("client tls");
    let result = submit(addr, tls, "bank-a").await;
    assert_refused_before_the_service(result);
}

#[tokio::test]
async fn a_worker_certificate_may_not_clear() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let addr = serve(&pki).await;

    let result = submit(addr, client_tls(&pki, Role::Worker, "gpu-1"), "gpu-1").await;
    let status = result
        .expect_err("worker cleared a trade")
        .expect("connected");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("worker"), "{status:?}");
}

#[tokio::test]
async fn a_member_may_not_claim_another_members_id() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let addr = serve(&pki).await;

    let result = submit(addr, client_tls(&pki, Role::Member, "bank-a"), "bank-b").await;
    let status = result
        .expect_err("bank-a cleared as bank-b")
        .expect("connected");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("bank-a") && status.message().contains("bank-b"),
        "{status:?}"
    );
}

#[tokio::test]
async fn the_server_certificate_verifies_for_localhost_and_loopback_ip_only() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let addr = serve(&pki).await;
    let tls = || client_tls(&pki, Role::Member, "bank-a");

    for name in ["localhost", "127.0.0.1"] {
        let seen = submit(addr, tls().domain_name(name), "bank-a").await;
        assert_eq!(
            seen.as_deref().ok(),
            Some("member/bank-a"),
            "{name}: {seen:?}"
        );
    }
    let wrong = submit(addr, tls().domain_name("gateway.example.com"), "bank-a").await;
    assert!(wrong.is_err(), "server cert accepted for a name it lacks");
}

#[tokio::test]
async fn tls_1_2_is_refused_by_the_acceptor() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let addr = serve(&pki).await;

    let handshake = |version: &'static rustls::SupportedProtocolVersion| {
        let layout = pki.layout.clone();
        async move {
            let ca = std::fs::read(layout.ca().cert).expect("ca");
            let mut roots = rustls::RootCertStore::empty();
            use rustls::pki_types::pem::PemObject as _;
            for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&ca) {
                roots.add(cert.expect("ca pem")).expect("ca anchor");
            }
            let member = layout.member("bank-a");
            let chain = rustls::pki_types::CertificateDer::pem_file_iter(&member.cert)
                .expect("cert")
                .collect::<Result<Vec<_>, _>>()
                .expect("cert pem");
            let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&member.key).expect("key");
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_protocol_versions(&[version])
            .expect("versions")
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .expect("client config");
            let tcp = tokio::net::TcpStream::connect(addr).await.expect("tcp");
            let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
            tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(name, tcp)
                .await
                .map(|tls| tls.get_ref().1.protocol_version())
        }
    };

    let v13 = handshake(&rustls::version::TLS13).await;
    assert_eq!(v13.ok().flatten(), Some(rustls::ProtocolVersion::TLSv1_3));
    let v12 = handshake(&rustls::version::TLS12).await;
    assert!(v12.is_err(), "TLS 1.2 handshake succeeded: {v12:?}");
}

#[tokio::test]
async fn tonics_own_server_tls_config_also_requires_a_client_certificate() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let tls = ServerTls::load(&TlsPaths::server(&pki.layout)).expect("server tls");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let router = Server::builder()
        .tls_config(tls.tonic_config())
        .expect("tls config")
        .add_service(ClearingServiceServer::new(WhoAmI));
    tokio::spawn(router.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));

    let seen = submit(addr, client_tls(&pki, Role::Member, "bank-b"), "bank-b").await;
    assert_eq!(seen.as_deref().ok(), Some("member/bank-b"), "{seen:?}");

    let ca = std::fs::read(pki.layout.ca().cert).expect("ca");
    let anonymous = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    assert!(submit(addr, anonymous, "bank-b").await.is_err());
}

#[tokio::test]
async fn health_and_reflection_are_served_next_to_clearing() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    install_default_crypto_provider();
    let pki = standard_pki();
    let tls = ServerTls::load(&TlsPaths::server(&pki.layout)).expect("server tls");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<ClearingServiceServer<WhoAmI>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("reflection");
    tokio::spawn(
        Server::builder()
            .add_service(health)
            .add_service(reflection)
            .add_service(ClearingServiceServer::new(WhoAmI))
            .serve_with_incoming(tls.incoming(listener)),
    );

    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .expect("uri")
        .tls_config(client_tls(&pki, Role::Member, "bank-a"))
        .expect("tls")
        .connect()
        .await
        .expect("connect");

    let mut health = HealthClient::new(channel.clone());
    for service in ["", "aether.v1.ClearingService"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health check")
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
    }

    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection call")
        .into_inner();
    let answer = answers
        .message()
        .await
        .expect("reflection answer")
        .expect("one answer");
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("unexpected reflection answer {answer:?}");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    for expected in [
        "aether.v1.ClearingService",
        "aether.v1.WorkerService",
        "aether.v1.SnapshotParticipant",
        "grpc.health.v1.Health",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }
}

#[cfg(unix)]
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path)
        .expect("metadata")
        .permissions()
        .mode()
        & 0o777
}

#[cfg(unix)]
#[test]
fn certs_init_keeps_keys_private_and_never_overwrites_without_force() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = DevPkiSpec {
        members: vec!["bank-a".into()],
        workers: vec!["gpu-1".into()],
        ..DevPkiSpec::default()
    };
    let first = init_dev_pki(dir.path(), &spec).expect("first init");
    assert_eq!(first.outcome, InitOutcome::Created);
    let layout = first.layout;
    let keys: Vec<_> = first
        .written
        .iter()
        .filter(|p| p.to_string_lossy().ends_with(".key.pem"))
        .collect();
    assert_eq!(
        keys.len(),
        4,
        "ca, server, member, worker keys: {:?}",
        first.written
    );
    for key in keys {
        assert_eq!(mode(key), 0o600, "{}", key.display());
    }
    assert_eq!(mode(&layout.ca().cert), 0o644);

    let ca_before = std::fs::read(layout.ca().cert).expect("ca");
    let member_before = std::fs::read(layout.member("bank-a").key).expect("member key");

    // Same spec again: nothing written, nothing changed.
    let again = init_dev_pki(dir.path(), &spec).expect("second init");
    assert_eq!(again.outcome, InitOutcome::Exists);
    assert!(again.written.is_empty(), "{:?}", again.written);
    assert_eq!(std::fs::read(layout.ca().cert).expect("ca"), ca_before);

    // A new member: issued by the existing CA; existing files untouched.
    let more = DevPkiSpec {
        members: vec!["bank-a".into(), "bank-c".into()],
        ..spec.clone()
    };
    let extended = init_dev_pki(dir.path(), &more).expect("extend");
    assert_eq!(extended.outcome, InitOutcome::Extended);
    assert_eq!(
        extended.written,
        vec![layout.member("bank-c").key, layout.member("bank-c").cert]
    );
    assert_eq!(mode(&layout.member("bank-c").key), 0o600);
    assert_eq!(std::fs::read(layout.ca().cert).expect("ca"), ca_before);
    assert_eq!(
        std::fs::read(layout.member("bank-a").key).expect("key"),
        member_before
    );
    // The new certificate chains to the old CA: loadable as a client identity.
    client_tls_config(&TlsPaths::client(&layout, Role::Member, "bank-c")).expect("bank-c tls");

    // force: a new CA.
    let forced = init_dev_pki(
        dir.path(),
        &DevPkiSpec {
            force: true,
            ..spec.clone()
        },
    )
    .expect("force");
    assert_eq!(forced.outcome, InitOutcome::Created);
    assert_ne!(std::fs::read(layout.ca().cert).expect("ca"), ca_before);
    assert!(
        !layout.member("bank-c").cert.exists(),
        "old CA's certificate left behind"
    );

    // Half a CA is refused rather than silently replaced.
    std::fs::remove_file(layout.ca().key).expect("rm ca key");
    let err = init_dev_pki(dir.path(), &spec).expect_err("incomplete CA accepted");
    assert!(err.to_string().contains("ca.key.pem"), "{err}");

    // Ids outside [a-z0-9][a-z0-9._-]{0,62} are refused.
    let bad = DevPkiSpec {
        members: vec!["Bank A".into()],
        ..DevPkiSpec::default()
    };
    let err = init_dev_pki(tempfile::tempdir().expect("tempdir").path(), &bad).expect_err("bad id");
    assert!(err.to_string().contains("Bank A"), "{err}");
}

#[test]
fn loading_names_the_file_at_fault() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let good = TlsPaths::server(&pki.layout);

    let missing = TlsPaths {
        key: pki.layout.certs_dir.join("nope.key.pem"),
        ..good.clone()
    };
    let err = ServerTls::load(&missing).expect_err("missing key");
    assert!(
        err.to_string().contains("private key file") && err.to_string().contains("nope.key.pem"),
        "{err}"
    );

    // A certificate where the key should be.
    let swapped = TlsPaths {
        key: good.cert.clone(),
        ..good.clone()
    };
    let err = ServerTls::load(&swapped).expect_err("cert as key");
    assert!(
        err.to_string().contains("server.pem") && err.to_string().contains("PRIVATE KEY"),
        "{err}"
    );

    // Someone else's key.
    let mismatched = TlsPaths {
        key: pki.layout.member("bank-a").key,
        ..good
    };
    let err = ServerTls::load(&mismatched).expect_err("mismatched key");
    assert!(err.to_string().contains("member-bank-a.key.pem"), "{err}");
}

#[test]
fn dev_certificates_carry_the_documented_names() {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    use x509_parser::prelude::{FromDer as _, GeneralName, X509Certificate};

    let pki = standard_pki();
    let names = |path: &Path| -> (Vec<String>, Vec<String>) {
        let der = CertificateDer::from_pem_file(path).expect("pem");
        let (_, cert) = X509Certificate::from_der(&der).expect("x509");
        let cns = cert
            .subject()
            .iter_common_name()
            .filter_map(|cn| cn.as_str().ok().map(str::to_owned))
            .collect();
        let sans = cert
            .subject_alternative_name()
            .expect("san")
            .map(|san| {
                san.value
                    .general_names
                    .iter()
                    .map(|name| match name {
                        GeneralName::DNSName(s) => format!("dns:{s}"),
                        GeneralName::URI(s) => format!("uri:{s}"),
                        GeneralName::IPAddress(b) => match b.len() {
                            4 => format!(
                                "ip:{}",
                                std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).expect("v4"))
                            ),
                            _ => format!(
                                "ip:{}",
                                std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).expect("v6"))
                            ),
                        },
                        other => format!("{other}"),
                    })
                    .collect()
            })
            .unwrap_or_default();
        (cns, sans)
    };

    let (cn, sans) = names(&pki.layout.server().cert);
    assert_eq!(cn, ["aether-gateway"]);
    assert_eq!(sans, ["dns:localhost", "ip:127.0.0.1", "ip:::1"]);
    let (cn, sans) = names(&pki.layout.member("bank-a").cert);
    assert_eq!(
        (cn, sans),
        (
            vec!["bank-a".to_owned()],
            vec!["uri:aether://member/bank-a".to_owned()]
        )
    );
    let (cn, sans) = names(&pki.layout.worker("gpu-1").cert);
    assert_eq!(
        (cn, sans),
        (
            vec!["gpu-1".to_owned()],
            vec!["uri:aether://worker/gpu-1".to_owned()]
        )
    );
}

#[tokio::test]
async fn the_coalescing_client_connector_is_identified_and_checks_the_server() {
    install_default_crypto_provider();
    let pki = standard_pki();
    let addr = serve(&pki).await;
    let paths = TlsPaths::client(&pki.layout, Role::Member, "bank-a");
    let tls = ClientTls::load(&paths).expect("client tls");

    // Over our connector the server sees bank-a's certificate.
    let channel = tls
        .connect(&format!("https://{addr}"))
        .await
        .expect("connect");
    let answer = ClearingServiceClient::new(channel)
        .submit(sealed("bank-a"))
        .await
        .expect("submit")
        .into_inner();
    let who = String::from_utf8(answer.ciphertext).expect("utf-8");
    assert!(who.contains("bank-a"), "{who}");

    // A plain-text endpoint is refused before anything connects.
    let e = tls
        .connect(&format!("http://{addr}"))
        .await
        .expect_err("http accepted");
    assert!(e.to_string().contains("https://"), "{e}");

    // A server whose certificate does not chain to the client's CA fails the handshake.
    let other = new_pki(&["bank-a"], &[]);
    let stranger = ClientTls::load(&TlsPaths {
        ca: other.layout.ca().cert,
        ..paths.clone()
    })
    .expect("client tls");
    let e = stranger
        .connect(&format!("https://{addr}"))
        .await
        .expect_err("an untrusted server was accepted");
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
}

/// `--sm2`: the SM2 PKI lives in `certs/sm2`, beside the standard one and untouched by it;
/// re-running issues only what is missing, from the same CA, with keys kept private; its
/// server identity loads under `gm` and its client identities load too, while a `gm` server
/// refuses to start on a standard identity.
#[cfg(unix)]
#[test]
fn the_sm2_pki_is_kept_apart_extended_from_its_own_ca_and_loads_under_gm() {
    use aether_gateway::certs::KeyAlgorithm;
    use aether_gateway::tls::{ServerIdentities, TlsSuite};
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = DevPkiSpec {
        members: vec!["bank-a".into()],
        workers: vec!["gpu-1".into()],
        algorithm: KeyAlgorithm::Sm2,
        ..DevPkiSpec::default()
    };
    let first = init_dev_pki(dir.path(), &spec).expect("sm2 init");
    assert_eq!(first.outcome, InitOutcome::Created);
    assert_eq!(first.layout, PkiLayout::sm2(dir.path()));
    assert!(!PkiLayout::new(dir.path()).ca().cert.exists());
    let standard = init_dev_pki(dir.path(), &DevPkiSpec::default()).expect("standard init");
    assert_eq!(standard.outcome, InitOutcome::Created);
    let layout = first.layout;
    let ca_before = std::fs::read(layout.ca().cert).expect("ca");
    let extended = init_dev_pki(
        dir.path(),
        &DevPkiSpec {
            members: vec!["bank-a".into(), "bank-c".into()],
            ..spec.clone()
        },
    )
    .expect("extend");
    assert_eq!(extended.outcome, InitOutcome::Extended);
    assert_eq!(
        extended.written,
        vec![layout.member("bank-c").key, layout.member("bank-c").cert]
    );
    assert_eq!(mode(&layout.member("bank-c").key), 0o600);
    assert_eq!(std::fs::read(layout.ca().cert).expect("ca"), ca_before);

    ServerTls::load_suite(
        TlsSuite::Gm,
        &ServerIdentities::dev(dir.path(), TlsSuite::Gm),
    )
    .expect("gm server identity");
    ServerTls::load_suite(
        TlsSuite::Both,
        &ServerIdentities::dev(dir.path(), TlsSuite::Both),
    )
    .expect("both server identities");
    ClientTls::dev(dir.path(), TlsSuite::Gm, Role::Member, "bank-c").expect("bank-c over gm");
    let wrong = ServerTls::load_suite(
        TlsSuite::Gm,
        &ServerIdentities {
            standard: None,
            sm2: Some(TlsPaths::server(&PkiLayout::new(dir.path()))),
        },
    )
    .expect_err("an ECDSA key is no SM2 identity");
    assert!(wrong.to_string().contains("rejected"), "{wrong}");
    let missing = ServerTls::load_suite(TlsSuite::Both, &ServerIdentities::default())
        .expect_err("both needs two identities");
    assert!(
        missing.to_string().contains("--tls-suite both"),
        "{missing}"
    );
}
