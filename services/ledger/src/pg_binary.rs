//! Rows in PostgreSQL's binary `COPY … FROM STDIN (FORMAT binary)` format, for bulk inserts.
//!
//! Why: an `INSERT … SELECT * FROM UNNEST($1::text[], …)` of a few hundred rows makes the
//! server build an array per column and take every element apart again; a binary COPY of
//! the same rows is parsed field by field into the table. Measured on this project's event
//! rows (1.3 KB payloads, three indexes): ~14 µs of server time per row through `UNNEST`,
//! ~9 µs through COPY (BENCHMARKS.md).
//!
//! The format, as PostgreSQL documents it: the signature `PGCOPY\n\377\r\n\0`, a 32-bit
//! flags word and a 32-bit header-extension length (both 0 here); per row a 16-bit field
//! count, then per field a 32-bit length and the value in the type's binary send format
//! (bigint and integer big-endian, a UUID's 16 bytes, text as UTF-8, bytea as is,
//! timestamptz as big-endian microseconds since 2000-01-01 UTC); a 16-bit -1 ends the data.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnection;
use uuid::Uuid;

/// How binary COPY data starts (read back by `store::pg_copy` too).
pub(crate) const SIGNATURE: &[u8; 11] = b"PGCOPY\n\xff\r\n\0";
/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01T00:00:00Z).
pub(crate) const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

/// A value longer than a COPY field can hold (2 GiB).
#[derive(Debug, thiserror::Error)]
#[error("a {len}-byte value does not fit in a PostgreSQL COPY field")]
pub struct FieldTooLong {
    pub len: usize,
}

impl From<FieldTooLong> for sqlx::Error {
    fn from(e: FieldTooLong) -> Self {
        sqlx::Error::Encode(Box::new(e))
    }
}

/// The COPY data of rows with a fixed number of columns, built row by row.
pub struct BinaryRows {
    out: Vec<u8>,
    columns: i16,
}

impl BinaryRows {
    /// Starts the data of rows with `columns` fields each; `bytes` is a hint of its size.
    pub fn new(columns: i16, bytes: usize) -> Self {
        let mut out = Vec::with_capacity(SIGNATURE.len() + 10 + bytes);
        out.extend_from_slice(SIGNATURE);
        out.extend_from_slice(&0i32.to_be_bytes());
        out.extend_from_slice(&0i32.to_be_bytes());
        BinaryRows { out, columns }
    }

    /// Starts a row: exactly `columns` fields must follow.
    pub fn row(&mut self) -> &mut Self {
        self.out.extend_from_slice(&self.columns.to_be_bytes());
        self
    }

    /// A `bytea` field, or any value already in its binary send format.
    pub fn bytes(&mut self, value: &[u8]) -> Result<&mut Self, FieldTooLong> {
        let len = i32::try_from(value.len()).map_err(|_| FieldTooLong { len: value.len() })?;
        self.out.extend_from_slice(&len.to_be_bytes());
        self.out.extend_from_slice(value);
        Ok(self)
    }

    /// A `text` field.
    pub fn text(&mut self, value: &str) -> Result<&mut Self, FieldTooLong> {
        self.bytes(value.as_bytes())
    }

    /// A `bigint` field.
    pub fn int8(&mut self, value: i64) -> &mut Self {
        self.fixed(&value.to_be_bytes())
    }

    /// An `integer` field.
    pub fn int4(&mut self, value: i32) -> &mut Self {
        self.fixed(&value.to_be_bytes())
    }

    /// A `uuid` field.
    pub fn uuid(&mut self, value: &Uuid) -> &mut Self {
        self.fixed(value.as_bytes())
    }

    /// A `timestamptz` field, to the microsecond (as PostgreSQL stores it).
    pub fn timestamptz(&mut self, value: &DateTime<Utc>) -> &mut Self {
        self.int8(value.timestamp_micros().saturating_sub(PG_EPOCH_MICROS))
    }

    /// The finished COPY data.
    pub fn finish(mut self) -> Vec<u8> {
        self.out.extend_from_slice(&(-1i16).to_be_bytes());
        self.out
    }

    fn fixed<const N: usize>(&mut self, value: &[u8; N]) -> &mut Self {
        // N is 4, 8 or 16.
        self.out.extend_from_slice(&(N as i32).to_be_bytes());
        self.out.extend_from_slice(value);
        self
    }
}

/// Runs `statement` (a `COPY … FROM STDIN (FORMAT binary)`) with `data` on `conn`. A
/// failure (a uniqueness conflict, a broken connection) leaves none of the rows in the
/// table; `writer` names the sender in the abort message the server logs.
pub async fn copy_in(
    conn: &mut PgConnection,
    statement: &str,
    data: Vec<u8>,
    writer: &str,
) -> Result<(), sqlx::Error> {
    let mut copy = conn.copy_in_raw(statement).await?;
    if let Err(e) = copy.send(data).await {
        let _ = copy
            .abort(format!("{writer} could not send its rows"))
            .await;
        return Err(e);
    }
    copy.finish().await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_laid_out_as_postgres_documents() {
        let id = Uuid::from_u128(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        let at = DateTime::parse_from_rfc3339("2000-01-01T00:00:01.000002Z")
            .unwrap()
            .with_timezone(&Utc);
        let mut rows = BinaryRows::new(5, 0);
        rows.row().int8(-2).int4(7).uuid(&id).timestamptz(&at);
        rows.text("hé").unwrap();
        let data = rows.finish();

        let mut want = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0".to_vec();
        want.extend_from_slice(&[0, 5]);
        want.extend_from_slice(&[0, 0, 0, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]);
        want.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 7]);
        want.extend_from_slice(&[0, 0, 0, 16]);
        want.extend_from_slice(&(1..=16).collect::<Vec<u8>>());
        want.extend_from_slice(&[0, 0, 0, 8]);
        want.extend_from_slice(&1_000_002i64.to_be_bytes());
        want.extend_from_slice(&[0, 0, 0, 3, b'h', 0xc3, 0xa9]);
        want.extend_from_slice(&[0xff, 0xff]);
        assert_eq!(data, want);
    }

    #[test]
    fn an_empty_copy_is_header_and_trailer() {
        assert_eq!(
            BinaryRows::new(3, 0).finish(),
            b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0\xff\xff".to_vec()
        );
    }
}
