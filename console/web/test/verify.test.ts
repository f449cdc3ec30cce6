// The worked examples of services/ledger/HASHING.md and audit/BUNDLE.md, checked with the
// same module the page runs (compiled by tsc, run by `node --test`).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { sm } from '../src/lib/sm.ts';
import {
  bytesToHex, canonicalJson, checkpointProblem, eventHash, fingerprint, keyChain, keyFor,
  verifyConsistency, verifyEvent, verifyInclusion, type Checkpoint, type LedgerEvent,
} from '../src/lib/verify.ts';

const enc = new TextEncoder();
const KEY = '04ff59edbeba90a0ba3c16661cf2b15cbbe5ec8f815909e4987bfd4fa6391b04772cc5053294efeb854bdefbf702a53111072cd07377a27f9539711a3d2e18b01f';
const ROOT3 = 'bb8bafd0c57d52a2cc72612cb0a875a2efd7f849d1cbd5c9f8d1d02545580fc7';
const ROOT5 = '0a0061821c16c4db35b8f1b9cc7eb25038c575407725097bd230bdcb751cb46f';
const L3 = '1c98f26392549dac2ae032b29702123d938e597d2bc376a9a9b6f87ad705c512';
const N01 = '445981b0f26f50a2aca94a6b1cf05292a19b7a9c2f65f3111418f40af052e17f';
const L4 = '4cb40f9d9171d2a694b277115b54cf9634a50709f609cf645e415c258eebf7c4';
const CP5: Checkpoint = {
  tree_size: 5,
  root_hash: ROOT5,
  signed_at: '2026-11-30T09:30:06.000000Z',
  signature: 'a553f39eaedda34c2fae09f0e559c10cad5591d1badd0963a76cf13c574abf841ffa99f122041314028d3bdaf00b29178cfd675a768d67fd5c61ce4654119cc4',
  public_key: KEY,
};
const SEQ3: LedgerEvent = {
  seq: 3,
  stream_id: 'clearing/member-042',
  stream_version: 2,
  event_id: '01938a5c-7b2f-7000-8000-000000000003',
  event_type: 'ClearingDecided',
  schema_version: 1,
  payload: { amount_minor: 98000, currency: 'SGD', decision: 'refer', reason: 'limit "soft" breach' },
  metadata: { actor: 'gateway', trace_id: 'b7ad6b7169203331b7ad6b7169203331' },
  recorded_at: '2026-11-30T09:30:02.500000Z',
  prev_hash: '83762233e6d7cf1574819a771c0fdd27c0a823d3024922f0b5da2f7eeb42f4dd',
  hash: '805beeeb8c2341a9a1458d2756eb7f74d5d3f744ea07b898cfe0373482ef413f',
};
const PROOF3 = { leaf_index: 2, tree_size: 5, hashes: [L3, N01, L4], checkpoint: CP5 };

test('SM3 test vector', () => {
  assert.equal(bytesToHex(sm.sm3(enc.encode('abc'))), '66c7f0f462eeedd9d1f2d46bdc10e4e24167c4875cf2f7a2297da02b8f4ba8e0');
});

test('HASHING.md worked example 1', () => {
  const e: LedgerEvent = {
    seq: 1, stream_id: 'engine/sgp-region', stream_version: 1,
    event_id: '01938a5c-7b2e-7c3d-8e4f-5a6b7c8d9e0f', event_type: 'EngineActivationRequested', schema_version: 1,
    payload: { traffic_weight: 0.1, model_ref: 'finmoe-7b-v3@sgp-region', policy_hooks: ['aml_v2', 'basel3_delta'] },
    metadata: { actor: 'operator:alice', trace_id: '4bf92f3577b34da6a3ce929d0e0e4736' },
    recorded_at: '2026-11-30T09:30:00.123456Z', prev_hash: '0'.repeat(64), hash: '',
  };
  assert.equal(eventHash(sm, e), 'e979426a7ac2cf7d93df8a275b02e210aee6630aae23ee13fb46ac269eb2e16e');
});

test('HASHING.md worked example 2: escapes, non-ASCII, exponent, null', () => {
  const e: LedgerEvent = {
    seq: 2, stream_id: 'clearing/member-é"x"', stream_version: 7,
    event_id: '01938a5c-7b2f-7000-8000-000000000002', event_type: 'ClearingDecided', schema_version: 1,
    payload: JSON.parse('{"amount_minor": 125000000, "currency": "SGD", "note": "line\\nbreak \\u001f", "score": 1.0e-7, "z": null}'),
    metadata: {}, recorded_at: '2026-11-30T09:30:01.000000Z',
    prev_hash: 'a0d1f63b2a2d1c6b1f2b3b8c9d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a', hash: '',
  };
  assert.equal(canonicalJson(e.payload), '{"amount_minor":125000000,"currency":"SGD","note":"line\\nbreak \\u001f","score":1e-7,"z":null}');
  assert.equal(eventHash(sm, e), '1ec0df9b3e21147654db335b99b37d8735cdfc56714fa08ac6c68cf505d3a3d9');
});

test('BUNDLE.md: fingerprint and the anchor’s signature', () => {
  assert.equal(fingerprint(sm, KEY), '6feea29a1f59302398b98d3b80d791a19c4f4012a72054c3ed68f05e4cd02537');
  assert.equal(checkpointProblem(sm, CP5), null);
  assert.match(checkpointProblem(sm, { ...CP5, tree_size: 4 }) ?? '', /does not verify/);
  assert.match(checkpointProblem(sm, { ...CP5, signed_at: '2026-11-30T09:30:06Z' }) ?? '', /signed_at/);
  assert.match(checkpointProblem(sm, { ...CP5, signature: '0'.repeat(128) }) ?? '', /out of range/);
});

test('BUNDLE.md: inclusion of seqs 2, 3 and 5 in the tree of 5', () => {
  assert.ok(verifyInclusion(sm, SEQ3.hash, 2, 5, [L3, N01, L4], ROOT5));
  assert.ok(verifyInclusion(sm, '83762233e6d7cf1574819a771c0fdd27c0a823d3024922f0b5da2f7eeb42f4dd', 1, 5,
    ['4a3e3613247669180bcb9e9094e40a11c6df9e49a877b35ff0a54ac3cdba2098', 'a9a06d6b58a1fbbc7ce2cacbb19a9cba80759ad19b8946e19465a9442c806a0e', L4], ROOT5));
  assert.ok(verifyInclusion(sm, 'e96909cca1f5ef416b7d8400e98e93a6bc8c9fcb9397c79da902e07bf1c9e277', 4, 5,
    ['f6bac0c9d11dd0aa50755c493d724257645f89aa248116cf06cda26bf155edd5'], ROOT5));
  // A truncated, extended or altered proof fails.
  assert.ok(!verifyInclusion(sm, SEQ3.hash, 2, 5, [L3, N01], ROOT5));
  assert.ok(!verifyInclusion(sm, SEQ3.hash, 2, 5, [L3, N01, L4, L4], ROOT5));
  assert.ok(!verifyInclusion(sm, SEQ3.hash, 2, 5, [L3, N01, L4.replace('4c', '4d')], ROOT5));
  assert.ok(!verifyInclusion(sm, SEQ3.hash, 5, 5, [L3, N01, L4], ROOT5));
});

test('BUNDLE.md: consistency from 3 to 5', () => {
  const proof = ['36937a2359f0060408c6d8f32c3b6307a604f6cd18b762f6182835ac9e482258', L3, N01, L4];
  assert.ok(verifyConsistency(sm, 3, 5, ROOT3, ROOT5, proof));
  assert.ok(!verifyConsistency(sm, 3, 5, ROOT5, ROOT5, proof));
});

test('verifyEvent: the whole check of seq 3, and each way it fails', () => {
  assert.equal(eventHash(sm, SEQ3), SEQ3.hash);
  assert.deepEqual(verifyEvent(sm, SEQ3, PROOF3).ok, true);
  const no = (v: ReturnType<typeof verifyEvent>) => (v.ok ? '' : v.reason);
  assert.match(no(verifyEvent(sm, { ...SEQ3, payload: { ...(SEQ3.payload as object), amount_minor: 98001 } }, PROOF3)), /do not hash/);
  assert.match(no(verifyEvent(sm, SEQ3, { ...PROOF3, hashes: [L3, L3, L4] })), /inclusion proof/);
  assert.match(no(verifyEvent(sm, SEQ3, { ...PROOF3, checkpoint: { ...CP5, signed_at: '2026-11-30T09:30:07.000000Z' } })), /SM2/);
  assert.match(no(verifyEvent(sm, SEQ3, null)), /no signed checkpoint/);
  const other = '04' + 'ab'.repeat(64);
  assert.match(no(verifyEvent(sm, SEQ3, PROOF3, keyChain(sm, other, []))), /key the ledger/);
  assert.equal(verifyEvent(sm, SEQ3, PROOF3, keyChain(sm, KEY, [])).ok, true);
});

test('key chain: a rotation must name the key in force', () => {
  const chain = keyChain(sm, KEY, [{
    tree_size: 3, root_hash: ROOT3, rotated_at: '2026-11-30T09:30:03.000000Z',
    previous_key: '04' + '11'.repeat(64), new_key: KEY, signature: CP5.signature, new_key_signature: CP5.signature,
  }]);
  assert.match(chain.problem ?? '', /does not name the key in force/);
  assert.equal(keyFor(keyChain(sm, KEY, []), 5), KEY);
});
