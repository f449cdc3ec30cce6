//! The synthetic trades every load client sends: deterministic (SplitMix64 from a seed),
//! from the members the development PKI issues certificates for.

use aether_gateway::pb::v1::{ClearingRequest, Trade};

/// Members the development PKI issues certificates for; channels alternate between them.
pub const MEMBERS: [&str; 2] = ["bank-a", "bank-b"];

/// Settlement date T+2, as members send it.
pub fn value_date() -> String {
    (chrono::Utc::now() + chrono::Duration::days(2))
        .format("%Y-%m-%d")
        .to_string()
}

/// A small deterministic generator (SplitMix64) for the trades.
pub struct SplitMix(pub u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A realistic small trade: the member buys from one of 200 counterparties, 100.00 to
/// 50,000.00 (log-uniform) in one of four currencies, mostly Singapore; about one trade
/// in a hundred is above the reporting threshold (the rules hold it).
pub fn trade_request(rng: &mut SplitMix, member: &str, value_date: &str) -> ClearingRequest {
    const CURRENCIES: [&str; 4] = ["SGD", "SGD", "USD", "EUR"];
    const JURISDICTIONS: [&str; 5] = ["SG", "SG", "SG", "HK", "GB"];
    let amount_minor = if rng.below(100) == 0 {
        12_000_000 + rng.below(5_000_000) as i64
    } else {
        (10_000.0 * 500f64.powf(rng.unit())) as i64
    };
    ClearingRequest {
        trade: Some(Trade {
            buyer: member.to_owned(),
            seller: format!("cp-{:03}", rng.below(200)),
            instrument: format!("SG{:010}", rng.below(50)),
            currency: CURRENCIES[rng.below(CURRENCIES.len() as u64) as usize].to_owned(),
            amount_minor,
            value_date: value_date.to_owned(),
            jurisdiction: JURISDICTIONS[rng.below(JURISDICTIONS.len() as u64) as usize].to_owned(),
            counterparty_tier: 1 + rng.below(3) as u32,
        }),
        ..ClearingRequest::default()
    }
}

// ---------------------------------------------------------------------------------------
// CPU accounting from /proc (Linux; absent elsewhere)
