//! The envelope as a member and the gateway use it: round trips, and every way it refuses.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use aether_gateway::envelope::{
    Aad, Direction, EnvelopeError, EnvelopeKey, ErrorKind, KEY_HEADER_LEN, MAX_PLAINTEXT_LEN,
    RequestKeys, RequestKeysPolicy, SessionKeys, SessionPolicy, Sm4Key, TAG_LEN,
    decode_wrapped_key, encode_wrapped_key, open, seal, wrap_key,
};

const NOW: u64 = 1_767_225_600; // 2026-01-01T00:00:00Z
const SUBMIT: &str = "/aether.v1.ClearingService/Submit";

fn request_aad<'a>(request_id: &'a str, key_id: &'a str) -> Aad<'a> {
    Aad {
        direction: Direction::Request,
        method: SUBMIT,
        request_id,
        member_id: "member-0042",
        key_id,
        issued_at: NOW,
    }
}

fn flip(bytes: &[u8], index: usize) -> Vec<u8> {
    let mut out = bytes.to_vec();
    out[index] ^= 0x01;
    out
}

// ---------------------------------------------------------------- server key

#[test]
fn server_key_is_created_private_and_loads_back_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys/envelope-sm2.pem");
    let (created, fresh) = EnvelopeKey::load_or_create(&path).unwrap();
    assert!(fresh);
    let (loaded, fresh) = EnvelopeKey::load_or_create(&path).unwrap();
    assert!(!fresh);
    assert_eq!(created.public_key_hex(), loaded.public_key_hex());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let pem = std::fs::read_to_string(&path).unwrap();
    assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----"));
}

#[test]
fn server_public_key_is_uncompressed_sec1_and_pem() {
    let key = EnvelopeKey::generate();
    let sec1 = key.public_key_sec1();
    assert_eq!(sec1.len(), 65);
    assert_eq!(sec1[0], 0x04);
    assert_eq!(key.public_key_hex(), hex::encode(&sec1));
    assert!(
        key.public_key_pem()
            .unwrap()
            .starts_with("-----BEGIN PUBLIC KEY-----")
    );
}

#[test]
fn a_file_that_is_not_a_key_is_refused_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envelope-sm2.pem");
    std::fs::write(&path, "not a key").unwrap();
    let err = EnvelopeKey::load_or_create(&path).unwrap_err();
    assert!(matches!(err, EnvelopeError::ServerKey(_)));
    assert!(err.to_string().contains("envelope-sm2.pem"), "{err}");
    assert_eq!(err.kind(), ErrorKind::Internal);
}

#[test]
fn no_secret_appears_in_debug_output() {
    let server = EnvelopeKey::generate();
    let pem = server.to_pkcs8_pem().unwrap();
    let shown = format!("{server:?}");
    assert!(shown.contains(&server.public_key_hex()));
    assert!(!shown.contains("PRIVATE"));
    let body: String = pem.lines().nth(1).unwrap().chars().take(20).collect();
    assert!(!shown.contains(&body));

    let key = Sm4Key::from_bytes(*b"0123456789abcdef");
    let shown = format!(
        "{key:?} {:?}",
        open(&key, &request_aad("r", ""), &[0; 12], &[0; 40])
    );
    assert!(!shown.contains("0123456789abcdef"), "{shown}");
    assert!(
        !shown.contains(&hex::encode(b"0123456789abcdef")),
        "{shown}"
    );
}

// ---------------------------------------------------------------- key wrap

#[test]
fn wrapped_key_is_113_bytes_c1c3c2_and_unwraps() {
    let server = EnvelopeKey::generate();
    let key = Sm4Key::generate().unwrap();
    let wrapped = wrap_key(&server.public_key(), &key).unwrap();
    assert_eq!(wrapped.len(), 113);
    assert_eq!(wrapped[0], 0x04);
    assert_eq!(
        server.unwrap_key(&wrapped).unwrap().expose_bytes(),
        key.expose_bytes()
    );
    // Random k: wrapping the same key twice gives different bytes.
    assert_ne!(wrap_key(&server.public_key(), &key).unwrap(), wrapped);
}

#[test]
fn key_header_is_padded_standard_base64() {
    let server = EnvelopeKey::generate();
    let key = Sm4Key::generate().unwrap();
    let wrapped = wrap_key(&server.public_key(), &key).unwrap();
    let header = encode_wrapped_key(&wrapped);
    assert_eq!(header.len(), KEY_HEADER_LEN);
    assert!(header.ends_with('=') && !header.ends_with("=="));
    assert_eq!(decode_wrapped_key(&header).unwrap(), wrapped);
    let (unwrapped, raw) = server.unwrap_key_header(&header).unwrap();
    assert_eq!(raw, wrapped);
    assert_eq!(unwrapped.expose_bytes(), key.expose_bytes());
}

#[test]
fn key_header_errors_are_precise() {
    let server = EnvelopeKey::generate();
    let wrapped = wrap_key(&server.public_key(), &Sm4Key::generate().unwrap()).unwrap();
    let header = encode_wrapped_key(&wrapped);
    for bad in [
        "not base64!",
        &header[..header.len() - 1],                 // padding missing
        &format!(" {header}"),                       // whitespace
        &header.replace('+', "-").replace('/', "_"), // URL-safe alphabet
    ] {
        if bad == header {
            continue;
        }
        assert_eq!(
            decode_wrapped_key(bad),
            Err(EnvelopeError::BadBase64),
            "{bad:?}"
        );
    }
    use base64::Engine as _;
    let short = base64::engine::general_purpose::STANDARD.encode(&wrapped[..112]);
    assert_eq!(
        decode_wrapped_key(&short),
        Err(EnvelopeError::WrappedKeyLength(112))
    );
    assert_eq!(
        server.unwrap_key(&[0u8; 114]).unwrap_err(),
        EnvelopeError::WrappedKeyLength(114)
    );
    assert_eq!(
        server.unwrap_key(&[]).unwrap_err(),
        EnvelopeError::WrappedKeyLength(0)
    );
}

#[test]
fn key_wrapped_to_another_server_does_not_unwrap() {
    let server = EnvelopeKey::generate();
    let other = EnvelopeKey::generate();
    let wrapped = wrap_key(&other.public_key(), &Sm4Key::generate().unwrap()).unwrap();
    let err = server.unwrap_key(&wrapped).unwrap_err();
    assert_eq!(err, EnvelopeError::KeyUnwrap);
    assert_eq!(err.kind(), ErrorKind::Unauthenticated);
}

#[test]
fn any_flipped_bit_in_the_wrapped_key_is_refused() {
    let server = EnvelopeKey::generate();
    let wrapped = wrap_key(&server.public_key(), &Sm4Key::generate().unwrap()).unwrap();
    // C1 tag, C1.x, C1.y, C3, C2.
    for index in [0, 1, 40, 64, 65, 80, 96, 97, 105, 112] {
        assert_eq!(
            server.unwrap_key(&flip(&wrapped, index)).unwrap_err(),
            EnvelopeError::KeyUnwrap,
            "byte {index}"
        );
    }
    // A C1 that is not on the curve, and an all-zero one.
    let mut off_curve = wrapped;
    off_curve[1..65].fill(0x11);
    assert_eq!(
        server.unwrap_key(&off_curve).unwrap_err(),
        EnvelopeError::KeyUnwrap
    );
    assert_eq!(
        server.unwrap_key(&[0u8; 113]).unwrap_err(),
        EnvelopeError::KeyUnwrap
    );
}

// ---------------------------------------------------------------- SM4-GCM

#[test]
fn seal_open_round_trip_including_empty_and_max_size() {
    let key = Sm4Key::generate().unwrap();
    let aad = request_aad("req-1", "");
    for plaintext in [
        Vec::new(),
        b"x".to_vec(),
        vec![0xa5; 4096],
        vec![7; MAX_PLAINTEXT_LEN],
    ] {
        let sealed = seal(&key, &aad, &plaintext).unwrap();
        assert_eq!(sealed.ciphertext.len(), plaintext.len() + TAG_LEN);
        assert_eq!(
            open(&key, &aad, &sealed.nonce, &sealed.ciphertext).unwrap(),
            plaintext
        );
    }
}

#[test]
fn oversize_payloads_are_refused_both_ways() {
    let key = Sm4Key::generate().unwrap();
    let aad = request_aad("req-1", "");
    let err = seal(&key, &aad, &vec![0; MAX_PLAINTEXT_LEN + 1]).unwrap_err();
    assert_eq!(
        err,
        EnvelopeError::TooLarge {
            len: MAX_PLAINTEXT_LEN + 1,
            max: MAX_PLAINTEXT_LEN
        }
    );
    assert_eq!(err.kind(), ErrorKind::ResourceExhausted);
    let err = open(
        &key,
        &aad,
        &[0; 12],
        &vec![0; MAX_PLAINTEXT_LEN + TAG_LEN + 1],
    )
    .unwrap_err();
    assert!(matches!(err, EnvelopeError::TooLarge { .. }));
}

#[test]
fn every_flipped_bit_of_nonce_ciphertext_and_tag_is_refused() {
    let key = Sm4Key::generate().unwrap();
    let aad = request_aad("req-1", "");
    let sealed = seal(&key, &aad, b"netting batch 7").unwrap();
    for i in 0..sealed.nonce.len() {
        assert_eq!(
            open(&key, &aad, &flip(&sealed.nonce, i), &sealed.ciphertext),
            Err(EnvelopeError::Authentication),
            "nonce byte {i}"
        );
    }
    for i in 0..sealed.ciphertext.len() {
        assert_eq!(
            open(&key, &aad, &sealed.nonce, &flip(&sealed.ciphertext, i)),
            Err(EnvelopeError::Authentication),
            "ciphertext/tag byte {i}"
        );
    }
}

#[test]
fn every_aad_field_is_bound() {
    let key = Sm4Key::generate().unwrap();
    let aad = request_aad("req-1", "k1");
    let sealed = seal(&key, &aad, b"decision please").unwrap();
    let variants = [
        Aad {
            direction: Direction::Response,
            ..aad
        },
        Aad {
            method: "/aether.v1.ClearingService/SubmitBatch",
            ..aad
        },
        Aad {
            request_id: "req-2",
            ..aad
        },
        Aad {
            member_id: "member-0043",
            ..aad
        },
        Aad { key_id: "", ..aad },
        Aad {
            issued_at: NOW + 1,
            ..aad
        },
    ];
    for other in variants {
        assert_eq!(
            open(&key, &other, &sealed.nonce, &sealed.ciphertext),
            Err(EnvelopeError::Authentication),
            "{other:?}"
        );
    }
}

#[test]
fn wrong_key_and_malformed_inputs_get_their_own_errors() {
    let key = Sm4Key::generate().unwrap();
    let aad = request_aad("req-1", "");
    let sealed = seal(&key, &aad, b"payload").unwrap();
    let other = Sm4Key::generate().unwrap();
    assert_eq!(
        open(&other, &aad, &sealed.nonce, &sealed.ciphertext),
        Err(EnvelopeError::Authentication)
    );
    assert_eq!(
        open(&key, &aad, &sealed.nonce[..11], &sealed.ciphertext),
        Err(EnvelopeError::NonceLength(11))
    );
    assert_eq!(
        open(&key, &aad, &[0; 16], &sealed.ciphertext),
        Err(EnvelopeError::NonceLength(16))
    );
    assert_eq!(
        open(&key, &aad, &sealed.nonce, &sealed.ciphertext[..15]),
        Err(EnvelopeError::Truncated(15))
    );
    // Cut but still as long as a tag: the tag no longer matches.
    assert_eq!(
        open(
            &key,
            &aad,
            &sealed.nonce,
            &sealed.ciphertext[..sealed.ciphertext.len() - 1]
        ),
        Err(EnvelopeError::Authentication)
    );
}

// ---------------------------------------------------------------- sessions

fn session_with(policy: SessionPolicy) -> (EnvelopeKey, SessionKeys, Sm4Key, String) {
    let server = EnvelopeKey::generate();
    let sessions = SessionKeys::new(policy);
    let key = Sm4Key::generate().unwrap();
    let wrapped = wrap_key(&server.public_key(), &key).unwrap();
    let grant = sessions.exchange(&server, &wrapped, NOW).unwrap();
    (server, sessions, key, grant.key_id)
}

#[test]
fn key_exchange_grants_a_random_key_id_with_defaults() {
    let server = EnvelopeKey::generate();
    let sessions = SessionKeys::default();
    let key = Sm4Key::generate().unwrap();
    let wrapped = wrap_key(&server.public_key(), &key).unwrap();
    let a = sessions.exchange(&server, &wrapped, NOW).unwrap();
    assert_eq!(a.key_id.len(), 32);
    assert!(
        a.key_id
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    );
    assert_eq!(a.expires_at, NOW + 600);
    assert_eq!(a.max_uses, 100_000);
    // The same KeyExchange replayed mints another id, which no captured request names.
    let b = sessions.exchange(&server, &wrapped, NOW).unwrap();
    assert_ne!(a.key_id, b.key_id);
    assert_eq!(sessions.len(), 2);
    // Garbage never registers anything.
    assert_eq!(
        sessions.exchange(&server, &[4; 113], NOW),
        Err(EnvelopeError::KeyUnwrap)
    );
    assert_eq!(sessions.len(), 2);
}

#[test]
fn session_request_and_response_round_trip() {
    let (_server, sessions, client_key, key_id) = session_with(SessionPolicy::default());
    let aad = request_aad("req-1", &key_id);
    let sealed = seal(&client_key, &aad, b"submit").unwrap();
    let opened = sessions
        .open(&aad, &sealed.nonce, &sealed.ciphertext, NOW + 1)
        .unwrap();
    assert_eq!(opened.plaintext, b"submit");
    // The gateway seals the answer with the same key; the member opens it.
    let response_aad = aad.response(NOW + 2);
    let answer = seal(&opened.key, &response_aad, b"accepted").unwrap();
    assert_ne!(answer.nonce, sealed.nonce);
    assert_eq!(
        open(
            &client_key,
            &response_aad,
            &answer.nonce,
            &answer.ciphertext
        )
        .unwrap(),
        b"accepted"
    );
    // A response can never be passed off as a request.
    assert_eq!(
        open(&client_key, &aad, &answer.nonce, &answer.ciphertext),
        Err(EnvelopeError::Authentication)
    );
}

#[test]
fn session_replayed_nonce_is_refused() {
    let (_s, sessions, key, key_id) = session_with(SessionPolicy::default());
    let aad = request_aad("req-1", &key_id);
    let sealed = seal(&key, &aad, b"once").unwrap();
    sessions
        .open(&aad, &sealed.nonce, &sealed.ciphertext, NOW)
        .unwrap();
    let err = sessions
        .open(&aad, &sealed.nonce, &sealed.ciphertext, NOW)
        .unwrap_err();
    assert_eq!(err, EnvelopeError::Replayed);
    assert_eq!(err.kind(), ErrorKind::Unauthenticated);
}

#[test]
fn forged_requests_neither_use_up_a_key_nor_block_its_nonce() {
    let (_s, sessions, key, key_id) = session_with(SessionPolicy {
        max_uses: 2,
        ..SessionPolicy::default()
    });
    let aad = request_aad("req-1", &key_id);
    let sealed = seal(&key, &aad, b"real").unwrap();
    for _ in 0..5 {
        let forged = flip(&sealed.ciphertext, 0);
        assert_eq!(
            sessions
                .open(&aad, &sealed.nonce, &forged, NOW)
                .unwrap_err(),
            EnvelopeError::Authentication
        );
    }
    sessions
        .open(&aad, &sealed.nonce, &sealed.ciphertext, NOW)
        .unwrap();
}

#[test]
fn unknown_key_id_is_refused() {
    let (_s, sessions, key, _key_id) = session_with(SessionPolicy::default());
    let aad = request_aad("req-1", "00000000000000000000000000000000");
    let sealed = seal(&key, &aad, b"x").unwrap();
    assert_eq!(
        sessions
            .open(&aad, &sealed.nonce, &sealed.ciphertext, NOW)
            .unwrap_err(),
        EnvelopeError::UnknownKeyId
    );
}

#[test]
fn expired_key_is_refused_then_purged() {
    let (_s, sessions, key, key_id) = session_with(SessionPolicy::default());
    let expires_at = NOW + 600;
    let at = |t: u64| Aad {
        issued_at: t,
        ..request_aad("req-1", &key_id)
    };
    let last = seal(&key, &at(expires_at - 1), b"x").unwrap();
    sessions
        .open(
            &at(expires_at - 1),
            &last.nonce,
            &last.ciphertext,
            expires_at - 1,
        )
        .unwrap();
    let late = seal(&key, &at(expires_at), b"x").unwrap();
    assert_eq!(
        sessions
            .open(&at(expires_at), &late.nonce, &late.ciphertext, expires_at)
            .unwrap_err(),
        EnvelopeError::KeyExpired {
            expired_at: expires_at
        }
    );
    // Still named "expired" for max_age after expiry, then forgotten.
    assert_eq!(sessions.purge_expired(expires_at + 299), 0);
    assert_eq!(sessions.purge_expired(expires_at + 300), 1);
    assert!(sessions.is_empty());
    let later = seal(&key, &at(expires_at + 300), b"x").unwrap();
    assert_eq!(
        sessions
            .open(
                &at(expires_at + 300),
                &later.nonce,
                &later.ciphertext,
                expires_at + 300
            )
            .unwrap_err(),
        EnvelopeError::UnknownKeyId
    );
}

#[test]
fn exhausted_key_is_refused() {
    let (_s, sessions, key, key_id) = session_with(SessionPolicy {
        max_uses: 3,
        ..SessionPolicy::default()
    });
    let aad = request_aad("req-1", &key_id);
    for _ in 0..3 {
        let sealed = seal(&key, &aad, b"x").unwrap();
        sessions
            .open(&aad, &sealed.nonce, &sealed.ciphertext, NOW)
            .unwrap();
    }
    let sealed = seal(&key, &aad, b"x").unwrap();
    assert_eq!(
        sessions
            .open(&aad, &sealed.nonce, &sealed.ciphertext, NOW)
            .unwrap_err(),
        EnvelopeError::KeyExhausted { max_uses: 3 }
    );
}

#[test]
fn stale_or_future_issue_time_is_refused() {
    let (_s, sessions, key, key_id) = session_with(SessionPolicy::default());
    for issued_at in [NOW - 301, NOW + 301] {
        let aad = Aad {
            issued_at,
            ..request_aad("req-1", &key_id)
        };
        let sealed = seal(&key, &aad, b"x").unwrap();
        let err = sessions
            .open(&aad, &sealed.nonce, &sealed.ciphertext, NOW)
            .unwrap_err();
        assert!(matches!(err, EnvelopeError::Stale { .. }), "{err}");
    }
}

/// One member's `KeyExchange` flood retires that member's own oldest keys, never another
/// member's; only a member with no key of its own can find the whole table full.
#[test]
fn session_table_is_bounded_per_member_and_in_total() {
    let sessions = SessionKeys::new(SessionPolicy {
        max_sessions: 4,
        max_sessions_per_member: 2,
        ..SessionPolicy::default()
    });
    let key = || Sm4Key::generate().unwrap();
    let a1 = sessions.register_for("bank-a", key(), NOW).unwrap();
    for _ in 0..10 {
        sessions.register_for("bank-a", key(), NOW).unwrap();
    }
    assert_eq!(sessions.len(), 2, "bank-a holds its quota, no more");
    let opened = sessions.open(&request_aad("req-1", &a1.key_id), &[0; 12], &[0; 32], NOW);
    assert_eq!(
        opened.unwrap_err(),
        EnvelopeError::UnknownKeyId,
        "its oldest key was retired"
    );
    sessions.register_for("bank-b", key(), NOW).unwrap();
    sessions.register_for("bank-b", key(), NOW).unwrap();
    assert_eq!(sessions.len(), 4);
    // A newcomer finds the table full, told so; a member with keys retires its own.
    let err = sessions.register_for("bank-c", key(), NOW).unwrap_err();
    assert_eq!(err, EnvelopeError::SessionTableFull { sessions: 4 });
    assert_eq!(err.kind(), ErrorKind::ResourceExhausted);
    sessions.register_for("bank-a", key(), NOW).unwrap();
    assert_eq!(sessions.len(), 4);
    // Once the old ones are expired and past the grace time there is room again.
    sessions
        .register_for("bank-c", key(), NOW + 600 + 300)
        .unwrap();
    assert_eq!(sessions.len(), 1);
}

#[test]
fn many_threads_on_one_session_never_accept_a_nonce_twice() {
    const MESSAGES: usize = 200;
    const THREADS: usize = 8;
    let (_s, sessions, key, key_id) = session_with(SessionPolicy::default());
    let sessions = Arc::new(sessions);
    let aad = request_aad("req-1", &key_id);
    let sealed: Arc<Vec<_>> = Arc::new(
        (0..MESSAGES)
            .map(|i| seal(&key, &aad, format!("m{i}").as_bytes()).unwrap())
            .collect(),
    );
    let accepted: Arc<Vec<AtomicUsize>> =
        Arc::new((0..MESSAGES).map(|_| AtomicUsize::new(0)).collect());
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (sessions, sealed, accepted, key_id) = (
                sessions.clone(),
                sealed.clone(),
                accepted.clone(),
                key_id.clone(),
            );
            std::thread::spawn(move || {
                let aad = request_aad("req-1", &key_id);
                for step in 0..MESSAGES {
                    // Each thread walks the messages from a different start.
                    let i = (step + t * 25) % MESSAGES;
                    match sessions.open(&aad, &sealed[i].nonce, &sealed[i].ciphertext, NOW) {
                        Ok(_) => {
                            accepted[i].fetch_add(1, Ordering::SeqCst);
                        }
                        Err(EnvelopeError::Replayed) => {}
                        Err(e) => panic!("unexpected {e}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for (i, n) in accepted.iter().enumerate() {
        assert_eq!(n.load(Ordering::SeqCst), 1, "message {i}");
    }
}

// ---------------------------------------------------------------- per-request keys

fn per_request(
    server: &EnvelopeKey,
    request_id: &str,
    plaintext: &[u8],
) -> (String, Sm4Key, aether_gateway::envelope::Sealed) {
    let key = Sm4Key::generate().unwrap();
    let header = encode_wrapped_key(&wrap_key(&server.public_key(), &key).unwrap());
    let sealed = seal(&key, &request_aad(request_id, ""), plaintext).unwrap();
    (header, key, sealed)
}

#[test]
fn per_request_key_round_trip_and_replay_refused() {
    let server = EnvelopeKey::generate();
    let guard = RequestKeys::default();
    let (header, key, sealed) = per_request(&server, "req-9", b"one shot");
    let aad = request_aad("req-9", "");
    let opened = guard
        .open(
            &server,
            &header,
            &aad,
            &sealed.nonce,
            &sealed.ciphertext,
            NOW,
        )
        .unwrap();
    assert_eq!(opened.plaintext, b"one shot");
    assert_eq!(opened.key.expose_bytes(), key.expose_bytes());
    assert_eq!(
        guard
            .open(
                &server,
                &header,
                &aad,
                &sealed.nonce,
                &sealed.ciphertext,
                NOW + 10
            )
            .unwrap_err(),
        EnvelopeError::Replayed
    );
    // A key id in the caller's AAD is ignored: per-request keys have none.
    let (header, _key, sealed) = per_request(&server, "req-10", b"x");
    guard
        .open(
            &server,
            &header,
            &request_aad("req-10", "ignored"),
            &sealed.nonce,
            &sealed.ciphertext,
            NOW,
        )
        .unwrap();
}

#[test]
fn per_request_errors_are_precise() {
    let server = EnvelopeKey::generate();
    let other = EnvelopeKey::generate();
    let guard = RequestKeys::default();
    let aad = request_aad("req-1", "");
    let (header, _key, sealed) = per_request(&server, "req-1", b"x");
    let open_with = |header: &str, nonce: &[u8], ct: &[u8], now: u64| {
        guard
            .open(&server, header, &aad, nonce, ct, now)
            .unwrap_err()
    };
    assert_eq!(
        open_with("%%%", &sealed.nonce, &sealed.ciphertext, NOW),
        EnvelopeError::BadBase64
    );
    let (foreign, _, foreign_sealed) = per_request(&other, "req-1", b"x");
    assert_eq!(
        open_with(
            &foreign,
            &foreign_sealed.nonce,
            &foreign_sealed.ciphertext,
            NOW
        ),
        EnvelopeError::KeyUnwrap
    );
    assert_eq!(
        open_with(&header, &sealed.nonce[..8], &sealed.ciphertext, NOW),
        EnvelopeError::NonceLength(8)
    );
    assert_eq!(
        open_with(&header, &sealed.nonce, &sealed.ciphertext[..3], NOW),
        EnvelopeError::Truncated(3)
    );
    assert_eq!(
        open_with(&header, &sealed.nonce, &flip(&sealed.ciphertext, 0), NOW),
        EnvelopeError::Authentication
    );
    assert!(matches!(
        open_with(&header, &sealed.nonce, &sealed.ciphertext, NOW + 301),
        EnvelopeError::Stale { .. }
    ));
    // None of the refusals was remembered: the genuine request still opens.
    guard
        .open(
            &server,
            &header,
            &aad,
            &sealed.nonce,
            &sealed.ciphertext,
            NOW,
        )
        .unwrap();
}

#[test]
fn per_request_cache_refuses_when_full_and_frees_expired_entries() {
    let server = EnvelopeKey::generate();
    let guard = RequestKeys::new(RequestKeysPolicy {
        max_age_secs: 300,
        capacity: 2,
    });
    let aad = request_aad("req-1", "");
    for _ in 0..2 {
        let (header, _k, sealed) = per_request(&server, "req-1", b"x");
        guard
            .open(
                &server,
                &header,
                &aad,
                &sealed.nonce,
                &sealed.ciphertext,
                NOW,
            )
            .unwrap();
    }
    let (header, _k, sealed) = per_request(&server, "req-1", b"x");
    let err = guard
        .open(
            &server,
            &header,
            &aad,
            &sealed.nonce,
            &sealed.ciphertext,
            NOW,
        )
        .unwrap_err();
    assert_eq!(err, EnvelopeError::ReplayCacheFull);
    assert_eq!(err.kind(), ErrorKind::ResourceExhausted);
    assert_eq!(guard.len(), 2);
    // Past issued_at + max_age the old entries would be stale anyway, so they make room.
    let later = Aad {
        issued_at: NOW + 301,
        ..aad
    };
    let key = Sm4Key::generate().unwrap();
    let header = encode_wrapped_key(&wrap_key(&server.public_key(), &key).unwrap());
    let sealed = seal(&key, &later, b"x").unwrap();
    guard
        .open(
            &server,
            &header,
            &later,
            &sealed.nonce,
            &sealed.ciphertext,
            NOW + 301,
        )
        .unwrap();
    assert_eq!(guard.len(), 1);
}
