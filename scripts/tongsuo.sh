#!/usr/bin/env bash
# Aether: Tongsuo's `openssl` command, the peer of the aether-gmtls interop test.
#
#   scripts/tongsuo.sh        prints the path of the binary on stdout
#
# Builds it once, from the Tongsuo source that the `tongsuo-src` crate vendors (fetched
# from crates.io with cargo, checksum pinned below), into
#   ${AETHER_TOOLS:-$HOME/.cache/aether/tools}/tongsuo/bin/openssl
# with its configuration at .../tongsuo/ssl/openssl.cnf (the binary's compiled-in
# OPENSSLDIR, so it needs no OPENSSL_CONF). Does nothing when that binary exists and
# answers `version`. Only a test peer: nothing of Aether links against it.
#
# Environment: AETHER_TOOLS (where tools live), TONGSUO_MAKE_JOBS (default 1: the
# machine is shared, leave a core free).
set -euo pipefail

# Tongsuo 8.5.0, as vendored by tongsuo-src; the checksum is the crate's own (registry index).
CRATE_VERSION="850.1.1+8.5.0"
CRATE_SHA256="c3707d4fc3f701c479a327bc98315902725b93507b1c447489ec101361321f79"
JOBS="${TONGSUO_MAKE_JOBS:-1}"

TOOLS="${AETHER_TOOLS:-$HOME/.cache/aether/tools}"
DEST="$TOOLS/tongsuo"
BIN="$DEST/bin/openssl"

info() { echo "tongsuo.sh: $*" >&2; }
die() {
    echo "tongsuo.sh: error: $*" >&2
    exit 1
}

if [[ -x "$BIN" ]] && "$BIN" version >/dev/null 2>&1; then
    info "already built: $("$BIN" version 2>/dev/null | head -n1)"
    echo "$BIN"
    exit 0
fi

for tool in cargo perl make cc tar sha256sum; do
    command -v "$tool" >/dev/null || die "'$tool' is needed to build Tongsuo and is not on PATH"
done

mkdir -p "$TOOLS"
WORK="$(mktemp -d "$TOOLS/tongsuo-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# 1. The crate, through cargo (it knows the registry and any mirror configured here).
info "fetching tongsuo-src $CRATE_VERSION"
mkdir -p "$WORK/fetch/src"
cat >"$WORK/fetch/Cargo.toml" <<EOF
[package]
name = "tongsuo-fetch"
version = "0.0.0"
edition = "2021"

[dependencies]
tongsuo-src = "=$CRATE_VERSION"

[workspace]
EOF
: >"$WORK/fetch/src/lib.rs"
(cd "$WORK/fetch" && cargo fetch --quiet) || die "cargo could not fetch tongsuo-src $CRATE_VERSION"

CARGO_HOME_DIR="${CARGO_HOME:-$HOME/.cargo}"
CRATE_FILE=""
for candidate in "$CARGO_HOME_DIR"/registry/cache/*/"tongsuo-src-$CRATE_VERSION.crate"; do
    [[ -f "$candidate" ]] && CRATE_FILE="$candidate" && break
done
[[ -n "$CRATE_FILE" ]] ||
    die "tongsuo-src-$CRATE_VERSION.crate not found under $CARGO_HOME_DIR/registry/cache"
echo "$CRATE_SHA256  $CRATE_FILE" | sha256sum --check --quiet - ||
    die "checksum mismatch for $CRATE_FILE"

tar xzf "$CRATE_FILE" -C "$WORK" || die "cannot unpack $CRATE_FILE"
SRC="$WORK/tongsuo-src-$CRATE_VERSION/tongsuo"
[[ -x "$SRC/Configure" ]] || die "no Tongsuo source in $CRATE_FILE"

# 2. Configure and build the command only (static: no shared libraries to find at run time).
info "building Tongsuo in $SRC with make -j$JOBS (several minutes)"
start=$SECONDS
(
    cd "$SRC"
    nice ./Configure enable-ntls no-shared no-tests \
        --prefix="$DEST" --openssldir="$DEST/ssl" >"$WORK/configure.log" 2>&1 ||
        { tail -n 40 "$WORK/configure.log" >&2; exit 1; }
    nice make -j"$JOBS" build_programs >"$WORK/make.log" 2>&1 ||
        { tail -n 60 "$WORK/make.log" >&2; exit 1; }
) || die "Tongsuo build failed (log above)"
info "built in $((SECONDS - start)) s"

# 3. Install: the binary and the configuration it reads by default; atomic rename last.
mkdir -p "$DEST/bin" "$DEST/ssl"
cp "$SRC/apps/openssl.cnf" "$DEST/ssl/openssl.cnf"
cp "$SRC/apps/openssl" "$DEST/bin/.openssl.new"
mv -f "$DEST/bin/.openssl.new" "$BIN"

"$BIN" version >/dev/null 2>&1 || die "the built $BIN does not answer 'version'"
info "installed $("$BIN" version | head -n1)"
echo "$BIN"
