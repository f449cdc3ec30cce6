// Search: the service's /api/v1/search when it has it, else the namespaces, jobs and
// datasets listed once and matched here (older services answer 404 there).
import { ApiError, enc, get } from './api.ts';
import { links } from './router.svelte.ts';

export interface Hit {
  type: 'JOB' | 'DATASET' | 'RUN' | 'EVENT_TYPE' | 'REQUEST' | 'NAMESPACE';
  name: string;
  namespace?: string;
  nodeId?: string | null;
  updatedAt?: string | null;
  seq?: number | null;
  requestId?: string | null;
}

let fallback: Promise<Hit[]> | null = null;
let serverHasSearch = true;

async function everything(): Promise<Hit[]> {
  const { namespaces } = await get<{ namespaces: { name: string }[] }>('/api/v1/namespaces?limit=1000');
  const hits: Hit[] = namespaces.map((n) => ({ type: 'NAMESPACE', name: n.name, namespace: n.name }));
  await Promise.all(
    namespaces.map(async (n) => {
      const [jobs, datasets] = await Promise.all([
        get<{ jobs: { name: string; updatedAt: string }[] }>(`/api/v1/namespaces/${enc(n.name)}/jobs?limit=1000`),
        get<{ datasets: { name: string; updatedAt: string }[] }>(`/api/v1/namespaces/${enc(n.name)}/datasets?limit=1000`),
      ]);
      for (const j of jobs.jobs) hits.push({ type: 'JOB', name: j.name, namespace: n.name, nodeId: `job:${n.name}:${j.name}`, updatedAt: j.updatedAt });
      for (const d of datasets.datasets) hits.push({ type: 'DATASET', name: d.name, namespace: n.name, nodeId: `dataset:${n.name}:${d.name}`, updatedAt: d.updatedAt });
    }),
  );
  return hits;
}

export async function search(q: string, limit = 10): Promise<{ total: number; hits: Hit[] }> {
  if (serverHasSearch) {
    try {
      const r = await get<{ totalCount: number; results: Hit[] }>(`/api/v1/search?q=${enc(q)}&limit=${limit}`);
      return { total: r.totalCount, hits: r.results };
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 404)) throw e;
      serverHasSearch = false;
    }
  }
  fallback ??= everything().catch((e) => {
    fallback = null;
    throw e;
  });
  const needle = q.toLowerCase();
  const found = (await fallback).filter((h) => `${h.namespace ?? ''} ${h.name}`.toLowerCase().includes(needle));
  return { total: found.length, hits: found.slice(0, limit) };
}

/** Where a hit leads. */
export function hitLink(h: Hit): string {
  switch (h.type) {
    case 'JOB':
      return links.job(h.namespace ?? '', h.name);
    case 'DATASET':
      return links.dataset(h.namespace ?? '', h.name);
    case 'NAMESPACE':
      return links.namespace(h.name);
    case 'RUN':
      return links.run(h.name);
    case 'EVENT_TYPE':
      return links.timeline({ event_type: h.name });
    case 'REQUEST':
      return links.decision(h.requestId ?? h.name);
  }
}

export const typeLabel: Record<Hit['type'], string> = {
  JOB: 'job',
  DATASET: 'dataset',
  NAMESPACE: 'namespace',
  RUN: 'run',
  EVENT_TYPE: 'event type',
  REQUEST: 'request',
};
