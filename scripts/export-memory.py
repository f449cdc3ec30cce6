#!/usr/bin/env python3
"""Peak memory of a running `aether serve` (SQLite, embedded defaults) over one evidence export
of 100,000 events and over three asked at once (BENCHMARKS.md, "Audit: inclusion proofs and
evidence exports"). Usage: scripts/export-memory.py target/release/aether [EVENTS]"""
# Peak memory of `aether serve` over one 100,000-event export and over three at once.
import json, os, subprocess, sys, time, urllib.request, threading, tempfile, re
BIN = sys.argv[1]
EVENTS = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
data = tempfile.mkdtemp(prefix="expmem-")
env = dict(os.environ, AETHER_TOKENS="operator:op-token-0123456789abcdef,regulator:rg-token-0123456789abcdef,regulator:rg2-token-0123456789abcdef",
           AETHER_LOG="warn", AETHER_CHECKPOINT_EVERY_EVENTS="5000")
env.pop("DATABASE_URL", None)
p = subprocess.Popen([BIN, "serve", "--data-dir", data, "--listen", "127.0.0.1:18099", "--grpc-listen", "127.0.0.1:0"],
                     env=env, stdout=subprocess.PIPE, stderr=open(data + ".log", "w"), text=True)
for line in p.stdout:
    if line.startswith("aether clearing on"):
        break
base = "http://127.0.0.1:18099"
def req(path, token, body=None):
    r = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                               headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"},
                               method="POST" if body is not None else "GET")
    return urllib.request.urlopen(r, timeout=600)
def hwm():
    s = open(f"/proc/{p.pid}/status").read()
    return int(re.search(r"VmHWM:\s+(\d+)", s).group(1)) // 1024, int(re.search(r"VmRSS:\s+(\d+)", s).group(1)) // 1024
t = time.time()
for b in range(EVENTS // 1000):
    evs = [{"event_type": "TradeBooked", "payload": {"n": b * 1000 + i, "note": "x" * 200}, "metadata": {"member": "m-bulk"}} for i in range(1000)]
    req("/v1/events", "op-token-0123456789abcdef", {"stream_id": f"trades/m-{b % 16}", "events": evs}).read()
print(f"filled {EVENTS} events in {time.time()-t:.1f} s; memory after the fill: peak {hwm()[0]} MiB, now {hwm()[1]} MiB")
while True:
    cps = json.load(req("/v1/audit/checkpoints", "rg-token-0123456789abcdef"))["checkpoints"]
    if cps and cps[-1]["checkpoint"]["tree_size"] >= EVENTS:
        break
    time.sleep(0.5)
# Reset the high-water mark so the export's own peak is measured.
open(f"/proc/{p.pid}/clear_refs", "w").write("5")
base_rss = hwm()[1]
def export(token, out):
    t = time.time()
    r = req("/v1/audit/exports", token, {"member": "m-bulk", "limit": 100000})
    n = 0
    while True:
        c = r.read(1 << 20)
        if not c: break
        n += len(c)
    out.append((n, time.time() - t))
out = []
export("rg-token-0123456789abcdef", out)
print(f"one export: {out[0][0]/2**20:.1f} MiB in {out[0][1]:.1f} s; server memory before {base_rss} MiB, peak during {hwm()[0]} MiB")
open(f"/proc/{p.pid}/clear_refs", "w").write("5")
base_rss = hwm()[1]
out = []; errs = []
def try_export(tok):
    try: export(tok, out)
    except Exception as e: errs.append(str(e))
ts = [threading.Thread(target=try_export, args=(tok,)) for tok in ["rg-token-0123456789abcdef", "rg2-token-0123456789abcdef", "rg-token-0123456789abcdef"]]
[x.start() for x in ts]; [x.join() for x in ts]
print(f"three at once (two regulators, one twice): {len(out)} served, refused {errs}; server memory before {base_rss} MiB, peak during {hwm()[0]} MiB")
p.terminate(); p.wait()
