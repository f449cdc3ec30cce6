// What the rollouts board shows, gathered from the control API (every reader) and, for
// regulators, from the ledger's rollout, analysis and snapshot events, cut at the time being
// viewed.
import { enc, get, withQuery } from './api.ts';
import type { LedgerEvent } from './verify.ts';

export interface Rollout {
  id: string;
  baseline: string;
  candidate: string;
  region: string;
  phase: string;
  candidate_weight: number;
  step_index: number | null;
  steps: number[];
  started_at: string;
  automated: boolean;
  fallback?: boolean;
}

export interface StageMetrics {
  requests?: number;
  error_rate?: number;
  latency_p50_us?: number;
  latency_p95_us?: number;
  latency_p99_us?: number;
  mean_confidence?: number;
  compliance_miss_rate?: number;
  saturation?: number;
}

/** One analysis check with the golden metrics of its window. */
export interface Check {
  seq: number;
  at: string;
  step: number | null;
  weight: number | null;
  gate: unknown;
  controller: string | null;
  agreement: number | null;
  baseline: StageMetrics | null;
  candidate: StageMetrics | null;
  drift: { score: number | null; tier: string | null } | null;
  risk: { risk: number | null; decision: string | null; sla_met: boolean | null } | null;
  significance: any;
}

export interface Rollback {
  seq: number;
  at: string;
  reason: string;
  snapshot: string;
  event: LedgerEvent;
}

export interface Board {
  rollout: Rollout;
  checks: Check[];
  /** [time ms, candidate weight %] in order. */
  weights: [number, number][];
  rollbacks: Rollback[];
  /** False when the golden metrics could not be read (an operator without the metrics). */
  metrics: boolean;
}

interface AnalysisCheck {
  seq: number;
  recorded_at: string;
  window_end: string;
  step: number | null;
  /** `"open"`, `"frozen"`, or `{"paused": {"reason": …}}`. */
  gate: unknown;
  weight: number | null;
  controller: string | null;
  significance?: unknown;
  // Members a service may add to each check: the window's metrics, risk and drift.
  metrics?: any;
  risk?: any;
  drift?: any;
}

const before = (t: string, asOf: string | null) => !asOf || Date.parse(t) <= Date.parse(asOf);

/** The ledger's events of one type on streams under a prefix (regulators), up to `asOf`. */
async function events(event_type: string, stream_prefix: string | null, asOf: string | null): Promise<LedgerEvent[]> {
  const out: LedgerEvent[] = [];
  let cursor: string | null = null;
  do {
    const page: { events: LedgerEvent[]; next_cursor: string | null } = await get(
      withQuery('/v1/audit/events', { event_type, stream_prefix, to: asOf, cursor, limit: 1000 }),
    );
    out.push(...page.events);
    cursor = page.next_cursor;
  } while (cursor && out.length < 5000);
  return out;
}

/** The gate as words: `open`, `frozen`, or `paused (<reason>)` (serde's tagged form). */
export function gateName(gate: unknown): string | null {
  if (gate === null || gate === undefined) return null;
  if (typeof gate === 'string') return gate;
  const [[kind, body]] = Object.entries(gate as Record<string, any>);
  const reason = body && typeof body === 'object' ? body.reason : null;
  return reason ? `${kind} (${String(reason).replaceAll('_', ' ')})` : kind;
}

function fromAssessed(c: AnalysisCheck, assessed: any, drift: any): Check {
  const m = c.metrics ?? assessed?.metrics;
  const r = c.risk ?? assessed?.risk;
  const d = c.drift ?? drift;
  return {
    seq: c.seq,
    at: c.window_end ?? c.recorded_at,
    step: c.step,
    weight: c.weight,
    gate: gateName(c.gate),
    controller: c.controller,
    agreement: m?.agreement?.jaccard ?? null,
    baseline: m?.baseline ?? null,
    candidate: m?.candidate ?? null,
    drift: d ? { score: d.report?.score ?? d.score ?? null, tier: d.tier ?? d.report?.tier ?? null } : null,
    risk: r ? { risk: r.risk ?? null, decision: r.decision ?? null, sla_met: r.sla?.met ?? null } : null,
    significance: c.significance ?? null,
  };
}

export async function rollouts(asOf: string | null, regulator: boolean): Promise<{ list: Rollout[]; past: boolean }> {
  if (asOf && regulator) {
    const s = await get<{ state: { rollouts: Rollout[] } }>(`/v1/audit/state?at=${enc(asOf)}`);
    return { list: s.state.rollouts ?? [], past: true };
  }
  const r = await get<{ rollouts: Rollout[] }>('/v1/rollouts');
  return { list: r.rollouts.filter((x) => before(x.started_at, asOf)), past: false };
}

/**
 * The rollout's rollbacks as an operator reads them (the audit API is the regulator's): the
 * rollbacks `/v1/snapshots` lists, each read by its seq from the ledger, this rollout's kept.
 */
async function operatorRollbacks(rollout: Rollout, asOf: string | null): Promise<Rollback[]> {
  const listed = await get<{ rollbacks: { seq: number; target_snapshot: string; reason: string }[] }>('/v1/snapshots');
  const read = await Promise.all(listed.rollbacks.filter((r) => r.seq > 0).map((r) => get<LedgerEvent>(`/v1/events/${r.seq}`)));
  return read
    .filter((e) => Date.parse(e.recorded_at) >= Date.parse(rollout.started_at) && before(e.recorded_at, asOf))
    .filter((e) => JSON.stringify(e.payload).includes(rollout.id))
    .map((e) => {
      const p = e.payload as any;
      return { seq: e.seq, at: e.recorded_at, reason: p.reason ?? '', snapshot: p.target_snapshot ?? '', event: e };
    });
}

export async function board(rollout: Rollout, asOf: string | null, regulator: boolean): Promise<Board> {
  const analysis = await get<{ checks: AnalysisCheck[] }>(`/v1/rollouts/${enc(rollout.id)}/analysis?limit=100`);
  const checks = analysis.checks.filter((c) => before(c.recorded_at, asOf)).reverse();
  let assessed = new Map<string, any>();
  let drifts = new Map<string, any>();
  let weights: [number, number][] = [];
  let rollbacks: Rollback[] = [];
  const stream = `analysis/${rollout.id}`;
  if (regulator) {
    const [a, d, steps, back] = await Promise.all([
      events('RolloutAssessed', stream, asOf),
      events('DriftAssessed', stream, asOf),
      get<{ events: LedgerEvent[] }>(withQuery('/v1/audit/events', { stream_prefix: `rollout/${rollout.id}`, to: asOf, limit: 1000 })),
      events('RolledBack', null, asOf),
    ]);
    // A window's assessment and drift report carry the window's end as `at`, like its check.
    assessed = new Map(a.map((e) => [(e.payload as any).at, e.payload]));
    drifts = new Map(d.map((e) => [(e.payload as any).at, e.payload]));
    for (const e of steps.events) {
      const p = e.payload as any;
      const w = e.event_type === 'RolloutStarted' ? 0 : (p.to_weight ?? p.weight ?? (e.event_type === 'RolloutPromoted' ? 100 : null));
      if (typeof w === 'number') weights.push([Date.parse(e.recorded_at), w]);
    }
    rollbacks = back
      .filter((e) => Date.parse(e.recorded_at) >= Date.parse(rollout.started_at))
      .filter((e) => JSON.stringify(e.payload).includes(rollout.id))
      .map((e) => {
        const p = e.payload as any;
        return { seq: e.seq, at: e.recorded_at, reason: p.reason ?? '', snapshot: p.target_snapshot ?? (e.metadata as any)?.snapshot_id ?? '', event: e };
      });
  }
  if (!regulator) rollbacks = await operatorRollbacks(rollout, asOf);
  const rows = checks.map((c) => fromAssessed(c, assessed.get(c.window_end), drifts.get(c.window_end)));
  if (!weights.length) weights = rows.filter((c) => c.weight !== null).map((c) => [Date.parse(c.at), c.weight!]);
  return { rollout, checks: rows, weights, rollbacks, metrics: rows.some((c) => c.candidate !== null) };
}
