//! Rollout analysis (issue 7), the pure decision core, fed with synthetic windows: the
//! statistics against published values, each decision branch, the circuit breaker, the
//! three-window rollback, inconclusive checks, a restart, and the worked example of
//! `ANALYSIS.md`.

use std::collections::{BTreeMap, BTreeSet};

use aether_control::analysis::*;
use chrono::{DateTime, TimeDelta, Utc};
use proptest::prelude::*;

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol
}

// ---------------------------------------------------------------- statistics

/// Q_KS(1) by hand from the series 2(e⁻² − e⁻⁸ + e⁻¹⁸ − …) = 0.2699996716773546; the
/// critical values are Smirnov's (1948) table for α = 0.10 / 0.05 / 0.01 (1.22 / 1.36 /
/// 1.63), to full precision as scipy's `kstwobign.isf` gives them.
#[test]
fn kolmogorov_survival_matches_published_values() {
    let by_hand = 2.0 * ((-2.0f64).exp() - (-8.0f64).exp() + (-18.0f64).exp());
    assert!(close(kolmogorov_q(1.0), by_hand, 1e-12));
    assert!(close(kolmogorov_q(1.0), 0.269_999_671_677_354_6, 1e-14));
    assert!(close(kolmogorov_q(1.223_847_870_217_082_5), 0.10, 1e-12));
    assert!(close(kolmogorov_q(1.358_098_639_322_550_5), 0.05, 1e-12));
    assert!(close(kolmogorov_q(1.627_623_611_518_950_6), 0.01, 1e-12));
    // The small-λ branch (Jacobi form) against the alternating series, computed to 2000
    // terms: Q(0.5) = 0.9639452436648751, Q(0.8) = 0.5441424115741981.
    assert!(close(kolmogorov_q(0.5), 0.963_945_243_664_875_1, 1e-12));
    assert!(close(kolmogorov_q(0.8), 0.544_142_411_574_198_1, 1e-12));
    // Continuous across the switch at 1.18.
    assert!(close(kolmogorov_q(1.179_999_999), kolmogorov_q(1.18), 1e-8));
    assert_eq!(kolmogorov_q(0.0), 1.0);
    assert!(kolmogorov_q(10.0) < 1e-80);
}

#[test]
fn ks_statistic_and_p_value_of_known_samples() {
    // The example of scipy.stats.ks_2samp / rv::misc::ks_two_sample: D = 0.3.
    let xs = [
        0.95692026,
        1.1348812,
        -0.76579239,
        -0.58065653,
        -0.05122393,
        0.71598754,
        1.39873528,
        0.42790527,
        1.84580764,
        0.64228521,
    ];
    let ys = [
        0.6948678,
        -0.3741825,
        0.36657279,
        1.15834174,
        -0.32421706,
        -0.38499295,
        1.44976991,
        0.2504608,
        -0.53694774,
        1.42221993,
    ];
    let k = ks_two_sample(&xs, &ys).expect("non-empty");
    assert!(close(k.statistic, 0.3, 1e-12));
    assert_eq!((k.n, k.m), (10, 10));

    // By hand: 1..8 against 5..12; at x = 4, F₁ = 4/8 and F₂ = 0, so D = 1/2.
    // nₑ = 8·8/16 = 4, λ = (2 + 0.12 + 0.11/2)·0.5 = 1.0875, Q(1.0875) = 0.18768427419801.
    let a: Vec<f64> = (1..=8).map(f64::from).collect();
    let b: Vec<f64> = (5..=12).map(f64::from).collect();
    let k = ks_two_sample(&a, &b).expect("non-empty");
    assert_eq!(k.statistic, 0.5);
    assert!(close(k.p_value, 0.187_684_274_198_013_4, 1e-12));

    // Identical samples: D = 0, p = 1; disjoint: D = 1.
    assert_eq!(ks_two_sample(&a, &a).map(|k| k.p_value), Some(1.0));
    assert_eq!(
        ks_two_sample(&[0.0], &[1.0, 2.0]).map(|k| k.statistic),
        Some(1.0)
    );
}

#[test]
fn wasserstein_on_hand_computed_cases() {
    // scipy.stats.wasserstein_distance documentation examples.
    assert!(close(
        wasserstein_1(&[0.0, 1.0, 3.0], &[5.0, 6.0, 8.0]).expect("non-empty"),
        5.0,
        1e-12
    ));
    assert!(close(
        wasserstein_1(&[3.4, 3.9, 7.5, 7.8], &[4.5, 1.4]).expect("non-empty"),
        2.7,
        1e-12
    ));
    // By hand: F₁ − F₂ = 2/3 − 1/3 on [0, 1), so W = 1/3.
    assert!(close(
        wasserstein_1(&[0.0, 0.0, 1.0], &[0.0, 1.0, 1.0]).expect("non-empty"),
        1.0 / 3.0,
        1e-15
    ));
    // A shift by c moves every unit of mass by c.
    let a: Vec<f64> = (0..50).map(|k| f64::from(k) / 50.0).collect();
    let b: Vec<f64> = a.iter().map(|x| x + 0.25).collect();
    assert!(close(
        wasserstein_1(&a, &b).expect("non-empty"),
        0.25,
        1e-12
    ));
    assert_eq!(wasserstein_1(&a, &[]), None);
}

#[test]
fn jaccard_edge_cases() {
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(jaccard(&set(&[]), &set(&[])), 1.0);
    assert_eq!(jaccard(&set(&["a"]), &set(&[])), 0.0);
    assert_eq!(jaccard(&set(&["a", "b"]), &set(&["b", "a"])), 1.0);
    assert_eq!(jaccard(&set(&["a"]), &set(&["b"])), 0.0);
    assert_eq!(jaccard(&set(&["a", "b", "c"]), &set(&["b", "c", "d"])), 0.5);
}

#[test]
fn agreement_counts_only_the_shadow_scored_sample() {
    let mut w = WindowSamples::new(t(0), t(60_000));
    // r1 flagged by both; r2 flagged only by the candidate but never scored by the
    // baseline, so it is outside the shadow sample and does not count.
    for (id, stage, flagged) in [
        ("r1", Stage::Baseline, true),
        ("r1", Stage::Candidate, true),
        ("r2", Stage::Candidate, true),
        ("r3", Stage::Baseline, false),
        ("r3", Stage::Candidate, false),
    ] {
        let mut o = obs(id, stage, 1000, t(1));
        o.flagged = flagged;
        w.add_request(o).expect("valid");
    }
    let a = w.metrics(&WindowSettings::default()).agreement;
    assert_eq!(a.shadow_sample, 2);
    assert_eq!(a.jaccard, 1.0);
    assert_eq!((a.candidate_flagged, a.baseline_flagged), (1, 1));
}

// ---------------------------------------------------------------- synthetic windows

const MINUTE_MS: i64 = 60_000;

fn t(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(1_800_000_000_000 + ms).expect("in range")
}

fn obs(id: &str, stage: Stage, latency_us: u64, at: DateTime<Utc>) -> RequestObservation {
    RequestObservation {
        request_id: id.into(),
        stage,
        latency_us,
        error: false,
        score: 0.5,
        confidence: 0.95,
        flagged: false,
        rules_flagged: false,
        features: BTreeMap::new(),
        shadow: false,
        at,
    }
}

/// One window's worth of traffic, both stages scoring the same `n` requests.
#[derive(Clone, Copy)]
struct Spec {
    n: usize,
    base_ms: u64,
    cand_ms: u64,
    cand_errors: usize,
    confidence: f64,
    score_shift: f64,
    /// Candidate batch fill, in tenths.
    fill: u32,
    agree: bool,
}

const HEALTHY: Spec = Spec {
    n: 100,
    base_ms: 100,
    cand_ms: 100,
    cand_errors: 0,
    confidence: 0.95,
    score_shift: 0.0,
    fill: 2,
    agree: true,
};

fn window(index: i64, s: Spec) -> WindowSamples {
    let start = t(index * MINUTE_MS);
    let mut w = WindowSamples::new(start, t((index + 1) * MINUTE_MS));
    let at = start + TimeDelta::seconds(1);
    for k in 0..s.n {
        let id = format!("w{index}-r{k}");
        let score = k as f64 / s.n as f64 * 0.5;
        let rules = k % 10 == 0;
        let features = BTreeMap::from([("amount".to_string(), k as f64)]);
        let mut base = obs(&id, Stage::Baseline, s.base_ms * 1000, at);
        base.score = score;
        base.flagged = rules;
        base.rules_flagged = rules;
        base.features = features.clone();
        w.add_request(base).expect("valid");
        let mut cand = obs(&id, Stage::Candidate, s.cand_ms * 1000, at);
        cand.error = k < s.cand_errors;
        cand.score = score + s.score_shift;
        cand.confidence = s.confidence;
        cand.flagged = if s.agree { rules } else { k % 10 == 1 };
        cand.rules_flagged = rules;
        cand.features = features;
        w.add_request(cand).expect("valid");
    }
    w.add_batch(BatchReport {
        stage: Stage::Candidate,
        batch_size: s.fill,
        max_batch: 10,
        queue_depth: 0,
        elapsed_us: 5_000,
        at,
    })
    .expect("valid");
    w
}

fn metrics_of(s: Spec) -> WindowMetrics {
    window(0, s).metrics(&WindowSettings::default())
}

fn analyzer(weight: u32) -> Analyzer {
    Analyzer::new(
        AnalysisSettings::default(),
        vec![1, 2, 5, 10, 25, 50, 100],
        weight,
    )
    .expect("valid settings")
}

fn run(a: &mut Analyzer, index: i64, s: Spec) -> Vec<AnalysisOutcome> {
    a.check(Check {
        window: &window(index, s),
        step: index as u64,
        snapshots: &[],
    })
    .expect("not finished")
}

fn transitions(out: &[AnalysisOutcome]) -> Vec<(ControllerMode, ControllerMode)> {
    out.iter()
        .filter_map(|o| match o {
            AnalysisOutcome::Transition(t) => Some((t.from, t.to)),
            _ => None,
        })
        .collect()
}

fn weights(out: &[AnalysisOutcome]) -> Vec<(u32, u32, WeightReason)> {
    out.iter()
        .filter_map(|o| match o {
            AnalysisOutcome::WeightChange(w) => Some((w.from, w.to, w.reason)),
            _ => None,
        })
        .collect()
}

fn assessed(out: &[AnalysisOutcome]) -> Option<&RiskAssessment> {
    out.iter().find_map(|o| match o {
        AnalysisOutcome::Assessed { risk, .. } => Some(risk),
        _ => None,
    })
}

// ---------------------------------------------------------------- risk branches

#[test]
fn each_risk_decision_branch() {
    let settings = AnalysisSettings::default();
    let decide_for = |s: Spec| assess(&metrics_of(s), &settings.risk, &settings.sla);

    // Fuse: p99 ×3 (L = 1), 10 % errors (E = 1), full batches (S = 1) → risk 1.
    let fuse = decide_for(Spec {
        cand_ms: 300,
        cand_errors: 10,
        fill: 10,
        ..HEALTHY
    });
    assert_eq!(fuse.decision, RiskDecision::Fuse);
    assert!(close(fuse.risk, 1.0, 1e-12));

    // Degrade: L = 1 → 0.40, E = 0.03/0.05 = 0.6 → 0.21, S = 0.4 → 0.10; risk 0.71.
    let degrade = decide_for(Spec {
        cand_ms: 200,
        cand_errors: 3,
        fill: 4,
        ..HEALTHY
    });
    assert_eq!(degrade.decision, RiskDecision::Degrade);
    assert!(close(degrade.risk, 0.71, 1e-12));

    // Increase: only S = 0.2 → risk 0.05, SLA met.
    let increase = decide_for(HEALTHY);
    assert_eq!(increase.decision, RiskDecision::Increase);
    assert!(close(increase.risk, 0.05, 1e-12));
    assert!(increase.sla.met);

    // Hold by risk: L = 0.5 → 0.20, S = 0.9 → 0.225; risk 0.425 is ≥ 0.4 but ≤ 0.65.
    let hold = decide_for(Spec {
        cand_ms: 150,
        fill: 9,
        ..HEALTHY
    });
    assert_eq!(hold.decision, RiskDecision::Hold);
    assert!(close(hold.risk, 0.425, 1e-12));

    // Hold by SLA: low risk, but the candidate flags other trades (agreement 0, and it
    // clears every trade the rules flagged).
    let sla = decide_for(Spec {
        agree: false,
        ..HEALTHY
    });
    assert_eq!(sla.decision, RiskDecision::Hold);
    let failed: Vec<Metric> = sla.sla.failures.iter().map(|b| b.metric).collect();
    assert_eq!(failed, [Metric::Agreement, Metric::ComplianceMissRate]);
}

// ---------------------------------------------------------------- state machine

#[test]
fn fuse_then_recovery_needs_n_healthy_checks_in_a_row_each_way() {
    let mut a = analyzer(10);
    let fuse = Spec {
        cand_ms: 300,
        cand_errors: 10,
        fill: 10,
        ..HEALTHY
    };
    let out = run(&mut a, 0, fuse);
    assert_eq!(
        transitions(&out),
        [(ControllerMode::Normal, ControllerMode::Fused)]
    );
    assert_eq!(weights(&out), [(10, 0, WeightReason::Fuse)]);
    let AnalysisOutcome::Transition(tr) = out
        .iter()
        .find(|o| matches!(o, AnalysisOutcome::Transition(_)))
        .expect("a transition")
    else {
        unreachable!()
    };
    // The transition carries the evidence that caused it.
    assert_eq!(tr.metrics.candidate.latency_p99_us, 300_000);
    assert_eq!(tr.at, t(MINUTE_MS));

    // Two healthy checks, then an unhealthy one: the streak restarts.
    for i in 1..=2 {
        assert!(transitions(&run(&mut a, i, HEALTHY)).is_empty());
    }
    let hold = Spec {
        cand_ms: 150,
        fill: 9,
        ..HEALTHY
    };
    assert!(transitions(&run(&mut a, 3, hold)).is_empty());
    assert_eq!(a.state().controller.healthy_streak, 0);

    // Three healthy in a row: Fused → Degraded, weight stays 0, fallback on.
    assert!(transitions(&run(&mut a, 4, HEALTHY)).is_empty());
    assert!(transitions(&run(&mut a, 5, HEALTHY)).is_empty());
    let out = run(&mut a, 6, HEALTHY);
    assert_eq!(
        transitions(&out),
        [(ControllerMode::Fused, ControllerMode::Degraded)]
    );
    assert!(weights(&out).is_empty());
    assert!(a.state().controller.mode.fallback_path());

    // Three more: Degraded → Normal; only the next healthy check widens, from the first step.
    run(&mut a, 7, HEALTHY);
    run(&mut a, 8, HEALTHY);
    let out = run(&mut a, 9, HEALTHY);
    assert_eq!(
        transitions(&out),
        [(ControllerMode::Degraded, ControllerMode::Normal)]
    );
    assert!(weights(&out).is_empty());
    let out = run(&mut a, 10, HEALTHY);
    assert_eq!(weights(&out), [(0, 1, WeightReason::Increase)]);
}

#[test]
fn degrade_holds_the_weight_and_a_fuse_from_degraded_cuts_it() {
    let mut a = analyzer(25);
    let degrade = Spec {
        cand_ms: 200,
        cand_errors: 3,
        fill: 4,
        ..HEALTHY
    };
    let out = run(&mut a, 0, degrade);
    assert_eq!(
        transitions(&out),
        [(ControllerMode::Normal, ControllerMode::Degraded)]
    );
    assert!(weights(&out).is_empty());
    // Healthy while Degraded: no widening until Normal again.
    assert!(weights(&run(&mut a, 1, HEALTHY)).is_empty());
    let fuse = Spec {
        cand_ms: 300,
        cand_errors: 10,
        fill: 10,
        ..HEALTHY
    };
    let out = run(&mut a, 2, fuse);
    assert_eq!(
        transitions(&out),
        [(ControllerMode::Degraded, ControllerMode::Fused)]
    );
    assert_eq!(weights(&out), [(25, 0, WeightReason::Fuse)]);
}

#[test]
fn healthy_candidate_is_widened_step_by_step_and_promoted() {
    let mut a = analyzer(0);
    let mut seen = Vec::new();
    for i in 0..40 {
        let out = run(&mut a, i, HEALTHY);
        seen.extend(weights(&out).into_iter().map(|(_, to, _)| to));
        if out
            .iter()
            .any(|o| matches!(o, AnalysisOutcome::Promote { weight: 100, .. }))
        {
            break;
        }
    }
    assert_eq!(seen, [1, 2, 3, 5, 8, 10, 15, 23, 25, 38, 50, 75, 100]);
    assert_eq!(a.state().finished, Some(Finish::Promoted));
    assert!(matches!(
        a.check(Check {
            window: &window(99, HEALTHY),
            step: 99,
            snapshots: &[],
        }),
        Err(AnalysisError::Finished(Finish::Promoted))
    ));
}

/// Widens a candidate until it is promoted or its promotion is withheld.
fn widen_to_the_end(a: &mut Analyzer, spec: Spec) -> Vec<AnalysisOutcome> {
    for i in 0..40 {
        let out = run(a, i, spec);
        if out.iter().any(|o| {
            matches!(
                o,
                AnalysisOutcome::Promote { .. } | AnalysisOutcome::PromotionWithheld { .. }
            )
        }) {
            return out;
        }
    }
    panic!("neither promoted nor withheld in 40 windows");
}

#[test]
fn a_healthy_but_significantly_slower_candidate_is_not_promoted_without_the_operator() {
    // 130 ms against 100 ms in every window: within the SLA and low risk, so it widens,
    // but 14 windows all slower are significant. The 14 differences are equal (ties), so
    // the normal approximation: W⁺ = 105, mean 52.5, variance 253.75 − (14³ − 14)/48 =
    // 196.875, z = 52.5/√196.875, p = ½·erfc(z/√2) = 9.140531649091767e-05 (Python's
    // math.erfc).
    let slower = Spec {
        cand_ms: 130,
        ..HEALTHY
    };
    let mut a = analyzer(0);
    let out = widen_to_the_end(&mut a, slower);
    let significance = out
        .iter()
        .find_map(|o| match o {
            AnalysisOutcome::Assessed { significance, .. } => Some(significance),
            _ => None,
        })
        .expect("assessed");
    let latency = &significance.comparisons[0];
    assert_eq!(latency.metric, GoldenMetric::LatencyP99Us);
    assert_eq!(latency.windows, 14);
    let wilcoxon = latency.wilcoxon.as_ref().expect("tested");
    assert_eq!(wilcoxon.method, PMethod::Normal);
    assert_eq!(wilcoxon.w_plus, 105.0);
    let p = latency.p_worse.expect("tested");
    assert!((p - 9.140531649091767e-05).abs() < 1e-18, "{p}");
    assert!(latency.significantly_worse);
    assert_eq!(
        latency.cliffs_delta.as_ref().map(|d| d.magnitude),
        Some(Magnitude::Large)
    );
    assert!(out.iter().any(|o| matches!(
        o,
        AnalysisOutcome::PromotionWithheld { worse, .. } if worse == &[GoldenMetric::LatencyP99Us]
    )));
    assert_eq!(
        a.state().gate,
        Gate::Paused {
            reason: PauseReason::SignificantlyWorse
        }
    );
    assert_eq!(a.state().finished, None);
    assert_eq!(a.state().weight, 100);

    // The same rollout with the requirement off is promoted.
    let mut settings = AnalysisSettings::default();
    settings.significance.promotion_requires_not_worse = false;
    let mut a = Analyzer::new(settings, vec![1, 2, 5, 10, 25, 50, 100], 0).expect("valid");
    let out = widen_to_the_end(&mut a, slower);
    assert!(
        out.iter()
            .any(|o| matches!(o, AnalysisOutcome::Promote { .. }))
    );
    assert_eq!(a.state().finished, Some(Finish::Promoted));
}

#[test]
fn the_paired_windows_survive_a_restart_and_are_bounded() {
    let mut settings = AnalysisSettings::default();
    settings.significance.max_windows = 8;
    let mut a = Analyzer::new(settings.clone(), vec![1, 2, 5, 10, 25, 50, 100], 0).expect("valid");
    for i in 0..5 {
        run(&mut a, i, HEALTHY);
    }
    let saved = serde_json::to_value(a.state()).expect("serialisable");
    let state = serde_json::from_value(saved).expect("state");
    let mut b =
        Analyzer::from_state(settings, vec![1, 2, 5, 10, 25, 50, 100], state).expect("valid");
    assert_eq!(b.state().paired.len(), 5);
    for i in 5..12 {
        run(&mut b, i, HEALTHY);
    }
    assert_eq!(b.state().paired.len(), 8);
    assert_eq!(b.state().paired[0].end, t(5 * MINUTE_MS));
}

// ---------------------------------------------------------------- drift tiers

fn drift_of(out: &[AnalysisOutcome]) -> &DriftAction {
    out.iter()
        .find_map(|o| match o {
            AnalysisOutcome::Drift(d) => Some(d),
            _ => None,
        })
        .expect("a conclusive check reports drift")
}

#[test]
fn drift_l2_pauses_and_requests_a_retrain_once() {
    let mut a = analyzer(5);
    let d = drift_of(&run(&mut a, 0, HEALTHY)).clone();
    assert_eq!((d.tier, d.response), (DriftTier::L1, DriftResponse::Record));
    assert_eq!(d.report.score, 0.0);

    let shifted = Spec {
        score_shift: 0.2,
        ..HEALTHY
    };
    let out = run(&mut a, 1, shifted);
    let d = drift_of(&out);
    assert_eq!(d.tier, DriftTier::L2);
    assert_eq!(d.response, DriftResponse::PauseAndRequestRetrain);
    assert!(close(d.report.score, 0.2, 1e-12));
    assert!(close(d.report.w1_vs_baseline.expect("enough"), 0.2, 1e-12));
    assert!(close(d.report.w1_vs_reference.expect("enough"), 0.2, 1e-12));
    assert!(out.iter().any(|o| matches!(
        o,
        AnalysisOutcome::Paused {
            reason: PauseReason::DriftL2,
            ..
        }
    )));
    assert!(weights(&out).is_empty(), "paused: no widening");
    // Still L2 next window: recorded, not requested again, still paused.
    let out = run(&mut a, 2, shifted);
    assert_eq!(drift_of(&out).response, DriftResponse::Record);
    assert!(weights(&out).is_empty());
    // The operator resumes: widening goes on.
    assert!(a.resume());
    assert_eq!(
        weights(&run(&mut a, 3, HEALTHY)),
        [(8, 10, WeightReason::Increase)]
    );
}

#[test]
fn drift_l3_freezes_the_candidate_at_zero_and_opens_a_review() {
    let mut a = analyzer(25);
    run(&mut a, 0, HEALTHY);
    let out = run(
        &mut a,
        1,
        Spec {
            score_shift: 0.32,
            ..HEALTHY
        },
    );
    let d = drift_of(&out);
    assert_eq!(
        (d.tier, d.response),
        (DriftTier::L3, DriftResponse::FreezeAndOpenReview)
    );
    assert_eq!(weights(&out), [(38, 0, WeightReason::DriftFreeze)]);
    assert_eq!(a.state().gate, Gate::Frozen);
    // Resume does not lift a freeze; closing the review does.
    assert!(!a.resume());
    assert!(weights(&run(&mut a, 2, HEALTHY)).is_empty());
    assert!(a.release_freeze());
    assert_eq!(
        weights(&run(&mut a, 3, HEALTHY)),
        [(0, 1, WeightReason::Increase)]
    );
}

/// The review an L3 freeze opens has the SLA's deadline; past it, unanswered, it is
/// escalated once; the operator's close (the rollout's count of closes) releases it.
#[test]
fn a_review_past_its_deadline_is_escalated_once_and_a_close_releases_the_freeze() {
    let mut settings = AnalysisSettings::default();
    settings.review.sla_ms = 90_000; // a window and a half
    let mut a = Analyzer::new(settings, vec![1, 2, 5, 10, 25, 50, 100], 25).expect("valid");
    let first = run(&mut a, 0, HEALTHY);
    // L1 windows archive the candidate's feature health.
    let health = first
        .iter()
        .find_map(|o| match o {
            AnalysisOutcome::FeatureHealth {
                scores, features, ..
            } => Some((scores, features)),
            _ => None,
        })
        .expect("an L1 window archives feature health");
    assert_eq!(health.0.n, 100);
    assert_eq!(health.1["amount"].min, 0.0);
    assert_eq!(health.1["amount"].max, 99.0);
    assert_eq!(health.1["amount"].p50, 49.0);
    run(
        &mut a,
        1,
        Spec {
            score_shift: 0.32,
            ..HEALTHY
        },
    );
    let review = a.state().open_review.clone().expect("a review is open");
    assert_eq!(review.opened_at, t(2 * MINUTE_MS));
    assert_eq!(review.deadline, t(2 * MINUTE_MS + 90_000));
    let overdue = |out: &[AnalysisOutcome]| {
        out.iter()
            .filter(|o| matches!(o, AnalysisOutcome::ReviewOverdue { .. }))
            .count()
    };
    assert_eq!(
        overdue(&run(&mut a, 2, HEALTHY)),
        0,
        "60 s after: within the SLA"
    );
    assert_eq!(overdue(&run(&mut a, 3, HEALTHY)), 1, "120 s after: overdue");
    assert_eq!(overdue(&run(&mut a, 4, HEALTHY)), 0, "escalated once");
    assert_eq!(a.state().gate, Gate::Frozen);
    assert!(!a.close_reviews(0), "no close recorded yet");
    assert!(a.close_reviews(1));
    assert!(!a.close_reviews(1), "the same close again changes nothing");
    assert_eq!(a.state().open_review, None);
    assert_eq!(
        weights(&run(&mut a, 5, HEALTHY)),
        [(0, 1, WeightReason::Increase)]
    );
}

#[test]
fn feature_drift_counts_when_significant() {
    let mut w = window(0, HEALTHY);
    let reference = ReferenceSample::from_stage(&w.baseline);
    // Move the candidate's inputs: amounts 50..150 instead of 0..100 → D = 0.5.
    if let Some(amounts) = w.candidate.features.get_mut("amount") {
        amounts.iter_mut().for_each(|x| *x += 50.0);
    }
    let r = assess_drift(
        &w.candidate,
        &w.baseline,
        Some(&reference),
        30,
        &DriftSettings::default(),
    );
    let f = &r.features["amount"];
    assert!(f.significant);
    assert_eq!(f.ks.expect("enough").statistic, 0.5);
    assert_eq!(r.ks_term, 0.5);
    assert_eq!(r.score, 0.5);
    assert_eq!(r.tier, DriftTier::L3);
}

// ---------------------------------------------------------------- rollback

fn snapshots() -> Vec<CommittedSnapshot> {
    [(0, "snap-0"), (2, "snap-2"), (4, "snap-4"), (5, "snap-5")]
        .into_iter()
        .map(|(step, id)| CommittedSnapshot {
            step,
            snapshot_id: id.into(),
        })
        .collect()
}

#[test]
fn three_consecutive_breaching_windows_roll_back_to_the_snapshot_before_the_offending_step() {
    let snaps = snapshots();
    let mut a = analyzer(10);
    let low_confidence = Spec {
        confidence: 0.70,
        ..HEALTHY
    };
    let check = |a: &mut Analyzer, index: i64, step: u64, s: Spec| {
        a.check(Check {
            window: &window(index, s),
            step,
            snapshots: &snaps,
        })
        .expect("not finished")
    };
    let rollback = |out: &[AnalysisOutcome]| {
        out.iter().find_map(|o| match o {
            AnalysisOutcome::Rollback(d) => Some(d.clone()),
            _ => None,
        })
    };
    // Two breaches, then a good window: the run starts again.
    assert!(rollback(&check(&mut a, 0, 3, low_confidence)).is_none());
    assert!(rollback(&check(&mut a, 1, 3, low_confidence)).is_none());
    assert!(rollback(&check(&mut a, 2, 3, HEALTHY)).is_none());
    assert!(a.state().rollback.streak.is_empty());
    // Breaches from step 4 on; an inconclusive window in between neither counts nor resets.
    assert!(rollback(&check(&mut a, 3, 4, low_confidence)).is_none());
    let empty = Spec { n: 0, ..HEALTHY };
    let out = check(&mut a, 4, 4, empty);
    assert!(matches!(out[0], AnalysisOutcome::Inconclusive { .. }));
    assert_eq!(a.state().rollback.streak.len(), 1);
    a.resume();
    assert!(rollback(&check(&mut a, 5, 5, low_confidence)).is_none());
    let out = check(&mut a, 6, 5, low_confidence);
    let d = rollback(&out).expect("third breaching window in a row");
    assert_eq!(d.offending_step, 4);
    assert_eq!(
        d.target,
        Some(CommittedSnapshot {
            step: 2,
            snapshot_id: "snap-2".into()
        })
    );
    assert_eq!(d.breaches.len(), 3);
    assert_eq!(
        d.breaches.iter().map(|b| b.step).collect::<Vec<_>>(),
        [4, 5, 5]
    );
    assert!(
        d.breaches
            .iter()
            .all(|b| b.breaches[0].metric == Metric::MeanConfidence)
    );
    assert!(d.reason.contains("mean confidence < 0.82"), "{}", d.reason);
    assert_eq!(
        weights(&out).last().map(|w| (w.1, w.2)),
        Some((0, WeightReason::Rollback))
    );
    assert_eq!(a.state().finished, Some(Finish::RolledBack));
}

#[test]
fn each_golden_metric_breaches_on_its_own() {
    let s = RollbackSettings::default();
    let m = metrics_of(HEALTHY);
    assert!(window_breaches(&m, 0.35, &s).is_empty());
    let kinds = |m: &WindowMetrics, drift| {
        window_breaches(m, drift, &s)
            .into_iter()
            .map(|b| b.metric)
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(&m, 0.351), [Metric::Drift]);
    let slow = metrics_of(Spec {
        cand_ms: 421,
        ..HEALTHY
    });
    assert_eq!(kinds(&slow, 0.0), [Metric::LatencyP99]);
    let at_bound = metrics_of(Spec {
        cand_ms: 420,
        confidence: 0.82,
        ..HEALTHY
    });
    assert!(kinds(&at_bound, 0.0).is_empty());
}

// ---------------------------------------------------------------- inconclusive, restart

#[test]
fn inconclusive_analysis_pauses_and_never_aborts() {
    let mut a = analyzer(10);
    let thin = Spec { n: 20, ..HEALTHY };
    let out = run(&mut a, 0, thin);
    let AnalysisOutcome::Inconclusive { missing, .. } = &out[0] else {
        panic!("expected inconclusive, got {out:?}")
    };
    let lacking: Vec<Evidence> = missing.iter().map(|m| m.evidence).collect();
    assert_eq!(
        lacking,
        [
            Evidence::BaselineRequests,
            Evidence::CandidateRequests,
            Evidence::ShadowSample
        ]
    );
    assert!(matches!(
        out[1],
        AnalysisOutcome::Paused {
            reason: PauseReason::Inconclusive,
            ..
        }
    ));
    assert_eq!(out.len(), 2);
    // No weight change, no transition, no rollback; the next thin window does not pause twice.
    let out = run(&mut a, 1, Spec { n: 0, ..HEALTHY });
    assert_eq!(out.len(), 1);
    assert_eq!(a.state().weight, 10);
    assert_eq!(a.state().finished, None);
    // Enough evidence again: judged, but held until the operator resumes.
    let out = run(&mut a, 2, HEALTHY);
    assert!(assessed(&out).is_some_and(RiskAssessment::healthy));
    assert!(weights(&out).is_empty());
    a.resume();
    assert_eq!(
        weights(&run(&mut a, 3, HEALTHY)),
        [(10, 15, WeightReason::Increase)]
    );
}

#[test]
fn a_restarted_analyzer_continues_without_repeating_or_skipping() {
    let script = [
        HEALTHY,
        HEALTHY,
        Spec {
            cand_ms: 300,
            cand_errors: 10,
            fill: 10,
            ..HEALTHY
        },
        HEALTHY,
        HEALTHY,
        Spec {
            confidence: 0.7,
            ..HEALTHY
        },
        HEALTHY,
        HEALTHY,
    ];
    let mut straight = analyzer(0);
    let expected: Vec<_> = (0..script.len())
        .map(|i| run(&mut straight, i as i64, script[i]))
        .collect();

    let mut first = analyzer(0);
    let mut got: Vec<_> = (0..4)
        .map(|i| run(&mut first, i as i64, script[i]))
        .collect();
    let saved = serde_json::to_string(first.state()).expect("serialisable");
    drop(first);
    let state: AnalyzerState = serde_json::from_str(&saved).expect("round trip");
    let mut second = Analyzer::from_state(
        AnalysisSettings::default(),
        vec![1, 2, 5, 10, 25, 50, 100],
        state,
    )
    .expect("valid");
    got.extend((4..script.len()).map(|i| run(&mut second, i as i64, script[i])));
    assert_eq!(got, expected);
    assert_eq!(second.state(), straight.state());
}

#[test]
fn aggregated_windows_feed_the_analyzer() {
    let settings: AnalysisSettings = serde_json::from_str(
        r#"{"window": {"length_ms": 1000}, "evidence": {"min_requests": 5, "min_shadow_sample": 5, "min_drift_samples": 5}}"#,
    )
    .expect("valid");
    let mut agg = WindowAggregator::new(t(0), &settings.window).expect("valid");
    let mut a = Analyzer::new(settings, vec![1, 2, 5, 10, 25, 50, 100], 1).expect("valid");
    for second in 0..3i64 {
        for k in 0..5 {
            let id = format!("s{second}-{k}");
            let at = t(second * 1000 + k * 100);
            agg.observe(obs(&id, Stage::Baseline, 90_000, at))
                .expect("open");
            agg.observe(obs(&id, Stage::Candidate, 95_000, at))
                .expect("open");
        }
    }
    let windows = agg.close_until(t(3000));
    assert_eq!(windows.len(), 3);
    let mut all = Vec::new();
    for (i, w) in windows.iter().enumerate() {
        all.extend(
            a.check(Check {
                window: w,
                step: i as u64,
                snapshots: &[],
            })
            .expect("not finished"),
        );
    }
    assert_eq!(
        weights(&all)
            .into_iter()
            .map(|(_, to, _)| to)
            .collect::<Vec<_>>(),
        [2, 3, 5]
    );
}

// ---------------------------------------------------------------- worked example

/// The worked example of ANALYSIS.md, number for number.
#[test]
fn worked_example_of_analysis_md() {
    let settings: AnalysisSettings = serde_json::from_str(
        r#"{"evidence": {"min_requests": 10, "min_shadow_sample": 10, "min_drift_samples": 10}}"#,
    )
    .expect("valid");
    let mut w = WindowSamples::new(t(0), t(MINUTE_MS));
    let at = t(1000);
    for k in 0..10u64 {
        let id = format!("r{k}");
        let mut b = obs(&id, Stage::Baseline, (100 + 10 * k) * 1000, at);
        b.score = k as f64 / 20.0;
        b.confidence = 0.9;
        b.flagged = (1..=3).contains(&k);
        b.rules_flagged = (1..=3).contains(&k);
        w.add_request(b).expect("valid");
        let mut c = obs(&id, Stage::Candidate, (150 + 15 * k) * 1000, at);
        c.score = (k + 4) as f64 / 20.0;
        c.confidence = 0.8;
        c.flagged = (2..=4).contains(&k);
        c.rules_flagged = (1..=3).contains(&k);
        w.add_request(c).expect("valid");
    }
    let mut failed = obs("r10", Stage::Candidate, 120_000, at);
    failed.error = true;
    w.add_request(failed).expect("valid");
    for (batch_size, queue_depth) in [(6, 4), (4, 0)] {
        w.add_batch(BatchReport {
            stage: Stage::Candidate,
            batch_size,
            max_batch: 8,
            queue_depth,
            elapsed_us: 40_000,
            at,
        })
        .expect("valid");
    }

    let m = w.metrics(&settings.window);
    let (b, c) = (&m.baseline, &m.candidate);
    assert_eq!(
        (b.latency_p50_us, b.latency_p95_us, b.latency_p99_us),
        (140_000, 190_000, 190_000)
    );
    assert_eq!(
        (c.latency_p50_us, c.latency_p95_us, c.latency_p99_us),
        (210_000, 285_000, 285_000)
    );
    assert_eq!((c.requests, c.errors, c.answered), (11, 1, 10));
    assert!(close(c.error_rate, 1.0 / 11.0, 1e-15));
    assert!(close(c.mean_confidence, 0.80, 1e-12));
    assert_eq!(m.agreement.shadow_sample, 10);
    assert_eq!(m.agreement.jaccard, 0.5);
    assert!(close(c.compliance_miss_rate, 1.0 / 3.0, 1e-15));
    assert_eq!(c.batch_fill, 0.625);
    assert_eq!(c.queue_fill, 0.0625);
    assert_eq!(c.saturation, 0.625);

    let r = assess(&m, &settings.risk, &settings.sla);
    assert!(close(r.terms.latency_ratio, 0.5, 1e-12));
    assert_eq!(r.terms.error_jump, 1.0);
    assert_eq!(r.terms.saturation, 0.625);
    assert!(close(r.risk, 0.70625, 1e-12));
    assert_eq!(r.decision, RiskDecision::Degrade);

    let mut a = Analyzer::new(settings, vec![1, 2, 5, 10, 25, 50, 100], 5).expect("valid");
    let out = a
        .check(Check {
            window: &w,
            step: 3,
            snapshots: &[],
        })
        .expect("not finished");
    let d = drift_of(&out);
    assert!(close(d.report.w1_vs_baseline.expect("enough"), 0.2, 1e-12));
    assert_eq!(
        d.report.w1_vs_reference, None,
        "first window: no reference yet"
    );
    assert!(close(d.report.score, 0.2, 1e-12));
    assert_eq!(
        (d.tier, d.response),
        (DriftTier::L2, DriftResponse::PauseAndRequestRetrain)
    );
    assert_eq!(
        transitions(&out),
        [(ControllerMode::Normal, ControllerMode::Degraded)]
    );
    assert!(weights(&out).is_empty());
    let streak = &a.state().rollback.streak;
    assert_eq!(streak.len(), 1);
    assert_eq!(streak[0].breaches[0].metric, Metric::MeanConfidence);
    let kinds: Vec<&str> = out
        .iter()
        .map(|o| match o {
            AnalysisOutcome::Inconclusive { .. } => "inconclusive",
            AnalysisOutcome::Paused { .. } => "paused",
            AnalysisOutcome::Assessed { .. } => "assessed",
            AnalysisOutcome::Drift(_) => "drift",
            AnalysisOutcome::Transition(_) => "transition",
            AnalysisOutcome::WeightChange(_) => "weight_change",
            AnalysisOutcome::Rollback(_) => "rollback",
            AnalysisOutcome::Promote { .. } => "promote",
            AnalysisOutcome::PromotionWithheld { .. } => "promotion_withheld",
            AnalysisOutcome::DriftEscalated(_) => "drift_escalated",
            AnalysisOutcome::ReviewOverdue { .. } => "review_overdue",
            AnalysisOutcome::FeatureHealth { .. } => "feature_health",
        })
        .collect();
    assert_eq!(kinds, ["assessed", "drift", "paused", "transition"]);
}

// ---------------------------------------------------------------- properties

fn any_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => -2.0f64..3.0,
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => any::<f64>(),
    ]
}

fn stage_samples() -> impl Strategy<Value = StageSamples> {
    (
        prop::collection::vec(any_f64(), 0..40),
        prop::collection::vec(any_f64(), 0..40),
    )
        .prop_map(|(scores, amounts)| StageSamples {
            scores,
            features: BTreeMap::from([("amount".to_string(), amounts)]),
            ..StageSamples::default()
        })
}

fn stage_metrics() -> impl Strategy<Value = StageMetrics> {
    (any::<u64>(), any_f64(), any_f64(), any_f64(), any_f64()).prop_map(
        |(p99, error_rate, saturation, confidence, miss)| StageMetrics {
            requests: 0,
            errors: 0,
            error_rate,
            latency_p50_us: p99 / 2,
            latency_p95_us: p99,
            latency_p99_us: p99,
            answered: 0,
            mean_confidence: confidence,
            rules_flagged: 0,
            compliance_misses: 0,
            compliance_miss_rate: miss,
            batches: 0,
            batch_fill: saturation,
            queue_fill: 0.0,
            saturation,
            mean_queue_depth: 0.0,
        },
    )
}

proptest! {
    #[test]
    fn drift_score_is_in_the_unit_interval_and_never_nan(
        candidate in stage_samples(),
        baseline in stage_samples(),
        reference in stage_samples(),
        with_reference in any::<bool>(),
        min in 0u64..5,
    ) {
        let reference = ReferenceSample::from_stage(&reference);
        let r = assess_drift(
            &candidate,
            &baseline,
            with_reference.then_some(&reference),
            min,
            &DriftSettings::default(),
        );
        prop_assert!(!r.score.is_nan());
        prop_assert!((0.0..=1.0).contains(&r.score));
        prop_assert_eq!(r.tier, drift_tier(r.score, &DriftSettings::default()));
        for f in r.features.values() {
            if let Some(k) = f.ks {
                prop_assert!((0.0..=1.0).contains(&k.statistic));
                prop_assert!((0.0..=1.0).contains(&k.p_value));
            }
        }
    }

    #[test]
    fn risk_is_in_the_unit_interval_and_never_nan(
        baseline in stage_metrics(),
        candidate in stage_metrics(),
        jaccard in any_f64(),
    ) {
        let m = WindowMetrics {
            start: t(0),
            end: t(1000),
            baseline,
            candidate,
            agreement: Agreement {
                jaccard,
                shadow_sample: 0,
                candidate_flagged: 0,
                baseline_flagged: 0,
                both_flagged: 0,
            },
        };
        let s = AnalysisSettings::default();
        let r = assess(&m, &s.risk, &s.sla);
        prop_assert!(!r.risk.is_nan());
        prop_assert!((0.0..=1.0).contains(&r.risk));
        for term in [r.terms.latency_ratio, r.terms.error_jump, r.terms.saturation] {
            prop_assert!((0.0..=1.0).contains(&term));
        }
    }

    #[test]
    fn empty_and_arbitrary_windows_never_panic_or_produce_nan(
        n in 0usize..12,
        cand_ms in 0u64..1000,
        cand_errors in 0usize..12,
        confidence in 0.0f64..=1.0,
        shift in -1.0f64..1.0,
        fill in 0u32..=10,
    ) {
        let spec = Spec { n, cand_ms, cand_errors, confidence, score_shift: shift, fill, ..HEALTHY };
        let settings: AnalysisSettings = serde_json::from_str(
            r#"{"evidence": {"min_requests": 0, "min_shadow_sample": 0, "min_drift_samples": 0}}"#,
        ).expect("valid");
        let mut a = Analyzer::new(settings, vec![1, 2, 5, 10, 25, 50, 100], 5).expect("valid");
        let out = a.check(Check { window: &window(0, spec), step: 0, snapshots: &[] }).expect("fresh");
        for o in &out {
            match o {
                AnalysisOutcome::Assessed { risk, .. } => prop_assert!((0.0..=1.0).contains(&risk.risk)),
                AnalysisOutcome::Drift(d) => prop_assert!((0.0..=1.0).contains(&d.report.score)),
                _ => {}
            }
        }
    }
}

/// The source design's escalation: a composite score above 0.7 followed, within the
/// configured time, by one of at least 0.85 freezes the candidate even below the L3
/// threshold; a planted drift (scores shifted by 0.3, then by 0.5; composite 0.710 and
/// 0.873 against the first window's scores).
#[test]
fn a_planted_drift_escalates_on_the_composite_score() {
    let escalating = |within_ms: u64| {
        let mut s = AnalysisSettings::default();
        s.drift.method = DriftMethod::Composite;
        s.drift.composite.l3_above = 0.95; // so that only the escalation reaches L3
        s.drift.composite.within_ms = within_ms;
        let mut a = Analyzer::new(s, vec![1, 2, 5, 10, 25, 50, 100], 10).expect("valid");
        run(&mut a, 0, HEALTHY);
        let warned = run(
            &mut a,
            1,
            Spec {
                score_shift: 0.3,
                ..HEALTHY
            },
        );
        let escalated = run(
            &mut a,
            2,
            Spec {
                score_shift: 0.5,
                ..HEALTHY
            },
        );
        (a, warned, escalated)
    };
    let (a, warned, escalated) = escalating(60_000);
    let first = drift_of(&warned);
    let composite = first.report.composite.as_ref().expect("a reference exists");
    assert!(
        composite.score > 0.7 && composite.score < 0.85,
        "{composite:?}"
    );
    assert_eq!(first.tier, DriftTier::L2);
    let e = escalated
        .iter()
        .find_map(|o| match o {
            AnalysisOutcome::DriftEscalated(e) => Some(e),
            _ => None,
        })
        .expect("escalated");
    assert_eq!(e.first_at, t(2 * MINUTE_MS));
    assert_eq!(e.at, t(3 * MINUTE_MS));
    assert!(e.score >= 0.85 && e.first_score > 0.7, "{e:?}");
    let d = drift_of(&escalated);
    assert_eq!(
        (d.tier, d.response),
        (DriftTier::L3, DriftResponse::FreezeAndOpenReview)
    );
    assert_eq!(a.state().gate, Gate::Frozen);
    assert_eq!(a.state().weight, 0);
    // KS/Wasserstein is still reported beside it, and is what the rollback reads.
    assert!(d.report.score > 0.0);

    // The same scores 60 s apart do not escalate within the design's 30 s: L2 only.
    let (a, _, late) = escalating(30_000);
    assert!(
        !late
            .iter()
            .any(|o| matches!(o, AnalysisOutcome::DriftEscalated(_)))
    );
    assert_eq!(drift_of(&late).tier, DriftTier::L2);
    assert_ne!(a.state().gate, Gate::Frozen);

    // With the default method the composite is recorded but the tiers are KS/W's.
    let mut b = analyzer(10);
    run(&mut b, 0, HEALTHY);
    let out = run(
        &mut b,
        1,
        Spec {
            score_shift: 0.3,
            ..HEALTHY
        },
    );
    let d = drift_of(&out);
    assert!(d.report.composite.as_ref().is_some_and(|c| c.score > 0.7));
    assert_eq!(
        d.tier,
        drift_tier(d.report.score, &DriftSettings::default())
    );
}
