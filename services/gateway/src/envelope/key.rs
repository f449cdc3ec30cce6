//! The gateway's SM2 envelope key, and wrapping an SM4 key to it.

use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use sm2::elliptic_curve::Generate;
use sm2::elliptic_curve::common::getrandom::SysRng;
use sm2::elliptic_curve::sec1::ToSec1Point;
use sm2::pkcs8::{DecodePrivateKey, EncodePrivateKey, EncodePublicKey, LineEnding};
use sm2::pke::{DecryptingKey, EncryptingKey, Mode};
use sm2::{PublicKey, SecretKey};
use zeroize::Zeroizing;

use super::{EnvelopeError, SM4_KEY_LEN, Sm4Key, WRAPPED_KEY_LEN};

/// SEC1 tag of an uncompressed point; the only C1 encoding the envelope accepts.
const UNCOMPRESSED: u8 = 0x04;

/// The gateway's SM2 key pair for the envelope. Debug shows only the public key.
pub struct EnvelopeKey {
    secret: SecretKey,
    decrypting: DecryptingKey,
}

impl std::fmt::Debug for EnvelopeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvelopeKey")
            .field("public_key", &self.public_key_hex())
            .finish_non_exhaustive()
    }
}

fn server_key_err(what: &str, path: &Path, e: impl std::fmt::Display) -> EnvelopeError {
    EnvelopeError::ServerKey(format!("{what} {}: {e}", path.display()))
}

impl EnvelopeKey {
    /// A fresh random key pair.
    pub fn generate() -> Self {
        Self::from_secret(SecretKey::generate())
    }

    fn from_secret(secret: SecretKey) -> Self {
        // C1C3C2 is GM/T 0003-2012's order and this crate's default; named to be explicit.
        let decrypting = DecryptingKey::new_with_mode(secret.to_nonzero_scalar(), Mode::C1C3C2);
        EnvelopeKey { secret, decrypting }
    }

    /// From the 32-byte big-endian private scalar (test vectors, HSM exports).
    pub fn from_secret_bytes(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        if bytes.len() != 32 {
            return Err(EnvelopeError::ServerKey(format!(
                "SM2 private key is {} bytes; it must be 32",
                bytes.len()
            )));
        }
        let secret = SecretKey::from_slice(bytes)
            .map_err(|_| EnvelopeError::ServerKey("not a valid SM2 private scalar".into()))?;
        Ok(Self::from_secret(secret))
    }

    /// From a PKCS#8 PEM private key (`-----BEGIN PRIVATE KEY-----`).
    pub fn from_pkcs8_pem(pem: &str) -> Result<Self, EnvelopeError> {
        let secret = SecretKey::from_pkcs8_pem(pem).map_err(|e| {
            EnvelopeError::ServerKey(format!("not an SM2 PKCS#8 PEM private key: {e}"))
        })?;
        Ok(Self::from_secret(secret))
    }

    /// The private key as PKCS#8 PEM; zeroed when dropped.
    pub fn to_pkcs8_pem(&self) -> Result<Zeroizing<String>, EnvelopeError> {
        self.secret
            .to_pkcs8_pem(LineEnding::LF)
            .map_err(|e| EnvelopeError::ServerKey(format!("cannot encode PKCS#8: {e}")))
    }

    /// Loads the PKCS#8 PEM private key at `path`.
    pub fn from_pem_file(path: &Path) -> Result<Self, EnvelopeError> {
        let pem = Zeroizing::new(
            std::fs::read_to_string(path).map_err(|e| server_key_err("cannot read", path, e))?,
        );
        Self::from_pkcs8_pem(&pem).map_err(|e| server_key_err("cannot load", path, e))
    }

    /// Loads the key at `path`, or creates a new one there (mode 0600, parent folders as
    /// needed). Returns the key and whether it was created now. The file is created
    /// exclusively, so a key written meanwhile by another process is loaded, not replaced.
    pub fn load_or_create(path: &Path) -> Result<(Self, bool), EnvelopeError> {
        if path.exists() {
            return Ok((Self::from_pem_file(path)?, false));
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| server_key_err("cannot create", dir, e))?;
        }
        let key = Self::generate();
        let pem = key.to_pkcs8_pem()?;
        match write_private(path, pem.as_bytes()) {
            Ok(()) => Ok((key, true)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Ok((Self::from_pem_file(path)?, false))
            }
            Err(e) => Err(server_key_err("cannot write", path, e)),
        }
    }

    pub fn public_key(&self) -> PublicKey {
        self.secret.public_key()
    }

    /// The public key as uncompressed SEC1 (`04 ‖ X ‖ Y`, 65 bytes), what clients wrap to.
    pub fn public_key_sec1(&self) -> Vec<u8> {
        self.public_key().to_sec1_point(false).as_bytes().to_vec()
    }

    /// [`Self::public_key_sec1`] as lowercase hex (130 characters).
    pub fn public_key_hex(&self) -> String {
        hex::encode(self.public_key_sec1())
    }

    /// The public key as a PEM SubjectPublicKeyInfo (`-----BEGIN PUBLIC KEY-----`).
    pub fn public_key_pem(&self) -> Result<String, EnvelopeError> {
        self.public_key()
            .to_public_key_pem(LineEnding::LF)
            .map_err(|e| EnvelopeError::ServerKey(format!("cannot encode public key: {e}")))
    }

    /// Decrypts a wrapped SM4 key (113 bytes, C1C3C2 with uncompressed C1).
    pub fn unwrap_key(&self, wrapped: &[u8]) -> Result<Sm4Key, EnvelopeError> {
        if wrapped.len() != WRAPPED_KEY_LEN {
            return Err(EnvelopeError::WrappedKeyLength(wrapped.len()));
        }
        // A compressed C1 would change where C3 and C2 start; refuse it rather than guess.
        if wrapped[0] != UNCOMPRESSED {
            return Err(EnvelopeError::KeyUnwrap);
        }
        let plain = Zeroizing::new(
            self.decrypting
                .decrypt(wrapped)
                .map_err(|_| EnvelopeError::KeyUnwrap)?,
        );
        let bytes = <[u8; SM4_KEY_LEN]>::try_from(plain.as_slice())
            .map_err(|_| EnvelopeError::KeyUnwrap)?;
        Ok(Sm4Key::from_bytes(bytes))
    }

    /// Decodes an `x-sm4-key` value and unwraps it; also returns the wrapped bytes, which
    /// the per-request replay cache keys on.
    pub fn unwrap_key_header(
        &self,
        value: &str,
    ) -> Result<(Sm4Key, [u8; WRAPPED_KEY_LEN]), EnvelopeError> {
        let wrapped = decode_wrapped_key(value)?;
        Ok((self.unwrap_key(&wrapped)?, wrapped))
    }
}

/// Encrypts `key` to the server's SM2 public key: what a client does before sending it.
/// Each call uses a fresh random k, so the 113 bytes differ every time.
pub fn wrap_key(server: &PublicKey, key: &Sm4Key) -> Result<[u8; WRAPPED_KEY_LEN], EnvelopeError> {
    let wrapped = EncryptingKey::new_with_mode(*server, Mode::C1C3C2)
        .encrypt(&mut SysRng, key.expose_bytes())
        .map_err(|_| EnvelopeError::Random)?;
    <[u8; WRAPPED_KEY_LEN]>::try_from(wrapped.as_slice())
        .map_err(|_| EnvelopeError::WrappedKeyLength(wrapped.len()))
}

/// The `x-sm4-key` value: standard base64 with padding (152 characters).
pub fn encode_wrapped_key(wrapped: &[u8; WRAPPED_KEY_LEN]) -> String {
    STANDARD.encode(wrapped)
}

/// Parses an `x-sm4-key` value; strict (canonical padding, no whitespace).
pub fn decode_wrapped_key(value: &str) -> Result<[u8; WRAPPED_KEY_LEN], EnvelopeError> {
    let bytes = STANDARD
        .decode(value)
        .map_err(|_| EnvelopeError::BadBase64)?;
    <[u8; WRAPPED_KEY_LEN]>::try_from(bytes.as_slice())
        .map_err(|_| EnvelopeError::WrappedKeyLength(bytes.len()))
}

#[cfg(unix)]
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

#[cfg(not(unix))]
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}
