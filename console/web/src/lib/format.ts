// Small display helpers shared by the pages.

/** An RFC 3339 time shown in UTC, to the second, unambiguous for people in any zone. */
export function when(t: string | null | undefined): string {
  if (!t) return '—';
  const d = new Date(t);
  if (Number.isNaN(d.getTime())) return t;
  return d.toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
}

/** How long ago, in words a person reads at a glance. */
export function ago(t: string | number, now = Date.now()): string {
  const s = Math.round((now - (typeof t === 'number' ? t : Date.parse(t))) / 1000);
  if (s < 0) return 'in the future';
  if (s < 90) return `${s} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 172800) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} days ago`;
}

export function short(hash: string | null | undefined, n = 12): string {
  return hash ? (hash.length > n ? hash.slice(0, n) + '…' : hash) : '—';
}

export function num(x: unknown, digits = 3): string {
  return typeof x === 'number' ? (Number.isInteger(x) ? String(x) : x.toFixed(digits)) : x == null ? '—' : String(x);
}

/** ISO time with the seconds, as the API's asOf/at parameters take it. */
export function iso(ms: number): string {
  return new Date(ms).toISOString().replace(/\.\d{3}Z$/, 'Z');
}
