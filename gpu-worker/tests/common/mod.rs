//! Trades a person would recognise: an ordinary one and one of each planted anomaly kind.
#![allow(dead_code)]

use aether_gpu_worker::{Trade, TradeContext};
use chrono::NaiveDate;

pub fn trade(buyer: &str, seller: &str, currency: &str, amount_minor: i64) -> Trade {
    Trade {
        request_id: format!("req-{buyer}-{seller}-{amount_minor}"),
        member_id: buyer.into(),
        buyer: buyer.into(),
        seller: seller.into(),
        instrument: "FX-SPOT".into(),
        currency: currency.into(),
        amount_minor,
        value_date: NaiveDate::from_ymd_opt(2026, 3, 4).expect("a Wednesday"),
        jurisdiction: "GB".into(),
        counterparty_tier: 1,
    }
}

/// 25,000.00 USD between two good names in London at 10:00 UTC, a handful a minute.
pub fn ordinary() -> (Trade, TradeContext) {
    (
        trade("bank-a", "broker-b", "USD", 2_500_000),
        TradeContext {
            hour_utc: 10,
            velocity: 3,
        },
    )
}

/// 99,990.00 USD, just under the 10,000,000-minor threshold, 120 trades a minute.
pub fn structuring() -> (Trade, TradeContext) {
    let (mut t, mut c) = ordinary();
    t.amount_minor = 9_999_000;
    c.velocity = 120;
    (t, c)
}

/// Booked in a FATF call-for-action jurisdiction with a tier-5 counterparty.
pub fn high_risk_low_tier() -> (Trade, TradeContext) {
    let (mut t, c) = ordinary();
    t.jurisdiction = "KP".into();
    t.counterparty_tier = 5;
    (t, c)
}

/// 250 million USD at 03:00 UTC.
pub fn odd_hour_huge() -> (Trade, TradeContext) {
    let (mut t, mut c) = ordinary();
    t.amount_minor = 25_000_000_000;
    c.hour_utc = 3;
    (t, c)
}
