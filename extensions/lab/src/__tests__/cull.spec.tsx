/**
 * GPU-aware culling in the UI: `GET servers/warnings` (404 from an older
 * service is no warnings), the queue model reading them without ever failing
 * its poll for them, the sidebar's banner with its countdown, the filter by hub
 * user and server name, and one notification per warning.
 */
import { PageConfig } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

import {
  cullWarningText,
  cullWarningsHere,
  formatCountdown,
  watchCullWarnings
} from '../cull';
import { DanluError, DanluService } from '../handler';
import { ExperimentsModel, QueueModel } from '../model';
import { DanluSidebar } from '../sidebar/sidebar';
import { SweepsModel } from '../sweeps';
import { ICullWarning, IJob, IShownCullWarning } from '../tokens';

function sleep(ms: number): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, ms));
}

async function until<T>(
  find: () => T | null | undefined | false,
  timeout = 3000
): Promise<T> {
  const start = Date.now();
  for (;;) {
    const found = find();
    if (found) {
      return found;
    }
    if (Date.now() - start > timeout) {
      throw new Error('not reached in time');
    }
    await sleep(5);
  }
}

const WARNING: ICullWarning = {
  server: 'alice',
  user: 'alice',
  name: '',
  cull_at: '2026-12-03T17:05:00Z',
  seconds_left: 240,
  idle_minutes: 11.0,
  devices: [0],
  reason: 'GPU 0 has been idle for 11 minutes and no kernel is busy',
  keep: 'Run something on the GPU, or release it: stop this server and start it again with a CPU profile (File > Hub Control Panel).'
};
const NAMED: ICullWarning = {
  ...WARNING,
  server: 'alice:gpu',
  name: 'gpu',
  cull_at: '2026-12-03T17:09:00Z',
  seconds_left: 480
};
const JOB: IJob = {
  id: 'j1',
  name: 'mnist',
  owner: 'alice',
  state: 'queued',
  created_at: '2025-01-01T00:00:00Z'
};

// eslint-disable-next-line @typescript-eslint/no-explicit-any
function fakeService(overrides: Record<string, any> = {}): any {
  return {
    whoami: jest.fn(async () => ({
      user: 'alice',
      admin: false,
      hub_url: '/hub/',
      mlflow_url: null
    })),
    jobs: jest.fn(async () => [JOB]),
    queues: jest.fn(async () => []),
    cullWarnings: jest.fn(async () => [WARNING]),
    experiments: jest.fn(async () => []),
    runs: jest.fn(async () => []),
    sweeps: jest.fn(async () => []),
    ...overrides
  };
}

function setHub(user: string, serverName: string): void {
  PageConfig.setOption('hubUser', user);
  PageConfig.setOption('hubServerName', serverName);
}

afterEach(() => {
  setHub('', '');
  jest.restoreAllMocks();
});

describe('DanluService.cullWarnings', () => {
  function service(status: number, body: unknown): DanluService {
    const fetch = jest.fn(
      async (_request: Request) =>
        new Response(JSON.stringify(body), { status })
    );
    return new DanluService({
      serverSettings: ServerConnection.makeSettings({
        baseUrl: 'http://localhost/user/alice/',
        fetch: fetch as unknown as typeof window.fetch
      })
    });
  }

  it('reads GET danlu/api/servers/warnings', async () => {
    const fetch = jest.fn(
      async (_request: Request) =>
        new Response(JSON.stringify({ warnings: [WARNING] }), { status: 200 })
    );
    const s = new DanluService({
      serverSettings: ServerConnection.makeSettings({
        baseUrl: 'http://localhost/user/alice/',
        fetch: fetch as unknown as typeof window.fetch
      })
    });
    expect(await s.cullWarnings()).toEqual([WARNING]);
    expect(new URL(fetch.mock.calls[0][0].url).pathname).toBe(
      '/user/alice/danlu/api/servers/warnings'
    );
  });

  it('answers no warnings when an older service answers 404', async () => {
    const s = service(404, { message: 'no such endpoint' });
    expect(await s.cullWarnings()).toEqual([]);
  });

  it('answers no warnings for an answer without a list', async () => {
    expect(await service(200, {}).cullWarnings()).toEqual([]);
  });

  it('throws any other failure', async () => {
    await expect(
      service(502, { message: 'the jobs service is down' }).cullWarnings()
    ).rejects.toEqual(new DanluError('the jobs service is down', 502));
  });
});

describe('QueueModel.cullWarnings', () => {
  let model: QueueModel | null = null;
  afterEach(() => {
    model?.dispose();
    model = null;
  });

  it('exposes the warnings with a deadline on the browser clock', async () => {
    jest.spyOn(Date, 'now').mockReturnValue(1_000_000);
    model = new QueueModel({ service: fakeService(), auto: false });
    expect(model.cullWarnings).toEqual([]);
    await model.refresh();
    expect(model.cullWarnings).toEqual([
      { ...WARNING, deadline: 1_000_000 + 240_000 }
    ]);
    expect(model.jobs).toEqual([JOB]);
    expect(model.status).toBe('ready');
  });

  it('does not fail the poll when the warnings fail, and keeps the last ones', async () => {
    const cullWarnings = jest
      .fn()
      .mockResolvedValueOnce([WARNING])
      .mockRejectedValue(new DanluError('the jobs service is down', 502));
    model = new QueueModel({
      service: fakeService({ cullWarnings }),
      auto: false
    });
    await model.refresh();
    await model.refresh();
    expect(cullWarnings).toHaveBeenCalledTimes(2);
    expect(model.error).toBeNull();
    expect(model.status).toBe('ready');
    expect(model.poll.state.phase).not.toBe('rejected');
    expect(model.cullWarnings.map(w => w.server)).toEqual(['alice']);
  });

  it('works with a service that lacks cullWarnings altogether', async () => {
    const service = fakeService();
    delete service.cullWarnings;
    model = new QueueModel({ service, auto: false });
    await model.refresh();
    expect(model.status).toBe('ready');
    expect(model.cullWarnings).toEqual([]);
  });

  it('still reads the warnings when the jobs fail', async () => {
    model = new QueueModel({
      service: fakeService({
        jobs: jest.fn(async () => {
          throw new Error('no jobs');
        })
      }),
      auto: false
    });
    await model.refresh();
    expect(model.status).toBe('error');
    expect(model.error).toBe('no jobs');
    expect(model.cullWarnings.map(w => w.server)).toEqual(['alice']);
  });

  it('drops warnings that are gone', async () => {
    const cullWarnings = jest
      .fn()
      .mockResolvedValueOnce([WARNING])
      .mockResolvedValue([]);
    model = new QueueModel({
      service: fakeService({ cullWarnings }),
      auto: false
    });
    await model.refresh();
    expect(model.cullWarnings).toHaveLength(1);
    await model.refresh();
    expect(model.cullWarnings).toEqual([]);
  });
});

describe('which warnings concern this server', () => {
  const shown = [WARNING, NAMED, { ...WARNING, server: 'bob', user: 'bob' }];

  it('keeps the default server of the hub user', () => {
    expect(cullWarningsHere(shown, 'alice', '').map(w => w.server)).toEqual([
      'alice'
    ]);
  });

  it('keeps a named server by its name', () => {
    expect(cullWarningsHere(shown, 'alice', 'gpu').map(w => w.server)).toEqual([
      'alice:gpu'
    ]);
  });

  it('keeps all outside JupyterHub (no hubUser)', () => {
    expect(cullWarningsHere(shown, '', '')).toHaveLength(3);
  });

  it("reads the page's hubUser and hubServerName", () => {
    setHub('alice', 'gpu');
    expect(cullWarningsHere(shown).map(w => w.server)).toEqual(['alice:gpu']);
  });
});

describe('the countdown text', () => {
  const warning: IShownCullWarning = { ...WARNING, deadline: 300_000 };

  it('formats M:SS', () => {
    expect(formatCountdown(240)).toBe('4:00');
    expect(formatCountdown(59)).toBe('0:59');
    expect(formatCountdown(3725)).toBe('62:05');
    expect(formatCountdown(-3)).toBe('0:00');
  });

  it('says when, why and how to keep the server', () => {
    expect(cullWarningText(warning, 300_000 - 239_400)).toBe(
      'This server will be stopped in 4:00: GPU 0 has been idle for 11 minutes and no kernel is busy. ' +
        WARNING.keep
    );
    expect(cullWarningText(warning, 400_000)).toMatch(/stopped in 0:00:/);
  });
});

describe('the sidebar banner', () => {
  let parts: {
    sidebar: DanluSidebar;
    queue: QueueModel;
    sweeps: SweepsModel;
  } | null = null;
  afterEach(() => {
    parts?.sidebar.dispose();
    parts?.queue.dispose();
    parts?.sweeps.dispose();
    parts = null;
  });

  // eslint-disable-next-line @typescript-eslint/no-explicit-any
  function setup(service: any) {
    const queue = new QueueModel({ service, auto: false });
    const experiments = new ExperimentsModel({ service });
    const sweeps = new SweepsModel({ service });
    const noop = jest.fn(async () => undefined);
    const sidebar = new DanluSidebar({
      queue,
      experiments,
      sweeps,
      actions: {
        cancel: noop,
        openOutput: noop,
        openTensorBoard: noop,
        registerModel: jest.fn(async () => null),
        openLineage: noop,
        openSweep: noop
      }
    });
    Widget.attach(sidebar, document.body);
    parts = { sidebar, queue, sweeps };
    return { node: sidebar.node, queue };
  }

  it('counts down every second at the top whatever the tab, and hides when the warnings go', async () => {
    let now = 5_000_000;
    jest.spyOn(Date, 'now').mockImplementation(() => now);
    const cullWarnings = jest
      .fn()
      .mockResolvedValueOnce([WARNING])
      .mockResolvedValue([]);
    const { node, queue } = setup(fakeService({ cullWarnings }));
    await queue.refresh();
    const banner = await until(() =>
      node.querySelector<HTMLElement>('.danlu-cull-warning')
    );
    expect(banner.getAttribute('role')).toBe('alert');
    expect(banner.textContent).toBe(
      'This server will be stopped in 4:00: GPU 0 has been idle for 11 minutes and no kernel is busy. ' +
        WARNING.keep
    );
    // Above the tab list, so it shows on every tab.
    const tabs = node.querySelector('.danlu-tabs')!;
    expect(
      banner.compareDocumentPosition(tabs) & Node.DOCUMENT_POSITION_FOLLOWING
    ).toBeTruthy();
    (node.querySelector('#danlu-tab-sweeps') as HTMLButtonElement).click();
    await until(() => node.querySelector('#danlu-panel-queue[hidden]'));
    await sleep(20);
    // Nothing else re-renders now: only the one-second ticker shows 3:55.
    now += 5_000;
    await until(
      () => node.querySelector('.danlu-cull-countdown')?.textContent === '3:55'
    );
    expect(node.querySelector('.danlu-cull-warning')).not.toBeNull();

    const clear = jest.spyOn(window, 'clearInterval');
    await queue.refresh();
    await until(() => !node.querySelector('.danlu-cull-warning'));
    await until(() => clear.mock.calls.length > 0);
  });

  it('shows only the warnings about this server', async () => {
    setHub('alice', 'gpu');
    const { node, queue } = setup(
      fakeService({ cullWarnings: jest.fn(async () => [WARNING, NAMED]) })
    );
    await queue.refresh();
    await until(() => node.querySelector('.danlu-cull-warning'));
    const banners = node.querySelectorAll('.danlu-cull-warning');
    expect(banners).toHaveLength(1);
    expect(banners[0].getAttribute('data-server')).toBe('alice:gpu');
    expect(banners[0].textContent).toMatch(/stopped in 8:00:/);
  });

  it('shows nothing for a server of another name', async () => {
    setHub('alice', 'cpu');
    const { node, queue } = setup(fakeService());
    await queue.refresh();
    await until(() => node.querySelector('.danlu-job'));
    expect(node.querySelector('.danlu-cull-warning')).toBeNull();
  });
});

describe('watchCullWarnings', () => {
  it('notifies once per (server, cull_at) and takes it back when it is gone', async () => {
    const cullWarnings = jest
      .fn()
      .mockResolvedValueOnce([WARNING])
      .mockResolvedValueOnce([{ ...WARNING, seconds_left: 235 }])
      .mockResolvedValueOnce([{ ...WARNING, cull_at: '2026-12-03T17:20:00Z' }])
      .mockResolvedValue([]);
    const queue = new QueueModel({
      service: fakeService({ cullWarnings }),
      auto: false
    });
    let n = 0;
    const show = jest.fn((_w: IShownCullWarning, _text: string) => `n${++n}`);
    const dismiss = jest.fn((_id: string) => undefined);
    const watch = watchCullWarnings(queue, { show, dismiss }, w => [...w]);
    try {
      await queue.refresh();
      await queue.refresh();
      expect(show).toHaveBeenCalledTimes(1);
      expect(show.mock.calls[0][1]).toMatch(
        /^This server will be stopped in 4:00: GPU 0 has been idle/
      );
      await queue.refresh(); // a new cull time: a new notification
      expect(show).toHaveBeenCalledTimes(2);
      expect(dismiss).toHaveBeenCalledWith('n1');
      await queue.refresh();
      expect(dismiss).toHaveBeenCalledWith('n2');
    } finally {
      watch.dispose();
      queue.dispose();
    }
  });
});
