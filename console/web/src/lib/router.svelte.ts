// A small History-API router under /ui/: the path picks the page, the query carries its
// state (node, depth, asOf, filters) so that every view is a shareable URL.
export const BASE = '/ui';

class Route {
  path = $state('/');
  query = $state(new URLSearchParams());
  /** The full location, for page-view records. */
  href = $state('');
}

export const route = new Route();

function read() {
  const p = location.pathname;
  route.path = p.startsWith(BASE) ? p.slice(BASE.length) || '/' : p;
  route.query = new URLSearchParams(location.search);
  route.href = location.pathname + location.search;
}

read();
addEventListener('popstate', read);

/** Goes to a console URL (`/ui/...`), adding a history entry unless `replace`. */
export function navigate(to: string, replace = false) {
  if (to === location.pathname + location.search) return;
  history[replace ? 'replaceState' : 'pushState'](null, '', to);
  read();
}

/** The current URL with some query parameters changed (null removes one). */
export function withParams(changes: Record<string, string | null>): string {
  const q = new URLSearchParams(location.search);
  for (const [k, v] of Object.entries(changes)) {
    if (v === null || v === '') q.delete(k);
    else q.set(k, v);
  }
  const s = q.toString();
  return location.pathname + (s ? `?${s}` : '');
}

/** Link targets, in one place so pages agree on them. */
export const links = {
  namespace: (ns: string) => `${BASE}/namespace?ns=${encodeURIComponent(ns)}`,
  job: (ns: string, name: string) => `${BASE}/job?${new URLSearchParams({ ns, name })}`,
  dataset: (ns: string, name: string) => `${BASE}/dataset?${new URLSearchParams({ ns, name })}`,
  node: (id: string) => {
    const [kind, ...rest] = splitNode(id);
    return kind === 'job' ? links.job(rest[0], rest[1]) : links.dataset(rest[0], rest[1]);
  },
  lineage: (node: string, asOf?: string | null) =>
    `${BASE}/lineage?${new URLSearchParams(asOf ? { node, asOf } : { node })}`,
  run: (id: string) => `${BASE}/run?id=${encodeURIComponent(id)}`,
  event: (seq: number | string) => `${BASE}/events/${seq}`,
  decision: (id: string) => `${BASE}/decisions/${encodeURIComponent(id)}`,
  timeline: (params: Record<string, string>) => `${BASE}/timeline?${new URLSearchParams(params)}`,
};

/**
 * `job:<ns>:<name>` → ['job', ns, name]. Namespaces may hold colons (`aether://policy`), names
 * in Aether's graph hold none, so split at the last colon; pages that have the node's data
 * use its `namespace` and `name` instead.
 */
export function splitNode(id: string): [string, string, string] {
  const kind = id.slice(0, id.indexOf(':'));
  const rest = id.slice(kind.length + 1);
  const cut = rest.lastIndexOf(':');
  return [kind, rest.slice(0, cut), rest.slice(cut + 1)];
}

export function nodeId(kind: 'job' | 'dataset', ns: string, name: string) {
  return `${kind}:${ns}:${name}`;
}
