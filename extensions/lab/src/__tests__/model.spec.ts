/**
 * QueueModel (polling states, backoff, standby, admin queues) and
 * ExperimentsModel (loading states, selection, comparison), over a fake service.
 */
import { DanluService } from '../handler';
import { ExperimentsModel, QueueModel } from '../model';
import { IJob, IRun } from '../tokens';

function sleep(ms: number): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, ms));
}

async function until(predicate: () => boolean, timeout = 3000): Promise<void> {
  const start = Date.now();
  while (!predicate()) {
    if (Date.now() - start > timeout) {
      throw new Error('condition not reached in time');
    }
    await sleep(5);
  }
}

const JOB: IJob = {
  id: 'j1',
  name: 'mnist',
  owner: 'alice',
  state: 'queued',
  created_at: '2025-01-01T00:00:00Z',
  queue_position: 2,
  queue: 'team-a'
};

// eslint-disable-next-line @typescript-eslint/no-explicit-any
function fakeService(
  overrides: Partial<Record<keyof DanluService, any>> = {}
): any {
  return {
    whoami: jest.fn(async () => ({
      user: 'alice',
      admin: false,
      hub_url: '/hub/',
      mlflow_url: null
    })),
    jobs: jest.fn(async () => [JOB]),
    queues: jest.fn(async () => []),
    job: jest.fn(async (id: string) => ({ ...JOB, id })),
    experiments: jest.fn(async () => []),
    runs: jest.fn(async () => []),
    metricHistory: jest.fn(async (ids: string[], key: string) => ({
      key,
      series: ids.map(id => ({
        run_id: id,
        run_name: id,
        points: [
          [0, 1],
          [1, 0.5]
        ]
      }))
    })),
    ...overrides
  };
}

function setHidden(hidden: boolean) {
  Object.defineProperty(document, 'visibilityState', {
    configurable: true,
    get: () => (hidden ? 'hidden' : 'visible')
  });
  document.dispatchEvent(new Event('visibilitychange'));
}

describe('QueueModel', () => {
  let model: QueueModel | null = null;
  afterEach(() => {
    model?.dispose();
    model = null;
    jest.restoreAllMocks();
    setHidden(false);
  });

  it('is loading until the first poll, then ready with the jobs', async () => {
    const service = fakeService();
    model = new QueueModel({ service, auto: false });
    expect(model.status).toBe('loading');
    const changed = jest.fn();
    model.changed.connect(changed);
    await model.refresh();
    expect(model.status).toBe('ready');
    expect(model.jobs).toEqual([JOB]);
    expect(model.job('j1')).toEqual(JOB);
    expect(model.whoami?.user).toBe('alice');
    expect(changed).toHaveBeenCalled();
    expect(service.queues).not.toHaveBeenCalled();
  });

  it('is empty when the user has no jobs', async () => {
    model = new QueueModel({
      service: fakeService({ jobs: jest.fn(async () => []) }),
      auto: false
    });
    await model.refresh();
    expect(model.status).toBe('empty');
    expect(model.loaded).toBe(true);
  });

  it('shows the error, and recovers on the next successful poll', async () => {
    const jobs = jest
      .fn()
      .mockRejectedValueOnce(
        new Error('the Danlu jobs service is not reachable')
      )
      .mockResolvedValue([JOB]);
    model = new QueueModel({ service: fakeService({ jobs }), auto: false });
    await model.refresh();
    expect(model.status).toBe('error');
    expect(model.error).toBe('the Danlu jobs service is not reachable');
    expect(model.poll.state.phase).toBe('rejected');
    await model.refresh();
    expect(model.status).toBe('ready');
    expect(model.error).toBeNull();
  });

  it('asks whoami once, and the queues only for admins', async () => {
    const service = fakeService({
      whoami: jest.fn(async () => ({
        user: 'root',
        admin: true,
        hub_url: '/hub/',
        mlflow_url: null
      })),
      queues: jest.fn(async () => [
        {
          name: 'team-a',
          quota: { gpus: { a100: 4 } },
          usage: { gpus: { a100: 1 } },
          pending: 1,
          running: 1
        }
      ])
    });
    model = new QueueModel({ service, auto: false });
    await model.refresh();
    await model.refresh();
    expect(service.whoami).toHaveBeenCalledTimes(1);
    expect(service.queues).toHaveBeenCalledTimes(2);
    expect(model.isAdmin).toBe(true);
    expect(model.queues[0].name).toBe('team-a');
  });

  it('polls on its own and backs off while the server fails', async () => {
    // The poll draws each wait at random between the interval and the last wait
    // times the growth: pin the draw to its top to see the growth itself.
    jest.spyOn(Math, 'random').mockReturnValue(0.999);
    let fail = true;
    const jobs = jest.fn(async () => {
      if (fail) {
        throw new Error('down');
      }
      return [JOB];
    });
    model = new QueueModel({
      service: fakeService({ jobs }),
      interval: 10,
      backoff: 2
    });
    const waits: number[] = [];
    model.poll.ticked.connect((_, state) => {
      if (state.phase === 'rejected') {
        waits.push(state.interval);
      }
    });
    await until(() => waits.length >= 7);
    const tail = waits.slice(-3);
    expect(tail[0]).toBeGreaterThan(10);
    expect(tail[1]).toBeGreaterThan(tail[0]);
    expect(tail[2]).toBeGreaterThan(tail[1]);
    expect(model.status).toBe('error');

    fail = false;
    await until(() => model!.status === 'ready');
    await until(
      () =>
        model!.poll.state.phase === 'resolved' ||
        model!.poll.state.phase === 'reconnected'
    );
    expect(model.poll.state.interval).toBe(10);
  });

  it('stands by while the page is hidden', async () => {
    const service = fakeService();
    model = new QueueModel({ service, interval: 10 });
    await until(() => service.jobs.mock.calls.length >= 2);
    setHidden(true);
    await sleep(60); // lingers one tick, then stands by
    const calls = service.jobs.mock.calls.length;
    await sleep(100);
    expect(service.jobs.mock.calls.length).toBe(calls);
    expect(model.poll.state.phase).toBe('standby');
    setHidden(false);
    await until(() => service.jobs.mock.calls.length > calls);
  });

  it('stops polling when disposed', async () => {
    const service = fakeService();
    model = new QueueModel({ service, interval: 10 });
    await until(() => service.jobs.mock.calls.length >= 1);
    model.dispose();
    const calls = service.jobs.mock.calls.length;
    await sleep(50);
    expect(service.jobs.mock.calls.length).toBe(calls);
    expect(model.isDisposed).toBe(true);
  });
});

function run(
  id: string,
  metrics: Record<string, number>,
  params: Record<string, string> = {}
): IRun {
  return {
    run_id: id,
    run_name: `run-${id}`,
    status: 'FINISHED',
    start_time: 0,
    end_time: 1,
    params,
    metrics,
    job_id: `job-${id}`,
    mlflow_url: `/services/mlflow/#/experiments/1/runs/${id}`
  };
}

describe('ExperimentsModel', () => {
  it('loads the experiments: ready, empty or error', async () => {
    const experiments = jest
      .fn()
      .mockResolvedValueOnce([
        { experiment_id: '1', name: 'alice/mnist', runs: 2 }
      ])
      .mockResolvedValueOnce([])
      .mockRejectedValueOnce(new Error('MLflow is not reachable'));
    const model = new ExperimentsModel({
      service: fakeService({ experiments })
    });
    expect(model.experimentsState.status).toBe('idle');
    const loading = model.loadExperiments();
    expect(model.experimentsState.status).toBe('loading');
    await loading;
    expect(model.experimentsState.status).toBe('ready');
    expect(model.experiments).toHaveLength(1);
    await model.loadExperiments();
    expect(model.experimentsState.status).toBe('empty');
    await model.loadExperiments();
    expect(model.experimentsState).toEqual({
      status: 'error',
      error: 'MLflow is not reachable'
    });
  });

  it('selects an experiment, loads its runs and clears the selection', async () => {
    const runs = jest.fn(async (id: string) =>
      id === '1'
        ? [
            run('a', { loss: 0.5, acc: 0.8 }, { lr: '0.1' }),
            run('b', { loss: 0.4 }, { bs: '32' })
          ]
        : []
    );
    const model = new ExperimentsModel({ service: fakeService({ runs }) });
    await model.selectExperiment('1');
    expect(runs).toHaveBeenCalledWith('1');
    expect(model.runsState.status).toBe('ready');
    expect(model.paramKeys).toEqual(['bs', 'lr']);
    expect(model.metricKeys).toEqual(['acc', 'loss']);

    model.toggleRun('b');
    model.toggleRun('a');
    expect(model.selectedRuns.map(r => r.run_id)).toEqual(['a', 'b']);
    model.toggleRun('a');
    expect([...model.selection]).toEqual(['b']);
    model.toggleRun('nope', true);
    expect([...model.selection]).toEqual(['b']);
    model.selectAll(true);
    expect(model.selection.size).toBe(2);

    await model.selectExperiment('2');
    expect(model.selection.size).toBe(0);
    expect(model.runsState.status).toBe('empty');
  });

  it('ignores the runs of an experiment that is no longer selected', async () => {
    let releaseSlow: (runs: IRun[]) => void = () => undefined;
    const runs = jest.fn((id: string) =>
      id === 'slow'
        ? new Promise<IRun[]>(resolve => (releaseSlow = resolve))
        : Promise.resolve([run('fast', {})])
    );
    const model = new ExperimentsModel({ service: fakeService({ runs }) });
    const slow = model.selectExperiment('slow');
    await model.selectExperiment('fast');
    releaseSlow([run('stale', {})]);
    await slow;
    expect(model.selectedExperiment).toBe('fast');
    expect(model.runs.map(r => r.run_id)).toEqual(['fast']);
  });

  it('compares one metric of the selected runs, loss first', async () => {
    const service = fakeService({
      runs: jest.fn(async () => [
        run('a', { acc: 0.9, loss: 0.1 }),
        run('b', { acc: 0.8, loss: 0.2 }),
        run('c', { acc: 1 })
      ])
    });
    const model = new ExperimentsModel({ service });
    await model.selectExperiment('1');

    await model.compare();
    expect(model.historyState.status).toBe('error');
    expect(model.historyState.error).toMatch(/Select at least one run/);

    model.toggleRun('b', true);
    model.toggleRun('a', true);
    await model.compare();
    expect(service.metricHistory).toHaveBeenLastCalledWith(['a', 'b'], 'loss');
    expect(model.compareKey).toBe('loss');
    expect(model.historyState.status).toBe('ready');
    expect(model.history?.series).toHaveLength(2);

    await model.compare('acc');
    expect(service.metricHistory).toHaveBeenLastCalledWith(['a', 'b'], 'acc');
    expect(model.compareKey).toBe('acc');
  });

  it('reports an empty history and a failed one', async () => {
    const metricHistory = jest
      .fn()
      .mockResolvedValueOnce({
        key: 'loss',
        series: [{ run_id: 'a', run_name: 'a', points: [] }]
      })
      .mockRejectedValueOnce(new Error('no such metric'));
    const model = new ExperimentsModel({
      service: fakeService({
        runs: jest.fn(async () => [run('a', { loss: 1 })]),
        metricHistory
      })
    });
    await model.selectExperiment('1');
    model.toggleRun('a', true);
    await model.compare();
    expect(model.historyState.status).toBe('empty');
    await model.compare();
    expect(model.historyState).toEqual({
      status: 'error',
      error: 'no such metric'
    });
    expect(model.history).toBeNull();
  });
});
