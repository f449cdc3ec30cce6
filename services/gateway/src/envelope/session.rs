//! Session keys: one SM2 unwrap per `KeyExchange`, then many requests under a key id.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use super::{
    Aad, EnvelopeError, EnvelopeKey, NONCE_LEN, Opened, Sm4Key, check_ciphertext_len, check_fresh,
    check_nonce, fill_random, open,
};

/// Limits of the session table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionPolicy {
    /// How long a key id is valid after `KeyExchange`, in seconds (default 600).
    pub ttl_secs: u64,
    /// How many requests a key id may open (default 100,000).
    pub max_uses: u64,
    /// How many key ids may be registered at once (default 4,096).
    pub max_sessions: usize,
    /// How many key ids one member may hold at once (default 64): a member's next
    /// `KeyExchange` past it retires that member's oldest key, never another member's.
    pub max_sessions_per_member: usize,
    /// How far a request's `issued_at` may be from server time, in seconds (default 300).
    pub max_age_secs: u64,
}

impl Default for SessionPolicy {
    fn default() -> Self {
        SessionPolicy {
            ttl_secs: 600,
            max_uses: 100_000,
            max_sessions: 4_096,
            max_sessions_per_member: 64,
            max_age_secs: 300,
        }
    }
}

/// The server's answer to `KeyExchange`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionGrant {
    /// 16 random bytes, lowercase hex (32 characters).
    pub key_id: String,
    /// Unix seconds; the key opens requests while `now < expires_at`.
    pub expires_at: u64,
    pub max_uses: u64,
}

struct Session {
    /// The member whose `KeyExchange` registered it.
    member: String,
    /// Registration order, for retiring a member's oldest key first.
    order: u64,
    /// `None` once the key expired or was used up: nothing more can open under it, so the
    /// key and the nonce set are dropped; the entry stays only to answer precisely.
    key: Option<Sm4Key>,
    expires_at: u64,
    uses: u64,
    /// Nonces of requests accepted under this key. Bounded by `max_uses` and freed at
    /// expiry, so the replay cache never outlives the key it protects.
    seen: HashSet<[u8; NONCE_LEN]>,
}

impl Session {
    fn retire(&mut self) {
        self.key = None;
        self.seen = HashSet::new();
    }
}

/// Registered session keys, safe to share between threads.
pub struct SessionKeys {
    policy: SessionPolicy,
    table: Mutex<HashMap<String, Session>>,
    registered: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionKeys")
            .field("policy", &self.policy)
            .field("sessions", &self.len())
            .finish()
    }
}

impl Default for SessionKeys {
    fn default() -> Self {
        Self::new(SessionPolicy::default())
    }
}

impl SessionKeys {
    pub fn new(policy: SessionPolicy) -> Self {
        SessionKeys {
            policy,
            table: Mutex::new(HashMap::new()),
            registered: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub fn policy(&self) -> &SessionPolicy {
        &self.policy
    }

    /// Handles a `KeyExchange` of an unnamed member (tests, tools).
    pub fn exchange(
        &self,
        server: &EnvelopeKey,
        wrapped: &[u8],
        now: u64,
    ) -> Result<SessionGrant, EnvelopeError> {
        self.exchange_for(server, wrapped, "", now)
    }

    /// Handles `member`'s `KeyExchange`: unwraps the 113 bytes and registers the key.
    pub fn exchange_for(
        &self,
        server: &EnvelopeKey,
        wrapped: &[u8],
        member: &str,
        now: u64,
    ) -> Result<SessionGrant, EnvelopeError> {
        let key = server.unwrap_key(wrapped)?;
        self.register_for(member, key, now)
    }

    /// Registers `key` for an unnamed member (see [`Self::register_for`]).
    pub fn register(&self, key: Sm4Key, now: u64) -> Result<SessionGrant, EnvelopeError> {
        self.register_for("", key, now)
    }

    /// Registers `member`'s `key` under a new random key id, valid for `ttl_secs` from
    /// `now`. A member at its quota, or any member of its own while the table is full,
    /// gives up its own oldest key: one member's flood never refuses another member.
    pub fn register_for(
        &self,
        member: &str,
        key: Sm4Key,
        now: u64,
    ) -> Result<SessionGrant, EnvelopeError> {
        let mut table = self.lock();
        purge(&mut table, now, self.policy.max_age_secs);
        let mut own: Vec<(u64, String)> = table
            .iter()
            .filter(|(_, s)| s.member == member)
            .map(|(id, s)| (s.order, id.clone()))
            .collect();
        own.sort_unstable();
        let quota = self.policy.max_sessions_per_member.max(1);
        let mut oldest = own.into_iter();
        while table.len() >= self.policy.max_sessions
            || table.values().filter(|s| s.member == member).count() >= quota
        {
            match oldest.next() {
                Some((_, id)) => {
                    table.remove(&id);
                }
                None => {
                    return Err(EnvelopeError::SessionTableFull {
                        sessions: table.len(),
                    });
                }
            }
        }
        let key_id = loop {
            let mut id = [0u8; 16];
            fill_random(&mut id)?;
            let id = hex::encode(id);
            if !table.contains_key(&id) {
                break id;
            }
        };
        let expires_at = now.saturating_add(self.policy.ttl_secs);
        let order = self
            .registered
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        table.insert(
            key_id.clone(),
            Session {
                member: member.to_owned(),
                order,
                key: Some(key),
                expires_at,
                uses: 0,
                seen: HashSet::new(),
            },
        );
        Ok(SessionGrant {
            key_id,
            expires_at,
            max_uses: self.policy.max_uses,
        })
    }

    /// Opens a request sealed under the session key `aad.key_id`. Refuses an unknown,
    /// expired or used-up key id, a stale `issued_at`, and a nonce already accepted under
    /// this key. A use is counted and the nonce remembered only once the payload
    /// authenticates, so garbage can neither use up a key nor block a nonce.
    pub fn open(
        &self,
        aad: &Aad<'_>,
        nonce: &[u8],
        ciphertext: &[u8],
        now: u64,
    ) -> Result<Opened, EnvelopeError> {
        let nonce = check_nonce(nonce)?;
        check_ciphertext_len(ciphertext)?;
        check_fresh(aad.issued_at, now, self.policy.max_age_secs)?;
        // Decrypt outside the lock so that sessions do not serialise on SM4 work; the
        // second look below settles races between two requests with one nonce.
        let key = {
            let mut table = self.lock();
            let session = self.usable(&mut table, aad.key_id, now)?;
            if session.seen.contains(&nonce) {
                return Err(EnvelopeError::Replayed);
            }
            session.key.clone().ok_or(EnvelopeError::UnknownKeyId)?
        };
        let plaintext = open(&key, aad, &nonce, ciphertext)?;
        let mut table = self.lock();
        let session = self.usable(&mut table, aad.key_id, now)?;
        if !session.seen.insert(nonce) {
            return Err(EnvelopeError::Replayed);
        }
        session.uses += 1;
        if session.uses >= self.policy.max_uses {
            session.retire();
        }
        Ok(Opened { plaintext, key })
    }

    /// Drops entries that can no longer matter; returns how many went. Expired keys lose
    /// key and nonces at once (on first touch, or here); their entry is kept `max_age_secs`
    /// longer so that late requests hear "expired" rather than "unknown". Call it from a
    /// timer; `register` also does.
    pub fn purge_expired(&self, now: u64) -> usize {
        let mut table = self.lock();
        purge(&mut table, now, self.policy.max_age_secs)
    }

    /// Number of registered key ids, expired ones not yet purged included.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn usable<'t>(
        &self,
        table: &'t mut HashMap<String, Session>,
        key_id: &str,
        now: u64,
    ) -> Result<&'t mut Session, EnvelopeError> {
        let session = table.get_mut(key_id).ok_or(EnvelopeError::UnknownKeyId)?;
        if now >= session.expires_at {
            session.retire();
            return Err(EnvelopeError::KeyExpired {
                expired_at: session.expires_at,
            });
        }
        if session.uses >= self.policy.max_uses {
            return Err(EnvelopeError::KeyExhausted {
                max_uses: self.policy.max_uses,
            });
        }
        Ok(session)
    }

    /// A panic elsewhere while holding the lock leaves the table consistent (every update
    /// is a single insert/remove), so a poisoned lock is still usable.
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn purge(table: &mut HashMap<String, Session>, now: u64, grace: u64) -> usize {
    let before = table.len();
    table.retain(|_, s| {
        if now >= s.expires_at {
            s.retire();
        }
        now < s.expires_at.saturating_add(grace)
    });
    before - table.len()
}
