//! Per-request keys: the wrapped key travels with every request in `x-sm4-key`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;

use sm3::{Digest, Sm3};

use super::{
    Aad, EnvelopeError, EnvelopeKey, NONCE_LEN, Opened, WRAPPED_KEY_LEN, check_ciphertext_len,
    check_fresh, check_nonce, decode_wrapped_key, open,
};

/// Limits of the per-request replay cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestKeysPolicy {
    /// How far `issued_at` may be from server time, either way, in seconds (default 300).
    /// A request is remembered until `issued_at + max_age_secs`, after which it would be
    /// refused as stale anyway: that is what makes the cache both bounded and complete.
    pub max_age_secs: u64,
    /// Most requests remembered at once (default 1,048,576, under 100 MiB). When full after
    /// dropping expired entries, new requests are refused, never an entry forgotten early.
    pub capacity: usize,
}

impl Default for RequestKeysPolicy {
    fn default() -> Self {
        RequestKeysPolicy {
            max_age_secs: 300,
            capacity: 1 << 20,
        }
    }
}

/// First 16 bytes of SM3(wrapped key ‖ nonce): names one sealed request.
type Fingerprint = [u8; 16];

#[derive(Default)]
struct Seen {
    /// Fingerprint → forget-after time (unix seconds).
    until: HashMap<Fingerprint, u64>,
    /// The same entries ordered by forget-after time, so expiry costs O(log n) each.
    by_time: BinaryHeap<Reverse<(u64, Fingerprint)>>,
}

impl Seen {
    fn forget_expired(&mut self, now: u64) {
        while let Some(Reverse((until, fp))) = self.by_time.peek().copied() {
            if until >= now {
                break;
            }
            self.by_time.pop();
            self.until.remove(&fp);
        }
    }
}

/// Opens requests with per-request keys and refuses replays; safe to share between threads.
pub struct RequestKeys {
    policy: RequestKeysPolicy,
    seen: Mutex<Seen>,
}

impl std::fmt::Debug for RequestKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestKeys")
            .field("policy", &self.policy)
            .field("remembered", &self.len())
            .finish()
    }
}

impl Default for RequestKeys {
    fn default() -> Self {
        Self::new(RequestKeysPolicy::default())
    }
}

impl RequestKeys {
    pub fn new(policy: RequestKeysPolicy) -> Self {
        RequestKeys {
            policy,
            seen: Mutex::new(Seen::default()),
        }
    }

    pub fn policy(&self) -> &RequestKeysPolicy {
        &self.policy
    }

    /// Opens a request whose key came in `x-sm4-key` (`key_header`). The AAD's key id is
    /// taken as empty whatever `aad.key_id` says, since per-request keys have none.
    pub fn open(
        &self,
        server: &EnvelopeKey,
        key_header: &str,
        aad: &Aad<'_>,
        nonce: &[u8],
        ciphertext: &[u8],
        now: u64,
    ) -> Result<Opened, EnvelopeError> {
        let wrapped = decode_wrapped_key(key_header)?;
        let nonce = check_nonce(nonce)?;
        check_ciphertext_len(ciphertext)?;
        check_fresh(aad.issued_at, now, self.policy.max_age_secs)?;
        let fp = fingerprint(&wrapped, &nonce);
        // Cheap refusal of a replay before paying for SM2.
        if self.lock().until.contains_key(&fp) {
            return Err(EnvelopeError::Replayed);
        }
        let key = server.unwrap_key(&wrapped)?;
        let aad = Aad { key_id: "", ..*aad };
        let plaintext = open(&key, &aad, &nonce, ciphertext)?;
        // Remember only authenticated requests, so forged ones cannot fill the cache.
        let mut seen = self.lock();
        if seen.until.contains_key(&fp) {
            return Err(EnvelopeError::Replayed);
        }
        if seen.until.len() >= self.policy.capacity {
            seen.forget_expired(now);
            if seen.until.len() >= self.policy.capacity {
                return Err(EnvelopeError::ReplayCacheFull);
            }
        }
        let until = aad.issued_at.saturating_add(self.policy.max_age_secs);
        seen.until.insert(fp, until);
        seen.by_time.push(Reverse((until, fp)));
        Ok(Opened { plaintext, key })
    }

    /// Forgets requests that would now be refused as stale anyway. `open` does this when
    /// the cache is full; a timer may call it to return memory sooner.
    pub fn forget_expired(&self, now: u64) {
        self.lock().forget_expired(now);
    }

    /// Number of requests remembered.
    pub fn len(&self) -> usize {
        self.lock().until.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every update keeps map and heap consistent before it can panic, so a poisoned lock
    /// is still usable.
    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn fingerprint(wrapped: &[u8; WRAPPED_KEY_LEN], nonce: &[u8; NONCE_LEN]) -> Fingerprint {
    let digest = Sm3::new()
        .chain_update(wrapped)
        .chain_update(nonce)
        .finalize();
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&digest[..16]);
    fp
}
