//! Reproducible arbitrary input for the fuzz suites (`fuzz_http_e2e`, `fuzz_grpc_e2e`):
//! the shapes that broke services before (NUL, lone surrogates escaped, numbers past 2^53
//! and 2^64, deep nesting, huge strings, wrong types), drawn from a seed so that a failure
//! can be replayed with `AETHER_FUZZ_SEED`.

use serde_json::{Value, json};

/// xorshift64*: a reproducible draw, reported on failure.
pub struct Draw(pub u64);

impl Draw {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len() as u64) as usize]
    }

    /// A string of the kinds that have broken parsers and databases.
    pub fn text(&mut self) -> String {
        match self.below(10) {
            0 => String::new(),
            1 => "a\u{0}b".to_owned(),
            2 => "x".repeat(1 + self.below(70_000) as usize),
            3 => "9223372036854775808".to_owned(),
            4 => "18446744073709551616".to_owned(),
            5 => "-1".to_owned(),
            6 => "é\u{202e}\u{feff}𝕏".to_owned(),
            7 => "../../etc/passwd".to_owned(),
            8 => format!("{}", self.next_u64()),
            _ => self
                .pick(&[
                    "true",
                    "null",
                    "1e309",
                    "0x10",
                    "2026-13-45T25:61:61Z",
                    "%00",
                    "*",
                ])
                .to_owned(),
        }
    }

    /// A JSON value, nested up to `depth`.
    pub fn value(&mut self, depth: u32) -> Value {
        match self.below(if depth == 0 { 6 } else { 9 }) {
            0 => Value::Null,
            1 => json!(self.below(2) == 1),
            2 => json!(self.text()),
            3 => serde_json::from_str(self.pick(&[
                "18446744073709551616",
                "9007199254740993",
                "-9223372036854775809",
                "1e300",
                "-0.0",
                "2147483648",
            ]))
            .unwrap_or(Value::Null),
            4 => json!(self.next_u64() as i64),
            5 => json!(self.next_u64() as f64 / 3.0),
            6 => Value::Array((0..self.below(4)).map(|_| self.value(depth - 1)).collect()),
            _ => {
                let keys = [
                    "stream_id",
                    "events",
                    "event_type",
                    "payload",
                    "metadata",
                    "name",
                    "ref",
                    "uri",
                    "digest",
                    "source",
                    "policy",
                    "version",
                    "steps",
                    "baseline",
                    "candidate",
                    "limit",
                    "from",
                    "to",
                    "weight",
                    "snapshot",
                    "documents",
                    "reason",
                    "resolution",
                    "since_tree_size",
                    "expected_version",
                    "$personal",
                ];
                let mut object = serde_json::Map::new();
                for _ in 0..self.below(5) {
                    object.insert(self.pick(&keys).to_owned(), self.value(depth - 1));
                }
                Value::Object(object)
            }
        }
    }

    /// A body: JSON of any shape, or bytes that are not JSON at all.
    pub fn body(&mut self) -> Vec<u8> {
        match self.below(8) {
            0 => b"{\"unterminated\": ".to_vec(),
            1 => vec![0xff, 0xfe, 0x00, 0x7b],
            2 => format!("{}{}", "[".repeat(3000), "]".repeat(3000)).into_bytes(),
            3 => b"{\"a\": \"\\ud800\"}".to_vec(),
            _ => serde_json::to_vec(&self.value(4)).unwrap_or_default(),
        }
    }
}

/// The draw's seed (`AETHER_FUZZ_SEED`, else a fixed one) and number of cases
/// (`AETHER_FUZZ_CASES`, else `default_cases`; the long suite asks for more).
pub fn seed_and_cases(default_cases: u64) -> (u64, u64) {
    let var = |name: &str| std::env::var(name).ok().and_then(|s| s.parse().ok());
    (
        var("AETHER_FUZZ_SEED").unwrap_or(0x5EED_A37E_u64),
        var("AETHER_FUZZ_CASES").unwrap_or(default_cases),
    )
}
