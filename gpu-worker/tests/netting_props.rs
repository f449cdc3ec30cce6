//! Properties of multilateral netting that must hold for any batch a member could send.

mod common;

use aether_gpu_worker::netting::{NettingError, net};
use aether_gpu_worker::{Trade, TradeError};
use common::trade;
use proptest::prelude::*;
use std::collections::BTreeMap;

const PARTIES: [&str; 6] = ["bank-a", "bank-b", "broker-c", "fund-d", "cp-e", "cp-f"];
const CURRENCIES: [&str; 4] = ["USD", "EUR", "JPY", "KWD"];

fn arb_trade() -> impl Strategy<Value = Trade> {
    (
        0..PARTIES.len(),
        1..PARTIES.len(),
        0..CURRENCIES.len(),
        // Up to i64::MAX so sums overflow i64 and must still be exact.
        prop_oneof![1..=1_000_000i64, 1..=i64::MAX],
    )
        .prop_map(|(b, offset, c, amount)| {
            let s = (b + offset) % PARTIES.len();
            trade(PARTIES[b], PARTIES[s], CURRENCIES[c], amount)
        })
}

fn arb_batch() -> impl Strategy<Value = Vec<Trade>> {
    prop::collection::vec(arb_trade(), 0..60)
}

fn reverse(t: &Trade) -> Trade {
    let mut r = t.clone();
    r.request_id = format!("{}-reversal", t.request_id);
    std::mem::swap(&mut r.buyer, &mut r.seller);
    r
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn every_currency_nets_to_exactly_zero(batch in arb_batch()) {
        let n = net(&batch).expect("valid batches net");
        let mut sums: BTreeMap<&str, i128> = BTreeMap::new();
        for p in &n.positions {
            *sums.entry(&p.currency).or_default() += p.net_minor;
        }
        prop_assert!(sums.values().all(|s| *s == 0), "{sums:?}");
        // Gross totals and net settlement are consistent with the trades.
        let total: i128 = batch.iter().map(|t| i128::from(t.amount_minor)).sum();
        prop_assert_eq!(n.gross.iter().map(|g| g.gross_minor).sum::<i128>(), total);
        prop_assert_eq!(n.currencies.iter().map(|c| c.gross_minor).sum::<i128>(), total);
        prop_assert_eq!(n.gross.iter().map(|g| g.trades).sum::<u64>(), batch.len() as u64);
        for c in &n.currencies {
            prop_assert!(c.net_settlement_minor <= c.gross_minor);
        }
    }

    #[test]
    fn trade_order_does_not_change_the_result(
        (batch, order) in arb_batch().prop_flat_map(|b| {
            let n = b.len();
            (Just(b), Just((0..n).collect::<Vec<_>>()).prop_shuffle())
        })
    ) {
        let shuffled: Vec<Trade> = order.iter().map(|i| batch[*i].clone()).collect();
        prop_assert_eq!(net(&batch), net(&shuffled));
    }

    #[test]
    fn a_trade_and_its_reverse_cancel(batch in arb_batch()) {
        let mut both = batch.clone();
        both.extend(batch.iter().map(reverse));
        let n = net(&both).expect("nets");
        prop_assert!(n.positions.iter().all(|p| p.net_minor == 0), "{:?}", n.positions);
        for c in &n.currencies {
            prop_assert_eq!(c.net_settlement_minor, 0);
        }
    }

    #[test]
    fn adding_a_reversed_pair_leaves_positions_unchanged(
        batch in arb_batch(),
        extra in arb_trade(),
    ) {
        let before = net(&batch).expect("nets");
        let mut after_batch = batch.clone();
        after_batch.push(extra.clone());
        after_batch.push(reverse(&extra));
        let after = net(&after_batch).expect("nets");
        let nonzero = |n: &aether_gpu_worker::Netting| {
            n.positions.iter().filter(|p| p.net_minor != 0).cloned().collect::<Vec<_>>()
        };
        prop_assert_eq!(nonzero(&before), nonzero(&after));
    }
}

#[test]
fn a_batch_with_a_self_trade_is_refused() {
    let mut t = trade("bank-a", "bank-b", "USD", 5);
    t.seller = t.buyer.clone();
    assert_eq!(
        net(&[trade("bank-a", "bank-b", "USD", 5), t]),
        Err(NettingError::InvalidTrade {
            index: 1,
            source: TradeError::SameParty {
                party: "bank-a".into()
            }
        })
    );
}
