//! The feature vector the clearing model reads. Its order, names and formulas are part of
//! the artifact contract (`model.json` lists the names; a model trained on another schema
//! is refused), and the same table is written in `gpu-worker/README.md`.
//!
//! Everything is computed in f64 with the pure-Rust `libm` and rounded once to f32, so a
//! trade maps to the same bits on every platform.

use chrono::{Datelike, Weekday};

use crate::trade::{Trade, TradeContext};

/// Version of the schema below; bump it when any name, order, formula or table changes.
pub const FEATURE_SCHEMA_VERSION: &str = "aether.features.v1";

/// Number of features.
pub const FEATURE_COUNT: usize = 17;

/// Feature names, in vector order.
pub const FEATURE_NAMES: [&str; FEATURE_COUNT] = [
    "log10_amount_major",
    "near_reporting_threshold",
    "ccy_usd",
    "ccy_eur",
    "ccy_gbp",
    "ccy_jpy",
    "ccy_cny",
    "ccy_hkd",
    "ccy_sgd",
    "ccy_chf",
    "ccy_other",
    "jurisdiction_risk",
    "counterparty_tier_norm",
    "hour_sin",
    "hour_cos",
    "log10_velocity",
    "value_date_weekend",
];

/// Currencies that get their own one-hot slot (features 2..=9); any other is `ccy_other`.
pub const ONE_HOT_CURRENCIES: [&str; 8] = ["USD", "EUR", "GBP", "JPY", "CNY", "HKD", "SGD", "CHF"];

/// Cash threshold, in minor units of the trade's currency, below which structuring is
/// watched for (10,000,000 minor = 100,000.00 in a two-decimal currency).
pub const REPORTING_THRESHOLD_MINOR: i64 = 10_000_000;

/// Start of the "just below the threshold" window: 90 % of the threshold.
pub const NEAR_THRESHOLD_FLOOR_MINOR: i64 = 9_000_000;

/// ISO 4217 minor-unit exponents that differ from the usual 2, sorted by code.
const CURRENCY_EXPONENTS: &[(&str, u32)] = &[
    ("BHD", 3),
    ("BIF", 0),
    ("CLF", 4),
    ("CLP", 0),
    ("DJF", 0),
    ("GNF", 0),
    ("IQD", 3),
    ("ISK", 0),
    ("JOD", 3),
    ("JPY", 0),
    ("KMF", 0),
    ("KRW", 0),
    ("KWD", 3),
    ("LYD", 3),
    ("OMR", 3),
    ("PYG", 0),
    ("RWF", 0),
    ("TND", 3),
    ("UGX", 0),
    ("UYI", 0),
    ("UYW", 4),
    ("VND", 0),
    ("VUV", 0),
    ("XAF", 0),
    ("XOF", 0),
    ("XPF", 0),
];

/// Minor-unit exponent of a currency (ISO 4217): 0 for JPY, 3 for KWD, 2 for most
/// (including codes not in the table).
pub fn currency_exponent(currency: &str) -> u32 {
    CURRENCY_EXPONENTS
        .binary_search_by(|(c, _)| (*c).cmp(currency))
        .map(|i| CURRENCY_EXPONENTS[i].1)
        .unwrap_or(2)
}

/// FATF "High-Risk Jurisdictions subject to a Call for Action" (the black list), as
/// published after the FATF plenary of 24 October 2025: DPRK, Iran, Myanmar.
pub const FATF_CALL_FOR_ACTION: [&str; 3] = ["IR", "KP", "MM"];

/// FATF "Jurisdictions under Increased Monitoring" (the grey list), 24 October 2025.
pub const FATF_INCREASED_MONITORING: [&str; 20] = [
    "AO", "BG", "BO", "CD", "CI", "CM", "DZ", "HT", "KE", "LA", "LB", "MC", "NA", "NP", "SS", "SY",
    "VE", "VG", "VN", "YE",
];

/// Risk weight of a jurisdiction: 1.0 on the FATF call-for-action list, 0.5 under FATF
/// increased monitoring, 0.0 otherwise.
pub fn jurisdiction_risk(jurisdiction: &str) -> f32 {
    if FATF_CALL_FOR_ACTION.binary_search(&jurisdiction).is_ok() {
        1.0
    } else if FATF_INCREASED_MONITORING
        .binary_search(&jurisdiction)
        .is_ok()
    {
        0.5
    } else {
        0.0
    }
}

/// The feature vector of one trade. Assumes a validated trade; out-of-range input is
/// clamped rather than producing NaN, so the function is total.
pub fn features(trade: &Trade, ctx: &TradeContext) -> [f32; FEATURE_COUNT] {
    let mut f = [0f32; FEATURE_COUNT];

    let exponent = currency_exponent(&trade.currency);
    let amount_minor = trade.amount_minor.max(0);
    let major = amount_minor as f64 / libm::pow(10.0, f64::from(exponent));
    f[0] = libm::log10(major + 1.0) as f32;

    f[1] = if (NEAR_THRESHOLD_FLOOR_MINOR..REPORTING_THRESHOLD_MINOR).contains(&amount_minor) {
        1.0
    } else {
        0.0
    };

    let slot = ONE_HOT_CURRENCIES
        .iter()
        .position(|c| *c == trade.currency)
        .unwrap_or(ONE_HOT_CURRENCIES.len());
    f[2 + slot] = 1.0;

    f[11] = jurisdiction_risk(&trade.jurisdiction);
    f[12] = (f32::from(trade.counterparty_tier.clamp(1, 5)) - 1.0) / 4.0;

    let angle = std::f64::consts::TAU * f64::from(ctx.hour_utc.min(23)) / 24.0;
    f[13] = libm::sin(angle) as f32;
    f[14] = libm::cos(angle) as f32;

    f[15] = libm::log10(f64::from(ctx.velocity) + 1.0) as f32;

    f[16] = match trade.value_date.weekday() {
        Weekday::Sat | Weekday::Sun => 1.0,
        _ => 0.0,
    };
    f
}

/// Row-major `[batch.len(), FEATURE_COUNT]` matrix of a batch.
pub fn feature_matrix(batch: &[(Trade, TradeContext)]) -> Vec<f32> {
    let mut rows = Vec::with_capacity(batch.len() * FEATURE_COUNT);
    for (trade, ctx) in batch {
        rows.extend_from_slice(&features(trade, ctx));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::NaiveDate;

    fn trade(currency: &str, amount_minor: i64, jurisdiction: &str, tier: u8) -> Trade {
        Trade {
            request_id: "r".into(),
            member_id: "m".into(),
            buyer: "b".into(),
            seller: "s".into(),
            instrument: "i".into(),
            currency: currency.into(),
            amount_minor,
            value_date: NaiveDate::from_ymd_opt(2026, 3, 4).expect("valid date"),
            jurisdiction: jurisdiction.into(),
            counterparty_tier: tier,
        }
    }

    #[test]
    fn tables_are_sorted_for_binary_search() {
        assert!(CURRENCY_EXPONENTS.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(FATF_CALL_FOR_ACTION.windows(2).all(|w| w[0] < w[1]));
        assert!(FATF_INCREASED_MONITORING.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(FEATURE_NAMES.len(), 2 + ONE_HOT_CURRENCIES.len() + 1 + 6);
    }

    #[test]
    fn amounts_are_read_in_major_units() {
        let ctx = TradeContext {
            hour_utc: 12,
            velocity: 0,
        };
        // 999.00 USD, 999 JPY and 999.000 KWD are all 999 major units.
        let usd = features(&trade("USD", 99_900, "US", 1), &ctx)[0];
        let jpy = features(&trade("JPY", 999, "JP", 1), &ctx)[0];
        let kwd = features(&trade("KWD", 999_000, "KW", 1), &ctx)[0];
        assert_eq!(usd, 3.0);
        assert_eq!(jpy, 3.0);
        assert_eq!(kwd, 3.0);
        assert_eq!(currency_exponent("XOF"), 0);
        assert_eq!(currency_exponent("EUR"), 2);
    }

    #[test]
    fn one_hot_threshold_risk_tier_hour_velocity_weekend() {
        let ctx = TradeContext {
            hour_utc: 6,
            velocity: 99,
        };
        let f = features(&trade("AUD", 9_500_000, "IR", 5), &ctx);
        assert_eq!(f[1], 1.0);
        assert_eq!(&f[2..11], &[0., 0., 0., 0., 0., 0., 0., 0., 1.]);
        assert_eq!(f[11], 1.0);
        assert_eq!(f[12], 1.0);
        assert!((f[13] - 1.0).abs() < 1e-7 && f[14].abs() < 1e-7);
        assert_eq!(f[15], 2.0);
        assert_eq!(f[16], 0.0);

        let mut t = trade("SGD", 10_000_000, "VG", 1);
        t.value_date = NaiveDate::from_ymd_opt(2026, 3, 7).expect("a Saturday");
        let f = features(&t, &ctx);
        assert_eq!(f[1], 0.0, "the threshold itself is not 'just below'");
        assert_eq!(f[8], 1.0);
        assert_eq!(f[11], 0.5);
        assert_eq!(f[12], 0.0);
        assert_eq!(f[16], 1.0);
        assert_eq!(jurisdiction_risk("DE"), 0.0);
    }

    #[test]
    fn every_feature_is_finite_at_the_extremes() {
        for (amount, velocity, hour) in [(1, 0, 0), (i64::MAX, u32::MAX, 23)] {
            let ctx = TradeContext {
                hour_utc: hour,
                velocity,
            };
            let f = features(&trade("JPY", amount, "US", 3), &ctx);
            assert!(f.iter().all(|x| x.is_finite()), "{f:?}");
        }
    }
}
