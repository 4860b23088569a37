/**
 * The status badge under a cell that was submitted as a training job.
 *
 * It follows the job through the shared `QueueModel` (no polling of its own);
 * a job missing from the user's job list is asked for once with `GET jobs/{id}`.
 */
import { Widget } from '@lumino/widgets';

import { QueueModel } from '../model';
import { IJob } from '../tokens';
import { formatDuration } from './format';

export class JobBadge extends Widget {
  constructor(options: { jobId: string; queue: QueueModel }) {
    super();
    this.jobId = options.jobId;
    this._queue = options.queue;
    this.addClass('danlu-job-badge');
    this.node.dataset.jobId = this.jobId;
    this.node.setAttribute('role', 'status');
    this.node.setAttribute('aria-live', 'polite');
    this._queue.changed.connect(this._update, this);
    this._update();
  }

  readonly jobId: string;

  /** The state shown now (`submitted` until the queue knows the job). */
  get state(): string {
    return this.node.dataset.state ?? 'submitted';
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._queue.changed.disconnect(this._update, this);
    super.dispose();
  }

  private _update(): void {
    const job = this._queue.job(this.jobId) ?? this._fetched;
    if (!job && this._queue.loaded && !this._asked) {
      this._asked = true;
      this._queue.service
        .job(this.jobId)
        .then(found => {
          this._fetched = found;
          this._update();
        })
        .catch(() => {
          this._missing = true;
          this._update();
        });
    }
    const state = job?.state ?? (this._missing ? 'unknown' : 'submitted');
    this.node.dataset.state = state;
    this.node.textContent = describe(this.jobId, state, job);
    this.node.title = job?.reason ?? '';
  }

  private _asked = false;
  private _fetched: IJob | undefined;
  private _missing = false;
  private _queue: QueueModel;
}

function describe(id: string, state: string, job?: IJob): string {
  const parts = [`Danlu job ${id}: ${state.replace('_', ' ')}`];
  if (job?.state === 'queued' && job.queue_position) {
    parts.push(`#${job.queue_position} in ${job.queue ?? 'queue'}`);
  }
  if (job?.elapsed_seconds) {
    parts.push(formatDuration(job.elapsed_seconds));
  }
  return parts.join(' · ');
}
