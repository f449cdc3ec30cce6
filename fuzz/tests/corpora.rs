//! Every committed corpus input through its target, in every test run: what libFuzzer
//! once found (or was seeded with) stays handled. Seeds named `ok-*` must be accepted and
//! `bad-*` refused, so the corpora also pin the decoders' verdicts; any other file (one
//! the fuzzer added) must only not panic.

use std::path::Path;

use aether_fuzz::{Outcome, TARGETS};

#[test]
fn every_corpus_input_is_handled_and_the_named_seeds_keep_their_verdict() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut dirs: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    let mut names: Vec<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
    names.sort();
    assert_eq!(dirs, names, "one corpus directory per target");

    let mut wrong = Vec::new();
    for (name, target) in TARGETS {
        let mut named = 0;
        for entry in std::fs::read_dir(root.join(name)).unwrap() {
            let path = entry.unwrap().path();
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let data = std::fs::read(&path).unwrap();
            let outcome = target(&data);
            let expected = if file.starts_with("ok-") {
                Some(Outcome::Accepted)
            } else if file.starts_with("bad-") {
                Some(Outcome::Refused)
            } else {
                None
            };
            if let Some(expected) = expected {
                named += 1;
                if outcome != expected {
                    wrong.push(format!("{name}/{file}: {outcome:?}, expected {expected:?}"));
                }
            }
        }
        assert!(named >= 2, "{name}: at least an ok- and a bad- seed");
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
