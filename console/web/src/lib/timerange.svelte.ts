// The span of time the lineage covers (first to last event), for the time control: read from
// the namespaces' createdAt/updatedAt, which every reader (operator or regulator) may list.
import { get } from './api.ts';

interface Namespace { name: string; createdAt: string; updatedAt: string }

class TimeRange {
  first = $state<number | null>(null);
  last = $state<number | null>(null);
}

export const range = new TimeRange();

export async function loadRange() {
  const { namespaces } = await get<{ namespaces: Namespace[] }>('/api/v1/namespaces?limit=1000');
  const starts = namespaces.map((n) => Date.parse(n.createdAt)).filter(Number.isFinite);
  const ends = namespaces.map((n) => Date.parse(n.updatedAt)).filter(Number.isFinite);
  range.first = starts.length ? Math.min(...starts) : null;
  range.last = ends.length ? Math.max(...ends) : null;
}
