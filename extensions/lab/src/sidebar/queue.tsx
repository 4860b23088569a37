/**
 * The Queue tab: this user's jobs with state, queue position, estimated start,
 * pending reason, GPUs, elapsed time and last checkpoint, and per job the buttons cancel, show
 * log (live), open output and open TensorBoard. Admins also see each team's GPU
 * quota use.
 */
import {
  launchIcon,
  listIcon,
  notebookIcon,
  stopIcon
} from '@jupyterlab/ui-components';
import * as React from 'react';

import {
  formatCheckpoint,
  formatDuration,
  formatRelative,
  gpuTotal
} from '../components/format';
import { LogView } from '../components/logview';
import { QueueModel } from '../model';
import { FINAL_STATES, IJob, IQueue } from '../tokens';
import { ISidebarActions } from './actions';
import {
  Empty,
  ErrorState,
  IconButton,
  Loading,
  useNow,
  useSignal
} from './common';

export function QueuePanel(props: {
  model: QueueModel;
  actions: ISidebarActions;
}): JSX.Element {
  const { model, actions } = props;
  useSignal(model.changed);
  const [logs, setLogs] = React.useState<ReadonlySet<string>>(new Set());
  const [polledAt, setPolledAt] = React.useState(Date.now());
  React.useEffect(() => {
    const slot = () => setPolledAt(Date.now());
    model.changed.connect(slot);
    return () => {
      model.changed.disconnect(slot);
    };
  }, [model]);
  const running = model.jobs.some(job => job.state === 'running');
  const now = useNow(running);

  const toggleLog = (id: string) =>
    setLogs(prev => {
      const next = new Set(prev);
      if (!next.delete(id)) {
        next.add(id);
      }
      return next;
    });

  const status = model.status;
  const retry = () => void model.refresh();
  return (
    <div className="danlu-queue">
      {model.isAdmin && model.queues.length > 0 && (
        <QuotaBars queues={model.queues} />
      )}
      {status === 'loading' && <Loading what="your jobs" />}
      {status === 'error' && (
        <ErrorState
          message={`Could not load your jobs: ${model.error}`}
          onRetry={retry}
        />
      )}
      {status === 'empty' && (
        <Empty>
          No jobs yet. Submit one with <strong>Run cell as training job</strong>{' '}
          in a notebook's cell toolbar, or with <code>%%train</code>.
        </Empty>
      )}
      {model.jobs.length > 0 && (
        <ul className="danlu-jobs" aria-label="Your jobs">
          {model.jobs.map(job => (
            <JobItem
              key={job.id}
              job={job}
              model={model}
              actions={actions}
              extraSeconds={
                job.state === 'running'
                  ? Math.max(0, (now - polledAt) / 1000)
                  : 0
              }
              showLog={logs.has(job.id)}
              onToggleLog={() => toggleLog(job.id)}
            />
          ))}
        </ul>
      )}
    </div>
  );
}

function JobItem(props: {
  job: IJob;
  model: QueueModel;
  actions: ISidebarActions;
  extraSeconds: number;
  showLog: boolean;
  onToggleLog: () => void;
}): JSX.Element {
  const { job, model, actions } = props;
  const [busy, setBusy] = React.useState(false);
  const run = (action: () => Promise<void>) => async () => {
    setBusy(true);
    try {
      await action();
    } finally {
      setBusy(false);
    }
  };
  const active = !FINAL_STATES.has(job.state);
  const started = job.state !== 'queued';
  const gpus = job.resources?.gpus ?? 0;
  const elapsed =
    job.elapsed_seconds !== null && job.elapsed_seconds !== undefined
      ? job.elapsed_seconds + props.extraSeconds
      : null;
  const details: string[] = [];
  if (job.state === 'queued' && job.queue_position) {
    details.push(`#${job.queue_position} in ${job.queue ?? 'the queue'}`);
  } else if (job.queue) {
    details.push(`queue ${job.queue}`);
  }
  if (job.state === 'queued' && job.estimated_start) {
    details.push(`starts ${formatRelative(job.estimated_start)}`);
  }
  details.push(
    gpus
      ? `${gpus} GPU${gpus > 1 ? 's' : ''}${
          job.devices?.length ? ` (${job.devices.join(', ')})` : ''
        }`
      : 'CPU'
  );
  if (elapsed !== null) {
    details.push(formatDuration(elapsed));
  }
  if (job.checkpoint) {
    details.push(formatCheckpoint(job.checkpoint, props.extraSeconds, !active));
  }
  return (
    <li className="danlu-job" data-job-id={job.id} data-state={job.state}>
      <div className="danlu-job-head">
        <span className="danlu-job-name" title={job.name}>
          {job.name}
        </span>
        <span className={`danlu-job-state danlu-state-${job.state}`}>
          {job.state.replace('_', ' ')}
        </span>
      </div>
      <div className="danlu-job-details">
        <span className="danlu-job-id">{job.id}</span>
        {details.map(text => (
          <span key={text}>{text}</span>
        ))}
      </div>
      {job.reason && <div className="danlu-job-reason">{job.reason}</div>}
      <div className="danlu-job-actions">
        {active && (
          <IconButton
            icon={stopIcon}
            label={`Cancel job ${job.id}`}
            disabled={busy}
            onClick={run(async () => {
              await actions.cancel(job);
              await model.refresh();
            })}
          />
        )}
        <IconButton
          icon={listIcon}
          label={`Show log of job ${job.id}`}
          pressed={props.showLog}
          onClick={props.onToggleLog}
        />
        {started && (
          <IconButton
            icon={notebookIcon}
            label={`Open output of job ${job.id}`}
            disabled={busy}
            onClick={run(() => actions.openOutput(job))}
          />
        )}
        {started && (
          <IconButton
            icon={launchIcon}
            label={`Open TensorBoard for job ${job.id}`}
            disabled={busy}
            onClick={run(() =>
              actions.openTensorBoard({ job_ids: [job.id] }, job.name)
            )}
          />
        )}
        {job.mlflow_run_url && (
          <a
            className="danlu-link"
            href={job.mlflow_run_url}
            target="_blank"
            rel="noopener noreferrer"
          >
            MLflow
          </a>
        )}
      </div>
      {props.showLog && <LogView service={model.service} jobId={job.id} />}
    </li>
  );
}

function QuotaBars(props: { queues: readonly IQueue[] }): JSX.Element {
  return (
    <section className="danlu-quotas" aria-label="Team GPU quotas">
      <h3>Team GPU quotas</h3>
      {props.queues.map(q => {
        const quota = gpuTotal(q.quota);
        const used = gpuTotal(q.usage);
        const pct = quota
          ? Math.min(100, (used / quota) * 100)
          : used
            ? 100
            : 0;
        const over = used > quota;
        return (
          <div className="danlu-quota" data-team={q.name} key={q.name}>
            <div className="danlu-quota-label">
              <span>
                {q.name}
                {q.held ? ' (held)' : ''}
              </span>
              <span>
                {used} / {quota} GPUs · {q.running} running · {q.pending}{' '}
                pending
              </span>
            </div>
            <div
              className={`danlu-quota-bar${over ? ' danlu-mod-over' : ''}`}
              role="progressbar"
              aria-label={`GPUs in use by team ${q.name}`}
              aria-valuemin={0}
              aria-valuemax={quota}
              aria-valuenow={used}
            >
              <div className="danlu-quota-fill" style={{ width: `${pct}%` }} />
            </div>
          </div>
        );
      })}
    </section>
  );
}
