//! Explanations of the reference model's scores: the efficiency property, agreement with
//! an independent brute-force Shapley computation (the permutation definition over all
//! 8! orderings), determinism from the recorded seed, and each way an explanation fails.

mod common;

use std::collections::HashMap;
use std::path::Path;

use aether_gpu_worker::explain::{
    Background, ExplainSettings, Explainer, ExplanationStatus, GROUPS, METHOD, seed_for,
};
use aether_gpu_worker::features::{FEATURE_COUNT, features};
use aether_gpu_worker::reference::REFERENCE_MODEL_DIGEST;
use aether_gpu_worker::{ClearingModel, DeviceChoice, ExplainError, ExplainPlan};
use common::{high_risk_low_tier, ordinary, structuring};

fn reference() -> ClearingModel {
    ClearingModel::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("model/reference/model.safetensors"),
        REFERENCE_MODEL_DIGEST,
        DeviceChoice::Cpu,
    )
    .expect("reference loads")
}

#[test]
fn a_held_trades_attributions_add_up_and_pass_every_check() {
    let model = reference();
    let (trade, ctx) = high_risk_low_tier();
    let row = features(&trade, &ctx);
    let e = model.explain("r-held", &row).expect("explained");
    assert_eq!(e.method, METHOD);
    assert_eq!(e.status, ExplanationStatus::Explained, "{e:#?}");
    assert!(e.failures.is_empty());
    // The reference forward pass agrees with the candle score the decision carries.
    let scored = model.model().score_batch(&[(trade, ctx)]).expect("scores");
    assert!((e.score - f64::from(scored[0].score)).abs() < 1e-5);
    // Efficiency: Σ φ = f(x) − E f(b).
    let sum: f64 = e.attributions.iter().map(|a| a.value).sum();
    assert!(
        (sum - (e.score - e.base_value)).abs() < 1e-9,
        "{sum} vs {e:#?}"
    );
    assert_eq!(e.attributions.len(), GROUPS.len());
    for a in &e.attributions {
        assert!(
            a.ci95[0] <= a.value + 1e-12 && a.value <= a.ci95[1] + 1e-12,
            "{a:?}"
        );
    }
    // A high-risk jurisdiction is the main reason this trade scores high.
    let top = e
        .attributions
        .iter()
        .max_by(|a, b| a.value.total_cmp(&b.value))
        .expect("attributions");
    assert_eq!(top.feature, "jurisdiction_risk", "{e:#?}");
    assert_eq!(e.features, row.to_vec());
    assert_eq!(e.background.size, 32);
}

/// v(S) computed here from scratch, Shapley by the permutation definition: the mean over
/// all 8! orderings of each player's marginal contribution when it joins.
#[test]
fn attributions_equal_a_brute_force_over_every_ordering() {
    let model = reference();
    let spec = model.model().spec().clone();
    let full = Background::of_model(&spec, 32).expect("background");
    let background = Background {
        rows: full.rows[..3].to_vec(),
        source: full.source.clone(),
    };
    let settings = ExplainSettings {
        background_size: 3,
        ..ExplainSettings::default()
    };
    let explainer = Explainer {
        weights: model.model().weights(),
        spec: &spec,
        background: &background,
        settings: &settings,
    };
    let (trade, ctx) = structuring();
    let x = features(&trade, &ctx);
    let e = explainer.explain(&x, 1).expect("explained");

    let mut v: HashMap<u32, f64> = HashMap::new();
    for mask in 0u32..256 {
        let mut total = 0.0;
        for b in &background.rows {
            let mut row: [f32; FEATURE_COUNT] = *b;
            for (g, (_, slots)) in GROUPS.iter().enumerate() {
                if mask >> g & 1 == 1 {
                    for &i in slots.iter() {
                        row[i] = x[i];
                    }
                }
            }
            total += explainer.f(&row);
        }
        v.insert(mask, total / background.rows.len() as f64);
    }
    let mut phi = [0f64; 8];
    let mut order: Vec<usize> = (0..8).collect();
    let mut count = 0u32;
    permutations(&mut order, 0, &mut |perm| {
        let mut mask = 0u32;
        for &player in perm {
            let before = v[&mask];
            mask |= 1 << player;
            phi[player] += v[&mask] - before;
        }
        count += 1;
    });
    assert_eq!(count, 40_320);
    for (g, a) in e.attributions.iter().enumerate() {
        let brute = phi[g] / f64::from(count);
        assert!(
            (a.value - brute).abs() < 1e-9,
            "{}: {} vs {brute}",
            a.feature,
            a.value
        );
    }
}

fn permutations(items: &mut Vec<usize>, k: usize, visit: &mut impl FnMut(&[usize])) {
    if k == items.len() {
        visit(items);
        return;
    }
    for i in k..items.len() {
        items.swap(k, i);
        permutations(items, k + 1, visit);
        items.swap(k, i);
    }
}

#[test]
fn the_same_request_is_explained_bit_for_bit_and_another_seed_moves_only_the_intervals() {
    let model = reference();
    let (trade, ctx) = structuring();
    let row = features(&trade, &ctx);
    let a = model.explain("r-1", &row).expect("explained");
    let b = reference().explain("r-1", &row).expect("explained");
    assert_eq!(
        serde_json::to_string(&a).expect("json"),
        serde_json::to_string(&b).expect("json")
    );
    assert_eq!(a.seed, format!("{:016x}", seed_for("r-1")));
    let c = model.explain("r-2", &row).expect("explained");
    let values = |e: &aether_gpu_worker::Explanation| -> Vec<f64> {
        e.attributions.iter().map(|a| a.value).collect()
    };
    assert_eq!(values(&a), values(&c));
    assert_ne!(
        a.attributions.iter().map(|a| a.ci95).collect::<Vec<_>>(),
        c.attributions.iter().map(|a| a.ci95).collect::<Vec<_>>()
    );
    // The record round-trips through JSON unchanged.
    let text = serde_json::to_string(&a).expect("json");
    let back: aether_gpu_worker::Explanation = serde_json::from_str(&text).expect("parses");
    assert_eq!(back, a);
}

#[test]
fn an_explanation_that_fails_a_check_says_which() {
    let model = reference();
    let spec = model.model().spec().clone();
    let background = Background::of_model(&spec, 32).expect("background");
    let strict = ExplainSettings {
        max_ci_width: 0.0,
        epsilon1: 0.0,
        epsilon2: 0.0,
        ..ExplainSettings::default()
    };
    let (trade, ctx) = high_risk_low_tier();
    let e = Explainer {
        weights: model.model().weights(),
        spec: &spec,
        background: &background,
        settings: &strict,
    }
    .explain(&features(&trade, &ctx), 9)
    .expect("computed");
    assert_eq!(e.status, ExplanationStatus::Failed);
    assert!(
        e.failures.iter().any(|f| f.starts_with("ci_width:")),
        "{:?}",
        e.failures
    );
    assert!(
        e.failures.contains(&"fidelity".to_owned()),
        "{:?}",
        e.failures
    );
    assert!(
        e.failures.contains(&"neighbourhood".to_owned()),
        "{:?}",
        e.failures
    );
    assert!(!e.failures.contains(&"efficiency".to_owned()));

    // A model without a training book has no background: no explanation, and the error
    // says why.
    let mut anonymous = spec.clone();
    anonymous.training = None;
    assert_eq!(
        Background::of_model(&anonymous, 32).map(|_| ()),
        Err(ExplainError::NoBackground)
    );
}

#[test]
fn a_batch_explains_the_marked_trades_and_those_at_the_threshold_only() {
    let model = reference();
    let batch = vec![ordinary(), high_risk_low_tier(), ordinary()];
    let plan = ExplainPlan {
        marked: vec![false, false, true],
        at_or_above: Some(0.5),
    };
    let result = model.score_net_and_explain(&batch, &plan).expect("scores");
    assert!(result.scores[0].score < 0.5 && result.scores[1].score >= 0.5);
    let asked: Vec<bool> = result.explanations.iter().map(Option::is_some).collect();
    assert_eq!(asked, [false, true, true]);
    assert!(result.explanations.iter().flatten().all(|e| e.is_ok()));
    let plain = model.score_and_net(&batch).expect("scores");
    assert!(plain.explanations.iter().all(Option::is_none));
}

/// Every coalition's value by the walk and the side-by-side layers, against one reference
/// forward pass per coalition, on the given weights.
fn coalitions_match_the_reference(
    weights: &aether_gpu_worker::artifact::MlpWeights,
    x: &[f32; FEATURE_COUNT],
    b: &[f32; FEATURE_COUNT],
) -> Result<(), String> {
    let fast = aether_gpu_worker::explain::ByInput::new(weights);
    let mut scratch = aether_gpu_worker::explain::Scratch::default();
    let mut values = [0f64; 256];
    fast.coalition_values(x, b, &mut values, &mut scratch);
    for (mask, value) in values.iter().enumerate() {
        let mut row = *b;
        for (g, (_, slots)) in GROUPS.iter().enumerate() {
            if mask >> g & 1 == 1 {
                for &i in slots.iter() {
                    row[i] = x[i];
                }
            }
        }
        let reference = f64::from(weights.forward(&row));
        if value.to_bits() != reference.to_bits() {
            return Err(format!("mask {mask}: {value} against {reference}"));
        }
    }
    Ok(())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
    /// The same on networks of other shapes (widths that are not multiples of eight, one
    /// to three hidden layers) and arbitrary weights and rows, the background agreeing
    /// with the instance on any set of groups (as a currency or a tier often does: the
    /// walk computes such coalitions once).
    #[test]
    fn the_coalition_values_are_the_reference_on_any_network(
        hidden in proptest::collection::vec(1usize..21, 1..4),
        seed in proptest::prelude::any::<u64>(),
        x in proptest::array::uniform17(-4.0f32..4.0),
        b in proptest::array::uniform17(-4.0f32..4.0),
        shared in 0usize..256,
    ) {
        let mut b = b;
        for (g, (_, slots)) in GROUPS.iter().enumerate() {
            if shared >> g & 1 == 1 {
                for &i in slots.iter() {
                    b[i] = x[i];
                }
            }
        }
        let mut sizes = vec![FEATURE_COUNT];
        sizes.extend(&hidden);
        sizes.push(1);
        let mut state = seed;
        let mut draw = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let layers = sizes
            .windows(2)
            .map(|w| aether_gpu_worker::artifact::DenseLayer {
                inputs: w[0],
                outputs: w[1],
                weight: (0..w[0] * w[1]).map(|_| draw()).collect(),
                bias: (0..w[1]).map(|_| draw() * 0.1).collect(),
            })
            .collect();
        let weights = aether_gpu_worker::artifact::MlpWeights { layers };
        proptest::prop_assert_eq!(coalitions_match_the_reference(&weights, &x, &b), Ok(()));
    }
}

#[test]
fn the_coalition_walk_gives_every_coalitions_forward_pass_bit_for_bit() {
    let model = reference();
    let spec = model.model().spec();
    let standardise = |raw: &[f32; FEATURE_COUNT]| -> [f32; FEATURE_COUNT] {
        let n = &spec.normalisation;
        std::array::from_fn(|i| (raw[i] - n.mean[i]) / n.std[i])
    };
    let (trade, ctx) = structuring();
    let x = standardise(&features(&trade, &ctx));
    let (trade, ctx) = ordinary();
    let b = standardise(&features(&trade, &ctx));
    assert_eq!(
        coalitions_match_the_reference(model.model().weights(), &x, &b),
        Ok(())
    );
}

/// Explanations recorded on a ledger must recompute bit for bit with every later build
/// (`aether model explain`): these were computed by the build before the faster walk
/// (a0-prefixed request ids over 24 trades of a synthetic book with planted anomalies,
/// held and not, so rows that agree with background rows on some groups and rows that do
/// not). Rewrite only with a new explanation method: `AETHER_WRITE_EXPLANATIONS=1`.
#[test]
fn explanations_are_those_recorded_by_earlier_builds() {
    let model = reference();
    let book = aether_gpu_worker::train::generate(99, 24, 0.3);
    let lines: Vec<String> = book
        .iter()
        .enumerate()
        .map(|(k, t)| {
            let row = features(&t.trade, &t.context);
            let e = model.explain(&format!("a0-{k}"), &row).expect("explained");
            serde_json::to_string(&e).expect("serialises")
        })
        .collect();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/recorded_explanations.jsonl");
    if std::env::var_os("AETHER_WRITE_EXPLANATIONS").is_some() {
        std::fs::write(&path, lines.join("\n") + "\n").expect("written");
    }
    let recorded = std::fs::read_to_string(&path).expect("recorded explanations");
    let recorded: Vec<&str> = recorded.lines().collect();
    assert_eq!(recorded.len(), lines.len());
    for (k, (now, then)) in lines.iter().zip(recorded).enumerate() {
        assert_eq!(now, then, "trade {k}'s explanation changed");
    }
}
