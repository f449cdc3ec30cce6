//! ShangMi TLS 1.3 against a standard TLS 1.3 configuration, in memory, in one run.
//!
//! * `gm`: [`aether_gmtls::gm_provider`] — TLS_SM4_GCM_SM3, curveSM2, sm2sig_sm3, SM2
//!   certificates from [`aether_gmtls::certs::DevCa`].
//! * `standard`: rustls' ring provider cut down to TLS13_AES_128_GCM_SHA256 and X25519,
//!   ECDSA P-256 certificates made with rcgen.
//!
//! Both are TLS 1.3 only, the server requires a client certificate, resumption is off on both
//! ends (every handshake is a full one) and every chain is one leaf under a trusted CA.
//!
//! Measured, each `REPEATS` times (gm and standard alternating), printed as min/median/max:
//!
//! 1. Full mutually authenticated handshakes per second: a fresh client and server
//!    connection, records moved between them in one thread until both are done. The rate is
//!    for client and server together, i.e. the CPU cost of both ends.
//! 2. Bulk: on one established connection of each kind, one request of N bytes client →
//!    server and one response of N bytes server → client (writer, write_tls, read_tls,
//!    process_new_packets, reader on each side), averaged over `ROUND_TRIPS` round trips,
//!    for N = 600 and 4096.
//!
//! Run: `cargo bench -p aether-gmtls --bench suites`. `GMTLS_BENCH_ROUND_TRIPS` and
//! `GMTLS_BENCH_HANDSHAKES` override the counts (for a quick check only).

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use aether_gmtls::certs::pem_to_cert_chain;
use aether_gmtls::{CURVE_SM2_ID, TLS_SM4_GCM_SM3_ID, gm_provider};
use rustls::client::Resumption;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::ServerName;
use rustls::server::NoServerSessionStorage;
use rustls::{
    CipherSuite, ClientConfig, ClientConnection, Connection, HandshakeKind, NamedGroup,
    ProtocolVersion, ServerConfig, ServerConnection,
};

const REPEATS: usize = 5;
const HANDSHAKES: usize = 200;
const ROUND_TRIPS: usize = 200_000;
const MESSAGE_SIZES: [usize; 2] = [600, 4096];

/// One side of the comparison: its configs and what it must negotiate.
struct Kind {
    name: &'static str,
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
    suite: CipherSuite,
    group: NamedGroup,
}

/// Full handshakes only: no session cache or tickets on either end.
fn no_resumption(
    mut client: ClientConfig,
    mut server: ServerConfig,
) -> (ClientConfig, ServerConfig) {
    client.resumption = Resumption::disabled();
    server.session_storage = Arc::new(NoServerSessionStorage {});
    server.send_tls13_tickets = 0;
    (client, server)
}

fn gm_kind() -> Kind {
    let pki = common::gm_pki();
    let provider = Arc::new(gm_provider());
    let ca = pki.ca.cert_der().expect("SM2 CA certificate DER");
    let roots = common::roots(&[&ca]);
    let server = common::server_config(
        provider.clone(),
        roots.clone(),
        pem_to_cert_chain(&pki.server.cert_pem).expect("SM2 server chain"),
        pki.server.key_der().expect("SM2 server key"),
    )
    .expect("gm server config");
    let client = common::client_config(
        provider,
        roots,
        pem_to_cert_chain(&pki.client.cert_pem).expect("SM2 client chain"),
        pki.client.key_der().expect("SM2 client key"),
    )
    .expect("gm client config");
    let (client, server) = no_resumption(client, server);
    Kind {
        name: "gm",
        client: Arc::new(client),
        server: Arc::new(server),
        suite: TLS_SM4_GCM_SM3_ID,
        group: CURVE_SM2_ID,
    }
}

fn standard_kind() -> Kind {
    use rustls::crypto::ring::{cipher_suite, kx_group};
    let pki = common::std_pki();
    let provider = Arc::new(CryptoProvider {
        cipher_suites: vec![cipher_suite::TLS13_AES_128_GCM_SHA256],
        kx_groups: vec![kx_group::X25519],
        ..common::ring_provider()
    });
    let roots = common::roots(&[&pki.ca_der]);
    let server = common::server_config(
        provider.clone(),
        roots.clone(),
        vec![pki.server_der],
        pki.server_key,
    )
    .expect("standard server config");
    let client = common::client_config(provider, roots, vec![pki.client_der], pki.client_key)
        .expect("standard client config");
    let (client, server) = no_resumption(client, server);
    Kind {
        name: "standard",
        client: Arc::new(client),
        server: Arc::new(server),
        suite: CipherSuite::TLS13_AES_128_GCM_SHA256,
        group: NamedGroup::X25519,
    }
}

/// A fresh connection pair, handshaken and checked: TLS 1.3, a full handshake, the expected
/// suite and group on both ends, the client certificate seen by the server.
fn connect(kind: &Kind) -> (Connection, Connection) {
    let name = ServerName::try_from("localhost").expect("server name");
    let client = ClientConnection::new(kind.client.clone(), name).expect("client connection");
    let server = ServerConnection::new(kind.server.clone()).expect("server connection");
    let (mut client, mut server) = (Connection::from(client), Connection::from(server));
    let outcome = common::handshake(&mut client, &mut server);
    assert!(outcome.ok(), "{} handshake failed: {outcome:?}", kind.name);
    for conn in [&client, &server] {
        assert_eq!(conn.protocol_version(), Some(ProtocolVersion::TLSv1_3));
        assert_eq!(conn.handshake_kind(), Some(HandshakeKind::Full));
        let suite = conn
            .negotiated_cipher_suite()
            .expect("negotiated cipher suite")
            .suite();
        assert_eq!(
            suite, kind.suite,
            "{} negotiated the wrong suite",
            kind.name
        );
        let group = conn
            .negotiated_key_exchange_group()
            .expect("negotiated group")
            .name();
        assert_eq!(
            group, kind.group,
            "{} negotiated the wrong group",
            kind.name
        );
    }
    assert_eq!(
        server.peer_certificates().map(<[_]>::len),
        Some(1),
        "{}: the server saw no client certificate",
        kind.name
    );
    (client, server)
}

/// Handshakes per second (client and server together) over `count` handshakes.
fn time_handshakes(kind: &Kind, count: usize) -> f64 {
    let start = Instant::now();
    for _ in 0..count {
        black_box(connect(kind));
    }
    count as f64 / start.elapsed().as_secs_f64()
}

/// Reusable buffers for the bulk loop.
struct Scratch {
    wire: Vec<u8>,
    received: Vec<u8>,
}

/// `msg` from `from` to `to` as on a real connection: plaintext in, records out, records in,
/// plaintext out. Returns the record bytes that crossed.
fn one_way(from: &mut Connection, to: &mut Connection, msg: &[u8], scratch: &mut Scratch) -> usize {
    from.writer().write_all(msg).expect("buffer plaintext");
    scratch.wire.clear();
    while from.wants_write() {
        from.write_tls(&mut scratch.wire).expect("write_tls");
    }
    let mut records = &scratch.wire[..];
    while !records.is_empty() {
        to.read_tls(&mut records).expect("read_tls");
        to.process_new_packets().expect("process_new_packets");
    }
    scratch.received.resize(msg.len(), 0);
    to.reader()
        .read_exact(&mut scratch.received)
        .expect("read the whole message");
    assert!(scratch.received == msg, "message corrupted in transit");
    scratch.wire.len()
}

/// Microseconds per round trip (request + response of `size` bytes each) over `rounds`.
fn time_bulk(client: &mut Connection, server: &mut Connection, size: usize, rounds: usize) -> f64 {
    let mut request: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let mut response: Vec<u8> = (0..size).map(|i| (i % 241) as u8).collect();
    let mut scratch = Scratch {
        wire: Vec::with_capacity(size + 64),
        received: Vec::with_capacity(size),
    };
    let start = Instant::now();
    for round in 0..rounds {
        // A different message every round, so a stale one cannot pass the check.
        let stamp = (round as u64).to_le_bytes();
        request[..8].copy_from_slice(&stamp);
        response[..8].copy_from_slice(&stamp);
        one_way(client, server, &request, &mut scratch);
        one_way(server, client, &response, &mut scratch);
    }
    start.elapsed().as_secs_f64() * 1e6 / rounds as f64
}

/// Wire bytes of one `size`-byte message on `conn` (records and their overhead).
fn record_bytes(client: &mut Connection, server: &mut Connection, size: usize) -> usize {
    let mut scratch = Scratch {
        wire: Vec::new(),
        received: Vec::new(),
    };
    let msg = vec![0x5a; size];
    let sent = one_way(client, server, &msg, &mut scratch);
    one_way(server, client, &msg, &mut scratch);
    sent
}

/// min, median, max.
fn summary(mut samples: Vec<f64>) -> (f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    (
        samples[0],
        samples[samples.len() / 2],
        samples[samples.len() - 1],
    )
}

fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be a positive integer, got {v:?}")),
        Err(_) => default,
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn suite_name(suite: CipherSuite) -> String {
    match suite {
        s if s == TLS_SM4_GCM_SM3_ID => "TLS_SM4_GCM_SM3 (0x00c6)".to_owned(),
        s => format!("{s:?} (0x{:04x})", u16::from(s)),
    }
}

fn group_name(group: NamedGroup) -> String {
    match group {
        g if g == CURVE_SM2_ID => "curveSM2 (0x0029)".to_owned(),
        g => format!("{g:?} (0x{:04x})", u16::from(g)),
    }
}

fn main() {
    let handshakes = env_count("GMTLS_BENCH_HANDSHAKES", HANDSHAKES);
    let rounds = env_count("GMTLS_BENCH_ROUND_TRIPS", ROUND_TRIPS);
    assert!(handshakes > 0 && rounds > 0, "counts must be positive");

    let kinds = [gm_kind(), standard_kind()];

    println!("aether-gmtls suites bench: in memory, one thread, TLS 1.3, mutual authentication");
    println!("cpu: {}", cpu_model());
    println!("each figure: {REPEATS} repeats (gm and standard alternating), min / median / max");
    for kind in &kinds {
        // Establishes the expected suite and group (asserted in `connect`) before timing.
        let _ = connect(kind);
        println!(
            "  {:<8} suite {}, group {}, certificates: {}",
            kind.name,
            suite_name(kind.suite),
            group_name(kind.group),
            if kind.name == "gm" {
                "SM2 (sm2sig_sm3), DevCa"
            } else {
                "ECDSA P-256 (ecdsa_secp256r1_sha256), rcgen"
            }
        );
    }
    println!();

    // 1. Handshakes.
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    for kind in &kinds {
        time_handshakes(kind, handshakes.div_ceil(10)); // warm-up
    }
    for _ in 0..REPEATS {
        for (kind, samples) in kinds.iter().zip(&mut rates) {
            samples.push(time_handshakes(kind, handshakes));
        }
    }

    // 2. Bulk, on one established connection per kind.
    let mut conns: Vec<(Connection, Connection)> = kinds.iter().map(connect).collect();
    let mut bulk: Vec<(usize, usize, Vec<Vec<f64>>)> = Vec::new();
    for size in MESSAGE_SIZES {
        let wire = conns
            .iter_mut()
            .map(|(c, s)| record_bytes(c, s, size))
            .collect::<Vec<_>>();
        assert!(
            wire.windows(2).all(|w| w[0] == w[1]),
            "record overhead differs: {wire:?}"
        );
        for (c, s) in &mut conns {
            time_bulk(c, s, size, rounds.div_ceil(20)); // warm-up
        }
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
        for _ in 0..REPEATS {
            for ((c, s), out) in conns.iter_mut().zip(&mut samples) {
                out.push(time_bulk(c, s, size, rounds));
            }
        }
        bulk.push((size, wire[0], samples));
    }
    for ((client, server), kind) in conns.iter().zip(&kinds) {
        for conn in [client, server] {
            let suite = conn.negotiated_cipher_suite().map(|s| s.suite());
            assert_eq!(suite, Some(kind.suite), "{}: suite changed", kind.name);
        }
    }

    let row = |what: &str, name: &str, unit: &str, (min, med, max): (f64, f64, f64)| {
        println!("{what:<34} {name:<9} {unit:<13} {min:>10.2} {med:>10.2} {max:>10.2}");
    };
    println!(
        "{:<34} {:<9} {:<13} {:>10} {:>10} {:>10}",
        "measurement", "kind", "unit", "min", "median", "max"
    );
    println!("{}", "-".repeat(34 + 9 + 13 + 3 * 10 + 5));
    let what = format!("full mutual handshake (x{handshakes})");
    let medians: Vec<f64> = rates
        .iter()
        .zip(&kinds)
        .map(|(samples, kind)| {
            let s = summary(samples.clone());
            row(&what, kind.name, "handshakes/s", s);
            s.1
        })
        .collect();
    println!(
        "{:<34} {:<9} {:<13} {:>21.3}",
        "",
        "ratio",
        "gm/standard",
        medians[0] / medians[1]
    );
    for (size, wire, samples) in &bulk {
        let what = format!("request+response {size} B (x{rounds})");
        let medians: Vec<f64> = samples
            .iter()
            .zip(&kinds)
            .map(|(samples, kind)| {
                let s = summary(samples.clone());
                row(&what, kind.name, "us/request", s);
                s.1
            })
            .collect();
        println!(
            "{:<34} {:<9} {:<13} {:>21.3}   ({wire} B on the wire per message)",
            "",
            "ratio",
            "gm/standard",
            medians[0] / medians[1]
        );
    }
    println!();
    println!(
        "handshakes/s: connection setup + full TLS 1.3 handshake with client certificate, \
         client and server CPU together"
    );
    println!(
        "us/request: one message client->server and one server->client, each encrypted \
         and decrypted through write_tls/read_tls/process_new_packets"
    );
}
