//! Interoperability with Tongsuo 8.5 (`scripts/tongsuo.sh` builds it), a C implementation
//! of RFC 8998 that shares no code with this crate.
//!
//! Runs when `AETHER_TONGSUO_OPENSSL` names Tongsuo's `openssl`; otherwise each test prints
//! that it was skipped and passes (`scripts/test.sh` always sets it).
//!
//! Tongsuo runs with `-enable_sm_tls13_strict`, its RFC 8998 profile check (SM suite only
//! with an SM2 certificate, curveSM2 and sm2sig_sm3 required).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_gmtls::certs::{DevCa, pem_to_cert_chain, san_uris};
use aether_gmtls::{
    CURVE_SM2_ID, SM2SIG_SM3, Sm2SigningKey, TLS_SM4_GCM_SM3_ID, gm_provider, verify,
};
use common::{client_config, roots, server_config};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::SigningKey as _;
use rustls::{ClientConnection, ServerConnection, StreamOwned};

/// The TLS flags both Tongsuo ends use: TLS 1.3, the SM suite, curveSM2, sm2sig_sm3, strict.
const SM_FLAGS: &[&str] = &[
    "-tls1_3",
    "-ciphersuites",
    "TLS_SM4_GCM_SM3",
    "-groups",
    "SM2",
    "-sigalgs",
    "sm2sig_sm3",
    "-enable_sm_tls13_strict",
];

struct Tongsuo {
    bin: PathBuf,
    dir: tempfile::TempDir,
}

impl Tongsuo {
    /// `None` (and a note on stderr) when the variable is unset.
    fn find(test: &str) -> Option<Self> {
        let Some(bin) = std::env::var_os("AETHER_TONGSUO_OPENSSL") else {
            // Straight to stderr, past the test harness' capture, so the skip is seen.
            let _ = writeln!(
                std::io::stderr(),
                "{test}: skipped: AETHER_TONGSUO_OPENSSL is not set (scripts/tongsuo.sh builds Tongsuo)"
            );
            return None;
        };
        let bin = PathBuf::from(bin);
        let tongsuo = Self {
            bin,
            dir: tempfile::tempdir().unwrap(),
        };
        let version = tongsuo.run(&["version"]);
        assert!(
            String::from_utf8_lossy(&version.stdout).contains("Tongsuo"),
            "{} is not Tongsuo: {version:?}",
            tongsuo.bin.display()
        );
        Some(tongsuo)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, contents).unwrap();
        path
    }

    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.path(name)).unwrap()
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args).current_dir(self.dir.path());
        // The configuration `req` needs, next to the binary as scripts/tongsuo.sh installs it.
        if let Some(conf) = self
            .bin
            .parent()
            .and_then(Path::parent)
            .map(|p| p.join("ssl/openssl.cnf"))
            .filter(|p| p.exists())
        {
            cmd.env("OPENSSL_CONF", conf);
        }
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap()
    }

    /// Runs and insists on success.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "openssl {args:?} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A CA, a server certificate (localhost, 127.0.0.1) and a client certificate
    /// (`aether://member/ts1`), all issued by Tongsuo itself; keys are SEC1 (`ecparam`).
    fn issue_pki(&self) {
        self.ok(&["ecparam", "-name", "SM2", "-genkey", "-out", "ca.key"]);
        self.ok(&[
            "req",
            "-new",
            "-x509",
            "-sm3",
            "-key",
            "ca.key",
            "-subj",
            "/CN=Tongsuo test CA",
            "-days",
            "30",
            "-out",
            "ca.crt",
        ]);
        self.write(
            "server.ext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n\
             keyUsage=critical,digitalSignature\nbasicConstraints=critical,CA:FALSE\n",
        );
        self.write(
            "client.ext",
            "subjectAltName=URI:aether://member/ts1\nextendedKeyUsage=clientAuth\n\
             keyUsage=critical,digitalSignature\nbasicConstraints=critical,CA:FALSE\n",
        );
        for (name, cn) in [("server", "localhost"), ("client", "ts1")] {
            let key = format!("{name}.key");
            let csr = format!("{name}.csr");
            let crt = format!("{name}.crt");
            let ext = format!("{name}.ext");
            let subj = format!("/CN={cn}");
            self.ok(&["ecparam", "-name", "SM2", "-genkey", "-out", &key]);
            self.ok(&[
                "req", "-new", "-sm3", "-key", &key, "-subj", &subj, "-out", &csr,
            ]);
            self.ok(&[
                "x509",
                "-req",
                "-sm3",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "30",
                "-extfile",
                &ext,
                "-out",
                &crt,
            ]);
        }
    }
}

/// Kills the child when the test ends, however it ends.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `s_server` on an ephemeral port and returns it with the port it printed.
fn start_s_server(tongsuo: &Tongsuo, extra: &[&str]) -> (Reaper, u16) {
    let mut args = vec!["s_server", "-accept", "127.0.0.1:0", "-naccept", "1"];
    args.extend_from_slice(SM_FLAGS);
    args.extend_from_slice(extra);
    let mut child = tongsuo
        .command(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = drain(child.stderr.take().unwrap());
    let reaper = Reaper(child);
    let mut lines = BufReader::new(stdout).lines();
    while let Some(Ok(line)) = lines.next() {
        if let Some(addr) = line.strip_prefix("ACCEPT ") {
            let port = addr.rsplit(':').next().unwrap().trim().parse().unwrap();
            // Keep draining stdout so s_server never blocks on a full pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return (reaper, port);
        }
    }
    drop(reaper);
    panic!(
        "s_server did not print ACCEPT: {}",
        String::from_utf8_lossy(&stderr.join().unwrap())
    );
}

/// Reads a pipe to its end on a thread (so the child never blocks on it).
fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        buf
    })
}

/// Waits for `child` at most `limit`, then kills it and fails the test.
fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let stdout = drain(child.stdout.take().unwrap());
    let stderr = drain(child.stderr.take().unwrap());
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "openssl did not finish in {limit:?}: {}",
                String::from_utf8_lossy(&stderr.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

#[test]
fn rustls_client_to_tongsuo_server_mutual_auth() {
    let Some(tongsuo) = Tongsuo::find("rustls_client_to_tongsuo_server_mutual_auth") else {
        return;
    };
    tongsuo.issue_pki();
    let (_server, port) = start_s_server(
        &tongsuo,
        &[
            "-client_sigalgs",
            "sm2sig_sm3",
            "-cert",
            "server.crt",
            "-key",
            "server.key",
            "-CAfile",
            "ca.crt",
            "-Verify",
            "1",
            "-verify_return_error",
            "-www",
        ],
    );

    // Our client trusts Tongsuo's CA and presents Tongsuo's client cert and SEC1 key.
    let ca = pem_to_cert_chain(&tongsuo.read("ca.crt")).unwrap();
    let config = client_config(
        Arc::new(gm_provider()),
        roots(&[&ca[0]]),
        pem_to_cert_chain(&tongsuo.read("client.crt")).unwrap(),
        // SEC1 `EC PRIVATE KEY` after an `EC PARAMETERS` block, as `ecparam -genkey` writes.
        PrivateKeyDer::from_pem_slice(tongsuo.read("client.key").as_bytes()).unwrap(),
    )
    .unwrap();
    let conn = ClientConnection::new(Arc::new(config), ServerName::try_from("localhost").unwrap())
        .unwrap();
    let sock = TcpStream::connect(("127.0.0.1", port)).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut tls = StreamOwned::new(conn, sock);
    tls.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut page = Vec::new();
    match tls.read_to_end(&mut page) {
        Ok(_) => {}
        // s_server -www closes without close_notify.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        Err(e) => panic!("read: {e}"),
    }
    let page = String::from_utf8_lossy(&page);

    assert_eq!(
        tls.conn.negotiated_cipher_suite().unwrap().suite(),
        TLS_SM4_GCM_SM3_ID
    );
    assert_eq!(
        tls.conn.negotiated_key_exchange_group().unwrap().name(),
        CURVE_SM2_ID
    );
    // Tongsuo's view: the SM suite, curveSM2, sm2sig_sm3, and our client certificate.
    assert!(page.contains("HTTP/1.0 200 ok"), "{page}");
    assert!(page.contains("Cipher is TLS_SM4_GCM_SM3"), "{page}");
    assert!(page.contains("Shared groups: curveSM2"), "{page}");
    assert!(page.contains("Peer signature type: sm2sig_sm3"), "{page}");
    assert!(page.contains("Client certificate"), "{page}");
    assert!(page.contains("Subject: CN=ts1"), "{page}");
    assert!(page.contains("URI:aether://member/ts1"), "{page}");
}

#[test]
fn tongsuo_client_to_rustls_server_mutual_auth() {
    let Some(tongsuo) = Tongsuo::find("tongsuo_client_to_rustls_server_mutual_auth") else {
        return;
    };
    // Our PKI from the certs module; Tongsuo's client gets our client cert (PKCS#8 key).
    let ca = DevCa::generate("Aether interop CA").unwrap();
    let server = ca
        .issue_server("aether-gateway", &["localhost", "127.0.0.1"])
        .unwrap();
    let client = ca.issue_client("w7", "aether://worker/w7").unwrap();
    tongsuo.write("our-ca.pem", &ca.pem().cert_pem);
    tongsuo.write("our-client.pem", &client.cert_pem);
    tongsuo.write("our-client.key", &client.key_pem);

    let config = server_config(
        Arc::new(gm_provider()),
        roots(&[&ca.cert_der().unwrap()]),
        pem_to_cert_chain(&server.cert_pem).unwrap(),
        server.key_der().unwrap(),
    )
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let server_thread = std::thread::spawn(move || {
        // Bounded accept: if s_client never connects the test fails instead of hanging.
        let deadline = Instant::now() + Duration::from_secs(60);
        let sock = loop {
            match listener.accept() {
                Ok((sock, _)) => break sock,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "s_client never connected");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        sock.set_nonblocking(false).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let conn = ServerConnection::new(Arc::new(config)).unwrap();
        let mut tls = StreamOwned::new(conn, sock);
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while !line.ends_with(b"\n") {
            tls.read_exact(&mut byte).unwrap();
            line.push(byte[0]);
        }
        let suite = tls.conn.negotiated_cipher_suite().unwrap().suite();
        let group = tls.conn.negotiated_key_exchange_group().unwrap().name();
        let peer = san_uris(&tls.conn.peer_certificates().unwrap()[0]).unwrap();
        tls.write_all(format!("hello {}\n", peer.join(",")).as_bytes())
            .unwrap();
        tls.conn.send_close_notify();
        tls.flush().unwrap();
        (line, suite, group, peer)
    });

    let port_arg = format!("127.0.0.1:{port}");
    let mut args = vec!["s_client", "-connect", &port_arg];
    args.extend_from_slice(SM_FLAGS);
    args.extend_from_slice(&[
        "-CAfile",
        "our-ca.pem",
        "-cert",
        "our-client.pem",
        "-key",
        "our-client.key",
        "-servername",
        "localhost",
        "-verify_hostname",
        "localhost",
        "-verify_return_error",
        "-ign_eof",
    ]);
    let mut child = tongsuo
        .command(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hi from tongsuo\n")
        .unwrap();
    let out = wait_bounded(child, Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let (line, suite, group, peer) = server_thread.join().unwrap();

    assert!(out.status.success(), "s_client failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("Verify return code: 0 (ok)"), "{stdout}");
    assert!(stdout.contains("Cipher is TLS_SM4_GCM_SM3"), "{stdout}");
    assert!(
        stdout.contains("Peer signature type: sm2sig_sm3"),
        "{stdout}"
    );
    assert!(
        stdout.contains("Peer Temp Key: ECDH, SM2, 256 bits"),
        "{stdout}"
    );
    assert!(stdout.contains("Verified peername: localhost"), "{stdout}");
    assert!(stdout.contains("hello aether://worker/w7"), "{stdout}");
    assert_eq!(line, b"hi from tongsuo\n");
    assert_eq!(suite, TLS_SM4_GCM_SM3_ID);
    assert_eq!(group, CURVE_SM2_ID);
    assert_eq!(peer, vec!["aether://worker/w7"]);
}

#[test]
fn chains_verify_both_ways() {
    let Some(tongsuo) = Tongsuo::find("chains_verify_both_ways") else {
        return;
    };
    // Tongsuo verifies ours.
    let ca = DevCa::generate("Aether interop CA").unwrap();
    let server = ca
        .issue_server("aether-gateway", &["localhost", "127.0.0.1"])
        .unwrap();
    let member = ca.issue_client("m9", "aether://member/m9").unwrap();
    tongsuo.write("our-ca.pem", &ca.pem().cert_pem);
    tongsuo.write("our-server.pem", &server.cert_pem);
    tongsuo.write("our-member.pem", &member.cert_pem);
    let out = tongsuo.ok(&[
        "verify",
        "-CAfile",
        "our-ca.pem",
        "-purpose",
        "sslserver",
        "our-server.pem",
    ]);
    assert!(out.contains("our-server.pem: OK"), "{out}");
    let out = tongsuo.ok(&[
        "verify",
        "-CAfile",
        "our-ca.pem",
        "-purpose",
        "sslclient",
        "our-member.pem",
    ]);
    assert!(out.contains("our-member.pem: OK"), "{out}");
    let text = tongsuo.ok(&["x509", "-in", "our-member.pem", "-noout", "-text"]);
    assert!(text.contains("Signature Algorithm: SM2-with-SM3"), "{text}");
    assert!(text.contains("ASN1 OID: SM2"), "{text}");
    assert!(text.contains("URI:aether://member/m9"), "{text}");
    assert!(text.contains("TLS Web Client Authentication"), "{text}");
    // Tongsuo reads our PKCS#8 key as an SM2 key.
    tongsuo.write("our-member.key", &member.key_pem);
    let key = tongsuo.ok(&["pkey", "-in", "our-member.key", "-noout", "-text"]);
    assert!(key.contains("ASN1 OID: SM2"), "{key}");

    // We verify Tongsuo's.
    tongsuo.issue_pki();
    let provider = Arc::new(gm_provider());
    let ts_ca = pem_to_cert_chain(&tongsuo.read("ca.crt")).unwrap();
    let ts_server = pem_to_cert_chain(&tongsuo.read("server.crt")).unwrap();
    let ts_client = pem_to_cert_chain(&tongsuo.read("client.crt")).unwrap();
    let server_verifier =
        WebPkiServerVerifier::builder_with_provider(roots(&[&ts_ca[0]]), provider.clone())
            .build()
            .unwrap();
    server_verifier
        .verify_server_cert(
            &ts_server[0],
            &[],
            &ServerName::try_from("localhost").unwrap(),
            &[],
            UnixTime::now(),
        )
        .unwrap();
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(roots(&[&ts_ca[0]]), provider)
            .build()
            .unwrap();
    client_verifier
        .verify_client_cert(&ts_client[0], &[], UnixTime::now())
        .unwrap();
    assert_eq!(
        san_uris(&ts_client[0]).unwrap(),
        vec!["aether://member/ts1"]
    );
    // A CA from the certs module can be reloaded from Tongsuo-format files too.
    let reloaded = DevCa::from_pem(&tongsuo.read("ca.crt"), &tongsuo.read("ca.key")).unwrap();
    let leaf = reloaded.issue_client("m10", "aether://member/m10").unwrap();
    tongsuo.write("leaf-by-reloaded.pem", &leaf.cert_pem);
    let out = tongsuo.ok(&["verify", "-CAfile", "ca.crt", "leaf-by-reloaded.pem"]);
    assert!(out.contains("leaf-by-reloaded.pem: OK"), "{out}");
}

/// The CertificateVerify ID, checked directly: Tongsuo verifies our signature with
/// distid `TLSv1.3+GM+Cipher+Suite`, and we verify one Tongsuo made with it.
#[test]
fn sm2_handshake_signatures_cross_verify() {
    let Some(tongsuo) = Tongsuo::find("sm2_handshake_signatures_cross_verify") else {
        return;
    };
    let ca = DevCa::generate("Aether interop CA").unwrap();
    let leaf = ca.issue_client("sig", "aether://member/sig").unwrap();
    tongsuo.write("key.pem", &leaf.key_pem);
    tongsuo.write("cert.pem", &leaf.cert_pem);
    tongsuo.ok(&[
        "x509", "-in", "cert.pem", "-pubkey", "-noout", "-out", "pub.pem",
    ]);
    let message = b"TLS 1.3, server CertificateVerify\0transcript-hash-stand-in";
    std::fs::write(tongsuo.path("msg.bin"), message).unwrap();
    let distid = format!("distid:{}", verify::TLS13_SM2_ID);

    // Ours -> Tongsuo.
    let key = Sm2SigningKey::from_pem(&leaf.key_pem).unwrap();
    let signature = key
        .choose_scheme(&[SM2SIG_SM3])
        .unwrap()
        .sign(message)
        .unwrap();
    std::fs::write(tongsuo.path("ours.sig"), &signature).unwrap();
    let out = tongsuo.ok(&[
        "pkeyutl", "-verify", "-pubin", "-inkey", "pub.pem", "-rawin", "-digest", "sm3",
        "-pkeyopt", &distid, "-in", "msg.bin", "-sigfile", "ours.sig",
    ]);
    assert!(out.contains("Signature Verified Successfully"), "{out}");
    // With the certificate ID Tongsuo refuses it: the IDs really differ.
    let wrong = tongsuo.run(&[
        "pkeyutl",
        "-verify",
        "-pubin",
        "-inkey",
        "pub.pem",
        "-rawin",
        "-digest",
        "sm3",
        "-pkeyopt",
        "distid:1234567812345678",
        "-in",
        "msg.bin",
        "-sigfile",
        "ours.sig",
    ]);
    assert!(!wrong.status.success());

    // Tongsuo -> ours.
    tongsuo.ok(&[
        "pkeyutl",
        "-sign",
        "-inkey",
        "key.pem",
        "-rawin",
        "-digest",
        "sm3",
        "-pkeyopt",
        &distid,
        "-in",
        "msg.bin",
        "-out",
        "theirs.sig",
    ]);
    let theirs = std::fs::read(tongsuo.path("theirs.sig")).unwrap();
    let cert = leaf.cert_der().unwrap();
    let ee = webpki::EndEntityCert::try_from(&cert).unwrap();
    ee.verify_signature(&verify::SM2_SM3_TLS13, message, &theirs)
        .unwrap();
    assert!(
        ee.verify_signature(&verify::SM2_SM3_CERT, message, &theirs)
            .is_err()
    );
}
