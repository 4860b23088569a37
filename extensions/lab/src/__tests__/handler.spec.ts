/**
 * DanluService: URLs, JSON, error mapping, and the authentication it sends
 * (the XSRF cookie as a header, never an Authorization token).
 */
import { PageConfig } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { DanluError, DanluService } from '../handler';

const BASE = 'http://localhost/user/alice/';

type FetchMock = jest.Mock<Promise<Response>, [Request]>;

function respond(status: number, body: unknown, statusText = ''): FetchMock {
  return jest.fn(async (_request: Request) => {
    const text = typeof body === 'string' ? body : JSON.stringify(body);
    return new Response(text, { status, statusText });
  });
}

function service(fetch: FetchMock, token = 'secret-token'): DanluService {
  const serverSettings = ServerConnection.makeSettings({
    baseUrl: BASE,
    token,
    fetch: fetch as unknown as typeof window.fetch
  });
  return new DanluService({ serverSettings });
}

function sent(fetch: FetchMock, call = 0): Request {
  return fetch.mock.calls[call][0];
}

describe('DanluService', () => {
  beforeEach(() => {
    document.cookie = '_xsrf=xsrf-cookie-value';
  });

  describe('URLs', () => {
    it('puts every path under {base_url}danlu/api/', async () => {
      const fetch = respond(200, { jobs: [] });
      await service(fetch).jobs();
      const url = new URL(sent(fetch).url);
      expect(url.origin + url.pathname).toBe(`${BASE}danlu/api/jobs`);
      expect(sent(fetch).method).toBe('GET');
    });

    it('encodes job ids as one path segment', async () => {
      const fetch = respond(200, { id: 'a/b' });
      await service(fetch).job('a/b');
      expect(new URL(sent(fetch).url).pathname).toBe(
        '/user/alice/danlu/api/jobs/a%2Fb'
      );
    });

    it('repeats run_id in the metric-history query', async () => {
      const fetch = respond(200, { key: 'loss', series: [] });
      await service(fetch).metricHistory(['r1', 'r2'], 'loss');
      const url = new URL(sent(fetch).url);
      expect(url.pathname).toBe('/user/alice/danlu/api/metric-history');
      expect(url.searchParams.getAll('run_id')).toEqual(['r1', 'r2']);
      expect(url.searchParams.get('key')).toBe('loss');
    });

    it('passes experiment_id to runs', async () => {
      const fetch = respond(200, { runs: [] });
      await service(fetch).runs('7 & 8');
      const url = new URL(sent(fetch).url);
      expect(url.pathname).toBe('/user/alice/danlu/api/runs');
      expect(url.searchParams.get('experiment_id')).toBe('7 & 8');
    });

    it('POSTs cancel and tensorboard with a JSON body', async () => {
      const fetch = respond(200, { id: 'j1', state: 'cancelled' });
      await service(fetch).cancel('j1');
      expect(sent(fetch).method).toBe('POST');
      expect(new URL(sent(fetch).url).pathname).toBe(
        '/user/alice/danlu/api/jobs/j1/cancel'
      );

      const tb = respond(200, {
        id: 'abc',
        url: '/user/alice/danlu/tensorboard/abc/',
        logdirs: {}
      });
      const result = await service(tb).tensorboard({ run_ids: ['r1', 'r2'] });
      expect(sent(tb).method).toBe('POST');
      expect(await sent(tb).json()).toEqual({ run_ids: ['r1', 'r2'] });
      expect(result.id).toBe('abc');
    });

    it("POSTs a model registration and reads a version's lineage by name and number", async () => {
      const version = {
        name: 'mnist.v2',
        version: 1,
        run_id: 'r1',
        approval: 'pending'
      };
      const post = respond(201, version);
      expect(await service(post).registerModel('r1', 'mnist.v2')).toEqual(
        version
      );
      expect(sent(post).method).toBe('POST');
      expect(new URL(sent(post).url).pathname).toBe(
        '/user/alice/danlu/api/models'
      );
      expect(await sent(post).json()).toEqual({
        run_id: 'r1',
        name: 'mnist.v2'
      });

      const get = respond(200, { model: {}, nodes: [], edges: [] });
      await service(get).lineage('mnist.v2', 7);
      expect(new URL(sent(get).url).pathname).toBe(
        '/user/alice/danlu/api/lineage/models/mnist.v2/7'
      );
      const odd = respond(200, { model: {}, nodes: [], edges: [] });
      await service(odd).lineage('a/b', '1');
      expect(new URL(sent(odd).url).pathname).toBe(
        '/user/alice/danlu/api/lineage/models/a%2Fb/1'
      );

      const models = respond(200, {
        models: [{ name: 'mnist', latest_version: 2, aliases: { champion: 1 } }]
      });
      expect((await service(models).models())[0].aliases).toEqual({
        champion: 1
      });
    });

    it("gives a refused registration the server's message, fix included", async () => {
      const refused = respond(409, {
        status: 409,
        reason: 'name_taken',
        field: 'name',
        message: 'model taken belongs to bob (choose another name)'
      });
      await expect(
        service(refused).registerModel('r1', 'taken')
      ).rejects.toMatchObject({
        message: 'model taken belongs to bob (choose another name)',
        status: 409
      });
    });
  });

  describe('JSON', () => {
    it('unwraps the lists of jobs, experiments and runs', async () => {
      const job = { id: 'j1', name: 'train', state: 'queued' };
      expect(await service(respond(200, { jobs: [job] })).jobs()).toEqual([
        job
      ]);
      const exp = { experiment_id: '1', name: 'alice/mnist', runs: 2 };
      expect(
        await service(respond(200, { experiments: [exp] })).experiments()
      ).toEqual([exp]);
      expect(await service(respond(200, { runs: [] })).runs('1')).toEqual([]);
    });

    it('reads queues and profiles as a list or wrapped', async () => {
      const q = {
        name: 'team-a',
        quota: {},
        usage: {},
        pending: 0,
        running: 0
      };
      expect(
        await service(respond(200, { queues: [q], draining: false })).queues()
      ).toEqual([q]);
      expect(await service(respond(200, [q])).queues()).toEqual([q]);
      const p = { slug: 'cpu', display_name: 'CPU' };
      expect(
        await service(
          respond(200, { profiles: [p], default: 'cpu' })
        ).profiles()
      ).toEqual({
        profiles: [p],
        default: 'cpu'
      });
      expect(await service(respond(200, [p])).profiles()).toEqual({
        profiles: [p],
        default: null
      });
    });

    it('rejects a 200 that is not JSON', async () => {
      await expect(
        service(respond(200, '<html>login</html>')).whoami()
      ).rejects.toThrow(/not JSON/);
    });
  });

  describe('errors', () => {
    it("carries the server's message and status", async () => {
      const message =
        'the Danlu jobs service is not reachable at http://127.0.0.1:8081';
      const error = await service(respond(503, { message }))
        .jobs()
        .catch(e => e);
      expect(error).toBeInstanceOf(DanluError);
      expect(error.message).toBe(message);
      expect(error.status).toBe(503);
    });

    it('names the status when the body has no message', async () => {
      const error = await service(respond(404, '<html>404</html>', 'Not Found'))
        .job('nope')
        .catch(e => e);
      expect(error).toBeInstanceOf(DanluError);
      expect(error.status).toBe(404);
      expect(error.message).toMatch(/404 Not Found for jobs\/nope/);
    });

    it('maps a network failure to status 0', async () => {
      const fetch: FetchMock = jest.fn(async (_request: Request) => {
        throw new TypeError('Failed to fetch');
      });
      const error = await service(fetch)
        .whoami()
        .catch(e => e);
      expect(error).toBeInstanceOf(DanluError);
      expect(error.status).toBe(0);
      expect(error.message).toMatch(/did not answer/);
    });
  });

  describe('authentication', () => {
    it('sends the XSRF cookie and same-origin credentials, never a token', async () => {
      PageConfig.setOption('token', 'page-token');
      try {
        const fetch = respond(200, { id: 'j1' });
        const s = service(fetch, 'settings-token');
        await s.cancel('j1');
        const request = sent(fetch);
        expect(request.headers.get('X-XSRFToken')).toBe('xsrf-cookie-value');
        expect(request.headers.get('Authorization')).toBeNull();
        expect(request.credentials).toBe('same-origin');
        expect(s.serverSettings.token).toBe('');
        expect(s.serverSettings.appendToken).toBe(false);
        expect(request.url).not.toMatch(/token/);
      } finally {
        PageConfig.setOption('token', '');
      }
    });

    it("keeps the app's base URL and fetch", async () => {
      const fetch = respond(200, { user: 'alice', admin: false });
      const s = service(fetch);
      expect(s.serverSettings.baseUrl).toBe(BASE);
      await s.whoami();
      expect(fetch).toHaveBeenCalledTimes(1);
    });
  });

  describe('streamLogs', () => {
    class FakeEventSource {
      static last: FakeEventSource;
      constructor(readonly url: string) {
        FakeEventSource.last = this;
      }
      onmessage: ((e: MessageEvent) => void) | null = null;
      onerror: ((e: Event) => void) | null = null;
      listeners: Record<string, (e: Event) => void> = {};
      closed = false;
      addEventListener(type: string, listener: (e: Event) => void) {
        this.listeners[type] = listener;
      }
      close() {
        this.closed = true;
      }
      message(data: unknown) {
        this.onmessage!({ data: JSON.stringify(data) } as MessageEvent);
      }
    }

    function streaming() {
      const s = new DanluService({
        serverSettings: ServerConnection.makeSettings({
          baseUrl: BASE,
          token: 't'
        }),
        eventSource: FakeEventSource as unknown as typeof EventSource
      });
      const lines: string[] = [];
      const onEnd = jest.fn();
      const onError = jest.fn();
      const handle = s.streamLogs('j 1', {
        onLine: l => lines.push(l),
        onEnd,
        onError
      });
      return { source: FakeEventSource.last, lines, onEnd, onError, handle };
    }

    it('reads lines until the end event, then closes', () => {
      const { source, lines, onEnd, handle } = streaming();
      expect(source.url.split('?')[0]).toBe(
        `${BASE}danlu/api/jobs/j%201/logs/stream`
      );
      source.message({ line: 'epoch 1 loss=0.9' });
      source.message({ line: 'epoch 2 loss=0.5' });
      source.listeners.end({
        data: JSON.stringify({ state: 'succeeded' })
      } as MessageEvent);
      expect(lines).toEqual(['epoch 1 loss=0.9', 'epoch 2 loss=0.5']);
      expect(onEnd).toHaveBeenCalledWith('succeeded');
      expect(source.closed).toBe(true);
      expect(handle.isDisposed).toBe(true);
    });

    it("sends the page's _xsrf cookie as a query argument (EventSource has no headers)", () => {
      const before = /\b_xsrf=([^;]*)/.exec(document.cookie)?.[1];
      document.cookie = '_xsrf=2|abc|def';
      try {
        const { source } = streaming();
        expect(source.url).toBe(
          `${BASE}danlu/api/jobs/j%201/logs/stream?_xsrf=${encodeURIComponent('2|abc|def')}`
        );
      } finally {
        document.cookie =
          before === undefined
            ? '_xsrf=; expires=Thu, 01 Jan 1970 00:00:00 GMT'
            : `_xsrf=${before}`;
      }
    });

    it('closes instead of reconnecting on an error', () => {
      const { source, onError, onEnd } = streaming();
      source.onerror!(new Event('error'));
      expect(source.closed).toBe(true);
      expect(onError).toHaveBeenCalledTimes(1);
      expect(onEnd).not.toHaveBeenCalled();
    });

    it('stops when disposed', () => {
      const { source, handle, onError } = streaming();
      handle.dispose();
      expect(source.closed).toBe(true);
      source.onerror!(new Event('error'));
      expect(onError).not.toHaveBeenCalled();
    });
  });
});
