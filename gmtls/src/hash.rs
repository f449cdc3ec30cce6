//! SM3 as rustls' transcript hash, and HMAC-SM3 so that rustls' generic
//! `HkdfUsingHmac` gives the TLS 1.3 key schedule over SM3 (RFC 8998 §3.4: the key
//! schedule is RFC 8446's, only the hash changes).

use ::hmac::{KeyInit, Mac};
use rustls::crypto::hash::{self, HashAlgorithm};
use rustls::crypto::hmac as tls_hmac;
use rustls::crypto::tls13::HkdfUsingHmac;
use sm3::{Digest, Sm3};

/// TLS has no `HashAlgorithm` code point for SM3; rustls only compares this value between
/// suites (HelloRetryRequest, resumption), so any value no other hash uses will do. 0x07 is
/// the high byte of `sm2sig_sm3` (0x0708).
pub const SM3_HASH_ALGORITHM: HashAlgorithm = HashAlgorithm::Unknown(0x07);

const SM3_OUTPUT_LEN: usize = 32;

/// SM3 (GB/T 32905-2016) for rustls.
#[derive(Debug)]
pub struct Sm3Hash;

/// The one SM3 instance the cipher suite points at.
pub static SM3: Sm3Hash = Sm3Hash;

impl hash::Hash for Sm3Hash {
    fn start(&self) -> Box<dyn hash::Context> {
        Box::new(Sm3Context(Sm3::new()))
    }

    fn hash(&self, data: &[u8]) -> hash::Output {
        hash::Output::new(&Sm3::digest(data))
    }

    fn output_len(&self) -> usize {
        SM3_OUTPUT_LEN
    }

    fn algorithm(&self) -> HashAlgorithm {
        SM3_HASH_ALGORITHM
    }
}

struct Sm3Context(Sm3);

impl hash::Context for Sm3Context {
    fn fork_finish(&self) -> hash::Output {
        hash::Output::new(&self.0.clone().finalize())
    }

    fn fork(&self) -> Box<dyn hash::Context> {
        Box::new(Sm3Context(self.0.clone()))
    }

    fn finish(self: Box<Self>) -> hash::Output {
        hash::Output::new(&self.0.finalize())
    }

    fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }
}

/// HMAC-SM3 (RFC 2104 over SM3).
#[derive(Debug)]
pub struct HmacSm3;

/// The one HMAC-SM3 instance the HKDF points at.
pub static HMAC_SM3: HmacSm3 = HmacSm3;

/// HKDF (RFC 5869) over HMAC-SM3: the TLS 1.3 key schedule of `TLS_SM4_GCM_SM3`.
pub static HKDF_SM3: HkdfUsingHmac<'static> = HkdfUsingHmac(&HMAC_SM3);

type HmacSm3Core = ::hmac::Hmac<Sm3>;

impl tls_hmac::Hmac for HmacSm3 {
    fn with_key(&self, key: &[u8]) -> Box<dyn tls_hmac::Key> {
        // HMAC is defined for keys of any length (longer ones are hashed first), so this
        // constructor cannot fail; the `Result` is only the `KeyInit` trait's shape.
        let mac = HmacSm3Core::new_from_slice(key).expect("HMAC accepts keys of any length");
        Box::new(HmacSm3Key(mac))
    }

    fn hash_output_len(&self) -> usize {
        SM3_OUTPUT_LEN
    }
}

struct HmacSm3Key(HmacSm3Core);

impl tls_hmac::Key for HmacSm3Key {
    fn sign_concat(&self, first: &[u8], middle: &[&[u8]], last: &[u8]) -> tls_hmac::Tag {
        let mut mac = self.0.clone();
        mac.update(first);
        for part in middle {
            mac.update(part);
        }
        mac.update(last);
        tls_hmac::Tag::new(&mac.finalize().into_bytes())
    }

    fn tag_len(&self) -> usize {
        SM3_OUTPUT_LEN
    }
}
