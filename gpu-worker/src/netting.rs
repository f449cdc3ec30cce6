//! Multilateral netting of a batch: each party's net cash position per currency, exact in
//! i128, with conservation checked before anything is reported.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::trade::{Trade, TradeError};

/// One party's net position in one currency: received as seller minus paid as buyer.
/// Positive means the party is owed money at settlement.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NetPosition {
    pub party: String,
    pub currency: String,
    pub net_minor: i128,
}

/// What one member submitted in one currency, before netting.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GrossTotal {
    pub member_id: String,
    pub currency: String,
    /// Sum of `amount_minor` over the member's trades in this currency.
    pub gross_minor: i128,
    pub trades: u64,
}

/// How much netting saved in one currency.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CurrencySummary {
    pub currency: String,
    /// Sum of all trade amounts (what would move without netting).
    pub gross_minor: i128,
    /// Sum of the positive net positions (what moves after netting).
    pub net_settlement_minor: i128,
    pub trades: u64,
}

/// The netting of one batch. Every list is sorted by its key (party or member, then
/// currency), so equal batches give equal results whatever the trade order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Netting {
    /// Every (party, currency) that appears in the batch, including those that net to 0.
    pub positions: Vec<NetPosition>,
    pub gross: Vec<GrossTotal>,
    /// Sorted by currency.
    pub currencies: Vec<CurrencySummary>,
}

/// Why a batch could not be netted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NettingError {
    #[error("trade {index} cannot be netted: {source}")]
    InvalidTrade { index: usize, source: TradeError },
    #[error("{what} overflowed i128 in {currency}")]
    Overflow {
        what: &'static str,
        currency: String,
    },
    /// Cannot happen with valid arithmetic; reported rather than hidden if it ever does.
    #[error("positions in {currency} sum to {residual}, not 0: netting is broken")]
    NotConserved { currency: String, residual: i128 },
}

fn add(
    slot: &mut i128,
    amount: i128,
    what: &'static str,
    currency: &str,
) -> Result<(), NettingError> {
    *slot = slot
        .checked_add(amount)
        .ok_or_else(|| NettingError::Overflow {
            what,
            currency: currency.into(),
        })?;
    Ok(())
}

/// Nets a batch. Each trade is validated first (an invalid one refuses the batch, with its
/// index); then the seller is credited and the buyer debited `amount_minor`, and per
/// currency the positions must sum to exactly zero.
pub fn net<'a>(trades: impl IntoIterator<Item = &'a Trade>) -> Result<Netting, NettingError> {
    let mut positions: BTreeMap<(&str, &str), i128> = BTreeMap::new();
    let mut gross: BTreeMap<(&str, &str), (i128, u64)> = BTreeMap::new();
    let mut per_currency: BTreeMap<&str, (i128, u64)> = BTreeMap::new();

    for (index, t) in trades.into_iter().enumerate() {
        t.validate()
            .map_err(|source| NettingError::InvalidTrade { index, source })?;
        let ccy = t.currency.as_str();
        let amount = i128::from(t.amount_minor);
        add(
            positions.entry((&t.seller, ccy)).or_default(),
            amount,
            "a net position",
            ccy,
        )?;
        add(
            positions.entry((&t.buyer, ccy)).or_default(),
            -amount,
            "a net position",
            ccy,
        )?;
        let g = gross.entry((&t.member_id, ccy)).or_default();
        add(&mut g.0, amount, "a gross total", ccy)?;
        g.1 += 1;
        let c = per_currency.entry(ccy).or_default();
        add(&mut c.0, amount, "a currency's gross", ccy)?;
        c.1 += 1;
    }

    // Conservation: money only moves between parties, so each currency nets to zero.
    let mut residual: BTreeMap<&str, i128> = BTreeMap::new();
    let mut settlement: BTreeMap<&str, i128> = BTreeMap::new();
    for ((_, ccy), net) in &positions {
        add(residual.entry(ccy).or_default(), *net, "a residual", ccy)?;
        if *net > 0 {
            add(
                settlement.entry(ccy).or_default(),
                *net,
                "a net settlement",
                ccy,
            )?;
        }
    }
    if let Some((ccy, r)) = residual.iter().find(|(_, r)| **r != 0) {
        return Err(NettingError::NotConserved {
            currency: (*ccy).into(),
            residual: *r,
        });
    }

    Ok(Netting {
        positions: positions
            .into_iter()
            .map(|((party, currency), net_minor)| NetPosition {
                party: party.into(),
                currency: currency.into(),
                net_minor,
            })
            .collect(),
        gross: gross
            .into_iter()
            .map(|((member, currency), (gross_minor, trades))| GrossTotal {
                member_id: member.into(),
                currency: currency.into(),
                gross_minor,
                trades,
            })
            .collect(),
        currencies: per_currency
            .into_iter()
            .map(|(currency, (gross_minor, trades))| CurrencySummary {
                currency: currency.into(),
                gross_minor,
                net_settlement_minor: settlement.get(currency).copied().unwrap_or(0),
                trades,
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::NaiveDate;

    fn t(member: &str, buyer: &str, seller: &str, ccy: &str, amount: i64) -> Trade {
        Trade {
            request_id: format!("{buyer}-{seller}-{amount}"),
            member_id: member.into(),
            buyer: buyer.into(),
            seller: seller.into(),
            instrument: "FX-SPOT".into(),
            currency: ccy.into(),
            amount_minor: amount,
            value_date: NaiveDate::from_ymd_opt(2026, 3, 4).expect("date"),
            jurisdiction: "GB".into(),
            counterparty_tier: 1,
        }
    }

    fn pos(party: &str, ccy: &str, net: i128) -> NetPosition {
        NetPosition {
            party: party.into(),
            currency: ccy.into(),
            net_minor: net,
        }
    }

    #[test]
    fn a_three_party_cycle_nets_down() {
        // A pays B 100, B pays C 100, C pays A 60 (USD); A pays C 5 EUR.
        let n = net(&[
            t("A", "A", "B", "USD", 100),
            t("B", "B", "C", "USD", 100),
            t("C", "C", "A", "USD", 60),
            t("A", "A", "C", "EUR", 5),
        ])
        .expect("nets");
        assert_eq!(
            n.positions,
            vec![
                pos("A", "EUR", -5),
                pos("A", "USD", -40),
                pos("B", "USD", 0),
                pos("C", "EUR", 5),
                pos("C", "USD", 40),
            ]
        );
        assert_eq!(
            n.gross,
            vec![
                GrossTotal {
                    member_id: "A".into(),
                    currency: "EUR".into(),
                    gross_minor: 5,
                    trades: 1
                },
                GrossTotal {
                    member_id: "A".into(),
                    currency: "USD".into(),
                    gross_minor: 100,
                    trades: 1
                },
                GrossTotal {
                    member_id: "B".into(),
                    currency: "USD".into(),
                    gross_minor: 100,
                    trades: 1
                },
                GrossTotal {
                    member_id: "C".into(),
                    currency: "USD".into(),
                    gross_minor: 60,
                    trades: 1
                },
            ]
        );
        assert_eq!(
            n.currencies[1],
            CurrencySummary {
                currency: "USD".into(),
                gross_minor: 260,
                net_settlement_minor: 40,
                trades: 3
            }
        );
    }

    #[test]
    fn sums_beyond_i64_stay_exact() {
        let n = net(&[
            t("A", "A", "B", "USD", i64::MAX),
            t("A", "A", "B", "USD", i64::MAX),
        ])
        .expect("nets");
        assert_eq!(n.positions[0], pos("A", "USD", -2 * i128::from(i64::MAX)));
        assert_eq!(n.gross[0].gross_minor, 2 * i128::from(i64::MAX));
    }

    #[test]
    fn invalid_trades_are_refused_with_their_index() {
        let err = net(&[t("A", "A", "B", "USD", 1), t("A", "A", "B", "USD", 0)]);
        assert_eq!(
            err,
            Err(NettingError::InvalidTrade {
                index: 1,
                source: TradeError::Amount { value: 0 }
            })
        );
    }

    #[test]
    fn an_empty_batch_nets_to_nothing() {
        assert_eq!(net(&Vec::<Trade>::new()), Ok(Netting::default()));
    }
}
