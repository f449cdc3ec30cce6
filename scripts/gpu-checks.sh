#!/usr/bin/env bash
# Aether's GPU checks, which CI cannot run (it has no GPU): build them on any x86-64 Linux
# machine with the CUDA toolkit, run them on one with an NVIDIA GPU.
#
#   scripts/gpu-checks.sh pack DIR   build the CUDA test binaries and the scoring bench into
#                                    DIR (stripped, xz-compressed, about 45 MB) with this script
#   DIR/gpu-checks.sh run [DIR]      on the GPU machine: unpack and run them
#
# What runs: the model tests of a CUDA build (`cpu_cuda_parity`: scores within 1e-4 of the
# CPU's), the end-to-end test of an `aether worker --device cuda` process deciding trades as
# a CPU worker does (`clearing_cuda_e2e`), and the scoring bench on both devices. The tests
# read the source tree at the path they were built in, so `run` needs this checkout there
# too (or a link to it, which it makes when given `AETHER_SOURCE=<checkout>`).
#
# Building needs nvcc (CUDA 12.x or 13.x) on PATH or in CUDA_HOME, and the toolkit's
# libcuda stub. CUDA_COMPUTE_CAP (default 90: H100/H200) names the target GPU when the build
# machine has none. Running needs the NVIDIA driver and the toolkit's cuBLAS, cuRAND and
# runtime libraries; `run` looks for those the loader misses under /usr/local, /opt, /usr/lib.
set -euo pipefail

die() {
    printf 'gpu-checks.sh: error: %s\n' "$*" >&2
    exit 1
}

pack() {
    local out=$1
    local root
    root=$(cd "$(dirname "$0")/.." && pwd)
    command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ] ||
        die "nvcc not found: install the CUDA toolkit or set CUDA_HOME"
    export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
    mkdir -p "$out"
    cd "$root"
    local model bench e2e target=${CARGO_TARGET_DIR:-$root/target}
    # The last "Executable" line cargo prints names each binary.
    model=$(cargo test -p aether-gpu-worker --features cuda --test model --no-run 2>&1 |
        tee /dev/stderr | sed -n 's/.*Executable tests\/model.rs (\(.*\))/\1/p' | tail -1)
    bench=$(cargo bench -p aether-gpu-worker --features cuda --bench scoring --no-run 2>&1 |
        tee /dev/stderr | sed -n 's/.*Executable benches\/scoring.rs (\(.*\))/\1/p' | tail -1)
    cargo build -p aether --features cuda
    e2e=$(cargo test -p aether-e2e --features cuda --test clearing_cuda_e2e --no-run 2>&1 |
        tee /dev/stderr |
        sed -n 's/.*Executable tests\/clearing_cuda_e2e.rs (\(.*\))/\1/p' | tail -1)
    [ -n "$model" ] && [ -n "$bench" ] && [ -n "$e2e" ] || die "a build did not name its binary"
    cp "$model" "$out/model"
    cp "$bench" "$out/scoring"
    cp "$e2e" "$out/clearing_cuda_e2e"
    cp "$target/debug/aether" "$out/aether"
    for f in model scoring clearing_cuda_e2e aether; do
        strip "$out/$f"
        xz -6 -T0 -f "$out/$f"
    done
    cp "$0" "$out/gpu-checks.sh"
    printf '%s\n' "$root" >"$out/source-path"
    ls -la "$out"
}

# find_libs BINARY: the directories holding the shared libraries BINARY needs and the loader
# does not find (the driver, cuBLAS, cuRAND, the runtime: whichever CUDA version it was
# built with).
find_libs() {
    local dirs="" f p
    for f in $(ldd "$1" | awk '/not found/ { print $1 }'); do
        p=$(find /usr/local /opt /usr/lib /usr/lib64 -name "$f" 2>/dev/null | head -1)
        printf '    %s -> %s\n' "$f" "${p:-MISSING}" >&2
        [ -z "$p" ] || dirs="$dirs:$(dirname "$p")"
    done
    printf '%s\n' "${dirs#:}"
}

run() {
    local dir=${1:-$(dirname "$0")}
    dir=$(cd "$dir" && pwd)
    local built_in
    built_in=$(cat "$dir/source-path")
    if [ -n "${AETHER_SOURCE:-}" ] && [ "$(cd "$AETHER_SOURCE" && pwd)" != "$built_in" ]; then
        [ ! -e "$built_in" ] || die "$built_in exists and is not AETHER_SOURCE"
        mkdir -p "$(dirname "$built_in")"
        ln -s "$(cd "$AETHER_SOURCE" && pwd)" "$built_in"
    fi
    [ -d "$built_in/gpu-worker" ] || die "the source tree is not at $built_in (set AETHER_SOURCE)"
    echo "== machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
    cd "$dir"
    for f in model scoring clearing_cuda_e2e aether; do
        [ -x "$f" ] || { xz -dkf "$f.xz" && chmod +x "$f"; }
    done
    local libs
    libs=$(find_libs ./aether)
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local failed=0
    echo "== model tests, CUDA build"
    timeout 300 ./model --nocapture || failed=1
    echo "== scoring bench"
    timeout 120 ./scoring --secs 1.5 || failed=1
    echo "== a CUDA worker against a CPU worker, end to end"
    AETHER_BIN="$dir/aether" timeout 300 ./clearing_cuda_e2e --nocapture || failed=1
    [ "$failed" = 0 ] || die "a check failed (above)"
    echo "== all GPU checks passed"
}

case "${1:-}" in
pack) pack "${2:?usage: gpu-checks.sh pack DIR}" ;;
run) run "${2:-}" ;;
*) die "usage: gpu-checks.sh pack DIR | run [DIR]" ;;
esac
