//! Assigning positions and chaining hashes for one group-commit batch. Pure: the
//! backends read the head and stream versions inside their transaction, call
//! [`plan_batch`], and insert what it returns.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::LedgerError;
use crate::event::{Committed, ExpectedVersion, ValidEvent};
use crate::hashing::{self, GENESIS_PREV_HASH, Hash, HashedFields};

/// One stream's part of an append request, validated.
#[derive(Debug, Clone)]
pub(crate) struct StreamAppend {
    pub stream_id: String,
    pub expected: ExpectedVersion,
    pub events: Vec<ValidEvent>,
}

/// The last committed event: where the next batch chains on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Head {
    pub seq: u64,
    pub hash: Hash,
    pub recorded_at: DateTime<Utc>,
}

/// A row ready to insert, exactly as it will be stored.
#[derive(Debug, Clone)]
pub(crate) struct EventRow {
    pub seq: i64,
    pub stream_id: String,
    pub stream_version: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub schema_version: i32,
    pub payload: String,
    pub metadata: String,
    pub recorded_at: DateTime<Utc>,
    pub prev_hash: Hash,
    pub hash: Hash,
    /// Side rows of the event's personal members.
    pub personal: Vec<crate::personal::PersonalField>,
}

pub(crate) type RequestOutcome = Result<Vec<Committed>, LedgerError>;

/// A planned batch: rows to insert, each request's outcome, and the chain state after it.
#[derive(Debug)]
pub(crate) struct Plan {
    pub rows: Vec<EventRow>,
    pub outcomes: Vec<RequestOutcome>,
    /// The head once `rows` are committed (unchanged if there are none).
    pub head: Option<Head>,
    /// Versions of the streams this batch appends to, once committed.
    pub versions: HashMap<String, u64>,
    /// Streams on which a request was refused for its expected version.
    pub conflicts: Vec<String>,
}

/// Plans a batch: requests whose expectations hold get consecutive seqs and a chain that
/// starts at `head`; the others get their error and leave no row. Requests are taken in
/// arrival order, each seeing the versions left by those before it. `known` holds the
/// current version of every stream in the batch (absent = 0).
pub(crate) fn plan_batch(
    head: Option<Head>,
    known: &HashMap<String, u64>,
    requests: &[&[StreamAppend]],
    now: DateTime<Utc>,
) -> Plan {
    let mut next_seq = head.map_or(1, |h| h.seq + 1);
    let mut prev_hash = head.map_or(GENESIS_PREV_HASH, |h| h.hash);
    // recorded_at never goes backwards in seq, even if the clock does.
    let recorded_at = head.map_or(now, |h| now.max(h.recorded_at));
    let mut versions: HashMap<String, u64> = HashMap::new();
    let mut seen_ids: HashSet<Uuid> = HashSet::new();
    let mut rows = Vec::new();
    let mut outcomes = Vec::with_capacity(requests.len());
    let mut conflicts = Vec::new();

    for appends in requests {
        if let Err(e) = check_request(appends, known, &versions, &seen_ids) {
            if let LedgerError::WrongExpectedVersion { stream_id, .. } = &e {
                conflicts.push(stream_id.clone());
            }
            outcomes.push(Err(e));
            continue;
        }
        let mut committed = Vec::new();
        for append in appends.iter() {
            let current = current_version(&append.stream_id, known, &versions);
            let version = versions.entry(append.stream_id.clone()).or_insert(current);
            for event in &append.events {
                *version += 1;
                seen_ids.insert(event.event_id);
                let fields = HashedFields {
                    seq: next_seq,
                    stream_id: &append.stream_id,
                    stream_version: *version,
                    event_id: event.event_id,
                    event_type: &event.event_type,
                    schema_version: event.schema_version,
                    payload: &event.payload,
                    metadata: &event.metadata,
                    recorded_at,
                };
                let hash = hashing::event_hash(&prev_hash, &fields);
                committed.push(Committed {
                    seq: next_seq,
                    stream_id: append.stream_id.clone(),
                    stream_version: *version,
                    event_id: event.event_id,
                    hash,
                    recorded_at,
                });
                rows.push(EventRow {
                    seq: to_i64(next_seq),
                    stream_id: append.stream_id.clone(),
                    stream_version: to_i64(*version),
                    event_id: event.event_id,
                    event_type: event.event_type.clone(),
                    // `NewEvent::validate` refused anything above `i32::MAX`.
                    schema_version: i32::try_from(event.schema_version).unwrap_or(i32::MAX),
                    payload: event.payload.clone(),
                    metadata: event.metadata.clone(),
                    recorded_at,
                    prev_hash,
                    hash,
                    personal: event.personal.clone(),
                });
                prev_hash = hash;
                next_seq += 1;
            }
        }
        outcomes.push(Ok(committed));
    }
    let head = match rows.last() {
        Some(last) => Some(Head {
            seq: last.seq as u64,
            hash: last.hash,
            recorded_at,
        }),
        None => head,
    };
    Plan {
        rows,
        outcomes,
        head,
        versions,
        conflicts,
    }
}

fn current_version(
    stream_id: &str,
    known: &HashMap<String, u64>,
    planned: &HashMap<String, u64>,
) -> u64 {
    planned
        .get(stream_id)
        .or_else(|| known.get(stream_id))
        .copied()
        .unwrap_or(0)
}

fn check_request(
    appends: &[StreamAppend],
    known: &HashMap<String, u64>,
    planned: &HashMap<String, u64>,
    seen_ids: &HashSet<Uuid>,
) -> Result<(), LedgerError> {
    let mut ids_here = HashSet::new();
    for append in appends {
        let actual = current_version(&append.stream_id, known, planned);
        if !append.expected.admits(actual) {
            return Err(LedgerError::WrongExpectedVersion {
                stream_id: append.stream_id.clone(),
                expected: append.expected,
                actual,
            });
        }
        for event in &append.events {
            if seen_ids.contains(&event.event_id) || !ids_here.insert(event.event_id) {
                return Err(LedgerError::DuplicateEventId {
                    event_id: event.event_id,
                });
            }
        }
    }
    Ok(())
}

/// Seqs and versions are far below i64::MAX; saturate rather than wrap if ever not.
fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The distinct stream ids a batch touches.
pub(crate) fn streams_of(requests: &[&[StreamAppend]]) -> Vec<String> {
    let set: HashSet<&str> = requests
        .iter()
        .flat_map(|r| r.iter().map(|a| a.stream_id.as_str()))
        .collect();
    set.into_iter().map(str::to_owned).collect()
}
