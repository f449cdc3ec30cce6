//! What the rules need to know beyond the trade: each member's recent trades (structuring
//! over 24 h, velocity over 1 min), exposure per counterparty against the limits table,
//! the reporting threshold and the high-risk jurisdictions. Kept in memory, bounded.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use aether_gpu_worker::Trade;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};

/// Trades remembered per member (oldest dropped first).
const MAX_RECENT_PER_MEMBER: usize = 1_000;
/// Trades of the member given to the rules as `recent` (newest first).
pub const CONTEXT_RECENT: usize = 100;
/// How far back `recent` looks.
const RECENT_WINDOW_SECS: i64 = 24 * 3600;

/// The fixed part of the rules' context.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RiskSettings {
    #[serde(default = "default_threshold")]
    pub reporting_threshold_minor: i64,
    #[serde(default = "default_high_risk")]
    pub high_risk_jurisdictions: Vec<String>,
    /// Exposure limit per counterparty, minor units.
    #[serde(default)]
    pub limits: HashMap<String, i64>,
}

fn default_threshold() -> i64 {
    aether_gpu_worker::features::REPORTING_THRESHOLD_MINOR
}

fn default_high_risk() -> Vec<String> {
    aether_gpu_worker::features::FATF_CALL_FOR_ACTION
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
}

impl Default for RiskSettings {
    fn default() -> Self {
        RiskSettings {
            reporting_threshold_minor: default_threshold(),
            high_risk_jurisdictions: default_high_risk(),
            limits: HashMap::new(),
        }
    }
}

struct RecentTrade {
    request_id: String,
    amount_minor: i64,
    counterparty: String,
    currency: String,
    at: DateTime<Utc>,
}

#[derive(Default)]
struct Book {
    recent: HashMap<String, VecDeque<RecentTrade>>,
    exposure: HashMap<String, i64>,
}

/// The live risk state.
pub struct RiskBook {
    settings: RiskSettings,
    book: Mutex<Book>,
}

impl RiskBook {
    pub fn new(settings: RiskSettings) -> Self {
        RiskBook {
            settings,
            book: Mutex::default(),
        }
    }

    /// The rules' `context` for a trade by `member` against `counterparty`, and the
    /// member's velocity (trades in the last minute).
    ///
    /// Bounded per request, since it is built for every trade: `recent` holds the member's
    /// newest [`CONTEXT_RECENT`] trades of the last 24 h, and `limits` / `exposure` only the
    /// counterparty's entries (what rules keyed by `request.counterparty` read).
    pub fn context(&self, member: &str, counterparty: &str, now: DateTime<Utc>) -> (Value, u32) {
        let book = self
            .book
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut velocity = 0u32;
        let mut recent = Vec::new();
        if let Some(trades) = book.recent.get(member) {
            for t in trades.iter().rev() {
                let age = (now - t.at).num_seconds().max(0);
                if age > RECENT_WINDOW_SECS {
                    break;
                }
                if age < 60 {
                    velocity = velocity.saturating_add(1);
                }
                if recent.len() < CONTEXT_RECENT {
                    recent.push(json!({
                        "request_id": t.request_id,
                        "amount_minor": t.amount_minor,
                        "age_seconds": age,
                        "counterparty": t.counterparty,
                        "currency": t.currency,
                    }));
                } else if age >= 60 {
                    break;
                }
            }
        }
        let mut limits = serde_json::Map::new();
        if let Some(l) = self.settings.limits.get(counterparty) {
            limits.insert(counterparty.to_owned(), json!(l));
        }
        let mut exposure = serde_json::Map::new();
        if let Some(e) = book.exposure.get(counterparty) {
            exposure.insert(counterparty.to_owned(), json!(e));
        }
        let context = json!({
            "limits": limits,
            "exposure": exposure,
            "recent": recent,
            "high_risk_jurisdictions": self.settings.high_risk_jurisdictions,
            "reporting_threshold_minor": self.settings.reporting_threshold_minor,
            "now": aether_ledger::hashing::format_timestamp(&now),
        });
        (context, velocity)
    }

    /// Remembers a decided trade (its seller is the counterparty); a cleared one adds to
    /// the counterparty's exposure.
    pub fn record(&self, trade: &Trade, cleared: bool, at: DateTime<Utc>) {
        let (member, request_id, counterparty, currency, amount_minor) = (
            trade.member_id.as_str(),
            trade.request_id.as_str(),
            trade.seller.as_str(),
            trade.currency.as_str(),
            trade.amount_minor,
        );
        let mut book = self
            .book
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let trades = book.recent.entry(member.to_owned()).or_default();
        while trades
            .front()
            .is_some_and(|t| (at - t.at).num_seconds() > RECENT_WINDOW_SECS)
            || trades.len() >= MAX_RECENT_PER_MEMBER
        {
            trades.pop_front();
        }
        trades.push_back(RecentTrade {
            request_id: request_id.to_owned(),
            amount_minor,
            counterparty: counterparty.to_owned(),
            currency: currency.to_owned(),
            at,
        });
        if cleared {
            let e = book.exposure.entry(counterparty.to_owned()).or_default();
            *e = e.saturating_add(amount_minor);
        }
    }
}
