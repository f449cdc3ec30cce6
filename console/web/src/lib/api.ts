// Every call to the service goes through here: the session cookie only (never a bearer
// token), the CSRF token on writes, and problem+json errors turned into their `detail`.

export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly title: string,
    detail: string,
  ) {
    super(detail);
  }
}

let csrf: string | null = null;
/** Called when the service says the session is gone, so the shell can ask to sign in. */
let onUnauthorized: () => void = () => {};

export function setCsrf(token: string | null) {
  csrf = token;
}

export function whenUnauthorized(f: () => void) {
  onUnauthorized = f;
}

async function problem(res: Response): Promise<ApiError> {
  let title = res.statusText || 'Error';
  let detail = `the service answered ${res.status}`;
  try {
    const body = await res.json();
    if (typeof body?.title === 'string') title = body.title;
    if (typeof body?.detail === 'string') detail = body.detail;
  } catch {
    // Not JSON (a proxy's page): keep the status line rather than show its text.
  }
  return new ApiError(res.status, title, detail);
}

export async function request(method: string, path: string, body?: unknown): Promise<Response> {
  const headers: Record<string, string> = {};
  if (method !== 'GET' && csrf) headers['X-CSRF-Token'] = csrf;
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let res: Response;
  try {
    res = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: 'same-origin',
    });
  } catch {
    throw new ApiError(0, 'Network error', 'the service could not be reached');
  }
  if (!res.ok) {
    const err = await problem(res);
    // The session routes answer 401 themselves; elsewhere a 401 means the cookie expired.
    if (res.status === 401 && !path.startsWith('/v1/session')) onUnauthorized();
    throw err;
  }
  return res;
}

export async function get<T>(path: string): Promise<T> {
  return (await request('GET', path)).json() as Promise<T>;
}

/** `path?k=v&…`, leaving out empty values. */
export function withQuery(path: string, params: Record<string, string | number | null | undefined>): string {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== '') q.set(k, String(v));
  const s = q.toString();
  return s ? `${path}?${s}` : path;
}

export const enc = encodeURIComponent;
