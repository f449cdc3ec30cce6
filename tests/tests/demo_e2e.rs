//! `aether demo` end to end: a real service process, real clearing traffic over mTLS, and
//! the rollout controller rolling the flawed candidate back on its own.

use aether_e2e::run_aether;

#[test]
fn the_demo_widens_the_candidate_then_rolls_it_back_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("demo");
    let out = run_aether(
        &[
            "demo",
            "--data-dir",
            data.to_str().unwrap(),
            "--timeout-secs",
            "240",
        ],
        &[("AETHER_LOG", "warn")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let log = std::fs::read_to_string(data.join("serve.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}\nserve.log:\n{log}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The order of the story: widened, then the drift, then one RolledBack.
    let at = |needle: &str| {
        stdout
            .find(needle)
            .unwrap_or_else(|| panic!("{needle:?} not in the timeline:\n{stdout}"))
    };
    let widened = at("candidate weight 0% -> 5% (increase)");
    let shift = at("the traffic mix shifts");
    let rolled = at("RolledBack to snapshot");
    assert!(widened < shift && shift < rolled, "{stdout}");
    assert_eq!(stdout.matches("RolledBack to snapshot").count(), 1);
    assert!(stdout.contains("the candidate was rolled back by the controller"));
    // After the rollback the flawed candidate decides nothing, yen trades included.
    assert!(
        stdout.contains("after the rollback: 30 yen trades, 0 decided by the candidate"),
        "{stdout}"
    );
    // The plan says how the weights move, the URLs say how to reopen them, and the
    // service's log tells the story.
    assert!(stdout.contains("(5, 8, 12, 18, 25 ...)"), "{stdout}");
    assert!(
        stdout.contains("a held trade explained (held_for_review, explained)"),
        "{stdout}"
    );
    assert!(stdout.contains("aether serve --data-dir"), "{stdout}");
    assert!(!stdout.contains("the operator resumes"), "{stdout}");
    assert!(log.contains("aether serving"), "serve.log:\n{log}");
    // Everything it recorded verifies, and a second demo refuses the used directory.
    let verify = run_aether(&["verify", "--data-dir", data.to_str().unwrap()], &[]);
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );
    let again = run_aether(&["demo", "--data-dir", data.to_str().unwrap()], &[]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("is not empty"));
}
