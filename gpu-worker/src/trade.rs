//! The clearing request as the worker sees it, and the checks it must pass before it is
//! scored or netted. A trade that fails a check is refused whole with the field and the
//! offending value named, so the gateway can answer the member precisely.

use chrono::NaiveDate;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Longest identifier accepted (request, member, party, instrument ids).
pub const MAX_ID_LEN: usize = 128;

/// One bilateral trade submitted for clearing: `buyer` pays `amount_minor` of `currency`
/// to `seller` on `value_date`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trade {
    /// The member's idempotency key for this request.
    pub request_id: String,
    /// The clearing member that submitted the trade (from its client certificate).
    pub member_id: String,
    /// Party that pays the cash leg.
    pub buyer: String,
    /// Party that receives the cash leg.
    pub seller: String,
    /// Instrument identifier (ISIN, ticker, contract code; opaque here).
    pub instrument: String,
    /// ISO 4217 alphabetic code: three upper-case ASCII letters.
    pub currency: String,
    /// Cash amount in the currency's minor unit (cents, yen, fils); strictly positive.
    pub amount_minor: i64,
    /// Settlement date, serialised as `YYYY-MM-DD`.
    pub value_date: NaiveDate,
    /// ISO 3166-1 alpha-2 code of the jurisdiction the trade is booked in.
    pub jurisdiction: String,
    /// Counterparty credit tier, 1 (best) to 5 (worst).
    pub counterparty_tier: u8,
}

/// What the gateway knows about the moment of submission, beyond the trade itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TradeContext {
    /// Hour of submission, UTC, 0..=23.
    pub hour_utc: u8,
    /// Trades submitted by the same member in the last minute (computed by the gateway).
    pub velocity: u32,
}

/// Why a trade or its context was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TradeError {
    #[error("{field} is empty")]
    EmptyField { field: &'static str },
    #[error("{field} is {len} bytes long, at most {max} are allowed", max = MAX_ID_LEN)]
    FieldTooLong { field: &'static str, len: usize },
    #[error("{field} contains a control or whitespace character at byte {position}")]
    BadCharacter {
        field: &'static str,
        position: usize,
    },
    #[error("currency {value:?} is not an ISO 4217 code (three upper-case letters A-Z)")]
    Currency { value: String },
    #[error("amount_minor must be greater than zero, got {value}")]
    Amount { value: i64 },
    #[error("jurisdiction {value:?} is not an assigned ISO 3166-1 alpha-2 code")]
    Jurisdiction { value: String },
    #[error("counterparty_tier must be within 1..=5, got {value}")]
    Tier { value: u8 },
    #[error("buyer and seller are the same party {party:?}")]
    SameParty { party: String },
    #[error("hour_utc must be within 0..=23, got {value}")]
    Hour { value: u8 },
}

impl Trade {
    /// Checks every field; the first failure is returned.
    pub fn validate(&self) -> Result<(), TradeError> {
        check_id("request_id", &self.request_id)?;
        check_id("member_id", &self.member_id)?;
        check_id("buyer", &self.buyer)?;
        check_id("seller", &self.seller)?;
        check_id("instrument", &self.instrument)?;
        if !is_currency_code(&self.currency) {
            return Err(TradeError::Currency {
                value: self.currency.clone(),
            });
        }
        if self.amount_minor <= 0 {
            return Err(TradeError::Amount {
                value: self.amount_minor,
            });
        }
        if !is_jurisdiction_code(&self.jurisdiction) {
            return Err(TradeError::Jurisdiction {
                value: self.jurisdiction.clone(),
            });
        }
        if !(1..=5).contains(&self.counterparty_tier) {
            return Err(TradeError::Tier {
                value: self.counterparty_tier,
            });
        }
        // A trade with oneself moves no money and is a classic wash-trade marker; netting it
        // would hide it, so it is refused instead.
        if self.buyer == self.seller {
            return Err(TradeError::SameParty {
                party: self.buyer.clone(),
            });
        }
        Ok(())
    }
}

impl TradeContext {
    /// Checks the submission context.
    pub fn validate(&self) -> Result<(), TradeError> {
        if self.hour_utc > 23 {
            return Err(TradeError::Hour {
                value: self.hour_utc,
            });
        }
        Ok(())
    }
}

/// Validates a trade and its context together.
pub fn validate(trade: &Trade, ctx: &TradeContext) -> Result<(), TradeError> {
    trade.validate()?;
    ctx.validate()
}

fn check_id(field: &'static str, value: &str) -> Result<(), TradeError> {
    if value.is_empty() {
        return Err(TradeError::EmptyField { field });
    }
    if value.len() > MAX_ID_LEN {
        return Err(TradeError::FieldTooLong {
            field,
            len: value.len(),
        });
    }
    // Ids end up in logs, events and file names: no whitespace or control characters.
    if let Some((position, _)) = value
        .char_indices()
        .find(|(_, c)| c.is_control() || c.is_whitespace())
    {
        return Err(TradeError::BadCharacter { field, position });
    }
    Ok(())
}

/// Three upper-case ASCII letters (the form of every ISO 4217 alphabetic code).
pub fn is_currency_code(code: &str) -> bool {
    code.len() == 3 && code.bytes().all(|b| b.is_ascii_uppercase())
}

/// An officially assigned ISO 3166-1 alpha-2 code, or `XK` (Kosovo; user-assigned, but
/// used by SWIFT and most banks, so refusing it would refuse real trades).
pub fn is_jurisdiction_code(code: &str) -> bool {
    code == "XK" || ISO_3166_ALPHA2.binary_search(&code).is_ok()
}

/// The 249 officially assigned ISO 3166-1 alpha-2 codes, sorted.
pub const ISO_3166_ALPHA2: [&str; 249] = [
    "AD", "AE", "AF", "AG", "AI", "AL", "AM", "AO", "AQ", "AR", "AS", "AT", "AU", "AW", "AX", "AZ",
    "BA", "BB", "BD", "BE", "BF", "BG", "BH", "BI", "BJ", "BL", "BM", "BN", "BO", "BQ", "BR", "BS",
    "BT", "BV", "BW", "BY", "BZ", "CA", "CC", "CD", "CF", "CG", "CH", "CI", "CK", "CL", "CM", "CN",
    "CO", "CR", "CU", "CV", "CW", "CX", "CY", "CZ", "DE", "DJ", "DK", "DM", "DO", "DZ", "EC", "EE",
    "EG", "EH", "ER", "ES", "ET", "FI", "FJ", "FK", "FM", "FO", "FR", "GA", "GB", "GD", "GE", "GF",
    "GG", "GH", "GI", "GL", "GM", "GN", "GP", "GQ", "GR", "GS", "GT", "GU", "GW", "GY", "HK", "HM",
    "HN", "HR", "HT", "HU", "ID", "IE", "IL", "IM", "IN", "IO", "IQ", "IR", "IS", "IT", "JE", "JM",
    "JO", "JP", "KE", "KG", "KH", "KI", "KM", "KN", "KP", "KR", "KW", "KY", "KZ", "LA", "LB", "LC",
    "LI", "LK", "LR", "LS", "LT", "LU", "LV", "LY", "MA", "MC", "MD", "ME", "MF", "MG", "MH", "MK",
    "ML", "MM", "MN", "MO", "MP", "MQ", "MR", "MS", "MT", "MU", "MV", "MW", "MX", "MY", "MZ", "NA",
    "NC", "NE", "NF", "NG", "NI", "NL", "NO", "NP", "NR", "NU", "NZ", "OM", "PA", "PE", "PF", "PG",
    "PH", "PK", "PL", "PM", "PN", "PR", "PS", "PT", "PW", "PY", "QA", "RE", "RO", "RS", "RU", "RW",
    "SA", "SB", "SC", "SD", "SE", "SG", "SH", "SI", "SJ", "SK", "SL", "SM", "SN", "SO", "SR", "SS",
    "ST", "SV", "SX", "SY", "SZ", "TC", "TD", "TF", "TG", "TH", "TJ", "TK", "TL", "TM", "TN", "TO",
    "TR", "TT", "TV", "TW", "TZ", "UA", "UG", "UM", "US", "UY", "UZ", "VA", "VC", "VE", "VG", "VI",
    "VN", "VU", "WF", "WS", "YE", "YT", "ZA", "ZM", "ZW",
];

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Trade {
        Trade {
            request_id: "req-1".into(),
            member_id: "bank-a".into(),
            buyer: "bank-a".into(),
            seller: "broker-b".into(),
            instrument: "XS0000000001".into(),
            currency: "USD".into(),
            amount_minor: 125_000,
            value_date: NaiveDate::from_ymd_opt(2026, 3, 4).expect("valid date"),
            jurisdiction: "SG".into(),
            counterparty_tier: 2,
        }
    }

    #[test]
    fn country_table_is_sorted_unique_and_complete() {
        assert!(ISO_3166_ALPHA2.windows(2).all(|w| w[0] < w[1]));
        assert!(
            ISO_3166_ALPHA2
                .iter()
                .all(|c| c.len() == 2 && c.bytes().all(|b| b.is_ascii_uppercase()))
        );
    }

    #[test]
    fn a_well_formed_trade_passes() {
        assert_eq!(sample().validate(), Ok(()));
        let ctx = TradeContext {
            hour_utc: 23,
            velocity: 0,
        };
        assert_eq!(validate(&sample(), &ctx), Ok(()));
    }

    #[test]
    fn each_bad_field_is_named() {
        let mut t = sample();
        t.request_id.clear();
        assert_eq!(
            t.validate(),
            Err(TradeError::EmptyField {
                field: "request_id"
            })
        );

        let mut t = sample();
        t.buyer = "a".repeat(MAX_ID_LEN + 1);
        assert_eq!(
            t.validate(),
            Err(TradeError::FieldTooLong {
                field: "buyer",
                len: MAX_ID_LEN + 1
            })
        );

        let mut t = sample();
        t.seller = "bro ker".into();
        assert_eq!(
            t.validate(),
            Err(TradeError::BadCharacter {
                field: "seller",
                position: 3
            })
        );

        for bad in ["usd", "US", "USDT", "U$D", ""] {
            let mut t = sample();
            t.currency = bad.into();
            assert_eq!(
                t.validate(),
                Err(TradeError::Currency { value: bad.into() })
            );
        }

        for bad in [0, -1, i64::MIN] {
            let mut t = sample();
            t.amount_minor = bad;
            assert_eq!(t.validate(), Err(TradeError::Amount { value: bad }));
        }

        for bad in ["sg", "SGP", "ZZ", "UK", ""] {
            let mut t = sample();
            t.jurisdiction = bad.into();
            assert_eq!(
                t.validate(),
                Err(TradeError::Jurisdiction { value: bad.into() })
            );
        }

        for bad in [0, 6, 255] {
            let mut t = sample();
            t.counterparty_tier = bad;
            assert_eq!(t.validate(), Err(TradeError::Tier { value: bad }));
        }

        let mut t = sample();
        t.seller = t.buyer.clone();
        assert_eq!(
            t.validate(),
            Err(TradeError::SameParty {
                party: "bank-a".into()
            })
        );

        let ctx = TradeContext {
            hour_utc: 24,
            velocity: 1,
        };
        assert_eq!(ctx.validate(), Err(TradeError::Hour { value: 24 }));
    }

    #[test]
    fn kosovo_and_gb_are_accepted() {
        let mut t = sample();
        for ok in ["XK", "GB", "AX", "ZW"] {
            t.jurisdiction = ok.into();
            assert_eq!(t.validate(), Ok(()), "{ok}");
        }
    }

    #[test]
    fn json_uses_iso_dates() {
        let json = serde_json::to_value(sample()).expect("serialises");
        assert_eq!(json["value_date"], "2026-03-04");
        let back: Trade = serde_json::from_value(json).expect("round-trips");
        assert_eq!(back, sample());
    }
}
