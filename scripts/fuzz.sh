#!/usr/bin/env bash
# Coverage-guided fuzzing of the decoders an attacker reaches (fuzz/README.md):
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET ...]
# Runs each target of fuzz/cargo-fuzz under libFuzzer for SECONDS_PER_TARGET (default 60)
# on a scratch copy of its committed corpus (fuzz/corpus/<target>), and fails on the first
# crash, leaving the input under fuzz/cargo-fuzz/artifacts/<target>/. New inputs the run
# found are left in the scratch copy (printed); copy the ones worth keeping into
# fuzz/corpus/<target>/ (or minimise them first with `cargo fuzz cmin`).
#
# cargo-fuzz 0.13.2 is installed once under ~/.cache/aether/tools. The project builds with
# the stable toolchain; cargo-fuzz passes nightly-only flags (-Z), so the instrumented
# build runs with RUSTC_BOOTSTRAP=1 and the sanitizer off (`-s none`): libFuzzer's coverage
# guidance and its crash detection (panics, aborts) without AddressSanitizer, which the
# project's safe Rust does not need. Its build (all of the stack, instrumented) lives in
# ~/.cache/aether/target-fuzz.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds=${1:-60}
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    mapfile -t targets < <(ls fuzz/cargo-fuzz/fuzz_targets | sed 's/\.rs$//')
fi

tools="${HOME}/.cache/aether/tools"
export PATH="$tools/bin:$PATH"
if ! cargo fuzz --version 2>/dev/null | grep -q '0\.13\.2'; then
    echo "fuzz.sh: installing cargo-fuzz 0.13.2 into $tools (once)"
    cargo install cargo-fuzz --version 0.13.2 --locked --root "$tools" --quiet
fi

export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="${AETHER_FUZZ_TARGET_DIR:-$HOME/.cache/aether/target-fuzz}"
fuzz=(cargo fuzz run --fuzz-dir fuzz/cargo-fuzz -s none)
echo "fuzz.sh: building the instrumented targets (${targets[*]})"
for target in "${targets[@]}"; do
    cargo fuzz build --fuzz-dir fuzz/cargo-fuzz -s none "$target" 2>&1 | tail -n 2
done

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for target in "${targets[@]}"; do
    mkdir -p "$scratch/$target"
    cp fuzz/corpus/"$target"/* "$scratch/$target/"
    seeds=$(find "$scratch/$target" -type f | wc -l)
    echo "==> $target: $seconds s from $seeds committed inputs"
    log="$scratch/$target.log"
    if ! "${fuzz[@]}" "$target" "$scratch/$target" -- \
        -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
        -print_final_stats=1 >"$log" 2>&1; then
        tail -n 40 "$log"
        echo "fuzz.sh: $target failed; the input is under fuzz/cargo-fuzz/artifacts/$target/" >&2
        exit 1
    fi
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*' || echo '?')
    found=$(($(find "$scratch/$target" -type f | wc -l) - seeds))
    echo "    $runs executions, coverage $cov edges, $found new inputs, no crash"
done
echo "fuzz.sh: every target ran ${seconds} s without a crash"
