/**
 * The numbers behind a sweep's view, free of React so that Jest checks them:
 * the best-so-far curve as chart series, and each parameter's scatter against
 * the objective (a log axis for `loguniform`, one column per value of a
 * `choice`, a linear axis otherwise).
 */
import { niceTicks } from './chart';
import { formatNumber } from './format';
import { IMetricSeries, ISweep, ISweepDimension, ISweepTrial } from '../tokens';

/** Colors of a trial's state, shared by the scatter's dots and the table's badges. */
export const TRIAL_COLORS: Record<string, string> = {
  running: '#1f77b4',
  complete: '#2ca02c',
  pruned: '#ff7f0e',
  failed: '#d62728',
  stopped: '#7f7f7f'
};

/** Whether `a` is better than `b` for the sweep's direction. */
export function better(a: number, b: number, direction: string): boolean {
  return direction === 'maximize' ? a > b : a < b;
}

/**
 * The best-so-far curve from the trials themselves, as the jobs service draws
 * it: complete trials in the order they ended, each with the best value so far.
 */
export function bestSoFar(
  trials: readonly ISweepTrial[],
  direction: string
): { trial: number; value: number; best: number }[] {
  const done = trials
    .filter(
      t => t.state === 'complete' && t.value !== null && isFinite(t.value)
    )
    .sort(
      (a, b) =>
        (a.finished_at ?? '').localeCompare(b.finished_at ?? '') ||
        a.number - b.number
    );
  const curve: { trial: number; value: number; best: number }[] = [];
  let best: number | null = null;
  for (const t of done) {
    const value = t.value as number;
    best = best === null || better(value, best, direction) ? value : best;
    curve.push({ trial: t.number, value, best });
  }
  return curve;
}

/**
 * The curve as two chart series over the trials ended so far (x = 1, 2, ...):
 * the best value so far, and each ended trial's own value.
 */
export function curveSeries(sweep: ISweep): IMetricSeries[] {
  const curve = (
    sweep.best_curve?.length
      ? sweep.best_curve
      : bestSoFar(sweep.trials ?? [], sweep.objective?.direction ?? '')
  ).filter(
    p =>
      p.best !== null &&
      p.value !== null &&
      isFinite(p.best as number) &&
      isFinite(p.value as number)
  );
  return [
    {
      run_id: 'best',
      run_name: 'best so far',
      points: curve.map((p, i) => [i + 1, p.best as number])
    },
    {
      run_id: 'trials',
      run_name: 'trial',
      points: curve.map((p, i) => [i + 1, p.value as number])
    }
  ];
}

/** A scale from values to pixels, with its ticks. */
export interface IAxis {
  kind: 'linear' | 'log' | 'category';
  /** The pixel of a value (NaN where the axis cannot place it). */
  at: (value: unknown) => number;
  ticks: { label: string; x: number }[];
}

function finite(values: unknown[]): number[] {
  return values
    .map(v => (typeof v === 'number' ? v : Number(v)))
    .filter(v => typeof v === 'number' && isFinite(v));
}

/** A linear axis over [lo, hi] mapped onto [a, b] pixels (b may be below a, for a y axis). */
export function linearAxis(
  lo: number,
  hi: number,
  a: number,
  b: number
): IAxis {
  if (!isFinite(lo) || !isFinite(hi)) {
    [lo, hi] = [0, 1];
  }
  if (lo === hi) {
    const pad = Math.abs(lo) * 0.1 || 1;
    [lo, hi] = [lo - pad, hi + pad];
  }
  const at = (value: unknown) => {
    const v = Number(value);
    return typeof value === 'boolean' || value === null || !isFinite(v)
      ? NaN
      : a + ((v - lo) / (hi - lo)) * (b - a);
  };
  return {
    kind: 'linear',
    at,
    ticks: niceTicks(lo, hi, 4).map(v => ({ label: tickLabel(v), x: at(v) }))
  };
}

/**
 * A log10 axis over [lo, hi] (both > 0): ticks at the powers of ten inside it,
 * with 2 and 5 times them when it spans less than two decades.
 */
export function logAxis(lo: number, hi: number, a: number, b: number): IAxis {
  if (!(lo > 0) || !(hi > 0) || !isFinite(lo) || !isFinite(hi)) {
    return linearAxis(lo, hi, a, b);
  }
  if (lo === hi) {
    [lo, hi] = [lo / 2, hi * 2];
  }
  const [l0, l1] = [Math.log10(lo), Math.log10(hi)];
  const at = (value: unknown) => {
    const v = Number(value);
    return v > 0 && isFinite(v)
      ? a + ((Math.log10(v) - l0) / (l1 - l0)) * (b - a)
      : NaN;
  };
  const multiples = l1 - l0 < 2 ? [1, 2, 5] : [1];
  const ticks: { label: string; x: number }[] = [];
  for (let e = Math.floor(l0); e <= Math.ceil(l1); e++) {
    for (const m of multiples) {
      const v = Number((m * Math.pow(10, e)).toPrecision(12));
      if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) {
        ticks.push({ label: tickLabel(v), x: at(v) });
      }
    }
  }
  return { kind: 'log', at, ticks };
}

/** One column per value of a `choice`, in the order the space lists them. */
export function categoryAxis(values: unknown[], a: number, b: number): IAxis {
  const keys: string[] = [];
  for (const v of values) {
    const key = categoryKey(v);
    if (!keys.includes(key)) {
      keys.push(key);
    }
  }
  const step = (b - a) / Math.max(1, keys.length);
  const at = (value: unknown) => {
    const i = keys.indexOf(categoryKey(value));
    return i < 0 ? NaN : a + step * (i + 0.5);
  };
  return {
    kind: 'category',
    at,
    ticks: keys.map((k, i) => ({ label: k, x: a + step * (i + 0.5) }))
  };
}

function categoryKey(value: unknown): string {
  return typeof value === 'string' ? value : JSON.stringify(value);
}

/** A tick's text: few digits, exponents for the very small and large. */
export function tickLabel(value: number): string {
  if (value !== 0 && (Math.abs(value) >= 1e5 || Math.abs(value) < 1e-3)) {
    return value.toExponential(0);
  }
  return String(Number(value.toPrecision(3)));
}

/** The x axis of a parameter: from its dimension, or from the trials' values for one the space does not describe. */
export function parameterAxis(
  dim: ISweepDimension | undefined,
  values: unknown[],
  a: number,
  b: number
): IAxis {
  const numbers = finite(values);
  if (dim?.distribution === 'choice') {
    return categoryAxis([...(dim.choices ?? []), ...values], a, b);
  }
  if (!dim && numbers.length < values.length) {
    return categoryAxis(values, a, b);
  }
  const lo =
    dim && typeof dim.low === 'number'
      ? Math.min(dim.low, ...numbers)
      : Math.min(...numbers);
  const hi =
    dim && typeof dim.high === 'number'
      ? Math.max(dim.high, ...numbers)
      : Math.max(...numbers);
  return dim?.distribution === 'loguniform'
    ? logAxis(lo, hi, a, b)
    : linearAxis(lo, hi, a, b);
}

export interface IScatterLayout {
  name: string;
  kind: IAxis['kind'];
  width: number;
  height: number;
  plot: { left: number; top: number; right: number; bottom: number };
  xTicks: { label: string; x: number }[];
  yTicks: { label: string; y: number }[];
  points: {
    number: number;
    state: string;
    x: number;
    y: number;
    param: unknown;
    value: number;
    color: string;
  }[];
}

/**
 * One small scatter per parameter: each trial with a value at its parameter's
 * value (x) and its objective (y, one scale shared by every plot so that they
 * read side by side). Trials without a value yet are left out.
 */
export function layoutScatters(
  sweep: Pick<ISweep, 'space' | 'trials'>,
  width = 220,
  height = 160
): IScatterLayout[] {
  const plot = { left: 44, top: 8, right: width - 10, bottom: height - 24 };
  const trials = (sweep.trials ?? []).filter(
    t => t.value !== null && isFinite(t.value as number)
  );
  const names = (sweep.space ?? []).map(d => d.name);
  for (const t of sweep.trials ?? []) {
    for (const key of Object.keys(t.params ?? {})) {
      if (!names.includes(key)) {
        names.push(key);
      }
    }
  }
  const values = trials.map(t => t.value as number);
  const y = linearAxis(
    Math.min(...values),
    Math.max(...values),
    plot.bottom,
    plot.top
  );
  const round = (v: number) => Math.round(v * 10) / 10;
  return names.map(name => {
    const dim = (sweep.space ?? []).find(d => d.name === name);
    const x = parameterAxis(
      dim,
      (sweep.trials ?? [])
        .map(t => t.params?.[name])
        .filter(v => v !== undefined),
      plot.left,
      plot.right
    );
    return {
      name,
      kind: x.kind,
      width,
      height,
      plot,
      xTicks: x.ticks.map(t => ({ label: t.label, x: round(t.x) })),
      yTicks: y.ticks.map(t => ({ label: t.label, y: round(t.x) })),
      points: trials
        .map(t => ({
          number: t.number,
          state: t.state,
          x: round(x.at(t.params?.[name])),
          y: round(y.at(t.value)),
          param: t.params?.[name],
          value: t.value as number,
          color: TRIAL_COLORS[t.state] ?? '#7f7f7f'
        }))
        .filter(p => isFinite(p.x) && isFinite(p.y))
    };
  });
}

/** A parameter's value as the table shows it. */
export function formatParam(value: unknown): string {
  if (typeof value === 'number') {
    return formatNumber(value);
  }
  return typeof value === 'string' ? value : JSON.stringify(value);
}
