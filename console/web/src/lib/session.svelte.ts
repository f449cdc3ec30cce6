// The signed-in session. The token is exchanged once for an HttpOnly cookie and then
// dropped; only the CSRF token is kept, in memory, and fetched again after a reload.
import { ApiError, request, setCsrf, whenUnauthorized } from './api.ts';
import { forgetKeys } from './proofs.ts';

export interface SessionInfo {
  role: 'operator' | 'regulator';
  actor: string;
  expires_at: string;
  csrf_token: string;
}

class Session {
  info = $state<SessionInfo | null>(null);
  /** False until the first GET /v1/session has answered. */
  known = $state(false);
  get regulator() {
    return this.info?.role === 'regulator';
  }
}

export const session = new Session();

function accept(info: SessionInfo | null) {
  setCsrf(info?.csrf_token ?? null);
  if (!info) forgetKeys();
  session.info = info;
  session.known = true;
}

whenUnauthorized(() => accept(null));

export async function loadSession() {
  try {
    accept(await (await request('GET', '/v1/session')).json());
  } catch (e) {
    if (e instanceof ApiError && (e.status === 401 || e.status === 404)) accept(null);
    else {
      session.known = true;
      throw e;
    }
  }
}

/** Exchanges `token` for the cookie; the caller clears its copy of the token. */
export async function signIn(token: string) {
  let res: Response;
  try {
    res = await fetch('/v1/session', {
      method: 'POST',
      headers: { Authorization: `Bearer ${token}` },
      credentials: 'same-origin',
    });
  } catch {
    throw new ApiError(0, 'Network error', 'the service could not be reached');
  }
  if (!res.ok) {
    let detail = `the service answered ${res.status}`;
    try {
      detail = (await res.json()).detail ?? detail;
    } catch {
      // keep the status
    }
    throw new ApiError(res.status, 'Sign-in failed', detail);
  }
  accept(await res.json());
}

export async function signOut() {
  try {
    await request('DELETE', '/v1/session');
  } finally {
    accept(null);
  }
}

/** Records a page view on the ledger (the server does so for regulators). */
export function recordView(path: string) {
  if (!session.info) return;
  request('POST', '/v1/session/views', { path }).catch(() => {
    // A view that cannot be recorded must not break the page; the server logs it.
  });
}
