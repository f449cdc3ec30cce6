//! Known-answer tests for the primitives, and checks of the pieces the handshake tests
//! cannot see on their own (nonce construction, key-share validation, SM2 IDs, key loading).

mod common;

use aes_gcm::aead::consts::U12;
use aes_gcm::{AeadInOut, KeyInit};
use aether_gmtls::aead::{SM4_GCM, Sm4Gcm, TagMismatch};
use aether_gmtls::hash::{HKDF_SM3, HMAC_SM3, SM3};
use aether_gmtls::kx::{CURVE_SM2, parse_key_share};
use aether_gmtls::sign::{Sm2KeyProvider, is_sm2_key};
use aether_gmtls::sm4ct::Sm4Ct;
use aether_gmtls::verify::{
    EC_PUBLIC_KEY_OID, SM2_CURVE_OID, SM2_SM3_CERT, SM2_SM3_TLS13, SM2_WITH_SM3_OID, alg_id,
};
use aether_gmtls::{SM2SIG_SM3, Sm2SigningKey, combined_provider};
use rustls::crypto::cipher::{
    AeadKey, InboundOpaqueMessage, Iv, OutboundChunks, OutboundPlainMessage,
};
use rustls::crypto::hash::Hash as _;
use rustls::crypto::hmac::Hmac as _;
use rustls::crypto::tls13::Hkdf as _;
use rustls::crypto::{KeyProvider, SupportedKxGroup};
use rustls::pki_types::{PrivateKeyDer, PrivateSec1KeyDer, SignatureVerificationAlgorithm};
use rustls::sign::SigningKey as _;
use rustls::{ContentType, Error, PeerMisbehaved, ProtocolVersion};

fn iv12(iv: &[u8]) -> Iv {
    Iv::from(<[u8; 12]>::try_from(iv).unwrap())
}

fn hex(s: &str) -> Vec<u8> {
    let s: String = s
        .chars()
        .filter(|c| !c.is_whitespace() && *c != ':')
        .collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

// RFC 8998 Appendix A.1, "SM4-GCM Test Vectors".
const GCM_IV: &str = "00001234567800000000ABCD";
const GCM_KEY: &str = "0123456789ABCDEFFEDCBA9876543210";
const GCM_PLAINTEXT: &str = "AAAAAAAAAAAAAAAABBBBBBBBBBBBBBBB CCCCCCCCCCCCCCCCDDDDDDDDDDDDDDDD
                             EEEEEEEEEEEEEEEEFFFFFFFFFFFFFFFF EEEEEEEEEEEEEEEEAAAAAAAAAAAAAAAA";
const GCM_AAD: &str = "FEEDFACEDEADBEEFFEEDFACEDEADBEEFABADDAD2";
const GCM_CIPHERTEXT: &str = "17F399F08C67D5EE19D0DC9969C4BB7D 5FD46FD3756489069157B282BB200735
                              D82710CA5C22F0CCFA7CBF93D496AC15 A56834CBCF98C397B4024A2691233B8D";
const GCM_TAG: &str = "83DE3541E4C2B58177E065A9BF7B62EC";

/// xorshift64*: reproducible inputs without a dependency.
fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// RustCrypto's generic GCM over the `sm4` crate (table SM4): an SM4-GCM written
/// independently of ours.
type ReferenceGcm = aes_gcm::AesGcm<sm4::Sm4, U12>;

#[test]
fn sm4_gcm_rfc8998_appendix_a1() {
    let key: [u8; 16] = hex(GCM_KEY).try_into().unwrap();
    let nonce: [u8; 12] = hex(GCM_IV).try_into().unwrap();
    let cipher = Sm4Gcm::new(&key);
    let mut buf = hex(GCM_PLAINTEXT);
    let tag = cipher.encrypt_in_place_detached(&nonce, &hex(GCM_AAD), &mut buf);
    assert_eq!(buf, hex(GCM_CIPHERTEXT));
    assert_eq!(tag.as_slice(), hex(GCM_TAG));
    cipher
        .decrypt_in_place_detached(&nonce, &hex(GCM_AAD), &mut buf, &tag)
        .unwrap();
    assert_eq!(buf, hex(GCM_PLAINTEXT));

    // The reference gives the same example.
    let reference = ReferenceGcm::new_from_slice(&key).unwrap();
    let mut buf = hex(GCM_PLAINTEXT);
    let tag = reference
        .encrypt_inout_detached(&nonce.into(), &hex(GCM_AAD), buf.as_mut_slice().into())
        .unwrap();
    assert_eq!(buf, hex(GCM_CIPHERTEXT));
    assert_eq!(tag.as_slice(), hex(GCM_TAG));
}

/// Every pairing of SM4 kernel and GHASH this CPU can run, the default first.
fn sm4_gcm_variants(key: &[u8; 16]) -> Vec<Sm4Gcm> {
    let mut variants = vec![
        Sm4Gcm::new(key),
        Sm4Gcm::with_cipher(<Sm4Ct as KeyInit>::new(key.into()), false),
        Sm4Gcm::with_cipher(Sm4Ct::with_tables(key), false),
        Sm4Gcm::with_cipher(Sm4Ct::with_tables(key), true),
    ];
    if let Some(ni) = Sm4Ct::with_aes_ni(key) {
        variants.push(Sm4Gcm::with_cipher(ni, true));
    }
    variants
}

/// Ours, on every kernel the CPU has, against the reference on random keys, nonces,
/// associated data and lengths from empty to past several of the kernels' passes (a pass
/// holds up to 47 data blocks and the tag mask; 48 data blocks put the mask in a pass of
/// its own) and GHASH windows (16 blocks), and every kind of tampering refused with
/// nothing of the plaintext left in the buffer.
#[test]
fn sm4_gcm_agrees_with_an_independent_gcm_and_refuses_tampering() {
    let mut next = xorshift(0x2545_F491_4F6C_DD1D);
    let mut bytes = |n: usize| -> Vec<u8> { (0..n).map(|_| next() as u8).collect() };
    let lengths = (0..=70).chain([
        255, 256, 257, 600, 751, 752, 753, 767, 768, 769, 1023, 1024, 1025, 1535, 1536, 1537, 2049,
        4096, 16_401,
    ]);
    for len in lengths {
        let key: [u8; 16] = bytes(16).try_into().unwrap();
        let nonce: [u8; 12] = bytes(12).try_into().unwrap();
        let aad_len = bytes(1)[0] as usize * 2;
        let aad = bytes(aad_len);
        let plaintext = bytes(len);
        for ours in sm4_gcm_variants(&key) {
            check_sm4_gcm(&ours, &key, &nonce, &aad, &plaintext);
        }
    }
}

fn check_sm4_gcm(ours: &Sm4Gcm, key: &[u8; 16], nonce: &[u8; 12], aad: &[u8], plaintext: &[u8]) {
    let len = plaintext.len();
    let case = format!("{len} bytes, {} of associated data, {ours:?}", aad.len());
    let mut sealed = plaintext.to_vec();
    let tag = ours.encrypt_in_place_detached(nonce, aad, &mut sealed);

    let reference = ReferenceGcm::new_from_slice(key).unwrap();
    let mut expected = plaintext.to_vec();
    let expected_tag = reference
        .encrypt_inout_detached(&(*nonce).into(), aad, expected.as_mut_slice().into())
        .unwrap();
    assert_eq!(sealed, expected, "{case}");
    assert_eq!(tag.as_slice(), expected_tag.as_slice(), "{case}");

    let mut opened = sealed.clone();
    ours.decrypt_in_place_detached(nonce, aad, &mut opened, &tag)
        .unwrap();
    assert_eq!(opened, plaintext, "{case}");

    let mut bad_tag = tag;
    bad_tag[len % 16] ^= 0x01;
    let mut flipped = sealed.clone();
    if let Some(byte) = flipped.get_mut(len / 2) {
        *byte ^= 0x80;
    }
    let mut other_aad = aad.to_vec();
    other_aad.push(0);
    let mut other_nonce = *nonce;
    other_nonce[11] ^= 1;
    // (associated data, nonce, sealed message, tag)
    type Attempt<'a> = (&'a [u8], &'a [u8; 12], Vec<u8>, [u8; 16]);
    let attempts: [Attempt; 4] = [
        (aad, nonce, sealed.clone(), bad_tag),
        (aad, nonce, flipped, tag),
        (&other_aad, nonce, sealed.clone(), tag),
        (aad, &other_nonce, sealed.clone(), tag),
    ];
    for (k, (aad, nonce, mut buf, tag)) in attempts.into_iter().enumerate() {
        if k == 1 && len == 0 {
            continue;
        }
        assert_eq!(
            ours.decrypt_in_place_detached(nonce, aad, &mut buf, &tag),
            Err(TagMismatch),
            "tampering {k}: {case}"
        );
        assert!(
            buf.iter().all(|b| *b == 0),
            "plaintext left after a refusal: {case}"
        );
    }
}

// GB/T 32907-2016 Appendix A.1: one SM4 block, key = plaintext.
#[test]
fn sm4_block_gbt32907_example1() {
    use sm4::cipher::{BlockCipherEncrypt, KeyInit};
    let cipher = sm4::Sm4::new_from_slice(&hex("0123456789abcdeffedcba9876543210")).unwrap();
    let mut block = sm4::cipher::Block::<sm4::Sm4>::try_from(
        hex("0123456789abcdeffedcba9876543210").as_slice(),
    )
    .unwrap();
    cipher.encrypt_block(&mut block);
    assert_eq!(block.as_slice(), hex("681edf34d206965e86b3e94f536e4246"));
}

/// Our constant-time SM4 ([`aether_gmtls::sm4ct::Sm4Ct`]) gives GB/T 32907's example and
/// agrees with the `sm4` crate on 2,000 pseudo-random keys, one block and eight at a time;
/// on a CPU with AES-NI it runs without tables.
#[test]
fn constant_time_sm4_agrees_with_the_standard_and_the_sm4_crate() {
    use aether_gmtls::sm4ct::{Kernel, Sm4Ct};
    use sm4::cipher::{BlockCipherEncrypt, KeyInit};
    let key = hex("0123456789abcdeffedcba9876543210");
    let ours = Sm4Ct::new_from_slice(&key).unwrap();
    if std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("ssse3") {
        assert!(ours.constant_time());
        let gfni = ["avx512f", "avx512bw", "gfni"];
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("gfni")
        {
            assert_eq!(ours.kernel(), Kernel::Gfni, "the CPU has {gfni:?}");
        } else {
            assert_eq!(ours.kernel(), Kernel::AesNi);
        }
    }
    let mut block = sm4::cipher::Block::<Sm4Ct>::try_from(key.as_slice()).unwrap();
    ours.encrypt_block(&mut block);
    assert_eq!(block.as_slice(), hex("681edf34d206965e86b3e94f536e4246"));

    let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
    let mut bytes16 = || {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&next().to_le_bytes());
        out[8..].copy_from_slice(&next().to_le_bytes());
        out
    };
    for _ in 0..2_000 {
        let key = bytes16();
        let ours = Sm4Ct::new_from_slice(&key).unwrap();
        let reference = sm4::Sm4::new_from_slice(&key).unwrap();
        let mut eight: Vec<sm4::cipher::Block<Sm4Ct>> = (0..4).map(|_| bytes16().into()).collect();
        let mut expected = eight.clone();
        reference.encrypt_blocks(&mut expected);
        ours.encrypt_blocks(&mut eight);
        for (a, b) in eight.iter().zip(&expected) {
            assert_eq!(a.as_slice(), b.as_slice(), "key {key:02x?}");
        }
        // Tails: one to seven blocks in one call.
        for n in 1..8 {
            let mut tail: Vec<sm4::cipher::Block<Sm4Ct>> =
                (0..n).map(|_| bytes16().into()).collect();
            let mut tail_expected = tail.clone();
            reference.encrypt_blocks(&mut tail_expected);
            ours.encrypt_blocks(&mut tail);
            for (a, b) in tail.iter().zip(&tail_expected) {
                assert_eq!(a.as_slice(), b.as_slice(), "{n} blocks");
            }
        }
        // Any number of blocks in one call, on every kernel this CPU has: the widest
        // takes 32 at a time, the tails in one pass.
        let key16: [u8; 16] = key;
        let kernels = [Some(ours.clone()), Sm4Ct::with_aes_ni(&key16)];
        let n = usize::from(bytes16()[0] % 80);
        let many: Vec<[u8; 16]> = (0..n).map(|_| bytes16()).collect();
        let mut many_expected: Vec<sm4::cipher::Block<Sm4Ct>> =
            many.iter().map(|b| (*b).into()).collect();
        reference.encrypt_blocks(&mut many_expected);
        for kernel in kernels.iter().flatten() {
            let mut got = many.clone();
            kernel.encrypt_in_place(&mut got);
            for (a, b) in got.iter().zip(&many_expected) {
                assert_eq!(
                    a.as_slice(),
                    b.as_slice(),
                    "{n} blocks on {:?}",
                    kernel.kernel()
                );
            }
        }
        let mut one = eight[0];
        ours.encrypt_block(&mut one);
        let mut one_expected = expected[0];
        reference.encrypt_block(&mut one_expected);
        assert_eq!(one.as_slice(), one_expected.as_slice());
    }
    // The table path (where the AES instructions are missing) is the same cipher.
    let tables = Sm4Ct::with_tables(&key.try_into().unwrap());
    assert!(!tables.constant_time());
    let mut block =
        sm4::cipher::Block::<Sm4Ct>::try_from(hex("0123456789abcdeffedcba9876543210").as_slice())
            .unwrap();
    tables.encrypt_block(&mut block);
    assert_eq!(block.as_slice(), hex("681edf34d206965e86b3e94f536e4246"));
}

/// The record layer: nonce = IV XOR seq (RFC 8446 §5.3), AAD = record header, inner
/// plaintext = content ‖ type. Recomputed here with the bare AEAD.
#[test]
fn record_protection_uses_rfc8446_nonce_and_aad() {
    use rustls::crypto::cipher::Tls13AeadAlgorithm as _;
    let key = hex(GCM_KEY);
    let iv = hex(GCM_IV);
    let seq: u64 = 0x0102_0304_0506_0708;
    let key16: [u8; 16] = key.clone().try_into().unwrap();
    let mut encrypter = SM4_GCM.encrypter_for_key(&key16, iv12(&iv));
    let payload = b"application data";
    let record = encrypter
        .encrypt(
            OutboundPlainMessage {
                typ: ContentType::ApplicationData,
                version: ProtocolVersion::TLSv1_2,
                payload: OutboundChunks::Single(payload),
            },
            seq,
        )
        .unwrap()
        .encode();
    // Header: type 23, legacy version 0x0303, length = payload + type byte + tag.
    let body_len = payload.len() + 1 + 16;
    assert_eq!(record[..5], [23, 3, 3, 0, body_len as u8]);

    let mut nonce = iv.clone();
    for (n, s) in nonce[4..].iter_mut().zip(seq.to_be_bytes()) {
        *n ^= s;
    }
    let cipher = ReferenceGcm::new_from_slice(&key).unwrap();
    let mut expected = [payload.as_slice(), &[23]].concat();
    let tag = cipher
        .encrypt_inout_detached(
            &aes_gcm::Nonce::<U12>::try_from(nonce.as_slice()).unwrap(),
            &record[..5],
            expected.as_mut_slice().into(),
        )
        .unwrap();
    expected.extend_from_slice(&tag);
    assert_eq!(&record[5..], expected.as_slice());

    // And the decrypter takes it back, refusing the wrong sequence number and a flipped bit.
    let mut decrypter = SM4_GCM.decrypter_for_key(&key16, iv12(&iv));
    // A key of the wrong length (rustls never passes one) fails every record, no panic.
    let mut wrong = SM4_GCM.encrypter(AeadKey::from([7u8; 32]), iv12(&iv));
    assert!(
        wrong
            .encrypt(
                OutboundPlainMessage {
                    typ: ContentType::ApplicationData,
                    version: ProtocolVersion::TLSv1_2,
                    payload: OutboundChunks::Single(b"x"),
                },
                0,
            )
            .is_err()
    );
    let mut body = record[5..].to_vec();
    let wrong_seq = decrypter.decrypt(
        InboundOpaqueMessage::new(
            ContentType::ApplicationData,
            ProtocolVersion::TLSv1_2,
            &mut body,
        ),
        seq + 1,
    );
    assert!(matches!(wrong_seq, Err(Error::DecryptError)));
    let mut body = record[5..].to_vec();
    body[0] ^= 1;
    let flipped = decrypter.decrypt(
        InboundOpaqueMessage::new(
            ContentType::ApplicationData,
            ProtocolVersion::TLSv1_2,
            &mut body,
        ),
        seq,
    );
    assert!(matches!(flipped, Err(Error::DecryptError)));
    let mut short = vec![0u8; 15];
    let too_short = decrypter.decrypt(
        InboundOpaqueMessage::new(
            ContentType::ApplicationData,
            ProtocolVersion::TLSv1_2,
            &mut short,
        ),
        seq,
    );
    assert!(matches!(too_short, Err(Error::DecryptError)));
    let mut body = record[5..].to_vec();
    let plain = decrypter
        .decrypt(
            InboundOpaqueMessage::new(
                ContentType::ApplicationData,
                ProtocolVersion::TLSv1_2,
                &mut body,
            ),
            seq,
        )
        .unwrap();
    assert_eq!(plain.typ, ContentType::ApplicationData);
    assert_eq!(plain.payload, payload);
}

// GB/T 32905-2016 Appendix A, examples 1 and 2.
#[test]
fn sm3_gbt32905_examples() {
    assert_eq!(
        SM3.hash(b"abc").as_ref(),
        hex("66c7f0f462eeedd9d1f2d46bdc10e4e24167c4875cf2f7a2297da02b8f4ba8e0")
    );
    let msg = b"abcd".repeat(16);
    let expected = hex("debe9ff92275b8a138604889c18e5a4d6fdb70e5387e5765293dcba39c0c5732");
    assert_eq!(SM3.hash(&msg).as_ref(), expected);
    // Incrementally, with a fork in the middle (what the transcript hash does).
    let mut ctx = SM3.start();
    ctx.update(&msg[..10]);
    let fork = ctx.fork();
    ctx.update(&msg[10..]);
    assert_eq!(ctx.fork_finish().as_ref(), expected);
    assert_eq!(ctx.finish().as_ref(), expected);
    let mut fork = fork;
    fork.update(&msg[10..]);
    assert_eq!(fork.finish().as_ref(), expected);
}

// HMAC-SM3 on the inputs of RFC 4231 test cases 1, 2 and 6 (the last with a key longer than
// the block). No standard publishes HMAC-SM3 answers; these were computed with Tongsuo 8.5.0,
// an independent implementation: `openssl mac -digest SM3 -macopt hexkey:<key> HMAC`.
#[test]
fn hmac_sm3_matches_tongsuo() {
    let cases: [(Vec<u8>, &[u8], &str); 3] = [
        (
            vec![0x0b; 20],
            b"Hi There",
            "51B00D1FB49832BFB01C3CE27848E59F871D9BA938DC563B338CA964755CCE70",
        ),
        (
            b"Jefe".to_vec(),
            b"what do ya want for nothing?",
            "2E87F1D16862E6D964B50A5200BF2B10B764FAA9680A296A2405F24BEC39F882",
        ),
        (
            vec![0xaa; 131],
            b"Test Using Larger Than Block-Size Key - Hash Key First",
            "B4FD844E13342002F0B2E0690EA7741F1497D993A70494CEA601E657BEDF67A0",
        ),
    ];
    for (key, data, expected) in cases {
        let tag = HMAC_SM3.with_key(&key).sign(&[&data[..3], &data[3..]]);
        assert_eq!(tag.as_ref(), hex(expected));
    }
}

// HKDF-SM3 on the inputs of RFC 5869 test case 1; answers computed with Tongsuo 8.5.0:
// `openssl kdf -keylen 42 -kdfopt digest:SM3 -kdfopt hexkey:.. -kdfopt hexsalt:..
//  -kdfopt hexinfo:.. HKDF` (and `mode:EXTRACT_ONLY` for the PRK).
#[test]
fn hkdf_sm3_matches_tongsuo() {
    let ikm = vec![0x0b; 22];
    let salt = hex("000102030405060708090a0b0c");
    let info = hex("f0f1f2f3f4f5f6f7f8f9");
    let expander = HKDF_SM3.extract_from_secret(Some(&salt), &ikm);
    let mut okm = [0u8; 42];
    expander
        .expand_slice(&[&info[..4], &info[4..]], &mut okm)
        .unwrap();
    assert_eq!(
        okm.as_slice(),
        hex(
            "C6:9F:E9:1B:7A:AE:E2:DD:57:18:D7:2D:CA:EE:0C:CE:93:F1:B8:E4:1F:79:2D:A5:12:61:B6:A5:17:E6:8B:36:ED:2C:59:55:72:B0:1D:FA:35:9B"
        )
    );
    // The PRK is HMAC-SM3(salt, ikm).
    assert_eq!(
        HMAC_SM3.with_key(&salt).sign(&[&ikm]).as_ref(),
        hex(
            "E0:D6:F7:B0:BD:05:63:27:B7:65:9F:1F:39:AD:85:05:61:FB:CF:4F:B1:0F:B5:8E:88:EA:FA:55:CF:7C:D0:1E"
        )
    );
}

#[test]
fn algorithm_identifiers_match_their_oids() {
    use der::Encode;
    let spki = [
        EC_PUBLIC_KEY_OID.to_der().unwrap(),
        SM2_CURVE_OID.to_der().unwrap(),
    ]
    .concat();
    assert_eq!(alg_id::SM2_PUBLIC_KEY.as_ref(), spki.as_slice());
    assert_eq!(
        alg_id::SM2_WITH_SM3.as_ref(),
        SM2_WITH_SM3_OID.to_der().unwrap().as_slice()
    );
    assert_eq!(SM2_CURVE_OID.to_string(), "1.2.156.10197.1.301");
    assert_eq!(SM2_WITH_SM3_OID.to_string(), "1.2.156.10197.1.501");
}

#[test]
fn curve_sm2_agrees_and_refuses_bad_points() {
    let a = CURVE_SM2.start().unwrap();
    let b = CURVE_SM2.start().unwrap();
    assert_eq!(u16::from(a.group()), 0x0029);
    assert_eq!(a.pub_key().len(), 65);
    assert_eq!(a.pub_key()[0], 0x04);
    let b_pub = b.pub_key().to_vec();
    let a_pub = a.pub_key().to_vec();
    let ab = a.complete(&b_pub).unwrap();
    let ba = b.complete(&a_pub).unwrap();
    assert_eq!(ab.secret_bytes(), ba.secret_bytes());
    assert_eq!(ab.secret_bytes().len(), 32);

    let invalid = |bytes: &[u8]| {
        let result = CURVE_SM2.start().unwrap().complete(bytes);
        assert!(matches!(
            result,
            Err(Error::PeerMisbehaved(PeerMisbehaved::InvalidKeyShare))
        ));
    };
    // Compressed form of a valid point.
    let mut compressed = vec![0x02 | (a_pub[64] & 1)];
    compressed.extend_from_slice(&a_pub[1..33]);
    assert!(parse_key_share(&compressed).is_err());
    invalid(&compressed);
    // Off the curve: y + 1.
    let mut off = a_pub.clone();
    off[64] ^= 0x01;
    invalid(&off);
    // All zero (would be the identity), wrong prefix, truncated, empty.
    let mut zero = vec![0u8; 65];
    zero[0] = 0x04;
    invalid(&zero);
    let mut hybrid = a_pub.clone();
    hybrid[0] = 0x06;
    invalid(&hybrid);
    invalid(&a_pub[..64]);
    invalid(&[]);
    // Coordinates ≥ p.
    invalid(&[[0x04].as_slice(), &[0xff; 64]].concat());
    // Only TLS 1.3.
    assert!(CURVE_SM2.usable_for_version(ProtocolVersion::TLSv1_3));
    assert!(!CURVE_SM2.usable_for_version(ProtocolVersion::TLSv1_2));
}

#[test]
fn handshake_and_certificate_signatures_use_their_own_ids() {
    let pki = common::gm_pki();
    let key = Sm2SigningKey::from_pem(&pki.client.key_pem).unwrap();
    assert!(
        key.choose_scheme(&[rustls::SignatureScheme::ECDSA_NISTP256_SHA256])
            .is_none()
    );
    let signer = key.choose_scheme(&[SM2SIG_SM3]).unwrap();
    assert_eq!(signer.scheme(), SM2SIG_SM3);
    let message = b"TLS 1.3, client CertificateVerify";
    let signature = signer.sign(message).unwrap();
    let cert = pki.client.cert_der().unwrap();
    let ee = webpki::EndEntityCert::try_from(&cert).unwrap();
    // CertificateVerify: ID "TLSv1.3+GM+Cipher+Suite" verifies, the certificate ID does not.
    ee.verify_signature(&SM2_SM3_TLS13, message, &signature)
        .unwrap();
    assert!(
        ee.verify_signature(&SM2_SM3_CERT, message, &signature)
            .is_err()
    );
    assert!(
        ee.verify_signature(&SM2_SM3_TLS13, b"other", &signature)
            .is_err()
    );
    assert!(
        SM2_SM3_TLS13
            .verify_signature(&[0x04; 65], message, &signature)
            .is_err()
    );
    assert!(SM2_SM3_TLS13.verify_signature(&[], message, &[]).is_err());
    assert_eq!(SM2_SM3_TLS13.distid(), "TLSv1.3+GM+Cipher+Suite");
    assert_eq!(SM2_SM3_CERT.distid(), "1234567812345678");
}

#[test]
fn key_loading_pkcs8_sec1_and_deferral() {
    use sm2::pkcs8::EncodePrivateKey;
    let pki = common::gm_pki();
    let pkcs8 = pki.server.key_der().unwrap();
    assert!(matches!(pkcs8, PrivateKeyDer::Pkcs8(_)));
    assert!(is_sm2_key(&pkcs8));
    let spki_from_pkcs8 = Sm2SigningKey::from_der(&pkcs8).unwrap();

    // The same key as SEC1 with an EC PARAMETERS block in front, as Tongsuo writes it.
    let secret = aether_gmtls::sign::sm2_secret_key(&pkcs8).unwrap();
    let sec1_pem = secret.to_sec1_pem(der::pem::LineEnding::LF).unwrap();
    let tongsuo_style = format!(
        "-----BEGIN EC PARAMETERS-----\nBggqgRzPVQGCLQ==\n-----END EC PARAMETERS-----\n{}",
        sec1_pem.as_str()
    );
    let from_sec1 = Sm2SigningKey::from_pem(&tongsuo_style).unwrap();
    assert_eq!(from_sec1.public_key(), spki_from_pkcs8.public_key());
    let sec1_der = PrivateKeyDer::from(PrivateSec1KeyDer::from(
        secret.to_sec1_der().unwrap().to_vec(),
    ));
    assert!(is_sm2_key(&sec1_der));

    // PKCS#8 round trip through the sm2 crate's encoder.
    let reencoded = PrivateKeyDer::from(rustls::pki_types::PrivatePkcs8KeyDer::from(
        secret.to_pkcs8_der().unwrap().as_bytes().to_vec(),
    ));
    assert!(Sm2KeyProvider.load_private_key(reencoded).is_ok());

    // A P-256 key: not SM2; the SM-only provider refuses it, the combined one defers to ring.
    let std = common::std_pki();
    assert!(!is_sm2_key(&std.server_key));
    assert!(
        Sm2KeyProvider
            .load_private_key(std.server_key.clone_key())
            .is_err()
    );
    let combined = combined_provider(common::ring_provider());
    let loaded = combined
        .key_provider
        .load_private_key(std.server_key.clone_key())
        .unwrap();
    assert_eq!(loaded.algorithm(), rustls::SignatureAlgorithm::ECDSA);
    let loaded = combined.key_provider.load_private_key(pkcs8).unwrap();
    assert!(loaded.choose_scheme(&[SM2SIG_SM3]).is_some());

    // Garbage is an error, not a panic.
    let junk = PrivateKeyDer::from(rustls::pki_types::PrivatePkcs8KeyDer::from(vec![
        0x30, 0x03, 1, 2, 3,
    ]));
    assert!(Sm2KeyProvider.load_private_key(junk).is_err());
}
