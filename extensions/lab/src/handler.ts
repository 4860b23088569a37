/**
 * The REST client of the Danlu server extension: one method per endpoint of
 * `{base_url}danlu/api/`, all over one `request()` helper.
 *
 * Requests go through `ServerConnection.makeRequest` with the Jupyter server's
 * settings, so the browser's cookie and the XSRF header authenticate them; the
 * settings are copied without a token, so no `Authorization: token ...` header is
 * ever sent (the server extension holds the tokens and calls the jobs service and
 * MLflow itself). Errors become a `DanluError` carrying the server's `message`
 * and the HTTP status. Live logs use an `EventSource` (same-origin cookies).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';

import {
  ICullWarning,
  IExperiment,
  IJob,
  ILineage,
  IMetricHistory,
  IModelSummary,
  IModelVersion,
  IProfile,
  IQueue,
  IRun,
  ISweep,
  ISweepSummary,
  ITensorBoard,
  IWhoami
} from './tokens';

/** The root of the server extension's REST API, relative to the server's base URL. */
export const API_ROOT = 'danlu/api';

/** A failed call: `message` is the server's own sentence, `status` the HTTP status (0: no answer). */
export class DanluError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
    this.name = 'DanluError';
  }
}

/** Query values; an array repeats the key (`run_id=A&run_id=B`). */
export type Query = Record<string, string | string[] | undefined>;

/** Callbacks of a live log stream. */
export interface ILogHandlers {
  /** One log line (the stream starts with the log written so far). */
  onLine(line: string): void;
  /** The job has ended; the stream is closed. */
  onEnd?(state: string): void;
  /** The connection broke before the end; the stream is closed. */
  onError?(): void;
}

export namespace DanluService {
  export interface IOptions {
    /** The Jupyter server settings (the app's `serviceManager.serverSettings`). */
    serverSettings?: ServerConnection.ISettings;
    /** The EventSource class (tests replace it). */
    eventSource?: typeof EventSource;
  }
}

/** The `_xsrf` cookie Jupyter sets for the page, if any. */
export function xsrfCookie(): string | undefined {
  if (typeof document === 'undefined') {
    return undefined;
  }
  const match = document.cookie.match('\\b_xsrf=([^;]*)\\b');
  return match ? decodeURIComponent(match[1]) : undefined;
}

/** One method per endpoint of the server extension. */
export class DanluService {
  constructor(options: DanluService.IOptions = {}) {
    const base = options.serverSettings ?? ServerConnection.makeSettings();
    // Same base URL, fetch and init (credentials: same-origin), but never a token.
    this.serverSettings = ServerConnection.makeSettings({
      ...base,
      token: '',
      appendToken: false
    });
    this._eventSource = options.eventSource;
  }

  /** The settings every request uses: cookies + XSRF, no token. */
  readonly serverSettings: ServerConnection.ISettings;

  /** The absolute URL of an API path, with its query string. */
  url(path: string, query?: Query): string {
    const url = URLExt.join(this.serverSettings.baseUrl, API_ROOT, path);
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query ?? {})) {
      for (const v of Array.isArray(value) ? value : [value]) {
        if (v !== undefined) {
          params.append(key, v);
        }
      }
    }
    const qs = params.toString();
    return qs ? `${url}?${qs}` : url;
  }

  /**
   * The one request helper: JSON in, JSON out, errors as `DanluError`.
   */
  async request<T>(
    path: string,
    init: RequestInit = {},
    query?: Query
  ): Promise<T> {
    let response: Response;
    try {
      response = await ServerConnection.makeRequest(
        this.url(path, query),
        init,
        this.serverSettings
      );
    } catch (error) {
      throw new DanluError(
        `The Jupyter server did not answer (${(error as Error).message}).`,
        0
      );
    }
    const text = await response.text();
    let data: any = null;
    if (text) {
      try {
        data = JSON.parse(text);
      } catch {
        if (response.ok) {
          throw new DanluError(
            `The Danlu server extension sent something that is not JSON for ${path}.`,
            response.status
          );
        }
      }
    }
    if (!response.ok) {
      const message =
        data && typeof data.message === 'string' && data.message
          ? data.message
          : `The Danlu server extension answered ${response.status} ${response.statusText} for ${path}.`;
      throw new DanluError(message, response.status);
    }
    return data as T;
  }

  /** `GET whoami`: the user, whether they are an admin, and the hub's and MLflow's URLs. */
  whoami(): Promise<IWhoami> {
    return this.request<IWhoami>('whoami');
  }

  /** `GET profiles`: the governed profiles the user may run on, and the default one. */
  async profiles(): Promise<{ profiles: IProfile[]; default: string | null }> {
    const data = await this.request<any>('profiles');
    if (Array.isArray(data)) {
      return { profiles: data, default: null };
    }
    return { profiles: data?.profiles ?? [], default: data?.default ?? null };
  }

  /** `GET jobs`: this user's jobs, newest first. */
  async jobs(): Promise<IJob[]> {
    const data = await this.request<{ jobs: IJob[] }>('jobs');
    return data?.jobs ?? [];
  }

  /** `GET jobs/{id}`. */
  job(id: string): Promise<IJob> {
    return this.request<IJob>(`jobs/${encodeURIComponent(id)}`);
  }

  /** `POST jobs/{id}/cancel`. */
  cancel(id: string): Promise<IJob> {
    return this.request<IJob>(`jobs/${encodeURIComponent(id)}/cancel`, {
      method: 'POST'
    });
  }

  /** `GET jobs/{id}/output`: saves the executed notebook into the server root, returns its path. */
  output(id: string): Promise<{ path: string }> {
    return this.request<{ path: string }>(
      `jobs/${encodeURIComponent(id)}/output`
    );
  }

  /** `GET queues`: every team's queue with quota and usage (the admin's view). */
  async queues(): Promise<IQueue[]> {
    const data = await this.request<any>('queues');
    return (Array.isArray(data) ? data : data?.queues) ?? [];
  }

  /**
   * `GET servers/warnings`: this user's notebook servers that hold an idle GPU
   * and will be stopped soon. A jobs service (or server extension) older than
   * GPU-aware culling answers 404: that is no warnings, not an error.
   */
  async cullWarnings(): Promise<ICullWarning[]> {
    let data: { warnings?: ICullWarning[] } | null;
    try {
      data = await this.request<{ warnings?: ICullWarning[] }>(
        'servers/warnings'
      );
    } catch (error) {
      if (error instanceof DanluError && error.status === 404) {
        return [];
      }
      throw error;
    }
    return Array.isArray(data?.warnings) ? data.warnings : [];
  }

  /** `GET experiments`: MLflow experiments holding this user's runs. */
  async experiments(): Promise<IExperiment[]> {
    const data = await this.request<{ experiments: IExperiment[] }>(
      'experiments'
    );
    return data?.experiments ?? [];
  }

  /** `GET runs?experiment_id=X`: this user's runs of one experiment. */
  async runs(experimentId: string): Promise<IRun[]> {
    const data = await this.request<{ runs: IRun[] }>(
      'runs',
      {},
      {
        experiment_id: experimentId
      }
    );
    return data?.runs ?? [];
  }

  /** `GET metric-history?run_id=A&run_id=B&key=K`: one metric's points per run. */
  metricHistory(runIds: string[], key: string): Promise<IMetricHistory> {
    return this.request<IMetricHistory>(
      'metric-history',
      {},
      {
        run_id: runIds,
        key
      }
    );
  }

  /** `POST tensorboard`: a (reused) TensorBoard over these jobs' or runs' logs. */
  tensorboard(
    target: { job_ids: string[] } | { run_ids: string[] }
  ): Promise<ITensorBoard> {
    return this.request<ITensorBoard>('tensorboard', {
      method: 'POST',
      body: JSON.stringify(target)
    });
  }

  /** `POST models`: register the model (or artifacts) of a run as a new version of model `name`. */
  registerModel(runId: string, name: string): Promise<IModelVersion> {
    return this.request<IModelVersion>('models', {
      method: 'POST',
      body: JSON.stringify({ run_id: runId, name })
    });
  }

  /** `GET models`: the registered models, their latest version and aliases. */
  async models(): Promise<IModelSummary[]> {
    const data = await this.request<{ models: IModelSummary[] }>('models');
    return data?.models ?? [];
  }

  /** `GET lineage/models/{name}/{version}`: what made a model version, as a graph. */
  lineage(name: string, version: string | number): Promise<ILineage> {
    return this.request<ILineage>(
      `lineage/models/${encodeURIComponent(name)}/${encodeURIComponent(String(version))}`
    );
  }

  /** `GET sweeps`: this user's sweeps, newest first, without their trials. */
  async sweeps(): Promise<ISweepSummary[]> {
    const data = await this.request<{ sweeps: ISweepSummary[] }>('sweeps');
    return data?.sweeps ?? [];
  }

  /** `GET sweeps/{id}`: one sweep with its trials and best-so-far curve. */
  sweep(id: string): Promise<ISweep> {
    return this.request<ISweep>(`sweeps/${encodeURIComponent(id)}`);
  }

  /** `POST sweeps/{id}/stop`: the jobs service cancels its queued and running trials. */
  stopSweep(id: string): Promise<ISweep> {
    return this.request<ISweep>(`sweeps/${encodeURIComponent(id)}/stop`, {
      method: 'POST'
    });
  }

  /**
   * `GET jobs/{id}/logs/stream` as server-sent events: calls `onLine` per line,
   * `onEnd` when the job has ended. Dispose of the result to stop listening.
   */
  streamLogs(id: string, handlers: ILogHandlers): IDisposable {
    const Source = this._eventSource ?? EventSource;
    // An EventSource cannot send the X-XSRFToken header: Jupyter takes the
    // token from the `_xsrf` query argument instead.
    const xsrf = xsrfCookie();
    const source = new Source(
      this.url(
        `jobs/${encodeURIComponent(id)}/logs/stream`,
        xsrf ? { _xsrf: xsrf } : undefined
      )
    );
    let disposed = false;
    const close = () => {
      disposed = true;
      source.close();
    };
    source.onmessage = (event: MessageEvent) => {
      try {
        const data = JSON.parse(event.data);
        handlers.onLine(String(data.line ?? ''));
      } catch {
        handlers.onLine(String(event.data));
      }
    };
    source.addEventListener('end', (event: Event) => {
      let state = '';
      try {
        state = JSON.parse((event as MessageEvent).data).state ?? '';
      } catch {
        // an end without a state is still the end
      }
      close();
      handlers.onEnd?.(state);
    });
    // An EventSource reconnects by itself and the stream would start over with
    // the whole log: close instead, and let the view offer to reopen it.
    source.onerror = () => {
      if (!disposed) {
        close();
        handlers.onError?.();
      }
    };
    return {
      get isDisposed() {
        return disposed;
      },
      dispose: close
    };
  }

  private _eventSource: typeof EventSource | undefined;
}
