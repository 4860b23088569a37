/**
 * The sidebar rendered in jsdom over the real models and a fake service: the
 * stable selectors and labels the UI tests rely on, the states, and the actions.
 */
import { Widget } from '@lumino/widgets';

import { ExperimentsModel, QueueModel } from '../model';
import { SweepsModel } from '../sweeps';
import { ISidebarActions } from '../sidebar/actions';
import { DanluSidebar } from '../sidebar/sidebar';
import { IJob, IModelVersion, IRun, ISweepSummary } from '../tokens';

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
      throw new Error('not rendered in time');
    }
    await sleep(5);
  }
}

const QUEUED: IJob = {
  id: 'q1',
  name: 'mnist',
  owner: 'alice',
  state: 'queued',
  reason: 'waiting for 2 GPUs of team-a (quota 4, used 4)',
  queue: 'team-a',
  queue_position: 3,
  estimated_start: null,
  resources: { nproc: 2, gpus: 2 },
  created_at: '2025-01-01T00:00:00Z'
};
const SWEEP: ISweepSummary = {
  id: '5eeeeeeeeea1',
  name: 'lr-search',
  owner: 'alice',
  state: 'running',
  reason: '',
  created_at: '2025-01-01T00:00:00Z',
  objective: { metric: 'loss', direction: 'minimize', text: 'loss:min' },
  space: [],
  options: {},
  experiment: 'alice/train',
  mlflow_run_id: null,
  counts: { running: 2, complete: 3, pruned: 1, failed: 0, stopped: 0 },
  best: { number: 3, job_id: 'j3', value: 0.25, params: { lr: 0.01 } },
  notes: []
};
const RUNNING: IJob = {
  id: 'r1',
  name: 'cifar',
  owner: 'alice',
  state: 'running',
  queue: 'team-a',
  resources: { nproc: 1, gpus: 1 },
  devices: [3],
  elapsed_seconds: 75,
  checkpoint: { step: 1500, age_seconds: 40, attempt: 2 },
  created_at: '2025-01-01T00:00:00Z'
};

function run(id: string, name: string, loss: number): IRun {
  return {
    run_id: id,
    run_name: name,
    status: 'FINISHED',
    start_time: 1700000000000,
    end_time: 1700000100000,
    params: { lr: '0.1' },
    metrics: { loss, acc: 0.9 },
    job_id: `job-${id}`,
    mlflow_url: `/services/mlflow/#/experiments/1/runs/${id}`
  };
}

// eslint-disable-next-line @typescript-eslint/no-explicit-any
function setup(overrides: Record<string, any> = {}) {
  const { actions: actionOverrides, ...serviceOverrides } = overrides;
  const service = {
    whoami: jest.fn(async () => ({
      user: 'alice',
      admin: false,
      hub_url: '/hub/',
      mlflow_url: '/services/mlflow/'
    })),
    jobs: jest.fn(async () => [RUNNING, QUEUED]),
    queues: jest.fn(async () => []),
    experiments: jest.fn(async () => [
      { experiment_id: '1', name: 'alice/mnist', runs: 2 }
    ]),
    runs: jest.fn(async () => [
      run('a', 'bright-owl', 0.2),
      run('b', 'calm-fox', 0.3)
    ]),
    metricHistory: jest.fn(async (ids: string[], key: string) => ({
      key,
      series: ids.map(id => ({
        run_id: id,
        run_name: id,
        points: [
          [0, 1],
          [1, 0.5],
          [2, 0.25]
        ]
      }))
    })),
    sweeps: jest.fn(async (): Promise<ISweepSummary[]> => [SWEEP]),
    ...serviceOverrides
    // eslint-disable-next-line @typescript-eslint/no-explicit-any
  } as any;
  const queue = new QueueModel({ service, auto: false });
  const experiments = new ExperimentsModel({ service });
  const sweeps = new SweepsModel({ service });
  const actions = {
    cancel: jest.fn(async (_job: IJob) => undefined),
    openOutput: jest.fn(async (_job: IJob) => undefined),
    openTensorBoard: jest.fn(
      async (
        _target: Parameters<ISidebarActions['openTensorBoard']>[0],
        _label: string
      ) => undefined
    ),
    registerModel: jest.fn(
      async (_run: IRun): Promise<IModelVersion | null> => null
    ),
    openLineage: jest.fn(
      async (_name: string, _version: string | number) => undefined
    ),
    openSweep: jest.fn(async (_id: string, _name: string) => undefined),
    ...(actionOverrides ?? {})
  };
  const sidebar = new DanluSidebar({ queue, experiments, sweeps, actions });
  Widget.attach(sidebar, document.body);
  return {
    service,
    queue,
    experiments,
    sweeps,
    actions,
    sidebar,
    node: sidebar.node
  };
}

describe('DanluSidebar', () => {
  let current: ReturnType<typeof setup> | null = null;
  afterEach(() => {
    current?.sidebar.dispose();
    current?.queue.dispose();
    current?.sweeps.dispose();
    current = null;
  });

  it('is the Danlu region with the Queue, Experiments and Sweeps tabs', async () => {
    current = setup();
    const { node, sidebar } = current;
    expect(sidebar.id).toBe('danlu-sidebar');
    expect(sidebar.title.caption).toBe('Danlu');
    expect(node.getAttribute('aria-label')).toBe('Danlu');
    const tabs = await until(() => {
      const found = node.querySelectorAll('[role=tab]');
      return found.length ? found : null;
    });
    expect([...tabs].map(t => t.textContent)).toEqual([
      'Queue',
      'Experiments',
      'Sweeps'
    ]);
    expect(tabs[0].getAttribute('aria-selected')).toBe('true');
  });

  it('shows loading, then each job with its details and labelled buttons', async () => {
    current = setup();
    const { node, queue } = current;
    await until(() => node.querySelector('.danlu-loading'));
    await queue.refresh();
    const queued = await until(() =>
      node.querySelector('li.danlu-job[data-job-id=q1]')
    );
    expect(queued.getAttribute('data-state')).toBe('queued');
    expect(queued.querySelector('.danlu-job-state')!.textContent).toBe(
      'queued'
    );
    expect(queued.querySelector('.danlu-job-reason')!.textContent).toMatch(
      /waiting for 2 GPUs/
    );
    expect(queued.textContent).toMatch(/#3 in team-a/);
    expect(queued.textContent).toMatch(/2 GPUs/);
    expect(queued.querySelector('[aria-label="Cancel job q1"]')).not.toBeNull();
    expect(
      queued.querySelector('[aria-label="Show log of job q1"]')
    ).not.toBeNull();
    // nothing ran yet: no output, no TensorBoard
    expect(
      queued.querySelector('[aria-label="Open output of job q1"]')
    ).toBeNull();

    const running = node.querySelector('li.danlu-job[data-job-id=r1]')!;
    expect(running.getAttribute('data-state')).toBe('running');
    expect(running.textContent).toMatch(/1 GPU \(3\)/);
    expect(running.textContent).toMatch(/1m 1\ds/);
    // its last checkpoint: the step and how long ago (the queued one has none)
    expect(running.textContent).toMatch(/checkpoint step 1500, 4\ds ago/);
    expect(queued.textContent).not.toMatch(/checkpoint/);
    for (const label of [
      'Cancel job r1',
      'Show log of job r1',
      'Open output of job r1',
      'Open TensorBoard for job r1'
    ]) {
      const button = running.querySelector(
        `button[aria-label="${label}"]`
      ) as HTMLButtonElement;
      expect(button).not.toBeNull();
      expect(button.title).toBe(label);
    }
  });

  it('hands cancel, output and TensorBoard to the actions', async () => {
    current = setup();
    const { node, queue, actions } = current;
    await queue.refresh();
    // a job's buttons are disabled while one of its actions runs
    const button = (label: string) =>
      until(() => {
        const found = node.querySelector(
          `button[aria-label="${label}"]`
        ) as HTMLButtonElement | null;
        return found && !found.disabled ? found : null;
      });
    (await button('Cancel job r1')).click();
    await until(() => actions.cancel.mock.calls.length > 0);
    expect(actions.cancel.mock.calls[0][0].id).toBe('r1');
    (await button('Open output of job r1')).click();
    await until(() => actions.openOutput.mock.calls.length > 0);
    (await button('Open TensorBoard for job r1')).click();
    await until(() => actions.openTensorBoard.mock.calls.length > 0);
    expect(actions.openTensorBoard).toHaveBeenCalledWith(
      { job_ids: ['r1'] },
      'cifar'
    );
  });

  it('shows the error with a Retry that polls again', async () => {
    const jobs = jest
      .fn()
      .mockRejectedValueOnce(
        new Error('the Danlu jobs service is not reachable')
      )
      .mockResolvedValue([]);
    current = setup({ jobs });
    const { node, queue } = current;
    await queue.refresh();
    const error = await until(() => node.querySelector('.danlu-error'));
    expect(error.getAttribute('role')).toBe('alert');
    expect(error.textContent).toMatch(/not reachable/);
    const retry = [...error.querySelectorAll('button')].find(
      b => b.textContent === 'Retry'
    )!;
    retry.click();
    await until(() => node.querySelector('.danlu-empty'));
    expect(jobs).toHaveBeenCalledTimes(2);
    expect(node.querySelector('.danlu-error')).toBeNull();
  });

  it('shows admins the quota bar of every team', async () => {
    current = setup({
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
          usage: { gpus: { a100: 3 } },
          pending: 2,
          running: 1
        },
        {
          name: 'team-b',
          quota: { gpus: { a100: 2, h100: 2 } },
          usage: {},
          pending: 0,
          running: 0
        }
      ])
    });
    const { node, queue } = current;
    await queue.refresh();
    const a = await until(() =>
      node.querySelector('.danlu-quota[data-team=team-a]')
    );
    const bar = a.querySelector('[role=progressbar]')!;
    expect(bar.getAttribute('aria-valuenow')).toBe('3');
    expect(bar.getAttribute('aria-valuemax')).toBe('4');
    expect(
      (a.querySelector('.danlu-quota-fill') as HTMLElement).style.width
    ).toBe('75%');
    expect(
      node.querySelector('.danlu-quota[data-team=team-b]')!.textContent
    ).toMatch(/0 \/ 4 GPUs/);
  });

  it('lists runs, compares the selected ones and opens TensorBoard for them', async () => {
    current = setup();
    const { node, service, actions } = current;
    const tab = await until(
      () =>
        [...node.querySelectorAll('[role=tab]')].find(
          t => t.textContent === 'Experiments'
        ) as HTMLButtonElement
    );
    tab.click();
    const table = await until(() => node.querySelector('table.danlu-runs'));
    expect(service.runs).toHaveBeenCalledWith('1');
    const row = table.querySelector('tr[data-run-id=a]')!;
    expect(row.textContent).toMatch(/bright-owl/);
    const link = [...row.querySelectorAll('a')].find(
      a => a.textContent === 'Open in MLflow'
    )!;
    expect(link.getAttribute('href')).toBe(
      '/services/mlflow/#/experiments/1/runs/a'
    );
    expect(link.getAttribute('target')).toBe('_blank');
    expect(link.getAttribute('rel')).toMatch(/noopener/);

    const compare = [...node.querySelectorAll('button')].find(
      b => b.textContent === 'Compare'
    )!;
    expect(compare.disabled).toBe(true);
    (
      node.querySelector(
        'input[aria-label="Select run bright-owl"]'
      ) as HTMLInputElement
    ).click();
    (
      node.querySelector(
        'input[aria-label="Select run calm-fox"]'
      ) as HTMLInputElement
    ).click();
    await until(() => !compare.disabled);
    compare.click();
    const chart = await until(() =>
      node.querySelector('svg.danlu-compare-chart')
    );
    expect(chart.querySelectorAll('path.danlu-series')).toHaveLength(2);
    expect(service.metricHistory).toHaveBeenCalledWith(['a', 'b'], 'loss');
    const select = node.querySelector(
      'select[aria-label=Metric]'
    ) as HTMLSelectElement;
    expect(select.value).toBe('loss');

    const open = [...node.querySelectorAll('button')].find(
      b => b.textContent === 'Open TensorBoard'
    )!;
    open.click();
    await until(() => actions.openTensorBoard.mock.calls.length > 0);
    expect(actions.openTensorBoard).toHaveBeenCalledWith(
      { run_ids: ['a', 'b'] },
      'bright-owl, calm-fox'
    );
  });

  it('registers a run as a model and shows the version with a Lineage button', async () => {
    const version: IModelVersion = {
      name: 'mnist-classifier',
      version: 3,
      run_id: 'a',
      approval: 'pending',
      evaluation: {
        state: 'queued',
        job_id: 'e1',
        metrics: {},
        thresholds: { accuracy: 0.9 },
        failures: []
      },
      decisions: [],
      aliases: []
    };
    let cancel: (value: null) => void = () => undefined;
    const registerModel = jest
      .fn()
      .mockReturnValueOnce(new Promise<null>(resolve => (cancel = resolve)))
      .mockResolvedValue(version);
    current = setup({ actions: { registerModel } });
    const { node, actions } = current;
    const tab = await until(
      () =>
        [...node.querySelectorAll('[role=tab]')].find(
          t => t.textContent === 'Experiments'
        ) as HTMLButtonElement
    );
    tab.click();
    const row = await until(() => node.querySelector('tr[data-run-id=a]'));
    const button = () =>
      row.querySelector(
        'button[aria-label="Register model from run bright-owl"]'
      ) as HTMLButtonElement;
    expect(button().title).toBe('Register model from run bright-owl');

    // disabled while the dialog is open; cancelled (or refused: the action shows why): nothing changes
    button().click();
    await until(
      () => registerModel.mock.calls.length === 1 && button().disabled
    );
    expect(registerModel.mock.calls[0][0].run_id).toBe('a');
    cancel(null);
    await until(() => !button().disabled);
    expect(row.querySelector('.danlu-registered')).toBeNull();

    button().click();
    const registered = await until(() =>
      row.querySelector('.danlu-registered[data-model=mnist-classifier]')
    );
    expect(registered.getAttribute('data-version')).toBe('3');
    expect(registered.getAttribute('data-approval')).toBe('pending');
    expect(registered.getAttribute('data-evaluation')).toBe('queued');
    expect(registered.textContent).toMatch(
      /mnist-classifier v3.*pending.*evaluation queued/
    );
    expect(
      node.querySelector('tr[data-run-id=b] .danlu-registered')
    ).toBeNull();

    (
      registered.querySelector(
        'button[aria-label="Open lineage of mnist-classifier version 3"]'
      ) as HTMLButtonElement
    ).click();
    await until(() => actions.openLineage.mock.calls.length > 0);
    expect(actions.openLineage).toHaveBeenCalledWith('mnist-classifier', 3);
  });

  it('moves between tabs with the arrow keys', async () => {
    current = setup();
    const { node } = current;
    const list = await until(() => node.querySelector('[role=tablist]'));
    list.dispatchEvent(
      new KeyboardEvent('keydown', { key: 'ArrowRight', bubbles: true })
    );
    await until(() =>
      node.querySelector('#danlu-tab-experiments[aria-selected=true]')
    );
    expect(
      node.querySelector('#danlu-panel-queue')!.hasAttribute('hidden')
    ).toBe(true);
  });

  it('lists the sweeps once the Sweeps tab is shown, and opens one', async () => {
    current = setup();
    const { node, service, actions } = current;
    await sleep(20);
    expect(service.sweeps).not.toHaveBeenCalled();
    const tab = await until(
      () =>
        [...node.querySelectorAll('[role=tab]')].find(
          t => t.textContent === 'Sweeps'
        ) as HTMLElement | undefined
    );
    tab.click();
    const item = await until(() =>
      node.querySelector('li.danlu-sweep-item[data-sweep-id="5eeeeeeeeea1"]')
    );
    expect(item.getAttribute('data-state')).toBe('running');
    expect(
      [...item.querySelectorAll('[data-count]')].map(b => b.textContent)
    ).toEqual(['2 running', '3 complete', '1 pruned']);
    expect(item.querySelector('.danlu-sweep-best')!.textContent).toContain(
      'best loss 0.25 (trial 3)'
    );
    (
      item.querySelector(
        'button[aria-label="Open sweep lr-search"]'
      ) as HTMLButtonElement
    ).click();
    expect(actions.openSweep).toHaveBeenCalledWith('5eeeeeeeeea1', 'lr-search');
  });
});
