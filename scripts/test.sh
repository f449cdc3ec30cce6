#!/usr/bin/env bash
# Aether: the one test command.
#
#   scripts/test.sh [--long] [extra args for the test runner]
#
# 1. Resolves a PostgreSQL server and exports DATABASE_URL (an admin-capable
#    URL; tests create and drop their own databases on that server):
#      a. DATABASE_URL from the environment, if set and non-empty;
#      b. else a server answering on 127.0.0.1:5432;
#      c. else a throwaway cluster (initdb + pg_ctl in a temp dir), stopped
#         and removed when this script exits.
# 2. cargo fmt --check, cargo clippy -D warnings, then all workspace tests
#    (cargo-nextest when installed, plain cargo test otherwise).
# 3. The lineage API read by the Marquez Python client, with a job sent by
#    openlineage-python (tests/marquez; when python3 is present), and the OpenAPI document
#    checked against the running service by schemathesis (tests/openapi).
# 4. The console (console/web, Node.js 20+ and npm): npm ci, a fresh build that must equal
#    the committed console/dist, svelte-check, its unit tests, and its browser test in
#    Debian's Chromium (installed with apt-get when missing; CHROMIUM names another).
#
# Also installs the S3-compatible server the object-storage tests start (s3s-fs, from
# crates.io, once, under ~/.cache/aether/tools) unless AETHER_S3S_FS names one, and builds
# Tongsuo's openssl (the RFC 8998 interop peer, scripts/tongsuo.sh, once, same place)
# unless AETHER_TONGSUO_OPENSSL names one.
#
# Environment switches:
#   AETHER_TEST_ONLY_PROVISION=1   stop right after provisioning PostgreSQL
#   AETHER_TEST_FORCE_THROWAWAY=1  skip (a) and (b), always use a throwaway cluster
#   CARGO_TARGET_DIR               respected as is
set -euo pipefail

# --long: after the suite, the two-minute chaos run (`aether cluster chaos`), 21 SIGKILLs of
# a lone node under load (running, stopping and starting), the HTTP fuzz
# test with 200 inputs per operation instead of 8, the gRPC fuzz test with 400 requests
# instead of 60, and a minute of coverage-guided fuzzing per decoder (scripts/fuzz.sh).
LONG=0
if [[ "${1:-}" == "--long" ]]; then
    LONG=1
    shift
fi

step() { printf '\n==> %s\n' "$*"; }
info() { printf '    %s\n' "$*"; }
warn() { printf 'test.sh: %s\n' "$*" >&2; }
die() {
    warn "error: $*"
    exit 1
}

# Hide any password: postgres://user:SECRET@host -> postgres://user:****@host
mask_url() {
    printf '%s\n' "$1" | sed -E 's#(://[^:/@]*:)[^@]*@#\1****@#'
}

# pg_answers HOST PORT: is a PostgreSQL server (or at least something) listening?
pg_answers() {
    local host=$1 port=$2
    if command -v pg_isready >/dev/null 2>&1; then
        pg_isready -q -h "$host" -p "$port" -t 3 >/dev/null 2>&1
    else
        # shellcheck disable=SC2016 # expanded by the inner bash
        timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$host" "$port" >/dev/null 2>&1
    fi
}

# port_in_use PORT: does anything accept TCP connections on 127.0.0.1:PORT?
port_in_use() {
    # shellcheck disable=SC2016 # expanded by the inner bash
    timeout 3 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1"' _ "$1" >/dev/null 2>&1
}

# url_works URL: true if psql can run a query with it (or psql is absent).
url_works() {
    command -v psql >/dev/null 2>&1 || return 0
    PGCONNECT_TIMEOUT=5 psql "$1" -X -q -t -A -v ON_ERROR_STOP=1 -c 'select 1' </dev/null >/dev/null 2>&1
}

# ---------------------------------------------------------------------------
# Throwaway cluster (path c)
# ---------------------------------------------------------------------------
PG_TMP=""
PG_BIN=""
PG_RUN_AS=""

# Run a command as the cluster owner (a non-root user when we are root).
as_pg_user() {
    if [[ -z "$PG_RUN_AS" ]]; then
        "$@"
    elif command -v runuser >/dev/null 2>&1; then
        runuser -u "$PG_RUN_AS" -- "$@"
    else
        local cmd
        cmd=$(printf '%q ' "$@")
        su -s /bin/sh "$PG_RUN_AS" -c "$cmd"
    fi
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$PG_TMP" ]]; then
        if [[ -f "$PG_TMP/data/postmaster.pid" ]]; then
            info "stopping throwaway PostgreSQL cluster"
            (cd "$PG_TMP" && as_pg_user "$PG_BIN/pg_ctl" -D "$PG_TMP/data" -m fast -w stop) >/dev/null 2>&1 ||
                warn "warning: pg_ctl stop failed; see $PG_TMP/postgres.log"
        fi
        rm -rf -- "$PG_TMP" || warn "warning: could not remove $PG_TMP"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Directory holding initdb and pg_ctl: highest /usr/lib/postgresql/<ver>/bin
# (Debian/Ubuntu), then /usr/pgsql-<ver>/bin (RPM), then PATH.
find_pg_bin() {
    local d
    while IFS= read -r d; do
        if [[ -x "$d/initdb" && -x "$d/pg_ctl" ]]; then
            printf '%s\n' "$d"
            return 0
        fi
    done < <(
        {
            compgen -G '/usr/lib/postgresql/*/bin' || true
            compgen -G '/usr/pgsql-*/bin' || true
        } | sort -V -r
    )
    local initdb pg_ctl
    initdb=$(command -v initdb 2>/dev/null || true)
    pg_ctl=$(command -v pg_ctl 2>/dev/null || true)
    if [[ -n "$initdb" && -n "$pg_ctl" ]]; then
        initdb=$(readlink -f "$initdb")
        pg_ctl=$(readlink -f "$pg_ctl")
        if [[ "$(dirname "$initdb")" == "$(dirname "$pg_ctl")" ]]; then
            dirname "$initdb"
            return 0
        fi
    fi
    if command -v pg_config >/dev/null 2>&1; then
        d=$(pg_config --bindir 2>/dev/null || true)
        if [[ -n "$d" && -x "$d/initdb" && -x "$d/pg_ctl" ]]; then
            printf '%s\n' "$d"
            return 0
        fi
    fi
    return 1
}

start_throwaway_cluster() {
    PG_BIN=$(find_pg_bin) || die "no PostgreSQL server found: set DATABASE_URL, run one on 127.0.0.1:5432, or install PostgreSQL (initdb/pg_ctl)"

    # PostgreSQL refuses to run as root: use a dedicated unprivileged user.
    if [[ "$(id -u)" == 0 ]]; then
        if id -u aether-pg >/dev/null 2>&1; then
            PG_RUN_AS=aether-pg
        elif command -v useradd >/dev/null 2>&1 &&
            useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin aether-pg >/dev/null 2>&1; then
            PG_RUN_AS=aether-pg
        else
            PG_RUN_AS=nobody
        fi
    fi

    local port=54329
    while port_in_use "$port"; do
        port=$((port + 1))
        ((port < 54429)) || die "no free port found for a throwaway PostgreSQL cluster"
    done

    # As root use /tmp: the cluster user must be able to reach the directory.
    local base=${TMPDIR:-/tmp}
    [[ -z "$PG_RUN_AS" ]] || base=/tmp
    PG_TMP=$(mktemp -d "$base/aether-pg.XXXXXX")
    mkdir "$PG_TMP/sock"
    if [[ -n "$PG_RUN_AS" ]]; then
        chown -R "$PG_RUN_AS" "$PG_TMP"
    fi

    info "starting throwaway PostgreSQL cluster ($PG_BIN, port $port${PG_RUN_AS:+, user $PG_RUN_AS}) in $PG_TMP"
    # cd into the temp dir: the cluster user may not be able to read our cwd.
    if ! (cd "$PG_TMP" && as_pg_user "$PG_BIN/initdb" -D "$PG_TMP/data" \
        --auth=trust -U postgres -E UTF8 --locale=C --no-sync) >"$PG_TMP/initdb.log" 2>&1; then
        cat "$PG_TMP/initdb.log" >&2
        die "initdb failed"
    fi
    if ! (cd "$PG_TMP" && as_pg_user "$PG_BIN/pg_ctl" -D "$PG_TMP/data" -l "$PG_TMP/postgres.log" -w -t 60 \
        -o "-p $port -k $PG_TMP/sock -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
        start) >/dev/null 2>&1; then
        cat "$PG_TMP/postgres.log" >&2 || true
        die "could not start the throwaway PostgreSQL cluster"
    fi
    DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
    PG_SOURCE="throwaway cluster on 127.0.0.1:$port (removed on exit)"
}

# ---------------------------------------------------------------------------
# 1. PostgreSQL
# ---------------------------------------------------------------------------
step "PostgreSQL"
PG_SOURCE=""
if [[ "${AETHER_TEST_FORCE_THROWAWAY:-}" != 1 ]]; then
    if [[ -n "${DATABASE_URL:-}" ]]; then
        PG_SOURCE="DATABASE_URL from the environment"
    elif pg_answers 127.0.0.1 5432; then
        me=$(id -un 2>/dev/null || printf '%s' "${USER:-}")
        for pg_user in postgres ${me:+"$me"}; do
            candidate="postgres://$pg_user@127.0.0.1:5432/postgres"
            if url_works "$candidate"; then
                DATABASE_URL=$candidate
                PG_SOURCE="local server on 127.0.0.1:5432 (user $pg_user)"
                break
            fi
        done
        if [[ -z "$PG_SOURCE" ]]; then
            warn "a server answers on 127.0.0.1:5432 but neither user postgres nor ${me:-the current user} can log in; using a throwaway cluster"
        fi
    fi
fi
if [[ -z "$PG_SOURCE" ]]; then
    start_throwaway_cluster
fi
export DATABASE_URL
echo "Using PostgreSQL: $(mask_url "$DATABASE_URL") [$PG_SOURCE]"

if [[ "${AETHER_TEST_ONLY_PROVISION:-}" == 1 ]]; then
    if command -v psql >/dev/null 2>&1; then
        PGCONNECT_TIMEOUT=10 psql "$DATABASE_URL" -X -v ON_ERROR_STOP=1 -c 'select version()' </dev/null
    fi
    echo "AETHER_TEST_ONLY_PROVISION=1: stopping after provisioning"
    exit 0
fi

# ---------------------------------------------------------------------------
# 2-5. Rust checks and tests
# ---------------------------------------------------------------------------
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v cargo >/dev/null 2>&1 || die "cargo not found on PATH"
if [[ -n "${CARGO_TARGET_DIR:-}" ]]; then
    info "CARGO_TARGET_DIR=$CARGO_TARGET_DIR"
fi

step "S3-compatible server (s3s-fs) for the Delta-on-object-storage tests"
# Tests start their own s3s-fs processes (lineage's `testing::S3Server`): AETHER_S3S_FS,
# else the copy cached under ~/.cache/aether/tools, installed here from crates.io when missing.
S3S_FS_VERSION=0.14.1
if [[ -n "${AETHER_S3S_FS:-}" ]]; then
    [[ -x "$AETHER_S3S_FS" ]] || die "AETHER_S3S_FS=$AETHER_S3S_FS is not an executable"
else
    tools="${HOME}/.cache/aether/tools"
    export AETHER_S3S_FS="$tools/bin/s3s-fs"
    if [[ ! -x "$AETHER_S3S_FS" ]]; then
        info "installing s3s-fs $S3S_FS_VERSION into $tools (once)"
        cargo install s3s-fs --version "$S3S_FS_VERSION" --features binary --locked \
            --root "$tools" --quiet || die "cannot install s3s-fs $S3S_FS_VERSION from crates.io"
    fi
fi
info "AETHER_S3S_FS=$AETHER_S3S_FS"

step "Tongsuo's openssl (RFC 8998 peer) for the SM TLS interop tests"
# The independent TLS 1.3 implementation the ShangMi suites are tested against
# (gmtls/tests/tongsuo.rs, tests/tests/gm_tls_e2e.rs): AETHER_TONGSUO_OPENSSL, else built once
# by scripts/tongsuo.sh from the tongsuo-src crate's source (about 4 minutes) and cached.
if [[ -n "${AETHER_TONGSUO_OPENSSL:-}" ]]; then
    [[ -x "$AETHER_TONGSUO_OPENSSL" ]] || die "AETHER_TONGSUO_OPENSSL=$AETHER_TONGSUO_OPENSSL is not an executable"
else
    AETHER_TONGSUO_OPENSSL=$(scripts/tongsuo.sh) || die "cannot build Tongsuo's openssl (scripts/tongsuo.sh)"
    export AETHER_TONGSUO_OPENSSL
fi
info "AETHER_TONGSUO_OPENSSL=$AETHER_TONGSUO_OPENSSL"

step "cargo fmt --all -- --check"
cargo fmt --all -- --check

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "build: the aether binary (end-to-end tests run it) and the tests"
cargo build -p aether --bins
cargo test --workspace --no-run

if cargo nextest --version >/dev/null 2>&1; then
    # Doc tests first, so that the run closes on nextest's summary of all tests.
    step "cargo test --workspace --doc"
    cargo test --workspace --doc
    step "cargo nextest run --workspace --no-fail-fast $*"
    cargo nextest run --workspace --no-fail-fast "$@"
else
    step "cargo test --workspace --no-fail-fast $* (cargo-nextest not installed)"
    log=$(mktemp)
    status=0
    cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?
    # One closing line for the whole run (cargo test ends on the last crate's doc tests).
    awk '/^test result:/ { p += $4; f += $6 } END { printf "%d passed, %d failed\n", p, f }' "$log"
    rm -f "$log"
    [ "$status" -eq 0 ] || exit "$status"
fi

# A virtual environment under ~/.cache/aether/tools/<name> holding what <requirements> pins,
# made again when the pins change; prints its path.
pinned_venv() {
    local venv="${HOME}/.cache/aether/tools/$1" requirements="$2" pins
    pins=$(sha256sum "$requirements" | cut -d' ' -f1)
    if [[ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ]]; then
        info "installing $requirements into $venv" >&2
        rm -rf "$venv"
        python3 -m venv "$venv" >&2 || die "cannot make a Python virtual environment (python3-venv)"
        "$venv/bin/pip" install -q --disable-pip-version-check -r "$requirements" >&2 ||
            die "cannot install $requirements"
        printf '%s\n' "$pins" >"$venv/.pins"
    fi
    printf '%s\n' "$venv"
}

step "the lineage API against the Marquez Python client and openlineage-python (tests/marquez)"
if command -v python3 >/dev/null 2>&1; then
    venv=$(pinned_venv marquez-venv tests/marquez/requirements.txt)
    AETHER_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/aether" "$venv/bin/python" tests/marquez/test_marquez_client.py
else
    warn "python3 not found: the Marquez client test (tests/marquez) is skipped"
fi

step "the OpenAPI document against the running service (schemathesis, tests/openapi)"
if command -v python3 >/dev/null 2>&1; then
    st_venv=$(pinned_venv schemathesis-venv tests/openapi/requirements.txt)
    tests/openapi/check.sh "$st_venv/bin/schemathesis" "${CARGO_TARGET_DIR:-$PWD/target}/debug/aether"
else
    warn "python3 not found: the OpenAPI check (tests/openapi) is skipped"
fi

step "the console: its committed build, its unit tests, and Chromium (console/web)"
# Node.js and npm are needed here only: the service embeds the committed console/dist, so
# `cargo run -- serve` needs neither. Chromium is Debian's, installed when missing.
command -v npm >/dev/null 2>&1 || die "npm not found: the console's tests need Node.js 20+ and npm"
if [[ -z "${CHROMIUM:-}" ]]; then
    CHROMIUM=$(command -v chromium || command -v chromium-browser || true)
    if [[ -z "$CHROMIUM" ]]; then
        command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]] ||
            die "Chromium not found: install Debian's chromium (or set CHROMIUM to a Chromium binary)"
        info "installing Debian's chromium (once)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || {
            apt-get update -q >/dev/null 2>&1
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
        } || die "cannot install Debian's chromium"
        CHROMIUM=$(command -v chromium)
    fi
fi
export CHROMIUM
info "CHROMIUM=$CHROMIUM ($("$CHROMIUM" --version 2>/dev/null || echo 'version unknown'))"
npm ci --prefix console/web --no-audit --no-fund --loglevel=error
# The committed build must be what its sources build to: the binary embeds it.
npm run --prefix console/web --silent build >/dev/null
if [[ -n "$(git status --porcelain -- console/dist 2>/dev/null)" ]]; then
    git status --short -- console/dist >&2
    die "console/dist differs from a fresh build of console/web: run 'npm run --prefix console/web build' and commit console/dist"
fi
npm run --prefix console/web --silent check
npm run --prefix console/web --silent test
AETHER_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/aether" \
    CONSOLE_ARTIFACTS="${CONSOLE_ARTIFACTS:-${CARGO_TARGET_DIR:-$PWD/target}/console-artifacts}" \
    npm run --prefix console/web --silent e2e

if [[ "$LONG" == 1 ]]; then
    step "the long chaos run: 3 nodes, 120 s, a SIGKILL every 10 s"
    "${CARGO_TARGET_DIR:-target}/debug/aether" cluster chaos --nodes 3 --duration-secs 120 \
        --kill-every-secs 10 --s3s-fs "$AETHER_S3S_FS"
    step "the long fuzz run: 200 arbitrary inputs on every HTTP operation (seed ${AETHER_FUZZ_SEED:-default})"
    AETHER_FUZZ_CASES=200 cargo test -p aether-e2e --test fuzz_http_e2e
    step "the long crash run: a lone node SIGKILLed 21 times under load, in its transitions too"
    AETHER_FAULT_KILLS=21 cargo test -p aether-e2e --test faults_e2e -- sigkill_cycles --nocapture
    step "the long gRPC fuzz run: 400 arbitrary clearing requests (seed ${AETHER_FUZZ_SEED:-default})"
    AETHER_FUZZ_CASES=400 cargo test -p aether-e2e --test fuzz_grpc_e2e
    step "coverage-guided fuzzing: every decoder target 60 s under libFuzzer (scripts/fuzz.sh)"
    scripts/fuzz.sh 60
fi

step "all checks passed"
