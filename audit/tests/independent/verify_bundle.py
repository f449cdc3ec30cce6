#!/usr/bin/env python3
"""A second, independent verifier of aether.evidence-bundle.v1, written from audit/BUNDLE.md and
services/ledger/HASHING.md only, as a regulator might. It cross-checks the specification: it
accepts audit/tests/data/example-bundle.json and rejects it after any one-character change to a
payload, hash, proof or signature. Not run by `cargo test`.

Usage: verify_bundle.py BUNDLE.json [TRUSTED_PUBLIC_KEY_HEX]

Needs Python >= 3.8 with SM3 in hashlib (OpenSSL 1.1.1+) and the `openssl` command (3.x) for SM2.
Simplifications: the RFC 8785 number formatting below covers common doubles only (use a JCS
library in earnest), and V0's strict member checks are reduced to duplicate detection."""
import datetime, hashlib, json, math, re, subprocess, sys, tempfile, os, uuid

def sm3(b): return hashlib.new("sm3", b).digest()
def leaf(h): return sm3(b"\x00" + h)
def node(l, r): return sm3(b"\x01" + l + r)
HEX64 = re.compile(r"^[0-9a-f]{64}$")

def h(s):
    if not isinstance(s, str) or not HEX64.match(s): raise ValueError(f"bad hash {s!r}")
    return bytes.fromhex(s)

def no_dups(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)): raise ValueError("duplicate member")
    return dict(pairs)

def jcs_num(x):
    if isinstance(x, bool): raise TypeError
    if isinstance(x, int): return str(x)
    if x == 0: return "0"
    if x.is_integer() and abs(x) < 1e21: return str(int(x))
    r = repr(x)  # shortest round-trip, as ECMAScript
    m = re.match(r"^(-?)(\d)(?:\.(\d+))?e([+-]\d+)$", r)
    if m:
        sign, d, frac, exp = m.groups(); e = int(exp); digits = d + (frac or "")
        if -7 < e < 21:  # ECMAScript would use fixed notation here
            r = f"{x:.{max(0, len(digits) - 1 - e)}f}"
        else:
            r = f"{sign}{d}{'.' + frac if frac else ''}e{'+' if e > 0 else '-'}{abs(e)}"
    return r

def jcs(v):
    if v is None: return "null"
    if v is True: return "true"
    if v is False: return "false"
    if isinstance(v, (int, float)): return jcs_num(v)
    if isinstance(v, str): return json.dumps(v, ensure_ascii=False)  # same escapes for our data
    if isinstance(v, list): return "[" + ",".join(jcs(x) for x in v) + "]"
    keys = sorted(v, key=lambda k: k.encode("utf-16-be"))
    return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" + jcs(v[k]) for k in keys) + "}"

def verify_inclusion(hash_, index, size, path, root):
    if index >= size: return False
    fn, sn, r = index, size - 1, leaf(hash_)
    for p in path:
        if sn == 0: return False
        if fn & 1 or fn == sn:
            r = node(p, r)
            if not fn & 1:
                while not fn & 1 and fn != 0: fn >>= 1; sn >>= 1
        else:
            r = node(r, p)
        fn >>= 1; sn >>= 1
    return sn == 0 and r == root

def verify_consistency(m, n, old_root, new_root, path):
    if not (0 < m < n) or not path: return False
    if m & (m - 1) == 0: path = [old_root] + path
    fn, sn = m - 1, n - 1
    while fn & 1: fn >>= 1; sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0: return False
        if fn & 1 or fn == sn:
            fr = node(c, fr); sr = node(c, sr)
            if not fn & 1:
                while not fn & 1 and fn != 0: fn >>= 1; sn >>= 1
        else:
            sr = node(sr, c)
        fn >>= 1; sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root

def der_int(b):
    b = b.lstrip(b"\x00") or b"\x00"
    if b[0] & 0x80: b = b"\x00" + b
    return b"\x02" + bytes([len(b)]) + b

def sm2_verify(pub_hex, message, sig_hex):
    sig = bytes.fromhex(sig_hex)
    if len(sig) != 64: return False
    der = der_int(sig[:32]) + der_int(sig[32:]); der = b"\x30" + bytes([len(der)]) + der
    pub = bytes.fromhex(pub_hex)
    # SubjectPublicKeyInfo: id-ecPublicKey + SM2 curve OID, then the SEC1 point.
    spki_prefix = bytes.fromhex("3059301306072a8648ce3d020106082a811ccf5501822d034200")
    with tempfile.TemporaryDirectory() as d:
        open(f"{d}/pub.der", "wb").write(spki_prefix + pub)
        open(f"{d}/msg", "wb").write(message)
        open(f"{d}/sig", "wb").write(der)
        out = subprocess.run(["openssl", "pkeyutl", "-verify", "-pubin", "-keyform", "DER", "-inkey", f"{d}/pub.der",
                              "-rawin", "-digest", "sm3", "-pkeyopt", "distid:1234567812345678",
                              "-in", f"{d}/msg", "-sigfile", f"{d}/sig"], capture_output=True)
        return out.returncode == 0

def main(path, trusted_hex=None):
    b = json.loads(open(path, "rb").read().decode("utf-8"), object_pairs_hook=no_dups)
    problems = []
    assert b["format"] == "aether.evidence-bundle.v1"
    first = b["public_key"]
    rots = b.get("key_rotations", [])
    chain = [first] + [r["new_key"] for r in rots]
    key = trusted_hex or first
    if key not in chain: problems.append("bundle names another key")
    print("fingerprint", hashlib.new("sm3", bytes.fromhex(key)).hexdigest(), "trusted" if trusted_hex else "NOT independently trusted")
    cps = b["checkpoints"]
    TIME = re.compile(r"^\d{4}-\d\d-\d\dT([01]\d|2[0-3]):[0-5]\d:[0-5]\d\.\d{6}Z$")  # no leap second
    KEY = re.compile(r"^[0-9a-f]{130}$")
    in_force = first
    for i, r in enumerate(rots):
        if not TIME.match(r["rotated_at"]) or not KEY.match(r["previous_key"]) or not KEY.match(r["new_key"]) \
                or r["previous_key"] == r["new_key"]:
            problems.append(f"key rotation {i} malformed"); continue
        st = (f"aether.checkpoint-key-rotation.v1\n{r['tree_size']}\n{r['root_hash']}\n{r['rotated_at']}\n"
              f"{r['previous_key']}\n{r['new_key']}\n").encode()
        if r["previous_key"] != in_force: problems.append(f"key rotation {i} does not continue the chain")
        if not sm2_verify(r["previous_key"], st, r["signature"]) or not sm2_verify(r["new_key"], st, r["new_key_signature"]):
            problems.append(f"key rotation {i} signature")
        if (i and r["tree_size"] <= rots[i-1]["tree_size"]) or r["tree_size"] >= cps[-1]["tree_size"]:
            problems.append(f"key rotation {i} order")
        in_force = r["new_key"]
    def key_for(size):  # the key after every rotation made at a smaller tree size
        k = first
        for r in rots:
            if r["tree_size"] < size: k = r["new_key"]
        return k
    lineage = b.get("lineage")
    if lineage is not None and not (isinstance(lineage, list) and all(isinstance(r, dict) for r in lineage)):
        problems.append("lineage is not an array of objects")
    for i, c in enumerate(cps):
        if not isinstance(c["signed_at"], str) or not TIME.match(c["signed_at"]):
            problems.append(f"checkpoint {i} signed_at {c['signed_at']!r} not in the documented form"); continue
        st = f"aether.checkpoint.v1\n{c['tree_size']}\n{c['root_hash']}\n{c['signed_at']}\n".encode()
        k = key_for(c["tree_size"])
        if c["public_key"] != k or not sm2_verify(k, st, c["signature"]): problems.append(f"checkpoint {i} signature")
        if i and c["tree_size"] <= cps[i-1]["tree_size"]: problems.append(f"checkpoint {i} order")
    if len(b["consistency"]) != len(cps) - 1: problems.append("consistency count")
    for i, (c, p) in enumerate(zip(zip(cps, cps[1:]), b["consistency"])):
        old, new = c
        if (p["old_size"], p["new_size"]) != (old["tree_size"], new["tree_size"]) or not verify_consistency(
                old["tree_size"], new["tree_size"], h(old["root_hash"]), h(new["root_hash"]), [h(x) for x in p["proof"]]):
            problems.append(f"consistency {i}")
    anchor = cps[-1]
    prev = None
    streams = {}
    for e in b["events"]:
        s = e["seq"]
        for f in ("payload", "metadata"):
            v = json.loads(e[f], object_pairs_hook=no_dups)
            if not isinstance(v, dict) or jcs(v) != e[f]: problems.append(f"seq {s}: {f} not canonical")
        if str(uuid.UUID(e["event_id"])) != e["event_id"]: problems.append(f"seq {s}: event_id")
        if not TIME.match(e["recorded_at"]): problems.append(f"seq {s}: recorded_at")
        canonical = ('{"event_id":' + json.dumps(e["event_id"]) + ',"event_type":' + json.dumps(e["event_type"], ensure_ascii=False)
                     + ',"metadata":' + e["metadata"] + ',"payload":' + e["payload"] + ',"recorded_at":' + json.dumps(e["recorded_at"])
                     + f',"schema_version":{e["schema_version"]},"seq":{s},"stream_id":' + json.dumps(e["stream_id"], ensure_ascii=False)
                     + f',"stream_version":{e["stream_version"]}' + '}').encode("utf-8")
        if sm3(b"aether.event.v1" + h(e["prev_hash"]) + canonical) != h(e["hash"]): problems.append(f"seq {s}: hash")
        if not (1 <= s <= anchor["tree_size"]) or not verify_inclusion(h(e["hash"]), s - 1, anchor["tree_size"], [h(x) for x in e["inclusion_proof"]], h(anchor["root_hash"])):
            problems.append(f"seq {s}: inclusion")
        if s == 1 and e["prev_hash"] != "0" * 64: problems.append("seq 1: prev_hash")
        if prev is not None:
            if s <= prev["seq"]: problems.append(f"seq {s}: order")
            elif s == prev["seq"] + 1 and e["prev_hash"] != prev["hash"]: problems.append(f"seq {s}: link")
            if e["recorded_at"] < prev["recorded_at"]: problems.append(f"seq {s}: time")
        if e["stream_version"] < 1: problems.append(f"seq {s}: stream_version")
        if e["stream_id"] in streams:
            a, va = streams[e["stream_id"]]
            if not 0 < e["stream_version"] - va <= s - a: problems.append(f"seq {s}: stream_version")
        streams[e["stream_id"]] = (s, e["stream_version"])
        prev = e
    print("OK" if not problems else "FAILED", problems)
    return not problems

if __name__ == "__main__":
    sys.exit(0 if main(*sys.argv[1:]) else 1)
