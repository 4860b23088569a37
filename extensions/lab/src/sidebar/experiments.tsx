/**
 * The Experiments tab: the experiments holding this user's runs, one
 * experiment's runs as a table (parameters and last metric values, a checkbox
 * per row, a link to MLflow), and for the checked runs a comparison chart of one
 * metric and a TensorBoard over their logs. Each run can be registered as a
 * model version (its row then shows the version's approval and evaluation, and
 * a Lineage button).
 */
import { refreshIcon } from '@jupyterlab/ui-components';
import * as React from 'react';

import { CompareChart } from '../components/chart';
import { formatNumber, formatTime } from '../components/format';
import { describeVersion } from '../components/register';
import { ExperimentsModel } from '../model';
import { IModelVersion, IRun } from '../tokens';
import { ISidebarActions } from './actions';
import { Empty, ErrorState, IconButton, Loading, useSignal } from './common';

export function ExperimentsPanel(props: {
  model: ExperimentsModel;
  actions: ISidebarActions;
}): JSX.Element {
  const { model, actions } = props;
  useSignal(model.changed);
  const state = model.experimentsState;

  // Show the newest experiment's runs once the list is in.
  React.useEffect(() => {
    if (
      state.status === 'ready' &&
      model.selectedExperiment === null &&
      model.experiments.length
    ) {
      void model.selectExperiment(model.experiments[0].experiment_id);
    }
  }, [state.status]);

  return (
    <div className="danlu-experiments">
      <div className="danlu-section-head">
        <h3 id="danlu-experiments-heading">Experiments</h3>
        <IconButton
          icon={refreshIcon}
          label="Refresh experiments"
          onClick={() => {
            void model.loadExperiments().then(() => model.reloadRuns());
          }}
        />
      </div>
      {(state.status === 'loading' || state.status === 'idle') && (
        <Loading what="experiments" />
      )}
      {state.status === 'error' && (
        <ErrorState
          message={`Could not load the experiments: ${state.error}`}
          onRetry={() => void model.loadExperiments()}
        />
      )}
      {state.status === 'empty' && (
        <Empty>
          No experiments yet: the runs of your training jobs appear here.
        </Empty>
      )}
      {model.experiments.length > 0 && (
        <ul
          className="danlu-experiment-list"
          aria-labelledby="danlu-experiments-heading"
        >
          {model.experiments.map(e => (
            <li key={e.experiment_id}>
              <button
                type="button"
                className="danlu-experiment"
                data-experiment-id={e.experiment_id}
                aria-pressed={model.selectedExperiment === e.experiment_id}
                onClick={() => void model.selectExperiment(e.experiment_id)}
              >
                <span className="danlu-experiment-name">{e.name}</span>
                <span className="danlu-experiment-runs">
                  {e.runs} run{e.runs === 1 ? '' : 's'}
                </span>
              </button>
            </li>
          ))}
        </ul>
      )}
      {model.selectedExperiment !== null && (
        <RunsSection model={model} actions={actions} />
      )}
    </div>
  );
}

function RunsSection(props: {
  model: ExperimentsModel;
  actions: ISidebarActions;
}): JSX.Element {
  const { model, actions } = props;
  const state = model.runsState;
  const selected = model.selectedRuns;
  const [opening, setOpening] = React.useState(false);
  const openTensorBoard = async () => {
    setOpening(true);
    try {
      await actions.openTensorBoard(
        { run_ids: selected.map(r => r.run_id) },
        selected.map(r => r.run_name || r.run_id).join(', ')
      );
    } finally {
      setOpening(false);
    }
  };
  return (
    <section className="danlu-runs-section" aria-label="Runs">
      {state.status === 'loading' && <Loading what="runs" />}
      {state.status === 'error' && (
        <ErrorState
          message={`Could not load the runs: ${state.error}`}
          onRetry={() => void model.reloadRuns()}
        />
      )}
      {state.status === 'empty' && (
        <Empty>This experiment has no runs of yours.</Empty>
      )}
      {model.runs.length > 0 && (
        <>
          <div className="danlu-runs-actions">
            <button
              type="button"
              className="jp-Button jp-mod-styled jp-mod-accept"
              disabled={!selected.length}
              onClick={() => void model.compare()}
            >
              Compare
            </button>
            <button
              type="button"
              className="jp-Button jp-mod-styled"
              disabled={!selected.length || opening}
              onClick={() => void openTensorBoard()}
            >
              Open TensorBoard
            </button>
            <span className="danlu-selection-count" aria-live="polite">
              {selected.length} selected
            </span>
          </div>
          <RunsTable model={model} actions={actions} />
          <Comparison model={model} />
        </>
      )}
    </section>
  );
}

function RunsTable(props: {
  model: ExperimentsModel;
  actions: ISidebarActions;
}): JSX.Element {
  const { model, actions } = props;
  const params = model.paramKeys;
  const metrics = model.metricKeys;
  const all =
    model.runs.length > 0 && model.selection.size === model.runs.length;
  return (
    <div className="danlu-table-wrap">
      <table className="danlu-runs">
        <thead>
          <tr>
            <th scope="col">
              <input
                type="checkbox"
                aria-label="Select all runs"
                checked={all}
                onChange={e => model.selectAll(e.currentTarget.checked)}
              />
            </th>
            <th scope="col">Run</th>
            <th scope="col">Status</th>
            <th scope="col">Started</th>
            {params.map(k => (
              <th
                scope="col"
                key={`p-${k}`}
                className="danlu-param"
                title={`parameter ${k}`}
              >
                {k}
              </th>
            ))}
            {metrics.map(k => (
              <th
                scope="col"
                key={`m-${k}`}
                className="danlu-metric"
                title={`metric ${k} (last value)`}
              >
                {k}
              </th>
            ))}
            <th scope="col">MLflow</th>
            <th scope="col">Model</th>
          </tr>
        </thead>
        <tbody>
          {model.runs.map(run => (
            <RunRow
              key={run.run_id}
              run={run}
              params={params}
              metrics={metrics}
              checked={model.selection.has(run.run_id)}
              onToggle={on => model.toggleRun(run.run_id, on)}
              registered={model.registeredFrom(run.run_id)}
              onRegister={async () => {
                const version = await actions.registerModel(run);
                if (version) {
                  model.noteRegistered(version);
                }
              }}
              onOpenLineage={v => void actions.openLineage(v.name, v.version)}
            />
          ))}
        </tbody>
      </table>
    </div>
  );
}

function RunRow(props: {
  run: IRun;
  params: string[];
  metrics: string[];
  checked: boolean;
  onToggle: (on: boolean) => void;
  registered: readonly IModelVersion[];
  onRegister: () => Promise<void>;
  onOpenLineage: (version: IModelVersion) => void;
}): JSX.Element {
  const { run } = props;
  const name = run.run_name || run.run_id;
  const [registering, setRegistering] = React.useState(false);
  const register = async () => {
    setRegistering(true);
    try {
      await props.onRegister();
    } finally {
      setRegistering(false);
    }
  };
  return (
    <tr
      data-run-id={run.run_id}
      className={props.checked ? 'danlu-mod-selected' : ''}
    >
      <td>
        <input
          type="checkbox"
          aria-label={`Select run ${name}`}
          checked={props.checked}
          onChange={e => props.onToggle(e.currentTarget.checked)}
        />
      </td>
      <th
        scope="row"
        className="danlu-run-name"
        title={run.job_id ? `job ${run.job_id}` : ''}
      >
        {name}
      </th>
      <td
        className={`danlu-run-status danlu-status-${run.status?.toLowerCase()}`}
      >
        {run.status}
      </td>
      <td>{formatTime(run.start_time)}</td>
      {props.params.map(k => (
        <td key={`p-${k}`} className="danlu-param">
          {run.params?.[k] ?? ''}
        </td>
      ))}
      {props.metrics.map(k => (
        <td key={`m-${k}`} className="danlu-metric">
          {formatNumber(run.metrics?.[k])}
        </td>
      ))}
      <td>
        {run.mlflow_url && (
          <a
            className="danlu-link"
            href={run.mlflow_url}
            target="_blank"
            rel="noopener noreferrer"
            aria-label={`Open in MLflow: run ${name}`}
          >
            Open in MLflow
          </a>
        )}
      </td>
      <td className="danlu-run-model">
        <button
          type="button"
          className="jp-Button jp-mod-styled danlu-register-model"
          aria-label={`Register model from run ${name}`}
          title={`Register model from run ${name}`}
          disabled={registering}
          onClick={() => void register()}
        >
          Register model
        </button>
        {props.registered.map(v => (
          <div
            key={`${v.name}-${v.version}`}
            className="danlu-registered"
            data-model={v.name}
            data-version={String(v.version)}
            data-approval={v.approval}
            data-evaluation={v.evaluation?.state ?? ''}
            title={describeVersion(v)}
          >
            <span className="danlu-registered-name">
              {v.name} v{v.version}
            </span>
            <span className={`danlu-approval danlu-approval-${v.approval}`}>
              {v.approval}
            </span>
            {v.evaluation?.state && (
              <span className="danlu-evaluation">
                evaluation {v.evaluation.state}
              </span>
            )}
            <button
              type="button"
              className="jp-Button jp-mod-minimal danlu-open-lineage"
              aria-label={`Open lineage of ${v.name} version ${v.version}`}
              title={`Open lineage of ${v.name} version ${v.version}`}
              onClick={() => props.onOpenLineage(v)}
            >
              Lineage
            </button>
          </div>
        ))}
      </td>
    </tr>
  );
}

function Comparison(props: { model: ExperimentsModel }): JSX.Element | null {
  const { model } = props;
  const state = model.historyState;
  if (state.status === 'idle') {
    return null;
  }
  const keys = Array.from(
    new Set(model.selectedRuns.flatMap(run => Object.keys(run.metrics ?? {})))
  ).sort();
  const key = model.compareKey ?? '';
  return (
    <section className="danlu-comparison" aria-label="Comparison">
      {keys.length > 0 && (
        <label className="danlu-metric-select">
          <span>Metric</span>
          <select
            aria-label="Metric"
            value={key}
            onChange={e => void model.compare(e.currentTarget.value)}
          >
            {!keys.includes(key) && key && <option value={key}>{key}</option>}
            {keys.map(k => (
              <option key={k} value={k}>
                {k}
              </option>
            ))}
          </select>
        </label>
      )}
      {state.status === 'loading' && <Loading what={`the history of ${key}`} />}
      {state.status === 'error' && (
        <ErrorState
          message={state.error ?? 'The comparison failed.'}
          onRetry={() => void model.compare()}
        />
      )}
      {state.status === 'empty' && (
        <Empty>The selected runs logged no values of {key}.</Empty>
      )}
      {state.status === 'ready' && model.history && (
        <CompareChart
          metric={model.history.key}
          series={model.history.series}
        />
      )}
    </section>
  );
}
