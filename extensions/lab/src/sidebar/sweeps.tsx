/**
 * The Sweeps tab: this user's sweeps, newest first, with their state, their
 * trials' counts by state and the best value so far. A sweep opens in a
 * main-area tab (its trials, best-so-far curve and parameters against the
 * objective, and its Stop button).
 */
import * as React from 'react';

import { formatNumber, formatRelative } from '../components/format';
import { SweepsModel } from '../sweeps';
import { ISweepSummary } from '../tokens';
import { ISidebarActions } from './actions';
import { Empty, ErrorState, Loading, useSignal } from './common';

const COUNTED = ['running', 'complete', 'pruned', 'failed', 'stopped'] as const;

export function SweepsPanel(props: {
  model: SweepsModel;
  actions: ISidebarActions;
}): JSX.Element {
  const { model, actions } = props;
  useSignal(model.changed);
  const status = model.status;
  return (
    <div className="danlu-sweeps">
      {status === 'loading' && <Loading what="your sweeps" />}
      {status === 'error' && (
        <ErrorState
          message={`Could not load your sweeps: ${model.error}`}
          onRetry={() => void model.refresh()}
        />
      )}
      {status === 'empty' && (
        <Empty>
          No sweeps yet. Start one with <code>%%train --sweep</code> or{' '}
          <code>danlu jobs submit --sweep</code>.
        </Empty>
      )}
      {model.sweeps.length > 0 && (
        <ul className="danlu-sweep-list" aria-label="Your sweeps">
          {model.sweeps.map(sweep => (
            <SweepItem
              key={sweep.id}
              sweep={sweep}
              onOpen={() => void actions.openSweep(sweep.id, sweep.name)}
            />
          ))}
        </ul>
      )}
    </div>
  );
}

function SweepItem(props: {
  sweep: ISweepSummary;
  onOpen: () => void;
}): JSX.Element {
  const { sweep } = props;
  const counts = COUNTED.filter(k => (sweep.counts?.[k] ?? 0) > 0);
  return (
    <li
      className="danlu-sweep-item"
      data-sweep-id={sweep.id}
      data-state={sweep.state}
    >
      <button
        type="button"
        className="danlu-sweep-open"
        aria-label={`Open sweep ${sweep.name}`}
        title={`Open sweep ${sweep.name} (${sweep.id})`}
        onClick={props.onOpen}
      >
        <span className="danlu-sweep-head">
          <span className="danlu-sweep-name">{sweep.name}</span>
          <span className={`danlu-job-state danlu-sweep-state-${sweep.state}`}>
            {sweep.state}
          </span>
        </span>
        <span className="danlu-job-details">
          <span className="danlu-job-id">{sweep.id}</span>
          <span>{sweep.objective?.text}</span>
          {sweep.created_at && <span>{formatRelative(sweep.created_at)}</span>}
        </span>
        <span className="danlu-sweep-counts">
          {counts.map(k => (
            <span
              key={k}
              className={`danlu-trial-badge danlu-trial-${k}`}
              data-count={k}
            >
              {sweep.counts[k]} {k}
            </span>
          ))}
        </span>
        {sweep.best && (
          <span className="danlu-sweep-best">
            best {sweep.objective?.metric} {formatNumber(sweep.best.value)}{' '}
            (trial {sweep.best.number})
          </span>
        )}
      </button>
    </li>
  );
}
