//! What the rules need to know beyond the trade: each member's recent trades (structuring
//! over 24 h, velocity over 1 min), exposure per counterparty against the limits table,
//! the reporting threshold and the high-risk jurisdictions. Kept in memory, bounded.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use aether_gpu_worker::Trade;
use aether_rules::Members;
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
    /// member's velocity (trades in the last minute, which the model needs for every
    /// trade).
    ///
    /// The context's members are produced only when a rule reads them (see
    /// [`aether_rules::lazy`]): `recent` is up to a hundred maps and most trades never
    /// reach the rule that reads it. Each member reads the book as it is at that moment.
    pub fn context<'a>(
        &'a self,
        member: &'a str,
        counterparty: &'a str,
        now: DateTime<Utc>,
    ) -> (RiskContext<'a>, u32) {
        let velocity = {
            let book = self.lock();
            book.recent.get(member).map_or(0, |trades| {
                // `at` never decreases along a member's trades (see `record`).
                let minute_ago = now - chrono::Duration::seconds(60);
                let older = trades.partition_point(|t| t.at <= minute_ago);
                u32::try_from(trades.len() - older).unwrap_or(u32::MAX)
            })
        };
        let context = RiskContext {
            book: self,
            member,
            counterparty,
            now,
        };
        (context, velocity)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `recent`: the member's newest [`CONTEXT_RECENT`] trades of the last 24 h, newest
    /// first.
    fn recent(&self, member: &str, now: DateTime<Utc>) -> Value {
        let book = self.lock();
        let Some(trades) = book.recent.get(member) else {
            return Value::Array(Vec::new());
        };
        let recent = trades
            .iter()
            .rev()
            .map(|t| (t, (now - t.at).num_seconds().max(0)))
            .take_while(|(_, age)| *age <= RECENT_WINDOW_SECS)
            .take(CONTEXT_RECENT)
            .map(|(t, age)| {
                json!({
                    "request_id": t.request_id,
                    "amount_minor": t.amount_minor,
                    "age_seconds": age,
                    "counterparty": t.counterparty,
                    "currency": t.currency,
                })
            })
            .collect();
        Value::Array(recent)
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
        let mut book = self.lock();
        let trades = book.recent.entry(member.to_owned()).or_default();
        // Kept in time order (clocks may step back; decisions finish out of order), so
        // that the velocity is a binary search.
        let at = trades.back().map_or(at, |last| last.at.max(at));
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

/// Members of the rules' `context` (documented in the rules crate's README).
const CONTEXT_MEMBERS: [&str; 6] = [
    "limits",
    "exposure",
    "recent",
    "high_risk_jurisdictions",
    "reporting_threshold_minor",
    "now",
];

/// The rules' `context` for one trade, produced member by member from the live book.
pub struct RiskContext<'a> {
    book: &'a RiskBook,
    member: &'a str,
    counterparty: &'a str,
    now: DateTime<Utc>,
}

impl Members for RiskContext<'_> {
    fn names(&self) -> Vec<Cow<'_, str>> {
        CONTEXT_MEMBERS.iter().map(|n| Cow::Borrowed(*n)).collect()
    }

    fn member(&self, name: &str) -> Option<Cow<'_, Value>> {
        let settings = &self.book.settings;
        // `limits` and `exposure` hold only the counterparty's entry: what rules keyed by
        // `request.counterparty` read, bounded whatever the number of counterparties.
        let value = match name {
            "limits" => {
                let mut limits = serde_json::Map::new();
                if let Some(l) = settings.limits.get(self.counterparty) {
                    limits.insert(self.counterparty.to_owned(), json!(l));
                }
                Value::Object(limits)
            }
            "exposure" => {
                let mut exposure = serde_json::Map::new();
                if let Some(e) = self.book.lock().exposure.get(self.counterparty) {
                    exposure.insert(self.counterparty.to_owned(), json!(e));
                }
                Value::Object(exposure)
            }
            "recent" => self.book.recent(self.member, self.now),
            "high_risk_jurisdictions" => json!(settings.high_risk_jurisdictions),
            "reporting_threshold_minor" => json!(settings.reporting_threshold_minor),
            "now" => json!(aether_ledger::hashing::format_timestamp(&self.now)),
            _ => return None,
        };
        Some(Cow::Owned(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::NaiveDate;

    /// The whole context as one JSON object (what a rule reading `context` whole sees).
    fn to_json(context: &RiskContext<'_>) -> Value {
        let members = CONTEXT_MEMBERS
            .iter()
            .filter_map(|n| Some(((*n).to_owned(), context.member(n)?.into_owned())))
            .collect();
        Value::Object(members)
    }

    fn trade(member: &str, n: u32, amount_minor: i64) -> Trade {
        Trade {
            request_id: format!("r-{n}"),
            member_id: member.to_owned(),
            buyer: "acct-1".into(),
            seller: "bank-b".into(),
            instrument: "XS0000000001".into(),
            currency: "EUR".into(),
            amount_minor,
            value_date: NaiveDate::from_ymd_opt(2026, 12, 2).expect("a date"),
            jurisdiction: "SG".into(),
            counterparty_tier: 2,
        }
    }

    #[test]
    fn velocity_counts_the_last_minute_and_recent_the_newest_hundred_of_a_day() {
        let book = RiskBook::new(RiskSettings::default());
        let now = Utc::now();
        let secs = chrono::Duration::seconds;
        // 150 trades two hours ago, 30 in the last minute, one a day and a half ago first.
        book.record(&trade("m", 0, 1), true, now - secs(36 * 3600));
        for n in 1..=150 {
            book.record(&trade("m", n, 10), true, now - secs(7200));
        }
        for n in 151..=180 {
            book.record(&trade("m", n, 20), false, now - secs(30));
        }
        book.record(&trade("other", 1, 5), true, now);
        let (context, velocity) = book.context("m", "bank-b", now);
        assert_eq!(velocity, 30);
        let recent = to_json(&context)["recent"].clone();
        let recent = recent.as_array().expect("a list");
        assert_eq!(recent.len(), CONTEXT_RECENT);
        assert_eq!(recent[0]["request_id"], "r-180", "newest first");
        assert_eq!(recent[0]["age_seconds"], 30);
        assert_eq!(recent[30]["request_id"], "r-150");
        assert_eq!(recent[30]["age_seconds"], 7200);
        // Cleared trades add to the counterparty's exposure; held ones do not.
        assert_eq!(to_json(&context)["exposure"]["bank-b"], 1 + 150 * 10 + 5);
        assert_eq!(book.context("nobody", "bank-b", now).1, 0);
    }

    #[test]
    fn a_trade_recorded_with_an_earlier_clock_keeps_the_book_in_order() {
        let book = RiskBook::new(RiskSettings::default());
        let now = Utc::now();
        book.record(&trade("m", 1, 10), true, now);
        // A decision that started earlier finishes later.
        book.record(
            &trade("m", 2, 10),
            true,
            now - chrono::Duration::seconds(120),
        );
        let (_, velocity) = book.context("m", "bank-b", now);
        assert_eq!(velocity, 2, "both are within the minute once kept in order");
    }
}
