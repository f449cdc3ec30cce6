// Proofs as the pages use them: the crypto is loaded on first use, the ledger's key chain
// is read once per session, and every event is checked by verify.ts.
import { get } from './api.ts';
import {
  fingerprint, keyChain, keyFor, verifyEvent, checkpointProblem,
  type Checkpoint, type InclusionProof, type KeyChain, type KeyRotation, type LedgerEvent, type Sm, type Verdict,
} from './verify.ts';

let smLoaded: Promise<Sm> | null = null;
export const loadSm = () => (smLoaded ??= import('./sm.ts').then((m) => m.sm));

let chainLoaded: Promise<KeyChain | null> | null = null;

/**
 * The ledger's checkpoint keys: the first checkpoint's key, then each CheckpointKeyRotated
 * (regulator only). Null when there is no checkpoint yet.
 */
export function ledgerKeys(): Promise<KeyChain | null> {
  chainLoaded ??= (async () => {
    const sm = await loadSm();
    const first = await get<{ checkpoints: { checkpoint: Checkpoint }[] }>('/v1/audit/checkpoints?limit=1');
    if (!first.checkpoints.length) return null;
    const rotations: KeyRotation[] = [];
    let cursor: string | null = null;
    do {
      const page: { events: LedgerEvent[]; next_cursor: string | null } = await get(
        `/v1/audit/events?event_type=CheckpointKeyRotated&stream_prefix=ledger/checkpoint-keys&limit=1000${cursor ? `&cursor=${cursor}` : ''}`,
      );
      rotations.push(...page.events.map((e) => e.payload as KeyRotation));
      cursor = page.next_cursor;
    } while (cursor);
    return keyChain(sm, first.checkpoints[0].checkpoint.public_key, rotations);
  })().catch((e) => {
    chainLoaded = null;
    throw e;
  });
  return chainLoaded;
}

/** Forgets what was read for the signed-in user (on sign-out). */
export function forgetKeys() {
  chainLoaded = null;
}

export interface Checked {
  verdict: Verdict;
  checkpoint?: Checkpoint;
  fingerprint?: string;
}

/** Checks an audit answer's `{event, inclusion_proof}` in the page. */
export async function checkEvent(event: LedgerEvent, proof: InclusionProof | null): Promise<Checked> {
  const sm = await loadSm();
  let chain: KeyChain | null = null;
  try {
    chain = await ledgerKeys();
  } catch {
    // Without the key events the proof is still checked against its own key, and the
    // fingerprint is shown for comparison.
  }
  const verdict = verifyEvent(sm, event, proof, chain);
  const cp = proof?.checkpoint;
  return { verdict, checkpoint: cp, fingerprint: cp && /^04[0-9a-f]{128}$/.test(cp.public_key) ? fingerprint(sm, cp.public_key) : undefined };
}

/** A checkpoint on its own (the integrity panel): its signature and that its key is in force. */
export async function checkCheckpoint(cp: Checkpoint): Promise<Checked> {
  const sm = await loadSm();
  const fp = /^04[0-9a-f]{128}$/.test(cp.public_key) ? fingerprint(sm, cp.public_key) : undefined;
  const bad = checkpointProblem(sm, cp);
  if (bad) return { verdict: { ok: false, reason: bad }, checkpoint: cp, fingerprint: fp };
  const chain = await ledgerKeys().catch(() => null);
  if (chain?.problem) return { verdict: { ok: false, reason: chain.problem }, checkpoint: cp, fingerprint: fp };
  if (chain && keyFor(chain, cp.tree_size) !== cp.public_key) {
    return { verdict: { ok: false, reason: 'signed by a key the ledger’s key events do not name' }, checkpoint: cp, fingerprint: fp };
  }
  return { verdict: { ok: true, detail: `signature valid for ${cp.tree_size} events` }, checkpoint: cp, fingerprint: fp };
}

export type { LedgerEvent, InclusionProof, Checkpoint };
