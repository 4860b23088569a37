/**
 * The comparison chart: one metric across runs, drawn as plain SVG.
 *
 * `layoutChart` is pure (scales, ticks and one path per series) so that Jest can
 * check the geometry; `CompareChart` renders it with a legend.
 */
import * as React from 'react';

import { IMetricSeries } from '../tokens';
import { formatNumber } from './format';

export const SERIES_COLORS = [
  '#1f77b4',
  '#ff7f0e',
  '#2ca02c',
  '#d62728',
  '#9467bd',
  '#8c564b',
  '#e377c2',
  '#17becf'
];

export interface IChartLayout {
  width: number;
  height: number;
  plot: { left: number; top: number; right: number; bottom: number };
  xTicks: { value: number; x: number }[];
  yTicks: { value: number; y: number }[];
  series: { run_id: string; run_name: string; color: string; d: string }[];
  /** The pixel of a step (x) and of a value (y), rounded as the paths are. */
  sx: (value: number) => number;
  sy: (value: number) => number;
}

/** About `count` round tick values covering [min, max]. */
export function niceTicks(min: number, max: number, count = 5): number[] {
  if (!isFinite(min) || !isFinite(max)) {
    return [];
  }
  if (min === max) {
    return [min];
  }
  const raw = (max - min) / Math.max(1, count);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step =
    [1, 2, 2.5, 5, 10].map(m => m * power).find(s => s >= raw) ?? raw;
  const ticks: number[] = [];
  for (
    let v = Math.ceil(min / step) * step;
    v <= max + step * 1e-9;
    v += step
  ) {
    ticks.push(Number(v.toPrecision(12)));
  }
  return ticks;
}

/** Scales, ticks and an SVG path per series, for a chart of the given size. */
export function layoutChart(
  series: readonly IMetricSeries[],
  width = 320,
  height = 200
): IChartLayout {
  const plot = { left: 44, top: 8, right: width - 8, bottom: height - 24 };
  const points = series.flatMap(s => s.points);
  const xs = points.map(p => p[0]);
  const ys = points.map(p => p[1]).filter(v => isFinite(v));
  let [x0, x1] = xs.length ? [Math.min(...xs), Math.max(...xs)] : [0, 1];
  let [y0, y1] = ys.length ? [Math.min(...ys), Math.max(...ys)] : [0, 1];
  if (x0 === x1) {
    [x0, x1] = [x0 - 1, x1 + 1];
  }
  if (y0 === y1) {
    const pad = Math.abs(y0) * 0.1 || 1;
    [y0, y1] = [y0 - pad, y1 + pad];
  }
  const sx = (v: number) =>
    plot.left + ((v - x0) / (x1 - x0)) * (plot.right - plot.left);
  const sy = (v: number) =>
    plot.bottom - ((v - y0) / (y1 - y0)) * (plot.bottom - plot.top);
  const round = (v: number) => Math.round(v * 10) / 10;
  return {
    width,
    height,
    plot,
    sx: v => round(sx(v)),
    sy: v => round(sy(v)),
    xTicks: niceTicks(x0, x1).map(value => ({ value, x: round(sx(value)) })),
    yTicks: niceTicks(y0, y1, 4).map(value => ({ value, y: round(sy(value)) })),
    series: series.map((s, i) => ({
      run_id: s.run_id,
      run_name: s.run_name,
      color: SERIES_COLORS[i % SERIES_COLORS.length],
      d: [...s.points]
        .filter(p => isFinite(p[1]))
        .sort((a, b) => a[0] - b[0])
        .map((p, j) => `${j ? 'L' : 'M'}${round(sx(p[0]))},${round(sy(p[1]))}`)
        .join('')
    }))
  };
}

/** The chart of one metric, with axes and a legend. */
export function CompareChart(props: {
  metric: string;
  series: readonly IMetricSeries[];
}): JSX.Element {
  const layout = layoutChart(props.series);
  const { plot } = layout;
  return (
    <figure className="danlu-compare">
      <svg
        className="danlu-compare-chart"
        role="img"
        aria-label={`${props.metric} by step for ${props.series.length} run(s)`}
        viewBox={`0 0 ${layout.width} ${layout.height}`}
        width="100%"
      >
        <g className="danlu-axis">
          <line
            x1={plot.left}
            y1={plot.bottom}
            x2={plot.right}
            y2={plot.bottom}
          />
          <line x1={plot.left} y1={plot.top} x2={plot.left} y2={plot.bottom} />
          {layout.xTicks.map(t => (
            <text
              key={`x${t.value}`}
              x={t.x}
              y={plot.bottom + 14}
              textAnchor="middle"
            >
              {formatNumber(t.value)}
            </text>
          ))}
          {layout.yTicks.map(t => (
            <g key={`y${t.value}`}>
              <line
                className="danlu-grid"
                x1={plot.left}
                y1={t.y}
                x2={plot.right}
                y2={t.y}
              />
              <text x={plot.left - 4} y={t.y + 3} textAnchor="end">
                {formatNumber(t.value)}
              </text>
            </g>
          ))}
        </g>
        {layout.series.map(s => (
          <path
            key={s.run_id}
            className="danlu-series"
            data-run-id={s.run_id}
            d={s.d}
            stroke={s.color}
            fill="none"
          >
            <title>{runLabel(s)}</title>
          </path>
        ))}
      </svg>
      <figcaption>
        <ul className="danlu-legend">
          {layout.series.map(s => (
            <li key={s.run_id}>
              <span className="danlu-swatch" style={{ background: s.color }} />
              {runLabel(s)}
            </li>
          ))}
        </ul>
      </figcaption>
    </figure>
  );
}

/** A run as the legend names it: its name and the start of its id (runs of one job name look alike). */
export function runLabel(run: { run_id: string; run_name: string }): string {
  return run.run_name
    ? `${run.run_name} · ${run.run_id.slice(0, 8)}`
    : run.run_id;
}
