// Proof checks in the browser, written from services/ledger/HASHING.md and audit/BUNDLE.md
// alone. Pure: the SM3/SM2 primitives come in as `Sm`, so the module is unit-tested in Node
// against the documents' worked examples and loaded lazily with sm-crypto-v2 in the page.

export interface Sm {
  /** SM3 digest of bytes. */
  sm3(data: Uint8Array): Uint8Array;
  /** SM2-with-SM3 verification, user id 1234567812345678, signature r‖s hex, SEC1 key hex. */
  sm2Verify(message: Uint8Array, signatureHex: string, publicKeyHex: string): boolean;
}

/** A ledger event as the API answers it (payload and metadata as parsed JSON). */
export interface LedgerEvent {
  seq: number;
  stream_id: string;
  stream_version: number;
  event_id: string;
  event_type: string;
  schema_version: number;
  payload: unknown;
  metadata: unknown;
  recorded_at: string;
  prev_hash: string;
  hash: string;
}

/** The payload of a `CheckpointSigned` event. */
export interface Checkpoint {
  tree_size: number;
  root_hash: string;
  signed_at: string;
  signature: string;
  public_key: string;
}

/** The payload of a `CheckpointKeyRotated` event. */
export interface KeyRotation {
  tree_size: number;
  root_hash: string;
  rotated_at: string;
  previous_key: string;
  new_key: string;
  signature: string;
  new_key_signature: string;
}

/** What the audit API returns as `inclusion_proof` (null when no checkpoint covers it yet). */
export interface InclusionProof {
  leaf_index: number;
  tree_size: number;
  hashes: string[];
  checkpoint: Checkpoint;
  checkpoint_seq?: number;
}

export type Verdict = { ok: true; detail: string } | { ok: false; reason: string };

const HASH_RE = /^[0-9a-f]{64}$/;
const KEY_RE = /^04[0-9a-f]{128}$/;
const SIG_RE = /^[0-9a-f]{128}$/;
// Six fractional digits and Z; second 60 (a leap second) is refused, as BUNDLE.md asks.
const TIME_RE = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:[0-5]\d\.\d{6}Z$/;
// Order of the SM2 group: r and s must lie in [1, q − 1] (BUNDLE.md V2).
const SM2_Q = BigInt('0xfffffffeffffffffffffffffffffffff7203df6b21c6052b53bbf40939d54123');

const utf8 = new TextEncoder();

export function hexToBytes(hex: string): Uint8Array {
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}

export function bytesToHex(bytes: Uint8Array): string {
  let s = '';
  for (const b of bytes) s += b.toString(16).padStart(2, '0');
  return s;
}

function concat(...parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/**
 * RFC 8785 text of a parsed JSON value. JSON.stringify already writes strings and numbers as
 * JCS wants (ECMAScript escapes and Number#toString); only member order has to be imposed,
 * and JS's default sort compares UTF-16 code units, which is JCS's order.
 */
export function canonicalJson(value: unknown): string {
  if (value === null || typeof value !== 'object') {
    if (typeof value === 'number' && !Number.isFinite(value)) throw new Error('non-finite number');
    return JSON.stringify(value);
  }
  if (Array.isArray(value)) return '[' + value.map(canonicalJson).join(',') + ']';
  const obj = value as Record<string, unknown>;
  const keys = Object.keys(obj).sort();
  return '{' + keys.map((k) => JSON.stringify(k) + ':' + canonicalJson(obj[k])).join(',') + '}';
}

/** The nine-member canonical object of HASHING.md, as text. */
export function eventCanonical(e: LedgerEvent): string {
  return canonicalJson({
    event_id: e.event_id,
    event_type: e.event_type,
    metadata: e.metadata,
    payload: e.payload,
    recorded_at: e.recorded_at,
    schema_version: e.schema_version,
    seq: e.seq,
    stream_id: e.stream_id,
    stream_version: e.stream_version,
  });
}

/** hash = SM3("aether.event.v1" ‖ prev_hash ‖ canonical), hex. */
export function eventHash(sm: Sm, e: LedgerEvent): string {
  const prev = e.seq === 1 ? new Uint8Array(32) : hexToBytes(e.prev_hash);
  return bytesToHex(sm.sm3(concat(utf8.encode('aether.event.v1'), prev, utf8.encode(eventCanonical(e)))));
}

export function leafHash(sm: Sm, hash: Uint8Array): Uint8Array {
  return sm.sm3(concat(Uint8Array.of(0), hash));
}

export function nodeHash(sm: Sm, left: Uint8Array, right: Uint8Array): Uint8Array {
  return sm.sm3(concat(Uint8Array.of(1), left, right));
}

/** RFC 9162 §2.1.3.2, exactly as BUNDLE.md V7 writes it. Attacker input: never throws. */
export function verifyInclusion(
  sm: Sm,
  hashHex: string,
  leafIndex: number,
  treeSize: number,
  proof: string[],
  rootHex: string,
): boolean {
  if (!HASH_RE.test(hashHex) || !HASH_RE.test(rootHex) || !proof.every((p) => HASH_RE.test(p))) return false;
  if (!Number.isSafeInteger(leafIndex) || !Number.isSafeInteger(treeSize) || leafIndex < 0) return false;
  if (leafIndex >= treeSize) return false;
  // BigInt keeps the shifts exact past 2^31.
  let fn = BigInt(leafIndex);
  let sn = BigInt(treeSize - 1);
  let r = leafHash(sm, hexToBytes(hashHex));
  for (const p of proof) {
    if (sn === 0n) return false;
    const pb = hexToBytes(p);
    if (fn % 2n === 1n || fn === sn) {
      r = nodeHash(sm, pb, r);
      if (fn % 2n === 0n) {
        while (fn % 2n === 0n && fn !== 0n) {
          fn >>= 1n;
          sn >>= 1n;
        }
      }
    } else {
      r = nodeHash(sm, r, pb);
    }
    fn >>= 1n;
    sn >>= 1n;
  }
  return sn === 0n && bytesToHex(r) === rootHex;
}

/** RFC 9162 §2.1.4.2, as BUNDLE.md V4 writes it (0 < m < n; m = n needs equal roots). */
export function verifyConsistency(
  sm: Sm,
  m: number,
  n: number,
  firstHex: string,
  secondHex: string,
  proof: string[],
): boolean {
  if (![firstHex, secondHex, ...proof].every((h) => HASH_RE.test(h))) return false;
  if (m === n) return proof.length === 0 && firstHex === secondHex;
  if (!Number.isSafeInteger(m) || !Number.isSafeInteger(n) || !(0 < m && m < n)) return false;
  if (proof.length === 0) return false;
  const bm = BigInt(m);
  let path = proof.map(hexToBytes);
  if ((bm & (bm - 1n)) === 0n) path = [hexToBytes(firstHex), ...path];
  let fn = bm - 1n;
  let sn = BigInt(n - 1);
  while (fn % 2n === 1n) {
    fn >>= 1n;
    sn >>= 1n;
  }
  let fr = path[0];
  let sr = path[0];
  for (const c of path.slice(1)) {
    if (sn === 0n) return false;
    if (fn % 2n === 1n || fn === sn) {
      fr = nodeHash(sm, c, fr);
      sr = nodeHash(sm, c, sr);
      if (fn % 2n === 0n) {
        while (fn % 2n === 0n && fn !== 0n) {
          fn >>= 1n;
          sn >>= 1n;
        }
      }
    } else {
      sr = nodeHash(sm, sr, c);
    }
    fn >>= 1n;
    sn >>= 1n;
  }
  return sn === 0n && bytesToHex(fr) === firstHex && bytesToHex(sr) === secondHex;
}

/** The four-line statement a checkpoint signs. */
export function checkpointStatement(cp: Checkpoint): string {
  return `aether.checkpoint.v1\n${cp.tree_size}\n${cp.root_hash}\n${cp.signed_at}\n`;
}

/** The six-line statement both keys of a rotation sign. */
export function rotationStatement(r: KeyRotation): string {
  return `aether.checkpoint-key-rotation.v1\n${r.tree_size}\n${r.root_hash}\n${r.rotated_at}\n${r.previous_key}\n${r.new_key}\n`;
}

/** SM2 over `statement`, with the form checks BUNDLE.md asks for first; null when valid. */
function signatureProblem(sm: Sm, statement: string, sig: string, key: string): string | null {
  if (!KEY_RE.test(key)) return 'the public key is not 65 bytes of SEC1 uncompressed lowercase hex';
  if (!SIG_RE.test(sig)) return 'the signature is not 64 bytes of lowercase hex';
  const r = BigInt('0x' + sig.slice(0, 64));
  const s = BigInt('0x' + sig.slice(64));
  if (r < 1n || r >= SM2_Q || s < 1n || s >= SM2_Q) return 'the signature’s r or s is out of range';
  try {
    return sm.sm2Verify(utf8.encode(statement), sig, key) ? null : 'the SM2 signature does not verify';
  } catch {
    return 'the public key is not a point on the SM2 curve';
  }
}

/** Checks a checkpoint's form and SM2 signature under its own key; null when valid. */
export function checkpointProblem(sm: Sm, cp: Checkpoint): string | null {
  if (!Number.isSafeInteger(cp.tree_size) || cp.tree_size < 1) return 'the checkpoint’s tree size is not a positive integer';
  if (!HASH_RE.test(cp.root_hash)) return 'the checkpoint’s root is not 64 lowercase hex digits';
  if (!TIME_RE.test(cp.signed_at)) return 'the checkpoint’s signed_at is not RFC 3339 UTC with six fractional digits';
  const bad = signatureProblem(sm, checkpointStatement(cp), cp.signature, cp.public_key);
  return bad && `checkpoint: ${bad}`;
}

/** SM3 of the key's SEC1 bytes, hex (BUNDLE.md "Key fingerprint"). */
export function fingerprint(sm: Sm, publicKeyHex: string): string {
  return bytesToHex(sm.sm3(hexToBytes(publicKeyHex)));
}

/** The keys in force: `[{key, after}]` where `key` signs trees larger than `after`. */
export interface KeyChain {
  keys: { key: string; after: number }[];
  problem: string | null;
}

/**
 * Follows the ledger's key rotations from its first checkpoint key (HASHING.md "Rotating the
 * checkpoint key", BUNDLE.md V1a): each must name the key in force, verify under both keys
 * and come at a larger tree size than the one before.
 */
export function keyChain(sm: Sm, firstKey: string, rotations: KeyRotation[]): KeyChain {
  const keys = [{ key: firstKey, after: 0 }];
  for (const r of rotations) {
    const current = keys[keys.length - 1];
    const where = `key rotation at tree size ${r.tree_size}`;
    if (r.previous_key !== current.key) return { keys, problem: `${where} does not name the key in force` };
    if (r.previous_key === r.new_key) return { keys, problem: `${where} keeps the same key` };
    if (!TIME_RE.test(r.rotated_at)) return { keys, problem: `${where} has a malformed time` };
    if (!(r.tree_size > current.after)) return { keys, problem: `${where} is not after the previous rotation` };
    const statement = rotationStatement(r);
    const old = signatureProblem(sm, statement, r.signature, r.previous_key);
    if (old) return { keys, problem: `${where}, previous key: ${old}` };
    const neu = signatureProblem(sm, statement, r.new_key_signature, r.new_key);
    if (neu) return { keys, problem: `${where}, new key: ${neu}` };
    keys.push({ key: r.new_key, after: r.tree_size });
  }
  return { keys, problem: null };
}

/** The key that must sign a checkpoint of `treeSize` events, per the chain. */
export function keyFor(chain: KeyChain, treeSize: number): string {
  let key = chain.keys[0].key;
  for (const k of chain.keys) if (treeSize > k.after) key = k.key;
  return key;
}

/**
 * The whole check of one event against the latest signed checkpoint: the fields re-hash to
 * `hash`, `hash` is leaf `seq − 1` of the checkpoint's tree, the checkpoint is signed by its
 * key, and (when the ledger's key chain is known) that key is the one in force.
 */
export function verifyEvent(
  sm: Sm,
  event: LedgerEvent,
  proof: InclusionProof | null | undefined,
  chain?: KeyChain | null,
): Verdict {
  if (!proof) return { ok: false, reason: 'no signed checkpoint covers this event yet' };
  if (!HASH_RE.test(event.hash) || (event.seq > 1 && !HASH_RE.test(event.prev_hash))) {
    return { ok: false, reason: 'the event’s hashes are not 64 lowercase hex digits' };
  }
  let recomputed: string;
  try {
    recomputed = eventHash(sm, event);
  } catch {
    return { ok: false, reason: 'the event’s fields cannot be canonicalized' };
  }
  if (recomputed !== event.hash) return { ok: false, reason: 'the event’s fields do not hash to its hash' };
  const cp = proof.checkpoint;
  if (proof.leaf_index !== event.seq - 1) return { ok: false, reason: 'the proof is for another leaf' };
  if (proof.tree_size !== cp.tree_size) return { ok: false, reason: 'the proof is for another tree size than the checkpoint' };
  if (!verifyInclusion(sm, event.hash, proof.leaf_index, cp.tree_size, proof.hashes, cp.root_hash)) {
    return { ok: false, reason: 'the inclusion proof does not lead to the checkpoint’s root' };
  }
  const bad = checkpointProblem(sm, cp);
  if (bad) return { ok: false, reason: bad };
  if (chain) {
    if (chain.problem) return { ok: false, reason: chain.problem };
    if (cp.public_key !== keyFor(chain, cp.tree_size)) {
      return { ok: false, reason: 'the checkpoint is signed by a key the ledger’s key events do not name' };
    }
  }
  return {
    ok: true,
    detail: `seq ${event.seq} is in the tree of ${cp.tree_size} events signed at ${cp.signed_at}`,
  };
}
