//! Checks every `vector` block of `proto/ENVELOPE.md` against the code, so that the
//! document a member's developer implements from can never drift from the server.

use std::collections::HashMap;

use aes_gcm::aead::consts::U12;
use aes_gcm::aead::{Aead, KeyInit, Payload};
use aether_gateway::envelope::{
    Aad, Direction, EnvelopeKey, KEY_HEADER_LEN, SessionKeys, Sm4Key, encode_wrapped_key, open,
    seal_with_fixed_nonce,
};

const DOC: &str = include_str!("../../../proto/ENVELOPE.md");

/// `name` → the block's `key: value` lines.
fn vectors() -> HashMap<String, HashMap<String, String>> {
    let mut out = HashMap::new();
    let mut current: Option<HashMap<String, String>> = None;
    for line in DOC.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```vector") => current = Some(HashMap::new()),
            (Some(_), "```") => {
                let block = current.take().expect("inside a block");
                let name = block
                    .get("name")
                    .expect("vector block without name")
                    .clone();
                assert!(
                    out.insert(name.clone(), block).is_none(),
                    "duplicate {name}"
                );
            }
            (Some(block), line) => {
                let (key, value) = line
                    .split_once(':')
                    .unwrap_or_else(|| panic!("not a `key: value` line: {line:?}"));
                block.insert(key.trim().to_string(), value.trim().to_string());
            }
            (None, _) => {}
        }
    }
    assert!(current.is_none(), "unterminated vector block");
    out
}

fn vector(name: &str) -> HashMap<String, String> {
    vectors()
        .remove(name)
        .unwrap_or_else(|| panic!("ENVELOPE.md has no vector {name}"))
}

fn field<'v>(v: &'v HashMap<String, String>, key: &str) -> &'v str {
    v.get(key)
        .unwrap_or_else(|| panic!("vector {} lacks {key}", v["name"]))
}

fn bytes(v: &HashMap<String, String>, key: &str) -> Vec<u8> {
    hex::decode(field(v, key)).unwrap_or_else(|e| panic!("{key} is not hex: {e}"))
}

/// Checks one seal example and returns its block.
fn check_seal_vector(name: &str) -> HashMap<String, String> {
    let v = vector(name);
    let v = &v;
    let key = Sm4Key::from_bytes(bytes(v, "sm4_key_hex").try_into().unwrap());
    let nonce: [u8; 12] = bytes(v, "nonce_hex").try_into().unwrap();
    let aad = Aad {
        direction: match field(v, "direction") {
            "request" => Direction::Request,
            "response" => Direction::Response,
            other => panic!("direction {other}"),
        },
        method: field(v, "method"),
        request_id: field(v, "request_id"),
        member_id: field(v, "member_id"),
        key_id: field(v, "key_id"),
        issued_at: field(v, "issued_at").parse().unwrap(),
    };
    assert_eq!(
        hex::encode(aad.encode().unwrap()),
        field(v, "aad_hex"),
        "{name}: AAD bytes"
    );
    let plaintext = bytes(v, "plaintext_hex");
    let sealed = seal_with_fixed_nonce(&key, &aad, &nonce, &plaintext).unwrap();
    assert_eq!(
        hex::encode(&sealed),
        field(v, "ciphertext_and_tag_hex"),
        "{name}: ciphertext ‖ tag"
    );
    assert_eq!(
        hex::encode(&sealed[sealed.len() - 16..]),
        field(v, "tag_hex"),
        "{name}: tag"
    );
    assert_eq!(open(&key, &aad, &nonce, &sealed).unwrap(), plaintext);
    v.clone()
}

#[test]
fn seal_example_of_a_request_with_a_per_request_key() {
    let v = check_seal_vector("seal-request-per-request-key");
    assert_eq!(field(&v, "key_id"), "");
    assert_eq!(field(&v, "direction"), "request");
}

#[test]
fn seal_example_of_a_response_with_a_session_key() {
    let v = check_seal_vector("seal-response-session-key");
    assert_eq!(field(&v, "direction"), "response");
    assert_key_id_format(field(&v, "key_id"));
}

#[test]
fn annotated_aad_in_section_6_is_the_vector_aad() {
    let start = DOC
        .find("Example — the AAD of vector `seal-request-per-request-key`")
        .expect("annotated AAD example");
    let block = DOC[start..].split("```").nth(1).expect("fenced block");
    // The first two columns are the length prefix and the bytes; the third is a comment.
    let annotated: String = block
        .lines()
        .flat_map(|line| line.split_whitespace().take(2))
        .filter(|word| word.chars().all(|c| c.is_ascii_hexdigit()))
        .collect();
    let v = vector("seal-request-per-request-key");
    assert_eq!(annotated, field(&v, "aad_hex"));
}

#[test]
fn sm2_key_wrap_example_unwraps_to_its_key() {
    let v = vector("sm2-key-wrap");
    let server = EnvelopeKey::from_secret_bytes(&bytes(&v, "server_private_key_hex")).unwrap();
    assert_eq!(server.public_key_hex(), field(&v, "server_public_key_hex"));
    let wrapped = bytes(&v, "wrapped_key_hex");
    assert_eq!(wrapped.len(), 113);
    let parts = [
        bytes(&v, "c1_hex"),
        bytes(&v, "c3_hex"),
        bytes(&v, "c2_hex"),
    ]
    .concat();
    assert_eq!(parts, wrapped, "C1 ‖ C3 ‖ C2");
    let wrapped: [u8; 113] = wrapped.try_into().unwrap();
    let header = encode_wrapped_key(&wrapped);
    assert_eq!(header, field(&v, "x_sm4_key"));
    assert_eq!(header.len(), KEY_HEADER_LEN);
    let expected = bytes(&v, "sm4_key_hex");
    assert_eq!(
        server.unwrap_key(&wrapped).unwrap().expose_bytes()[..],
        expected[..]
    );
    let (key, raw) = server.unwrap_key_header(&header).unwrap();
    assert_eq!(raw, wrapped);
    assert_eq!(key.expose_bytes()[..], expected[..]);
    // The PEM shown in the document is this key's.
    assert!(
        DOC.contains(server.public_key_pem().unwrap().trim_end()),
        "public key PEM in §10.3"
    );
    // The wrap example and the seal example use the same SM4 key.
    let seal = vector("seal-request-per-request-key");
    assert_eq!(field(&seal, "sm4_key_hex"), field(&v, "sm4_key_hex"));
}

fn assert_key_id_format(key_id: &str) {
    let v = vector("key-id-format");
    let length: usize = field(&v, "length").parse().unwrap();
    let alphabet = field(&v, "alphabet");
    assert_eq!(key_id.len(), length, "{key_id}");
    assert!(key_id.chars().all(|c| alphabet.contains(c)), "{key_id}");
}

#[test]
fn granted_key_ids_have_the_documented_format() {
    assert_key_id_format(field(&vector("key-id-format"), "example_key_id"));
    let sessions = SessionKeys::default();
    for _ in 0..20 {
        let grant = sessions
            .register(Sm4Key::generate().unwrap(), 1_767_225_600)
            .unwrap();
        assert_key_id_format(&grant.key_id);
    }
}

/// RFC 8998 ("ShangMi (SM) Cipher Suites for TLS 1.3"), Appendix A.1, SM4-GCM example:
/// shows the AEAD used by the envelope is the standard SM4-GCM.
#[test]
fn rfc8998_appendix_a1_sm4_gcm_vector() {
    let v = vector("rfc8998-a1-sm4-gcm");
    assert_eq!(
        field(&v, "key_hex"),
        "0123456789abcdeffedcba9876543210",
        "the vector block must stay the RFC's"
    );
    let cipher = aes_gcm::AesGcm::<sm4::Sm4, U12>::new_from_slice(&bytes(&v, "key_hex")).unwrap();
    let iv: [u8; 12] = bytes(&v, "iv_hex").try_into().unwrap();
    let aad = bytes(&v, "aad_hex");
    let plaintext = bytes(&v, "plaintext_hex");
    let sealed = cipher
        .encrypt(
            &iv.into(),
            Payload {
                msg: &plaintext,
                aad: &aad,
            },
        )
        .unwrap();
    let expected = [bytes(&v, "ciphertext_hex"), bytes(&v, "tag_hex")].concat();
    assert_eq!(hex::encode(&sealed), hex::encode(&expected));
}
