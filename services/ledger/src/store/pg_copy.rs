//! Whole-ledger reads on PostgreSQL through one `COPY (SELECT …) TO STDOUT (FORMAT binary)`.
//!
//! Why: `verify` reads every event once, in order. Paged `SELECT`s through sqlx spent about
//! as much client CPU decoding rows as the SM3 work itself; the binary COPY stream is a
//! plain sequence of length-prefixed fields, parsed here without per-column lookups, and
//! it is one statement on one snapshot instead of a hundred. The format is PostgreSQL's
//! documented binary COPY format (signature, flags, header extension, then per tuple an
//! `int16` field count and per field an `int32` length and the bytes; `-1` ends).

use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde_json::value::RawValue;
use sqlx::Postgres;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgPool;
use uuid::Uuid;

use crate::error::LedgerError;
use crate::event::RecordedEvent;
use crate::pg_binary::{PG_EPOCH_MICROS, SIGNATURE};

/// Columns of `select_events!`, in its order.
const COLUMNS: i16 = 11;

/// Streams every event with `seq >= from_seq` in seq order to `pages`, `page_len` at a
/// time. Stops early, without error, when the receiver is dropped.
pub(crate) async fn copy_all(
    pool: &PgPool,
    from_seq: u64,
    page_len: usize,
    pages: &tokio::sync::mpsc::Sender<Result<Vec<RecordedEvent>, LedgerError>>,
) -> Result<(), LedgerError> {
    let from = i64::try_from(from_seq).unwrap_or(i64::MAX);
    // No parameters in COPY: the bound is an integer formatted here, nothing else varies.
    let statement = format!(
        "COPY ({}WHERE seq >= {from} ORDER BY seq) TO STDOUT (FORMAT binary)",
        select_events!("")
    );
    let mut conn = Detaching(Some(pool.acquire().await?));
    let Some(c) = conn.0.as_mut() else {
        return Ok(());
    };
    let mut chunks = c.copy_out_raw(&statement).await?;
    let mut parser = CopyParser::default();
    let mut page = Vec::with_capacity(page_len);
    while let Some(chunk) = chunks.next().await {
        parser.feed(&chunk?, &mut page)?;
        if page.len() >= page_len {
            let full = std::mem::replace(&mut page, Vec::with_capacity(page_len));
            if pages.send(Ok(full)).await.is_err() {
                return Ok(());
            }
        }
    }
    parser.finish()?;
    drop(chunks);
    // Read to the end: the connection is clean and may serve other queries.
    conn.release();
    if !page.is_empty() {
        let _ = pages.send(Ok(page)).await;
    }
    Ok(())
}

/// A pooled connection that is closed, not returned to the pool, unless released: a COPY
/// left unfinished (an early return, a reader task aborted once verify found a problem)
/// would hand its leftover rows to the next query on that connection.
struct Detaching(Option<PoolConnection<Postgres>>);

impl Detaching {
    fn release(&mut self) {
        drop(self.0.take());
    }
}

impl Drop for Detaching {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(conn.detach());
        }
    }
}

/// Incremental parser of a binary COPY stream of `select_events!` rows.
#[derive(Default)]
pub(crate) struct CopyParser {
    /// Bytes of an incomplete header or tuple carried over to the next chunk.
    pending: Vec<u8>,
    header_read: bool,
    ended: bool,
    /// The last seq parsed, to name the row a problem is in.
    last_seq: i64,
}

impl CopyParser {
    /// Parses every complete tuple in `pending` + `chunk` into `out`.
    pub(crate) fn feed(
        &mut self,
        chunk: &[u8],
        out: &mut Vec<RecordedEvent>,
    ) -> Result<(), LedgerError> {
        if self.pending.is_empty() {
            // The common case: PostgreSQL sends one tuple per message.
            let used = self.parse(chunk, out)?;
            self.pending.extend_from_slice(&chunk[used..]);
        } else {
            let mut pending = std::mem::take(&mut self.pending);
            pending.extend_from_slice(chunk);
            let used = self.parse(&pending, out)?;
            pending.drain(..used);
            self.pending = pending;
        }
        Ok(())
    }

    /// The stream ended: anything but a complete trailer is a truncated read.
    pub(crate) fn finish(&self) -> Result<(), LedgerError> {
        if self.ended && self.pending.is_empty() {
            Ok(())
        } else {
            Err(self.corrupt("the COPY stream ended inside a row".into()))
        }
    }

    /// Parses complete pieces of `bytes`; returns how many bytes were used.
    fn parse(&mut self, bytes: &[u8], out: &mut Vec<RecordedEvent>) -> Result<usize, LedgerError> {
        let mut used = 0;
        if !self.header_read {
            let Some(len) = self.header(bytes)? else {
                return Ok(0);
            };
            used = len;
            self.header_read = true;
        }
        while used < bytes.len() {
            if self.ended {
                return Err(self.corrupt("data after the COPY trailer".into()));
            }
            let mut r = Reader::new(&bytes[used..]);
            let Some(fields) = r.i16() else { break };
            if fields == -1 {
                self.ended = true;
                used += 2;
                continue;
            }
            if fields != COLUMNS {
                return Err(self.corrupt(format!("a row of {fields} columns, not {COLUMNS}")));
            }
            match self.tuple(&mut r)? {
                Some(event) => {
                    self.last_seq = event.seq as i64;
                    out.push(event);
                    used += r.pos;
                }
                None => break,
            }
        }
        Ok(used)
    }

    /// The header's length once it is complete.
    fn header(&self, bytes: &[u8]) -> Result<Option<usize>, LedgerError> {
        let mut r = Reader::new(bytes);
        let (Some(signature), Some(_flags), Some(extension)) = (r.take(11), r.i32(), r.i32())
        else {
            return Ok(None);
        };
        if signature != SIGNATURE {
            return Err(self.corrupt("not a binary COPY stream".into()));
        }
        let extension = usize::try_from(extension)
            .map_err(|_| self.corrupt("negative COPY header extension".into()))?;
        Ok(r.take(extension).map(|_| r.pos))
    }

    /// One tuple's eleven fields, or `None` if it is not complete yet.
    fn tuple(&self, r: &mut Reader<'_>) -> Result<Option<RecordedEvent>, LedgerError> {
        macro_rules! field {
            ($name:literal) => {
                match r.field() {
                    Field::Value(v) => v,
                    Field::Incomplete => return Ok(None),
                    Field::Null => return Err(self.corrupt(format!("{} is NULL", $name))),
                }
            };
        }
        let seq = int8(field!("seq")).ok_or_else(|| self.corrupt("seq is not an int8".into()))?;
        let corrupt = |reason: String| LedgerError::CorruptRow { seq, reason };
        let stream_id = text(field!("stream_id"), "stream_id", seq)?;
        let stream_version = int8(field!("stream_version"))
            .ok_or_else(|| corrupt("stream_version is not an int8".into()))?;
        let event_id = Uuid::from_slice(field!("event_id"))
            .map_err(|_| corrupt("event_id is not a uuid".into()))?;
        let event_type = text(field!("event_type"), "event_type", seq)?;
        let schema_version = <[u8; 4]>::try_from(field!("schema_version"))
            .map(i32::from_be_bytes)
            .map_err(|_| corrupt("schema_version is not an int4".into()))?;
        let payload = json(field!("payload"), "payload", seq)?;
        let metadata = json(field!("metadata"), "metadata", seq)?;
        let recorded_at = int8(field!("recorded_at"))
            .and_then(|micros| micros.checked_add(PG_EPOCH_MICROS))
            .and_then(DateTime::<Utc>::from_timestamp_micros)
            .ok_or_else(|| corrupt("recorded_at is not a timestamptz".into()))?;
        let prev_hash = <[u8; 32]>::try_from(field!("prev_hash"))
            .map_err(|_| corrupt("prev_hash has not 32 bytes".into()))?;
        let hash = <[u8; 32]>::try_from(field!("hash"))
            .map_err(|_| corrupt("hash has not 32 bytes".into()))?;
        Ok(Some(RecordedEvent {
            seq: seq as u64,
            stream_id,
            stream_version: stream_version as u64,
            event_id,
            event_type,
            schema_version: schema_version as u32,
            payload,
            metadata,
            recorded_at,
            prev_hash,
            hash,
        }))
    }

    fn corrupt(&self, reason: String) -> LedgerError {
        // The row after the last good one is where the problem is.
        LedgerError::CorruptRow {
            seq: self.last_seq.saturating_add(1),
            reason,
        }
    }
}

fn int8(bytes: &[u8]) -> Option<i64> {
    <[u8; 8]>::try_from(bytes).ok().map(i64::from_be_bytes)
}

fn text(bytes: &[u8], column: &str, seq: i64) -> Result<String, LedgerError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| LedgerError::CorruptRow {
        seq,
        reason: format!("{column} is not UTF-8"),
    })
}

fn json(bytes: &[u8], column: &str, seq: i64) -> Result<Box<RawValue>, LedgerError> {
    let corrupt = |reason: String| LedgerError::CorruptRow { seq, reason };
    let text = text(bytes, column, seq)?;
    RawValue::from_string(text).map_err(|e| corrupt(format!("{column} is not JSON: {e}")))
}

enum Field<'a> {
    Value(&'a [u8]),
    Null,
    Incomplete,
}

/// Big-endian reads that say `None` when the bytes run out.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let out = self.bytes.get(self.pos..end)?;
        self.pos = end;
        Some(out)
    }

    fn i16(&mut self) -> Option<i16> {
        self.take(2)
            .and_then(|b| b.try_into().ok())
            .map(i16::from_be_bytes)
    }

    fn i32(&mut self) -> Option<i32> {
        self.take(4)
            .and_then(|b| b.try_into().ok())
            .map(i32::from_be_bytes)
    }

    fn field(&mut self) -> Field<'a> {
        match self.i32() {
            None => Field::Incomplete,
            Some(-1) => Field::Null,
            Some(len) => match usize::try_from(len).ok().and_then(|n| self.take(n)) {
                Some(v) => Field::Value(v),
                None => Field::Incomplete,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
        out.extend_from_slice(bytes);
    }

    fn tuple(seq: i64, payload: &str) -> Vec<u8> {
        let mut t = COLUMNS.to_be_bytes().to_vec();
        field(&mut t, &seq.to_be_bytes());
        field(&mut t, b"clearing/bank-a");
        field(&mut t, &seq.to_be_bytes());
        field(&mut t, Uuid::from_u128(seq as u128).as_bytes());
        field(&mut t, b"ClearingDecided");
        field(&mut t, &1i32.to_be_bytes());
        field(&mut t, payload.as_bytes());
        field(&mut t, b"{}");
        // 2026-12-02T00:00:00Z
        field(
            &mut t,
            &(1_796_169_600_000_000i64 - PG_EPOCH_MICROS).to_be_bytes(),
        );
        field(&mut t, &[seq as u8; 32]);
        field(&mut t, &[seq as u8 + 1; 32]);
        t
    }

    fn stream(rows: usize) -> Vec<u8> {
        let mut s = SIGNATURE.to_vec();
        s.extend_from_slice(&0i32.to_be_bytes());
        s.extend_from_slice(&0i32.to_be_bytes());
        for seq in 1..=rows as i64 {
            s.extend(tuple(seq, "{\"amount\":1}"));
        }
        s.extend_from_slice(&(-1i16).to_be_bytes());
        s
    }

    #[test]
    fn rows_split_anywhere_across_chunks_parse_the_same() {
        let bytes = stream(3);
        for chunk in [1, 2, 7, 64, bytes.len()] {
            let mut parser = CopyParser::default();
            let mut out = Vec::new();
            for piece in bytes.chunks(chunk) {
                parser.feed(piece, &mut out).unwrap();
            }
            parser.finish().unwrap();
            assert_eq!(out.len(), 3, "chunks of {chunk}");
            assert_eq!(out[2].seq, 3);
            assert_eq!(out[2].stream_id, "clearing/bank-a");
            assert_eq!(out[2].event_id, Uuid::from_u128(3));
            assert_eq!(out[2].payload.get(), "{\"amount\":1}");
            assert_eq!(out[2].recorded_at.to_rfc3339(), "2026-12-02T00:00:00+00:00");
            assert_eq!(out[2].hash, [4; 32]);
        }
    }

    #[test]
    fn a_stream_cut_short_is_an_error_not_a_short_ledger() {
        let bytes = stream(2);
        let mut parser = CopyParser::default();
        let mut out = Vec::new();
        parser.feed(&bytes[..bytes.len() - 10], &mut out).unwrap();
        let err = parser.finish().unwrap_err();
        assert!(err.to_string().contains("ended inside a row"), "{err}");
    }

    #[test]
    fn bad_rows_are_named_by_seq() {
        let mut bytes = stream(1);
        let at = bytes.len() - 2;
        bytes.splice(at..at, tuple(2, "{not json"));
        let mut parser = CopyParser::default();
        let err = parser.feed(&bytes, &mut Vec::new()).unwrap_err();
        assert!(
            matches!(&err, LedgerError::CorruptRow { seq: 2, reason } if reason.contains("payload is not JSON")),
            "{err}"
        );
        let err = CopyParser::default()
            .feed(b"PGCOPY\nXXXXXXXXXXXXX", &mut Vec::new())
            .unwrap_err();
        assert!(
            err.to_string().contains("not a binary COPY stream"),
            "{err}"
        );
    }

    proptest::proptest! {
        /// Garbage never panics the parser.
        #[test]
        fn arbitrary_bytes_never_panic(
            garbage in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
            keep_header in proptest::prelude::any::<bool>(),
        ) {
            let mut bytes = if keep_header { stream(0)[..19].to_vec() } else { Vec::new() };
            bytes.extend(garbage);
            let mut parser = CopyParser::default();
            let _ = parser.feed(&bytes, &mut Vec::new());
            let _ = parser.finish();
        }
    }
}
