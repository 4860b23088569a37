/**
 * One sweep in a main-area tab: its state and objective, a Stop button (after
 * a confirmation, the jobs service cancels its queued and running trials), a
 * link to its parent run in MLflow, the best-so-far curve, one scatter per
 * parameter against the objective, and the trials' table (state, parameters,
 * objective, step and rungs, and each trial's job with its live log).
 *
 * Everything the API sends is rendered as React text or attributes, never as
 * HTML; links go through `safeUrl`.
 */
import { MainAreaWidget, ReactWidget } from '@jupyterlab/apputils';
import { listIcon, refreshIcon } from '@jupyterlab/ui-components';
import * as React from 'react';

import { DanluService } from '../handler';
import {
  Empty,
  ErrorState,
  IconButton,
  Loading,
  useSignal
} from '../sidebar/common';
import { SweepModel } from '../sweeps';
import { ISweep, ISweepTrial } from '../tokens';
import { layoutChart } from './chart';
import { formatNumber } from './format';
import { danluIcon } from './icons';
import { safeUrl } from './lineage';
import { LogView } from './logview';
import {
  curveSeries,
  formatParam,
  IScatterLayout,
  layoutScatters,
  TRIAL_COLORS
} from './sweepdata';

/** What the view asks of the application (index.ts: a dialog, an error message). */
export interface ISweepActions {
  /** Ask whether to stop the sweep. */
  confirmStop(sweep: ISweep): Promise<boolean>;
  /** Say that something failed, in a dialog. */
  showError(title: string, message: string): Promise<void>;
}

export function SweepView(props: {
  model: SweepModel;
  service: DanluService;
  actions: ISweepActions;
}): JSX.Element {
  const { model, service, actions } = props;
  useSignal(model.changed);
  const [stopping, setStopping] = React.useState(false);
  const sweep = model.sweep;
  const stop = async () => {
    if (!sweep || !(await actions.confirmStop(sweep))) {
      return;
    }
    setStopping(true);
    try {
      await model.stop();
    } catch (error) {
      await actions.showError(
        `Sweep ${sweep.name} could not be stopped`,
        error instanceof Error ? error.message : String(error)
      );
    } finally {
      setStopping(false);
    }
  };
  const mlflow = safeUrl(sweep?.mlflow_run_url);
  return (
    <div
      className="danlu-sweep"
      data-sweep-id={model.id}
      data-state={sweep?.state ?? ''}
    >
      <div className="danlu-section-head">
        <h2>Sweep {sweep?.name ?? model.id}</h2>
        {sweep && (
          <span
            className={`danlu-job-state danlu-sweep-state-${sweep.state}`}
            data-state={sweep.state}
          >
            {sweep.state}
          </span>
        )}
        <IconButton
          icon={refreshIcon}
          label="Refresh sweep"
          onClick={() => void model.refresh()}
        />
        {sweep?.state === 'running' && (
          <button
            type="button"
            className="jp-Button jp-mod-styled jp-mod-warn danlu-sweep-stop"
            disabled={stopping}
            onClick={() => void stop()}
          >
            Stop sweep
          </button>
        )}
        {mlflow && (
          <a
            className="danlu-link danlu-sweep-mlflow"
            href={mlflow}
            target="_blank"
            rel="noopener noreferrer"
          >
            Parent run in MLflow
          </a>
        )}
      </div>
      {model.status === 'loading' && <Loading what="the sweep" />}
      {model.status === 'error' && (
        <ErrorState
          message={`Could not load the sweep: ${model.error}`}
          onRetry={() => void model.refresh()}
        />
      )}
      {sweep && <SweepBody sweep={sweep} service={service} />}
    </div>
  );
}

function SweepBody(props: {
  sweep: ISweep;
  service: DanluService;
}): JSX.Element {
  const { sweep } = props;
  const options = sweep.options ?? {};
  const facts = [
    `objective ${sweep.objective?.text ?? ''}`,
    `${options.trials ?? '?'} trials, ${options.parallel ?? '?'} at once`,
    `scheduler ${options.scheduler ?? '?'}, sampler ${options.sampler ?? '?'}`,
    `experiment ${sweep.experiment}`
  ];
  return (
    <>
      <div className="danlu-job-details danlu-sweep-facts">
        <span className="danlu-job-id">{sweep.id}</span>
        {facts.map(f => (
          <span key={f}>{f}</span>
        ))}
      </div>
      <div className="danlu-sweep-space">
        {(sweep.space ?? []).map(d => (
          <code key={d.name}>{d.text}</code>
        ))}
      </div>
      {sweep.reason && <div className="danlu-job-reason">{sweep.reason}</div>}
      {(sweep.notes ?? []).map(note => (
        <div className="danlu-job-reason" key={note}>
          {note}
        </div>
      ))}
      {sweep.best && (
        <div className="danlu-sweep-best" data-trial={sweep.best.number}>
          Best: trial {sweep.best.number}, {sweep.objective?.metric}{' '}
          {formatNumber(sweep.best.value)} with{' '}
          {Object.entries(sweep.best.params ?? {})
            .map(([k, v]) => `${k}=${formatParam(v)}`)
            .join(', ')}
        </div>
      )}
      <div className="danlu-sweep-charts">
        <section className="danlu-sweep-curve-section" aria-label="Best so far">
          <h3>Best {sweep.objective?.metric} so far</h3>
          <BestCurve sweep={sweep} />
        </section>
        <section
          className="danlu-sweep-scatters"
          aria-label="Parameters against the objective"
        >
          <h3>Parameters against {sweep.objective?.metric}</h3>
          <div className="danlu-scatter-grid">
            {layoutScatters(sweep).map(layout => (
              <Scatter
                key={layout.name}
                layout={layout}
                metric={sweep.objective?.metric ?? ''}
              />
            ))}
          </div>
          <ul className="danlu-legend">
            {Object.entries(TRIAL_COLORS).map(([state, color]) => (
              <li key={state}>
                <span className="danlu-swatch" style={{ background: color }} />
                {state}
              </li>
            ))}
          </ul>
        </section>
      </div>
      <TrialsTable sweep={sweep} service={props.service} />
    </>
  );
}

function BestCurve(props: { sweep: ISweep }): JSX.Element {
  const series = curveSeries(props.sweep);
  if (!series[0].points.length) {
    return <Empty>No trial has completed yet.</Empty>;
  }
  const layout = layoutChart(series, 320, 180);
  const { plot } = layout;
  const metric = props.sweep.objective?.metric ?? '';
  return (
    <svg
      className="danlu-sweep-curve"
      role="img"
      aria-label={`best ${metric} after each completed trial`}
      viewBox={`0 0 ${layout.width} ${layout.height}`}
      width="100%"
    >
      <Axes
        plot={plot}
        xTicks={layout.xTicks
          .filter(t => Number.isInteger(t.value))
          .map(t => ({
            label: formatNumber(t.value),
            x: t.x
          }))}
        yTicks={layout.yTicks.map(t => ({
          label: formatNumber(t.value),
          y: t.y
        }))}
        xLabel="trials completed"
      />
      <path
        className="danlu-series danlu-best-curve"
        d={layout.series[0].d}
        stroke="#1f77b4"
        fill="none"
      >
        <title>best so far</title>
      </path>
      {series[1].points.map(([x, y], i) => (
        <circle
          key={i}
          className="danlu-curve-trial"
          cx={layout.sx(x)}
          cy={layout.sy(y)}
          r={2.5}
          fill={TRIAL_COLORS.complete}
        >
          <title>{`completed trial ${i + 1}: ${formatNumber(y)}`}</title>
        </circle>
      ))}
    </svg>
  );
}

function Axes(props: {
  plot: { left: number; top: number; right: number; bottom: number };
  xTicks: { label: string; x: number }[];
  yTicks: { label: string; y: number }[];
  xLabel: string;
}): JSX.Element {
  const { plot } = props;
  return (
    <g className="danlu-axis">
      <line x1={plot.left} y1={plot.bottom} x2={plot.right} y2={plot.bottom} />
      <line x1={plot.left} y1={plot.top} x2={plot.left} y2={plot.bottom} />
      {props.xTicks.map((t, i) => (
        <text
          key={`x${i}`}
          className="danlu-tick-x"
          x={t.x}
          y={plot.bottom + 12}
          textAnchor="middle"
        >
          {t.label}
        </text>
      ))}
      {props.yTicks.map((t, i) => (
        <g key={`y${i}`}>
          <line
            className="danlu-grid"
            x1={plot.left}
            y1={t.y}
            x2={plot.right}
            y2={t.y}
          />
          <text x={plot.left - 4} y={t.y + 3} textAnchor="end">
            {t.label}
          </text>
        </g>
      ))}
      <text
        className="danlu-axis-label"
        x={(plot.left + plot.right) / 2}
        y={plot.bottom + 22}
        textAnchor="middle"
      >
        {props.xLabel}
      </text>
    </g>
  );
}

function Scatter(props: {
  layout: IScatterLayout;
  metric: string;
}): JSX.Element {
  const { layout } = props;
  return (
    <figure
      className="danlu-scatter"
      data-param={layout.name}
      data-axis={layout.kind}
    >
      <svg
        role="img"
        aria-label={`${props.metric} against ${layout.name}`}
        viewBox={`0 0 ${layout.width} ${layout.height}`}
        width="100%"
      >
        <Axes
          plot={layout.plot}
          xTicks={layout.xTicks}
          yTicks={layout.yTicks}
          xLabel={`${layout.name}${layout.kind === 'log' ? ' (log)' : ''}`}
        />
        {layout.points.map(p => (
          <circle
            key={p.number}
            className="danlu-scatter-point"
            data-trial={p.number}
            data-state={p.state}
            cx={p.x}
            cy={p.y}
            r={3.5}
            fill={p.color}
          >
            <title>{`trial ${p.number} (${p.state}): ${layout.name}=${formatParam(p.param)}, ${props.metric}=${formatNumber(p.value)}`}</title>
          </circle>
        ))}
      </svg>
    </figure>
  );
}

function TrialsTable(props: {
  sweep: ISweep;
  service: DanluService;
}): JSX.Element {
  const { sweep } = props;
  const [logs, setLogs] = React.useState<ReadonlySet<string>>(new Set());
  const names = (sweep.space ?? []).map(d => d.name);
  const trials = [...(sweep.trials ?? [])].sort((a, b) => a.number - b.number);
  const toggle = (id: string) =>
    setLogs(prev => {
      const next = new Set(prev);
      if (!next.delete(id)) {
        next.add(id);
      }
      return next;
    });
  if (!trials.length) {
    return <Empty>No trials yet.</Empty>;
  }
  return (
    <div className="danlu-table-wrap">
      <table className="danlu-runs danlu-trials" aria-label="Trials">
        <thead>
          <tr>
            <th scope="col">Trial</th>
            <th scope="col">State</th>
            {names.map(k => (
              <th scope="col" key={`p-${k}`} className="danlu-param">
                {k}
              </th>
            ))}
            <th scope="col" className="danlu-metric">
              {sweep.objective?.metric}
            </th>
            <th scope="col">Step</th>
            <th scope="col">Rungs</th>
            <th scope="col">Job</th>
            <th scope="col">Reason</th>
          </tr>
        </thead>
        <tbody>
          {trials.map(t => (
            <TrialRow
              key={t.number}
              trial={t}
              names={names}
              service={props.service}
              showLog={!!t.job_id && logs.has(t.job_id)}
              onToggleLog={() => t.job_id && toggle(t.job_id)}
              best={sweep.best?.number === t.number}
              columns={names.length + 7}
            />
          ))}
        </tbody>
      </table>
    </div>
  );
}

function TrialRow(props: {
  trial: ISweepTrial;
  names: string[];
  service: DanluService;
  showLog: boolean;
  onToggleLog: () => void;
  best: boolean;
  columns: number;
}): JSX.Element {
  const { trial: t } = props;
  const job = t.job_id;
  return (
    <>
      <tr
        data-trial={t.number}
        data-state={t.state}
        data-job-id={job ?? ''}
        className={props.best ? 'danlu-mod-selected' : ''}
      >
        <th scope="row">
          {t.number}
          {props.best ? ' ★' : ''}
        </th>
        <td>
          <span
            className={`danlu-trial-badge danlu-trial-${t.state}`}
            title={t.job_state ? `job ${t.job_state}` : ''}
          >
            {t.state}
          </span>
        </td>
        {props.names.map(k => (
          <td key={`p-${k}`} className="danlu-param">
            {t.params?.[k] === undefined ? '' : formatParam(t.params[k])}
          </td>
        ))}
        <td className="danlu-metric">{formatNumber(t.value)}</td>
        <td>{t.step ?? ''}</td>
        <td>{t.rungs || ''}</td>
        <td className="danlu-trial-job">
          {job && (
            <>
              <span className="danlu-job-id" title={t.job_state ?? ''}>
                {job}
              </span>
              <IconButton
                icon={listIcon}
                label={`Show log of job ${job}`}
                pressed={props.showLog}
                onClick={props.onToggleLog}
              />
            </>
          )}
        </td>
        <td className="danlu-trial-reason">{t.reason || t.job_reason || ''}</td>
      </tr>
      {props.showLog && job && (
        <tr className="danlu-trial-log">
          <td colSpan={props.columns}>
            <LogView service={props.service} jobId={job} />
          </td>
        </tr>
      )}
    </>
  );
}

/** The widget id of a sweep's tab. */
export function sweepWidgetId(id: string): string {
  return `danlu-sweep-${id}`;
}

/** A main-area tab with one sweep; it polls while open and stops when closed. */
export function createSweepWidget(
  service: DanluService,
  id: string,
  name: string,
  actions: ISweepActions
): MainAreaWidget<ReactWidget> {
  const model = new SweepModel({ service, id });
  const content = ReactWidget.create(
    <SweepView model={model} service={service} actions={actions} />
  );
  content.addClass('danlu-sweep-panel');
  const widget = new MainAreaWidget({ content });
  widget.id = sweepWidgetId(id);
  widget.title.label = `Sweep: ${name || id}`;
  widget.title.caption = `Sweep ${name} (${id}): trials, best so far, parameters against the objective`;
  widget.title.icon = danluIcon;
  widget.title.closable = true;
  widget.disposed.connect(() => model.dispose());
  return widget;
}
