#!/usr/bin/env bash
# The OpenAPI document against the running service, with schemathesis:
#
#   tests/openapi/check.sh <path to schemathesis> <path to the aether binary>
#
# Starts `aether serve` on a scratch data directory and runs schemathesis over every
# operation of /v1/openapi.json, seeded and deterministic:
#   1. every operation, with a token of a role it admits: no server error, no status the
#      document does not list, every answer's content type and schema as documented;
#   2. every operation again (but the audit API's, whose 403 for an operator token is the
#      point), also with `positive_data_acceptance`: a request the document says is valid
#      (parameters and bodies within their documented limits) is not refused with 400 or
#      422, except where tests/openapi/schemathesis.toml says why a body's validity is
#      semantic (a CEL policy that compiles, an artifact inside the model directories,
#      numbers within ±2^53 at any depth), which a JSON schema cannot state.
set -euo pipefail
ST="$1"
AETHER="$2"
dir=$(mktemp -d)
port=$((20000 + RANDOM % 20000))
operator="openapi-operator-$RANDOM$RANDOM$RANDOM"
regulator="openapi-regulator-$RANDOM$RANDOM$RANDOM"
# The embedded SQLite ledger in the scratch directory, whatever DATABASE_URL the caller has.
env -u DATABASE_URL AETHER_TOKENS="operator:$operator,regulator:$regulator" AETHER_LOG=warn \
    "$AETHER" serve --data-dir "$dir/data" --listen "127.0.0.1:$port" --grpc-listen 127.0.0.1:0 \
    >"$dir/serve.out" 2>"$dir/serve.log" </dev/null &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 1 100); do
    grep -q "aether listening on" "$dir/serve.out" 2>/dev/null && break
    sleep 0.2
done
grep -q "aether listening on" "$dir/serve.out" || { cat "$dir/serve.log" >&2; exit 1; }
url="http://127.0.0.1:$port/v1/openapi.json"
common=(--seed 20261206 --generation-deterministic --max-examples 20 --phases examples,fuzzing
    --request-timeout 30 --no-color)
response_checks=not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance
echo "schemathesis: every operation (operator), response checks"
"$ST" run "$url" -H "Authorization: Bearer $operator" "${common[@]}" \
    --exclude-path-regex '^/v1/audit' --checks "$response_checks"
echo "schemathesis: the audit API (regulator), response checks"
"$ST" run "$url" -H "Authorization: Bearer $regulator" "${common[@]}" \
    --include-path-regex '^/v1/audit' --checks "$response_checks"
echo "schemathesis: every operation, documented limits accepted"
"$ST" --config-file "$(dirname "$0")/schemathesis.toml" run "$url" \
    -H "Authorization: Bearer $operator" "${common[@]}" \
    --exclude-path-regex '^/v1/audit' --checks "$response_checks,positive_data_acceptance"
