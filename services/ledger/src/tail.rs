//! The events this process committed or read most recently, kept in memory for the
//! followers (lineage relays, the Merkle log, the checkpointer) that would otherwise read
//! every one of them back from the database: the writer's batches a moment after it
//! inserted them, and, in a cluster, the other nodes' events once per process rather than
//! once per follower.
//!
//! Only committed events are kept: the writer's batches after their commit, and pages the
//! followers read from the database. Held batches never overlap and need not be
//! consecutive (another process may have written in between); a page read here is exactly
//! what the database holds at those seqs, ending at the first seq not held, so a follower
//! that gets a short page reads the rest from the database, as it does for writes from
//! other processes.
//!
//! Batches are kept as [`RecordedEvent`]s, made once when published: each follower used to
//! rebuild its page from the writer's rows, checking every payload's JSON again on the way
//! (2–3 % of the gateway's CPU under clearing load, with two lineage relays following).
//! Followers share them (`Arc`) rather than copy them: copying every payload and metadata
//! text once per relay was another 1.6 % of the gateway's CPU. In a cluster of three nodes
//! on one machine, each event of another node was read from the database by both relays
//! of the lease holder, and its hash by the Merkle log and the checkpointer of every node.
//! The hashes the Merkle log and the checkpointer read are kept too, apart, for the other.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde_json::value::RawValue;

use crate::event::RecordedEvent;
use crate::hashing::Hash;
use crate::store::plan::EventRow;

/// Most events kept (and, apart, most hashes).
const MAX_EVENTS: usize = 65_536;
/// Most payload and metadata bytes kept (1 MiB payloads would otherwise make 64 GiB).
const MAX_BYTES: usize = 64 << 20;

/// What is kept of one event: its seq and what it costs to hold.
trait Item: Clone {
    fn seq(&self) -> u64;
    fn bytes(&self) -> usize;
}

impl Item for Arc<RecordedEvent> {
    fn seq(&self) -> u64 {
        self.seq
    }

    fn bytes(&self) -> usize {
        self.payload.get().len() + self.metadata.get().len() + self.stream_id.len() + 128
    }
}

impl Item for (u64, Hash) {
    fn seq(&self) -> u64 {
        self.0
    }

    fn bytes(&self) -> usize {
        40
    }
}

/// A batch as followers share it: consecutive seqs.
type Batch<T> = Arc<Vec<T>>;

/// Recently committed events in batches keyed by their first seq, never overlapping.
struct Held<T> {
    batches: BTreeMap<u64, Batch<T>>,
    events: usize,
    bytes: usize,
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Held {
            batches: BTreeMap::new(),
            events: 0,
            bytes: 0,
        }
    }
}

impl<T: Item> Held<T> {
    /// The batches holding up to `max` items from `from_seq` on while their seqs run on
    /// (shared, not copied); `None` where no batch holds `from_seq`.
    fn batches_from(&self, from_seq: u64, max: usize) -> Option<Vec<Batch<T>>> {
        let (_, first) = self.batches.range(..=from_seq).next_back()?;
        let mut through = first.last()?.seq();
        if through < from_seq {
            return None;
        }
        let mut batches = vec![Arc::clone(first)];
        // Seqs are consecutive within a batch, so a batch's last seq says how many of the
        // items are wanted.
        while through + 1 < from_seq.saturating_add(max as u64) {
            let Some(next) = self.batches.get(&(through + 1)) else {
                break;
            };
            through = next.last().map_or(through, Item::seq);
            batches.push(Arc::clone(next));
        }
        Some(batches)
    }

    fn holds(&self, seq: u64) -> bool {
        self.batches
            .range(..=seq)
            .next_back()
            .and_then(|(_, b)| b.last())
            .is_some_and(|last| last.seq() >= seq)
    }

    /// Keeps the items (in seq order) that no batch holds yet, as batches of consecutive
    /// seqs; then drops the lowest seqs while over the bounds, keeping the newest batch
    /// even if it alone is over them.
    fn insert(&mut self, items: impl IntoIterator<Item = T>) {
        let mut run: Vec<T> = Vec::new();
        for item in items {
            let continues = run.last().is_none_or(|last| last.seq() + 1 == item.seq());
            if !continues || self.holds(item.seq()) {
                self.add(std::mem::take(&mut run));
            }
            if !self.holds(item.seq()) {
                run.push(item);
            }
        }
        self.add(run);
        while (self.events > MAX_EVENTS || self.bytes > MAX_BYTES) && self.batches.len() > 1 {
            if let Some((_, old)) = self.batches.pop_first() {
                self.events -= old.len();
                self.bytes -= old.iter().map(Item::bytes).sum::<usize>();
            }
        }
    }

    fn add(&mut self, run: Vec<T>) {
        let Some(first) = run.first().map(Item::seq) else {
            return;
        };
        self.events += run.len();
        self.bytes += run.iter().map(Item::bytes).sum::<usize>();
        self.batches.insert(first, Arc::new(run));
    }
}

/// At most `max` items of `batches` from `from_seq` on.
fn items_of<T: Item>(batches: &[Batch<T>], from_seq: u64, max: usize) -> impl Iterator<Item = &T> {
    batches
        .iter()
        .flat_map(|b| b.iter())
        .skip_while(move |e| e.seq() < from_seq)
        .take(max)
}

/// What the followers share: whole events, and apart, hashes read on their own.
#[derive(Default)]
pub(crate) struct Tail {
    events: Mutex<Held<Arc<RecordedEvent>>>,
    hashes: Mutex<Held<(u64, Hash)>>,
}

/// A committed row as followers read it; `None` if its text is not JSON, which the writer
/// never stores (the database read then decides).
fn recorded(row: EventRow) -> Option<Arc<RecordedEvent>> {
    Some(Arc::new(RecordedEvent {
        seq: u64::try_from(row.seq).ok()?,
        stream_id: row.stream_id,
        stream_version: u64::try_from(row.stream_version).ok()?,
        event_id: row.event_id,
        event_type: row.event_type,
        schema_version: u32::try_from(row.schema_version).ok()?,
        // The owned text is kept as it is (canonical JSON has no whitespace to trim).
        payload: RawValue::from_string(row.payload).ok()?,
        metadata: RawValue::from_string(row.metadata).ok()?,
        recorded_at: row.recorded_at,
        prev_hash: row.prev_hash,
        hash: row.hash,
    }))
}

impl Tail {
    /// Adds a committed batch (rows in seq order). Called by the writer after the commit
    /// and before it signals one, when the insert no longer shares the rows.
    pub(crate) fn publish(&self, rows: Arc<Vec<EventRow>>) {
        // Rows still shared are not kept. Personal values live only in the database, where
        // they can be erased; a `RecordedEvent` has none.
        let Ok(rows) = Arc::try_unwrap(rows) else {
            return;
        };
        let Some(events) = rows.into_iter().map(recorded).collect::<Option<Vec<_>>>() else {
            return;
        };
        self.learn(&events);
    }

    /// Keeps committed events a follower read from the database, for the other followers.
    pub(crate) fn learn(&self, events: &[Arc<RecordedEvent>]) {
        if let Ok(mut held) = self.events.lock() {
            held.insert(events.iter().cloned());
        }
    }

    /// Keeps committed hashes a follower read from the database, for the other followers.
    pub(crate) fn learn_hashes(&self, hashes: &[(u64, Hash)]) {
        if let Ok(mut held) = self.hashes.lock() {
            held.insert(hashes.iter().copied());
        }
    }

    /// Up to `max` events from `from_seq` on, if `from_seq` is held; `None` (read the
    /// database) otherwise.
    pub(crate) fn events_from(&self, from_seq: u64, max: usize) -> Option<Vec<Arc<RecordedEvent>>> {
        // Only the batches are taken under the lock: the writer publishes through it on
        // every commit and must not wait while a follower takes its page.
        let batches = self.events.lock().ok()?.batches_from(from_seq, max)?;
        Some(items_of(&batches, from_seq, max).cloned().collect())
    }

    /// Up to `max` `(seq, hash)` pairs from `from_seq` on, as [`Tail::events_from`]: from
    /// the events held, else from the hashes held.
    pub(crate) fn hashes_from(&self, from_seq: u64, max: usize) -> Option<Vec<(u64, Hash)>> {
        if let Some(batches) = self.events.lock().ok()?.batches_from(from_seq, max) {
            return Some(
                items_of(&batches, from_seq, max)
                    .map(|e| (e.seq, e.hash))
                    .collect(),
            );
        }
        let batches = self.hashes.lock().ok()?.batches_from(from_seq, max)?;
        Some(items_of(&batches, from_seq, max).copied().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use uuid::Uuid;

    fn row(seq: u64) -> EventRow {
        EventRow {
            seq: seq as i64,
            stream_id: format!("s-{seq}"),
            stream_version: 1,
            event_id: Uuid::now_v7(),
            event_type: "Happened".into(),
            schema_version: 1,
            payload: format!("{{\"n\":{seq}}}"),
            metadata: "{}".into(),
            recorded_at: Utc::now(),
            prev_hash: [0; 32],
            hash: [seq as u8; 32],
            personal: Vec::new(),
        }
    }

    fn batch(seqs: std::ops::RangeInclusive<u64>) -> Arc<Vec<EventRow>> {
        Arc::new(seqs.map(row).collect())
    }

    fn seqs(events: Option<Vec<Arc<RecordedEvent>>>) -> Option<Vec<u64>> {
        events.map(|e| e.into_iter().map(|e| e.seq).collect())
    }

    #[test]
    fn pages_cross_batches_and_stop_at_max() {
        let tail = Tail::default();
        tail.publish(batch(1..=3));
        tail.publish(batch(4..=6));
        tail.publish(batch(7..=7));
        assert_eq!(seqs(tail.events_from(2, 4)), Some(vec![2, 3, 4, 5]));
        assert_eq!(seqs(tail.events_from(5, 10)), Some(vec![5, 6, 7]));
        assert_eq!(seqs(tail.events_from(7, 10)), Some(vec![7]));
        assert_eq!(seqs(tail.events_from(1, 3)), Some(vec![1, 2, 3]));
        assert_eq!(seqs(tail.events_from(3, 2)), Some(vec![3, 4]));
        // Only the batches a page needs are taken.
        let run = tail.events.lock().unwrap();
        assert_eq!(run.batches_from(1, 3).map(|b| b.len()), Some(1));
        assert_eq!(run.batches_from(3, 2).map(|b| b.len()), Some(2));
        assert_eq!(run.batches_from(2, 100).map(|b| b.len()), Some(3));
        drop(run);
        let e = tail.events_from(5, 1).unwrap().remove(0);
        assert_eq!(e.payload.get(), "{\"n\":5}");
        // Two followers get the one event, not a copy each.
        let again = tail.events_from(4, 2).unwrap().remove(1);
        assert!(Arc::ptr_eq(&e, &again));
        assert_eq!(e.hash, [5; 32]);
        assert_eq!(
            tail.hashes_from(6, 5),
            Some(vec![(6, [6; 32]), (7, [7; 32])])
        );
    }

    #[test]
    fn personal_values_are_not_kept() {
        let tail = Tail::default();
        let mut rows = vec![row(1)];
        rows[0].personal.push(crate::personal::PersonalField {
            member: "buyer".into(),
            value: "\"Alice\"".into(),
            salt: [7; 16],
        });
        tail.publish(Arc::new(rows));
        let run = tail.events.lock().unwrap();
        assert_eq!(run.events, 1);
        // What is kept is the event as committed: its payload, not the personal value.
        let kept = &run.batches[&1][0];
        assert_eq!(kept.payload.get(), "{\"n\":1}");
        assert!(!format!("{kept:?}").contains("Alice"));
        drop(run);
        // A batch something else still holds is left to the database.
        let shared = batch(2..=2);
        let _held = Arc::clone(&shared);
        tail.publish(shared);
        assert!(tail.events_from(2, 1).is_none());
    }

    #[test]
    fn a_row_that_is_not_json_is_left_to_the_database() {
        let tail = Tail::default();
        tail.publish(batch(1..=2));
        let mut rows = vec![row(3), row(4)];
        rows[1].payload = "{not json".into();
        tail.publish(Arc::new(rows));
        assert_eq!(seqs(tail.events_from(1, 10)), Some(vec![1, 2]));
        assert!(tail.events_from(3, 10).is_none());
    }

    #[test]
    fn seqs_outside_the_run_are_left_to_the_database() {
        let tail = Tail::default();
        assert!(tail.events_from(1, 10).is_none());
        tail.publish(batch(10..=12));
        assert!(tail.events_from(9, 10).is_none());
        assert!(tail.events_from(13, 10).is_none());
        assert!(tail.hashes_from(13, 10).is_none());
    }

    #[test]
    fn a_page_ends_where_the_seqs_held_stop() {
        let tail = Tail::default();
        tail.publish(batch(1..=3));
        // Seqs 4 and 5 were written by another process.
        tail.publish(batch(6..=8));
        assert_eq!(seqs(tail.events_from(2, 10)), Some(vec![2, 3]));
        assert!(tail.events_from(4, 10).is_none());
        assert_eq!(seqs(tail.events_from(6, 10)), Some(vec![6, 7, 8]));
        // A follower reads them from the database: from then on the run goes on.
        let read: Vec<_> = (4..=5).filter_map(|s| recorded(row(s))).collect();
        tail.learn(&read);
        assert_eq!(
            seqs(tail.events_from(2, 10)),
            Some(vec![2, 3, 4, 5, 6, 7, 8])
        );
    }

    #[test]
    fn what_is_held_is_kept_once() {
        let tail = Tail::default();
        tail.publish(batch(3..=5));
        // A page overlapping what is held on both sides: only seqs 1, 2 and 6 are added,
        // and the events held stay the ones followers already share.
        let before = tail.events_from(4, 1).unwrap().remove(0);
        let read: Vec<_> = (1..=6).filter_map(|s| recorded(row(s))).collect();
        tail.learn(&read);
        assert_eq!(seqs(tail.events_from(1, 10)), Some(vec![1, 2, 3, 4, 5, 6]));
        assert!(Arc::ptr_eq(&before, &tail.events_from(4, 1).unwrap()[0]));
        let held = tail.events.lock().unwrap();
        assert_eq!(held.events, 6);
        assert_eq!(
            held.batches
                .iter()
                .map(|(k, b)| (*k, b.len()))
                .collect::<Vec<_>>(),
            vec![(1, 2), (3, 3), (6, 1)]
        );
    }

    #[test]
    fn hashes_read_alone_are_kept_apart() {
        let tail = Tail::default();
        tail.publish(batch(1..=2));
        tail.learn_hashes(&[(3, [3; 32]), (4, [4; 32]), (6, [6; 32])]);
        // Events first, then the hashes held.
        assert_eq!(tail.hashes_from(2, 10), Some(vec![(2, [2; 32])]));
        assert_eq!(
            tail.hashes_from(3, 10),
            Some(vec![(3, [3; 32]), (4, [4; 32])])
        );
        assert_eq!(tail.hashes_from(6, 10), Some(vec![(6, [6; 32])]));
        assert!(tail.hashes_from(5, 10).is_none());
        assert!(tail.events_from(3, 10).is_none());
    }

    #[test]
    fn the_oldest_batches_go_when_the_bounds_are_passed() {
        let tail = Tail::default();
        let per = 1_000u64;
        let batches = MAX_EVENTS as u64 / per + 2;
        for b in 0..batches {
            tail.publish(batch(b * per + 1..=(b + 1) * per));
        }
        assert!(tail.events_from(1, 1).is_none());
        let newest = (batches - 1) * per + 1;
        assert_eq!(seqs(tail.events_from(newest, 1)), Some(vec![newest]));
        let run = tail.events.lock().unwrap();
        assert!(run.events <= MAX_EVENTS);
        assert_eq!(
            run.events,
            run.batches.values().map(|b| b.len()).sum::<usize>()
        );
    }
}
