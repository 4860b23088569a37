/**
 * The state behind the sweeps' views, free of widgets.
 *
 * `SweepsModel` is the sidebar's list of this user's sweeps; `SweepModel` is one
 * sweep with its trials, for its main-area tab. Both poll with a @lumino/polling
 * `Poll` like the queue does: they stand by while the page is hidden and back
 * off while the server fails. The list starts polling when the Sweeps tab is
 * first shown; a sweep's tab polls while the sweep runs and stops once it and
 * all its trials have ended.
 */
import { DanluService } from './handler';
import { ViewStatus } from './model';
import { PolledModel } from './polled';
import { FINAL_STATES, ISweep, ISweepSummary } from './tokens';

/** Whether a sweep will change no more: it has ended and so have its trials. */
export function sweepSettled(sweep: ISweep): boolean {
  return (
    sweep.state !== 'running' &&
    (sweep.trials ?? []).every(
      t => !t.job_id || FINAL_STATES.has(t.job_state ?? '')
    )
  );
}

/** This user's sweeps (newest first), polled once the sidebar's Sweeps tab has been shown (not at once). */
export class SweepsModel extends PolledModel {
  constructor(options: { service: DanluService } & PolledModel.IOptions) {
    super('danlu:sweeps', options, false);
    this.service = options.service;
  }

  readonly service: DanluService;

  get sweeps(): readonly ISweepSummary[] {
    return this._sweeps;
  }

  get status(): ViewStatus {
    if (this.error !== null) {
      return 'error';
    }
    if (!this.loaded) {
      return 'loading';
    }
    return this._sweeps.length ? 'ready' : 'empty';
  }

  /** Begin polling (the first time the tab is shown); later calls poll now. */
  async start(): Promise<void> {
    if (this.isDisposed) {
      return;
    }
    if (!this._started) {
      this._started = true;
      await this.poll.start();
    }
    await this.refresh();
  }

  protected async load(): Promise<void> {
    this._sweeps = await this.service.sweeps();
  }

  private _started = false;
  private _sweeps: ISweepSummary[] = [];
}

/** One sweep with its trials, polled (at once, by default) until it has settled. */
export class SweepModel extends PolledModel {
  constructor(
    options: {
      service: Pick<DanluService, 'sweep' | 'stopSweep'>;
      id: string;
    } & PolledModel.IOptions
  ) {
    super(`danlu:sweep-${options.id}`, options, true);
    this.service = options.service;
    this.id = options.id;
  }

  readonly service: Pick<DanluService, 'sweep' | 'stopSweep'>;
  readonly id: string;

  get sweep(): ISweep | null {
    return this._sweep;
  }

  get status(): ViewStatus {
    if (this.error !== null && this._sweep === null) {
      return 'error';
    }
    return this._sweep === null ? 'loading' : 'ready';
  }

  /** Poll now, starting the poll again if the sweep had settled. */
  async refresh(): Promise<void> {
    if (!this.isDisposed && this.poll.state.phase === 'stopped') {
      await this.poll.start();
    }
    await super.refresh();
  }

  /** Stop the sweep (the caller has asked for confirmation); its answer is shown at once. */
  async stop(): Promise<void> {
    this._sweep = await this.service.stopSweep(this.id);
    this.emitChanged();
    await this.refresh();
  }

  protected async load(): Promise<void> {
    this._sweep = await this.service.sweep(this.id);
    if (sweepSettled(this._sweep)) {
      void this.poll.stop(); // nothing will change: Refresh starts it again
    }
  }

  private _sweep: ISweep | null = null;
}
