//! Properties over arbitrary input: the envelope never panics, and sealing round-trips.

use aether_gateway::envelope::{
    Aad, Direction, EnvelopeKey, RequestKeys, SessionKeys, Sm4Key, decode_wrapped_key, open, seal,
    wrap_key,
};
use proptest::prelude::*;

const NOW: u64 = 1_767_225_600;

fn direction() -> impl Strategy<Value = Direction> {
    prop_oneof![Just(Direction::Request), Just(Direction::Response)]
}

fn text() -> impl Strategy<Value = String> {
    proptest::string::string_regex("(?s).{0,40}").unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn seal_then_open_round_trips(
        key in any::<[u8; 16]>(),
        plaintext in proptest::collection::vec(any::<u8>(), 0..2048),
        dir in direction(),
        method in text(), request_id in text(), member_id in text(), key_id in text(),
        issued_at in any::<u64>(),
    ) {
        let key = Sm4Key::from_bytes(key);
        let aad = Aad { direction: dir, method: &method, request_id: &request_id,
            member_id: &member_id, key_id: &key_id, issued_at };
        let sealed = seal(&key, &aad, &plaintext).unwrap();
        prop_assert_eq!(open(&key, &aad, &sealed.nonce, &sealed.ciphertext).unwrap(), plaintext);
    }

    #[test]
    fn open_never_panics_and_never_accepts_garbage(
        key in any::<[u8; 16]>(),
        nonce in proptest::collection::vec(any::<u8>(), 0..20),
        ciphertext in proptest::collection::vec(any::<u8>(), 0..200),
        method in text(), request_id in text(),
        issued_at in any::<u64>(),
    ) {
        let key = Sm4Key::from_bytes(key);
        let aad = Aad { direction: Direction::Request, method: &method, request_id: &request_id,
            member_id: "m", key_id: "", issued_at };
        // A random 128-bit tag matching is out of reach; anything else must be an Err.
        prop_assert!(open(&key, &aad, &nonce, &ciphertext).is_err());
    }

    #[test]
    fn sessions_never_panic_on_arbitrary_requests(
        key_id in text(),
        nonce in proptest::collection::vec(any::<u8>(), 0..20),
        ciphertext in proptest::collection::vec(any::<u8>(), 0..100),
        issued_at in any::<u64>(),
        now in any::<u64>(),
    ) {
        let sessions = SessionKeys::default();
        let grant = sessions.register(Sm4Key::from_bytes([1; 16]), NOW).unwrap();
        for id in [key_id.as_str(), grant.key_id.as_str()] {
            let aad = Aad { direction: Direction::Request, method: "/m", request_id: "r",
                member_id: "m", key_id: id, issued_at };
            prop_assert!(sessions.open(&aad, &nonce, &ciphertext, now).is_err());
        }
    }

    #[test]
    fn key_header_parsing_never_panics(value in "(?s).{0,200}") {
        let _ = decode_wrapped_key(&value);
    }
}

proptest! {
    // SM2 work per case; fewer cases.
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn unwrap_never_panics_on_arbitrary_bytes(
        wrapped in proptest::collection::vec(any::<u8>(), 0..130),
        tail in proptest::collection::vec(any::<u8>(), 112),
    ) {
        let server = EnvelopeKey::generate();
        prop_assert!(server.unwrap_key(&wrapped).is_err());
        // Right length and tag, random rest: must still be refused cleanly.
        let mut shaped = vec![0x04];
        shaped.extend_from_slice(&tail);
        prop_assert!(server.unwrap_key(&shaped).is_err());
    }

    #[test]
    fn per_request_open_never_panics(
        header in "[A-Za-z0-9+/=]{0,160}",
        nonce in proptest::collection::vec(any::<u8>(), 0..16),
        ciphertext in proptest::collection::vec(any::<u8>(), 0..64),
        issued_at in (NOW - 400)..(NOW + 400),
    ) {
        let server = EnvelopeKey::generate();
        let guard = RequestKeys::default();
        let aad = Aad { direction: Direction::Request, method: "/m", request_id: "r",
            member_id: "m", key_id: "", issued_at };
        prop_assert!(guard.open(&server, &header, &aad, &nonce, &ciphertext, NOW).is_err());
        // And with a genuine wrapped key but arbitrary payload.
        let key = Sm4Key::from_bytes([9; 16]);
        let header = aether_gateway::envelope::encode_wrapped_key(
            &wrap_key(&server.public_key(), &key).unwrap());
        prop_assert!(guard.open(&server, &header, &aad, &nonce, &ciphertext, NOW).is_err());
        prop_assert!(guard.is_empty());
    }
}
