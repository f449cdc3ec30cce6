//! The events this process committed most recently, kept in memory for the followers
//! (lineage relays, the Merkle log, the checkpointer) that would otherwise read every one
//! of them back from the database a moment after the writer inserted it.
//!
//! Only committed batches are published, in seq order, by the writer itself. The tail holds
//! one run of consecutive seqs: a batch that does not continue it (another process wrote
//! in between, or a batch went in alone after a conflict) starts a new run. So a page read
//! here is exactly what the database holds at those seqs, though it may end sooner: the
//! database can hold later events written by other processes, which followers find on their
//! periodic database read.
//!
//! Batches are kept as [`RecordedEvent`]s, made once when published: each follower used to
//! rebuild its page from the writer's rows, checking every payload's JSON again on the way
//! (2–3 % of the gateway's CPU under clearing load, with two lineage relays following).
//! Followers share them (`Arc`) rather than copy them: copying every payload and metadata
//! text once per relay was another 1.6 % of the gateway's CPU.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde_json::value::RawValue;

use crate::event::RecordedEvent;
use crate::hashing::Hash;
use crate::store::plan::EventRow;

/// Most events kept.
const MAX_EVENTS: usize = 65_536;
/// Most payload and metadata bytes kept (1 MiB payloads would otherwise make 64 GiB).
const MAX_BYTES: usize = 64 << 20;

/// A committed batch as followers share it.
type Batch = Arc<Vec<Arc<RecordedEvent>>>;

/// Recently committed batches, oldest first, their seqs consecutive.
#[derive(Default)]
pub(crate) struct Tail {
    inner: Mutex<Run>,
}

#[derive(Default)]
struct Run {
    batches: VecDeque<Batch>,
    events: usize,
    bytes: usize,
}

impl Run {
    fn first_seq(&self) -> Option<u64> {
        self.batches.front()?.first().map(|e| e.seq)
    }

    fn last_seq(&self) -> Option<u64> {
        self.batches.back()?.last().map(|e| e.seq)
    }

    /// The batches holding the `max` rows from `from_seq` on (shared, not copied); `None`
    /// where the run does not hold `from_seq` (empty when it is the seq after the run).
    fn batches_from(&self, from_seq: u64, max: usize) -> Option<Vec<Batch>> {
        let (first, last) = (self.first_seq()?, self.last_seq()?);
        if from_seq < first || from_seq > last {
            return None;
        }
        // Batches are consecutive: the one holding `from_seq` is the last starting at or before it.
        let start = self
            .batches
            .partition_point(|b| b.first().is_some_and(|e| e.seq <= from_seq));
        // Seqs are consecutive, so a batch's last seq says how many of the rows are wanted.
        let mut batches = Vec::new();
        for batch in self.batches.range(start.saturating_sub(1)..) {
            batches.push(Arc::clone(batch));
            let through = batch.last().map_or(0, |e| e.seq);
            if through + 1 >= from_seq.saturating_add(max as u64) {
                break;
            }
        }
        Some(batches)
    }
}

/// At most `max` events of `batches` from `from_seq` on.
fn events_of(
    batches: &[Batch],
    from_seq: u64,
    max: usize,
) -> impl Iterator<Item = &Arc<RecordedEvent>> {
    batches
        .iter()
        .flat_map(|b| b.iter())
        .skip_while(move |e| e.seq < from_seq)
        .take(max)
}

fn bytes_of(events: &[Arc<RecordedEvent>]) -> usize {
    events
        .iter()
        .map(|e| e.payload.get().len() + e.metadata.get().len() + e.stream_id.len() + 128)
        .sum()
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
        let events = Arc::new(events);
        let Some(first) = events.first().map(|e| e.seq) else {
            return;
        };
        let Ok(mut run) = self.inner.lock() else {
            return;
        };
        if run.last_seq().is_some_and(|last| last + 1 != first) {
            *run = Run::default();
        }
        run.events += events.len();
        run.bytes += bytes_of(&events);
        run.batches.push_back(events);
        // Keep the newest batch even if it alone is over the bounds.
        while (run.events > MAX_EVENTS || run.bytes > MAX_BYTES) && run.batches.len() > 1 {
            if let Some(old) = run.batches.pop_front() {
                run.events -= old.len();
                run.bytes -= bytes_of(&old);
            }
        }
    }

    /// Up to `max` events from `from_seq` on, if this process committed `from_seq`
    /// recently; `None` (read the database) otherwise, or when nothing here follows it.
    pub(crate) fn events_from(&self, from_seq: u64, max: usize) -> Option<Vec<Arc<RecordedEvent>>> {
        // Only the batches are taken under the lock: the writer publishes through it on
        // every commit and must not wait while a follower takes its page.
        let batches = self.batches_from(from_seq, max)?;
        Some(events_of(&batches, from_seq, max).cloned().collect())
    }

    /// Up to `max` `(seq, hash)` pairs from `from_seq` on, as [`Tail::events_from`].
    pub(crate) fn hashes_from(&self, from_seq: u64, max: usize) -> Option<Vec<(u64, Hash)>> {
        let batches = self.batches_from(from_seq, max)?;
        Some(
            events_of(&batches, from_seq, max)
                .map(|e| (e.seq, e.hash))
                .collect(),
        )
    }

    fn batches_from(&self, from_seq: u64, max: usize) -> Option<Vec<Batch>> {
        self.inner.lock().ok()?.batches_from(from_seq, max)
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
        let run = tail.inner.lock().unwrap();
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
        let run = tail.inner.lock().unwrap();
        assert_eq!(run.events, 1);
        // What is kept is the event as committed: its payload, not the personal value.
        let kept = &run.batches[0][0];
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
    fn a_batch_that_skips_seqs_starts_a_new_run() {
        let tail = Tail::default();
        tail.publish(batch(1..=3));
        // Seqs 4 and 5 were written by another process.
        tail.publish(batch(6..=8));
        assert!(tail.events_from(2, 10).is_none());
        assert_eq!(seqs(tail.events_from(6, 10)), Some(vec![6, 7, 8]));
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
        let run = tail.inner.lock().unwrap();
        assert!(run.events <= MAX_EVENTS);
        assert_eq!(
            run.events,
            run.batches.iter().map(|b| b.len()).sum::<usize>()
        );
    }
}
