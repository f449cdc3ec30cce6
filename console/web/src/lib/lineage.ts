// Reads of the Marquez-shaped lineage API, with the time being viewed (asOf) applied.
import { ApiError, enc, get, withQuery } from './api.ts';

export interface Edge { origin: string; destination: string }
export interface RunJson {
  id: string;
  state: string;
  createdAt: string;
  updatedAt: string;
  startedAt: string | null;
  endedAt: string | null;
  durationMs: number | null;
  facets?: Record<string, any>;
  inputVersions?: { namespace: string; name: string; version: string | null }[];
  outputVersions?: { namespace: string; name: string; version: string | null }[];
  jobVersion?: { namespace: string; name: string } | null;
}
export interface NodeData {
  id: { namespace: string; name: string };
  name: string;
  namespace: string;
  type: string;
  createdAt: string;
  updatedAt: string;
  description?: string | null;
  facets: Record<string, any>;
  inputs?: { namespace: string; name: string }[];
  outputs?: { namespace: string; name: string }[];
  latestRun?: RunJson | null;
  fields?: { name: string; type: string | null; description: string | null }[];
  currentVersion?: string | null;
}
export interface GraphNode { id: string; type: 'JOB' | 'DATASET'; data: NodeData | null; inEdges: Edge[]; outEdges: Edge[] }

/** The aether_ledger run facet: where a run's event sits in the ledger. */
export interface LedgerFacet {
  seq: number;
  hash: string;
  prev_hash: string;
  stream_id: string;
  event_type: string;
  snapshot_id?: string;
  trace_id?: string;
}

export function lineage(nodeId: string, depth: number, asOf: string | null) {
  return get<{ graph: GraphNode[] }>(withQuery('/api/v1/lineage', { nodeId, depth, asOf }));
}

/** One node's data as of a time (the graph at depth 0 holds just it). */
export async function node(nodeId: string, asOf: string | null): Promise<GraphNode> {
  const g = await lineage(nodeId, 0, asOf);
  const n = g.graph.find((x) => x.id === nodeId);
  if (!n) throw new ApiError(404, 'No such node', `no node ${nodeId}`);
  return n;
}

export const run = (id: string) => get<RunJson>(`/api/v1/jobs/runs/${enc(id)}`);

/**
 * A job's runs, newest first: Marquez's runs route where the service has it, else the job's
 * latest run alone (`complete` false).
 */
export async function jobRuns(ns: string, name: string, latest: RunJson | null | undefined) {
  try {
    const r = await get<{ runs: RunJson[] }>(`/api/v1/namespaces/${enc(ns)}/jobs/${enc(name)}/runs?limit=100`);
    return { runs: r.runs, complete: true };
  } catch (e) {
    if (!(e instanceof ApiError && (e.status === 404 || e.status === 405))) throw e;
    return { runs: latest ? [latest] : [], complete: false };
  }
}

export interface DatasetVersion { version: string; createdAt: string; createdByRun: { id: string } | null; facets?: Record<string, unknown> }

export const datasetVersions = (ns: string, name: string) =>
  get<{ versions: DatasetVersion[]; totalCount: number }>(`/api/v1/namespaces/${enc(ns)}/datasets/${enc(name)}/versions?limit=100`);

/** The ledger facet of a run, if its events carry one. */
export function ledgerFacet(r: RunJson | null | undefined): LedgerFacet | null {
  const f = r?.facets?.aether_ledger;
  return f && typeof f.seq === 'number' ? (f as LedgerFacet) : null;
}

/** One decision of a scoring batch, from the aether_clearing_batch run facet. */
export interface BatchDecision { seq: number; hash: string; stream_id: string; event_id: string; request_id?: string; trace_id?: string }

/** The decisions of a `clearing.batch` run (one run per scoring batch), if it is one. */
export function batchDecisions(r: RunJson | null | undefined): BatchDecision[] | null {
  const d = r?.facets?.aether_clearing_batch?.decisions;
  return Array.isArray(d) ? (d as BatchDecision[]) : null;
}

/** Whether something made at `t` existed at `asOf` (always, when live). */
export const existed = (t: string | null | undefined, asOf: string | null) => !asOf || !t || Date.parse(t) <= Date.parse(asOf);
