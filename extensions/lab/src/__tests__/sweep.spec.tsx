/**
 * A sweep's view: the best-so-far curve, the scatters' scales (a log axis for
 * loguniform, one column per choice), the polling model, and the rendered tab
 * (trials with their states, Stop after a confirmation, API text never as HTML).
 */
import { Widget } from '@lumino/widgets';
import * as React from 'react';

import {
  bestSoFar,
  categoryAxis,
  curveSeries,
  linearAxis,
  layoutScatters,
  logAxis,
  parameterAxis
} from '../components/sweepdata';
import { ReactWidget } from '@jupyterlab/apputils';
import { SweepView } from '../components/sweep';
import { SweepModel, SweepsModel, sweepSettled } from '../sweeps';
import { ISweep, ISweepTrial } from '../tokens';

function trial(
  number: number,
  state: string,
  value: number | null,
  params: Record<string, unknown>,
  finished_at: string | null = null
): ISweepTrial {
  return {
    number,
    job_id: `00000000000${number}`,
    job_state: state === 'running' ? 'running' : 'succeeded',
    attempts: 1,
    preemptions: 0,
    state,
    params,
    value,
    step: 5,
    rungs: 1,
    reason: '',
    finished_at
  };
}

const TRIALS = [
  trial(0, 'complete', 0.5, { lr: 0.01, batch: 32 }, '2025-01-01T00:00:03Z'),
  trial(1, 'complete', 0.8, { lr: 0.1, batch: 64 }, '2025-01-01T00:00:01Z'),
  trial(2, 'pruned', 0.9, { lr: 0.0001, batch: 64 }, '2025-01-01T00:00:02Z'),
  trial(3, 'complete', 0.3, { lr: 0.001, batch: 32 }, '2025-01-01T00:00:04Z'),
  trial(4, 'running', 0.7, { lr: 0.05, batch: 32 }),
  trial(5, 'running', null, { lr: 0.02, batch: 64 })
];

function sweep(overrides: Partial<ISweep> = {}): ISweep {
  return {
    id: '5eeeeeeeeea1',
    name: 'lr-search',
    owner: 'alice',
    state: 'running',
    reason: '',
    created_at: '2025-01-01T00:00:00Z',
    finished_at: null,
    objective: { metric: 'loss', direction: 'minimize', text: 'loss:min' },
    space: [
      {
        name: 'lr',
        distribution: 'loguniform',
        low: 0.0001,
        high: 0.1,
        text: 'lr=loguniform(0.0001,0.1)'
      },
      {
        name: 'batch',
        distribution: 'choice',
        choices: [32, 64],
        text: 'batch=choice(32,64)'
      }
    ],
    options: { trials: 8, parallel: 2, scheduler: 'asha', sampler: 'tpe' },
    experiment: 'alice/train',
    mlflow_run_id: 'r'.repeat(32),
    mlflow_run_url: '/services/mlflow/#/experiments/1/runs/rrr',
    counts: { running: 2, complete: 3, pruned: 1, failed: 0, stopped: 0 },
    best: {
      number: 3,
      job_id: '000000000003',
      value: 0.3,
      params: { lr: 0.001 }
    },
    notes: [],
    trials: TRIALS,
    best_curve: [],
    ...overrides
  };
}

describe('bestSoFar', () => {
  it('takes complete trials in the order they ended, keeping the best', () => {
    expect(bestSoFar(TRIALS, 'minimize')).toEqual([
      { trial: 1, value: 0.8, best: 0.8 },
      { trial: 0, value: 0.5, best: 0.5 },
      { trial: 3, value: 0.3, best: 0.3 }
    ]);
    expect(bestSoFar(TRIALS, 'maximize').map(p => p.best)).toEqual([
      0.8, 0.8, 0.8
    ]);
  });

  it("is the service's curve when it sends one, as series over trials ended", () => {
    const [best, values] = curveSeries(
      sweep({
        best_curve: [
          { trial: 4, finished_at: null, value: 2, best: 2 },
          { trial: 1, finished_at: null, value: 3, best: 2 }
        ]
      })
    );
    expect(best.points).toEqual([
      [1, 2],
      [2, 2]
    ]);
    expect(values.points).toEqual([
      [1, 2],
      [2, 3]
    ]);
    // no curve from the service: computed from the trials
    expect(curveSeries(sweep())[0].points).toEqual([
      [1, 0.8],
      [2, 0.5],
      [3, 0.3]
    ]);
  });
});

describe('axes', () => {
  it('places a log axis by decades, ticks at powers of ten', () => {
    const axis = logAxis(1e-4, 1e-1, 0, 300);
    expect(axis.kind).toBe('log');
    expect(axis.at(1e-4)).toBeCloseTo(0);
    expect(axis.at(1e-3)).toBeCloseTo(100);
    expect(axis.at(1e-2)).toBeCloseTo(200);
    expect(axis.at(1e-1)).toBeCloseTo(300);
    expect(axis.ticks.map(t => t.label)).toEqual([
      '1e-4',
      '0.001',
      '0.01',
      '0.1'
    ]);
    expect(axis.at(0)).toBeNaN();
    expect(axis.at(-1)).toBeNaN();
  });

  it('adds 2 and 5 times the powers of ten within less than two decades', () => {
    const axis = logAxis(0.01, 0.5, 0, 100);
    expect(axis.ticks.map(t => t.label)).toEqual([
      '0.01',
      '0.02',
      '0.05',
      '0.1',
      '0.2',
      '0.5'
    ]);
  });

  it('is linear for uniform and int, and pixels may run upwards for y', () => {
    const x = linearAxis(0, 10, 0, 100);
    expect(x.at(5)).toBe(50);
    const y = linearAxis(0, 1, 100, 0);
    expect(y.at(1)).toBe(0);
    expect(y.at(0.25)).toBe(75);
    expect(linearAxis(3, 3, 0, 100).at(3)).toBe(50);
  });

  it('gives each choice a column, the space order first', () => {
    const axis = categoryAxis([64, 32, 'adam', 64], 0, 300);
    expect(axis.ticks.map(t => t.label)).toEqual(['64', '32', 'adam']);
    expect(axis.at(32)).toBe(150);
    expect(axis.at('sgd')).toBeNaN();
    const dim = {
      name: 'batch',
      distribution: 'choice',
      choices: [32, 64],
      text: ''
    };
    expect(parameterAxis(dim, [64], 0, 100).ticks.map(t => t.label)).toEqual([
      '32',
      '64'
    ]);
  });
});

describe('layoutScatters', () => {
  it('draws each trial with a value in one plot per parameter, sharing the y scale', () => {
    const plots = layoutScatters(sweep(), 220, 160);
    expect(plots.map(p => [p.name, p.kind])).toEqual([
      ['lr', 'log'],
      ['batch', 'category']
    ]);
    const [lr, batch] = plots;
    // trial 5 has no value yet
    expect(lr.points.map(p => p.number)).toEqual([0, 1, 2, 3, 4]);
    for (const p of lr.points) {
      expect(p.x).toBeGreaterThanOrEqual(lr.plot.left);
      expect(p.x).toBeLessThanOrEqual(lr.plot.right);
      expect(p.y).toBeGreaterThanOrEqual(lr.plot.top);
      expect(p.y).toBeLessThanOrEqual(lr.plot.bottom);
    }
    // log: 1e-4, 1e-3, 1e-2 and 1e-1 are evenly spaced
    const at = (n: number) => lr.points.find(p => p.number === n)!.x;
    expect(at(3) - at(2)).toBeCloseTo(at(0) - at(3), 0);
    expect(at(1) - at(0)).toBeCloseTo(at(0) - at(3), 0);
    // values up the y axis: the lowest (the best, minimizing) at the bottom, in both plots
    const y = (plot: typeof lr, n: number) =>
      plot.points.find(p => p.number === n)!.y;
    expect(y(lr, 3)).toBe(lr.plot.bottom);
    expect(y(lr, 2)).toBe(lr.plot.top);
    expect(y(batch, 3)).toBe(y(lr, 3));
    expect(lr.points.find(p => p.number === 2)!.state).toBe('pruned');
  });

  it('adds a parameter the space does not name, from the trials', () => {
    const plots = layoutScatters({
      space: [],
      trials: [
        trial(0, 'complete', 1, { opt: 'adam' }),
        trial(1, 'complete', 2, { opt: 'sgd' })
      ]
    });
    expect(plots.map(p => [p.name, p.kind])).toEqual([['opt', 'category']]);
  });
});

describe('SweepModel', () => {
  it('polls until the sweep and its trials have ended, and stops on demand', async () => {
    let current = sweep();
    const service = {
      sweep: jest.fn(async () => current),
      stopSweep: jest.fn(async () => {
        current = sweep({
          state: 'stopped',
          trials: TRIALS.map(t =>
            t.state === 'running'
              ? { ...t, state: 'stopped', job_state: 'cancelled' }
              : t
          )
        });
        return current;
      })
    };
    const model = new SweepModel({ service, id: current.id, interval: 20 });
    await model.refresh();
    expect(model.status).toBe('ready');
    expect(sweepSettled(model.sweep!)).toBe(false);
    await model.stop();
    expect(service.stopSweep).toHaveBeenCalledWith(current.id);
    expect(model.sweep!.state).toBe('stopped');
    expect(sweepSettled(model.sweep!)).toBe(true);
    await new Promise(r => setTimeout(r, 50));
    expect(model.poll.state.phase).toBe('stopped');
    model.dispose();
  });

  it('lists sweeps only once started', async () => {
    const service = {
      sweeps: jest.fn(async () => [sweep()])
      // eslint-disable-next-line @typescript-eslint/no-explicit-any
    } as any;
    const model = new SweepsModel({ service, interval: 10000 });
    await new Promise(r => setTimeout(r, 20));
    expect(service.sweeps).not.toHaveBeenCalled();
    expect(model.status).toBe('loading');
    await model.start();
    expect(model.status).toBe('ready');
    expect(model.sweeps.map(s => s.id)).toEqual(['5eeeeeeeeea1']);
    model.dispose();
  });
});

async function until<T>(find: () => T | null | undefined | false): Promise<T> {
  const start = Date.now();
  for (;;) {
    const found = find();
    if (found) {
      return found;
    }
    if (Date.now() - start > 3000) {
      throw new Error('not rendered in time');
    }
    await new Promise(r => setTimeout(r, 5));
  }
}

describe('SweepView', () => {
  it('shows trials with states, the curve and scatters, and stops after a confirmation', async () => {
    const hostile = '<img src=x onerror="window.pwned=1">';
    let current = sweep({ name: hostile, reason: hostile });
    const service = {
      sweep: jest.fn(async () => current),
      stopSweep: jest.fn(async () => {
        current = sweep({ name: hostile, state: 'stopped' });
        return current;
      })
    };
    const model = new SweepModel({
      service,
      id: current.id,
      interval: 60000
    });
    const confirmStop = jest.fn(async () => true);
    const widget = ReactWidget.create(
      <SweepView
        model={model}
        // eslint-disable-next-line @typescript-eslint/no-explicit-any
        service={service as any}
        actions={{ confirmStop, showError: jest.fn(async () => undefined) }}
      />
    );
    Widget.attach(widget, document.body);
    const node = widget.node;
    const rows = await until(() => {
      const found = node.querySelectorAll('table.danlu-trials tbody tr');
      return found.length === TRIALS.length && found;
    });
    expect([...rows].map(r => r.getAttribute('data-state'))).toEqual(
      TRIALS.map(t => t.state)
    );
    expect(node.querySelectorAll('.danlu-scatter').length).toBe(2);
    expect(
      node
        .querySelector('.danlu-scatter[data-param="lr"]')!
        .getAttribute('data-axis')
    ).toBe('log');
    expect(
      node.querySelectorAll('.danlu-scatter[data-param="lr"] circle').length
    ).toBe(5);
    expect(node.querySelector('path.danlu-best-curve')).not.toBeNull();
    expect(node.querySelector('img')).toBeNull();
    expect(node.textContent).toContain(hostile);
    expect(
      node.querySelector('a.danlu-sweep-mlflow')!.getAttribute('href')
    ).toBe('/services/mlflow/#/experiments/1/runs/rrr');

    (
      node.querySelector('button.danlu-sweep-stop') as HTMLButtonElement
    ).click();
    await until(() => service.stopSweep.mock.calls.length > 0);
    expect(confirmStop).toHaveBeenCalled();
    await until(
      () =>
        node.querySelector('.danlu-sweep')!.getAttribute('data-state') ===
        'stopped'
    );
    expect(node.querySelector('button.danlu-sweep-stop')).toBeNull();
    widget.dispose();
    model.dispose();
  });

  it('does not stop when the confirmation is declined', async () => {
    const service = {
      sweep: jest.fn(async () => sweep()),
      stopSweep: jest.fn(async () => sweep())
    };
    const model = new SweepModel({ service, id: 'x', interval: 60000 });
    const widget = ReactWidget.create(
      <SweepView
        model={model}
        // eslint-disable-next-line @typescript-eslint/no-explicit-any
        service={service as any}
        actions={{
          confirmStop: async () => false,
          showError: jest.fn(async () => undefined)
        }}
      />
    );
    Widget.attach(widget, document.body);
    const stop = await until(
      () =>
        widget.node.querySelector(
          'button.danlu-sweep-stop'
        ) as HTMLButtonElement
    );
    stop.click();
    await new Promise(r => setTimeout(r, 30));
    expect(service.stopSweep).not.toHaveBeenCalled();
    widget.dispose();
    model.dispose();
  });
});
