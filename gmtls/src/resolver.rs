//! One server, two certificates: an SM2 one for ShangMi clients, a standard one for the rest.

use std::sync::Arc;

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::suite::TLS_SM4_GCM_SM3_ID;
use crate::verify::SM2SIG_SM3;

/// Picks the SM2 certificate when the client offered both `sm2sig_sm3` and
/// `TLS_SM4_GCM_SM3`, the standard one otherwise. Use it with
/// [`combined_provider`](crate::combined_provider).
///
/// The certificate is resolved before rustls picks the suite and the group, and in TLS 1.3
/// neither depends on the certificate, so:
///
/// * A client that offers the SM suite and `sm2sig_sm3` *and* standard suites gets the SM2
///   certificate; the suite is still rustls' usual choice (the client's order unless
///   `ServerConfig::ignore_client_order`), so it may be an AES suite with the SM2
///   certificate. Such a client said it can verify `sm2sig_sm3`, so the handshake works; for
///   SM-only connections give the client an SM-only config (`gm_provider()`).
/// * A client that offers the SM suite but not `sm2sig_sm3` (it could not verify an SM2
///   certificate) gets the standard certificate and may negotiate `TLS_SM4_GCM_SM3` with it:
///   legal TLS 1.3, but not RFC 8998's profile, which wants an SM2 certificate with the SM
///   suite. Tongsuo's `enable_sm_tls13_strict` client refuses that combination.
/// * A client that offers `sm2sig_sm3` but not the SM suite gets the standard certificate,
///   which it must then be able to verify; a client offering neither gets the standard one.
/// * Client certificates are not chosen here: the client verifier of the combined provider
///   accepts SM2 and standard chains alike (subject to its trust anchors).
#[derive(Debug)]
pub struct DualCertResolver {
    sm2: Arc<CertifiedKey>,
    standard: Arc<CertifiedKey>,
}

impl DualCertResolver {
    /// `sm2`: an SM2 chain with an SM2 key; `standard`: a chain and key the base provider
    /// signs with.
    pub fn new(sm2: Arc<CertifiedKey>, standard: Arc<CertifiedKey>) -> Self {
        Self { sm2, standard }
    }

    /// The rule, on its own: true when the hello offers `sm2sig_sm3` and `TLS_SM4_GCM_SM3`.
    pub fn wants_sm2(client_hello: &ClientHello<'_>) -> bool {
        client_hello.signature_schemes().contains(&SM2SIG_SM3)
            && client_hello.cipher_suites().contains(&TLS_SM4_GCM_SM3_ID)
    }
}

impl ResolvesServerCert for DualCertResolver {
    fn resolve(&self, client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        if Self::wants_sm2(&client_hello) {
            Some(Arc::clone(&self.sm2))
        } else {
            Some(Arc::clone(&self.standard))
        }
    }
}
