//! Hot swap under concurrent evaluation: no evaluation ever sees two rule sets.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use aether_rules::{Action, CompiledPolicy, Evaluation, RuleEngine, RuleSet, Severity};

use crate::{clean_context, clean_request, document, rule};

const RULES_PER_POLICY: usize = 12;
const EVALUATORS: usize = 4;
const EVALUATIONS_EACH: usize = 150;
/// Evaluators keep going past `EVALUATIONS_EACH` until this many swaps have happened, so
/// that swaps interleave with evaluations however fast either is.
const MIN_SWAPS: usize = 20;

/// Policy `name` whose every rule fires and cites `letter`.
fn lettered(name: &str, version: &str, letter: &str) -> Arc<CompiledPolicy> {
    let rules = (0..RULES_PER_POLICY)
        .map(|i| {
            let mut r = rule(&format!("r{i}"), "request.amount_minor >= 0");
            r.cites = vec![letter.to_string()];
            r.severity = Severity::Medium;
            r
        })
        .collect();
    let mut d = document(name, rules);
    d.version = version.to_string();
    Arc::new(CompiledPolicy::compile(d).expect("compiles"))
}

/// The single letter every fired rule cites, or a panic naming the mix.
fn letter_of(e: &Evaluation, expected_rules: usize) -> String {
    assert_eq!(e.fired.len(), expected_rules, "every rule fires once");
    assert!(e.errors.is_empty(), "{:?}", e.errors);
    let letters: Vec<&str> = e.fired.iter().map(|f| f.cites[0].as_str()).collect();
    let first = letters[0];
    assert!(
        letters.iter().all(|l| *l == first),
        "one evaluation saw two rule sets: {letters:?}"
    );
    first.to_string()
}

/// Runs `EVALUATORS` threads evaluating `hooks` while `swap` runs in a loop on another
/// thread; each evaluation goes through `check`. Returns how many swaps and how many
/// evaluations happened.
fn under_swaps(
    engine: &RuleEngine,
    hooks: &[&str],
    swap: impl Fn(usize) + Sync,
    check: impl Fn(&Evaluation) + Sync,
) -> (usize, usize) {
    let done = AtomicBool::new(false);
    let swaps = AtomicUsize::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut i = 0;
            while !done.load(Ordering::Relaxed) {
                swap(i);
                i += 1;
                swaps.store(i, Ordering::Relaxed);
                std::thread::yield_now();
            }
        });
        let workers: Vec<_> = (0..EVALUATORS)
            .map(|_| {
                s.spawn(|| {
                    let mut n = 0;
                    while n < EVALUATIONS_EACH || swaps.load(Ordering::Relaxed) < MIN_SWAPS {
                        let e = engine
                            .evaluate(&clean_request(), &clean_context(), hooks)
                            .expect("runs");
                        check(&e);
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let results: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        done.store(true, Ordering::Relaxed);
        let mut evaluations = 0;
        for r in results {
            match r {
                Ok(n) => evaluations += n,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        (swaps.load(Ordering::Relaxed), evaluations)
    })
}

#[test]
fn replacing_a_whole_set_never_mixes_two_sets() {
    // Two policies in each set, so a mix could also come from taking one policy from
    // each set.
    let set_a = Arc::new(
        RuleSet::new([lettered("p", "1.0.0", "A"), lettered("q", "1.0.0", "A")]).expect("set"),
    );
    let set_b = Arc::new(
        RuleSet::new([lettered("p", "2.0.0", "B"), lettered("q", "2.0.0", "B")]).expect("set"),
    );
    let engine = RuleEngine::with_rule_set((*set_a).clone());
    let seen_a = AtomicUsize::new(0);
    let seen_b = AtomicUsize::new(0);
    let (swaps, evaluations) = under_swaps(
        &engine,
        &["p", "q"],
        |i| {
            engine.replace(if i % 2 == 0 {
                set_b.clone()
            } else {
                set_a.clone()
            });
        },
        |e| {
            let letter = letter_of(e, 2 * RULES_PER_POLICY);
            let (digest, version, counter) = match letter.as_str() {
                "A" => (set_a.digest(), "1.0.0", &seen_a),
                _ => (set_b.digest(), "2.0.0", &seen_b),
            };
            assert_eq!(e.rules_digest, digest, "digest names the set evaluated");
            assert!(e.fired.iter().all(|f| f.policy_version == version));
            counter.fetch_add(1, Ordering::Relaxed);
        },
    );
    let (a, b) = (seen_a.into_inner(), seen_b.into_inner());
    assert_eq!(a + b, evaluations);
    // The swaps really did interleave with the evaluations.
    assert!(swaps > 10, "only {swaps} swaps");
    assert!(a > 0 && b > 0, "saw A {a} times and B {b} times");
}

#[test]
fn installing_versions_of_one_policy_never_mixes_versions() {
    let v1 = lettered("aml_v2", "1.0.0", "A");
    let v2 = lettered("aml_v2", "2.0.0", "B");
    let engine = RuleEngine::new();
    engine.install(v1.clone());
    let seen = [AtomicUsize::new(0), AtomicUsize::new(0)];
    under_swaps(
        &engine,
        &["aml_v2"],
        |i| {
            engine.install(if i % 2 == 0 { v2.clone() } else { v1.clone() });
        },
        |e| {
            let letter = letter_of(e, RULES_PER_POLICY);
            let index = usize::from(letter == "B");
            let version = ["1.0.0", "2.0.0"][index];
            assert!(e.fired.iter().all(|f| f.policy_version == version));
            seen[index].fetch_add(1, Ordering::Relaxed);
        },
    );
    let [a, b] = seen.map(AtomicUsize::into_inner);
    assert!(a > 0 && b > 0, "saw v1 {a} times and v2 {b} times");
}

#[test]
fn an_evaluation_in_flight_finishes_on_its_snapshot() {
    let engine = RuleEngine::new();
    engine.install(lettered("p", "1.0.0", "A"));
    let in_flight = engine.snapshot();
    let installed = engine.install(lettered("p", "2.0.0", "B"));
    assert_eq!(installed.digest(), engine.snapshot().digest());
    let old = in_flight
        .evaluate(&clean_request(), &clean_context(), &["p"])
        .expect("runs");
    let new = engine
        .evaluate(&clean_request(), &clean_context(), &["p"])
        .expect("runs");
    assert_eq!(letter_of(&old, RULES_PER_POLICY), "A");
    assert_eq!(letter_of(&new, RULES_PER_POLICY), "B");
    assert_eq!(old.decision, Action::Hold);
}

#[test]
fn concurrent_installs_of_different_policies_are_all_kept() {
    let engine = RuleEngine::new();
    let policies: Vec<_> = (0..8)
        .map(|i| lettered(&format!("policy-{i}"), "1.0.0", "A"))
        .collect();
    std::thread::scope(|s| {
        for p in &policies {
            s.spawn(|| engine.install(p.clone()));
        }
    });
    let set = engine.snapshot();
    assert_eq!(set.len(), 8);
    assert_eq!(set.digest(), RuleSet::new(policies).expect("set").digest());
}
