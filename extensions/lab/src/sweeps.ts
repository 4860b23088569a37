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
import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { DanluService } from './handler';
import { ViewStatus } from './model';
import { FINAL_STATES, ISweep, ISweepSummary } from './tokens';

function messageOf(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

interface IPolled {
  /** Milliseconds between polls while all is well (default 5000). */
  interval?: number;
  /** Start polling at once (default false for the list, true for one sweep). */
  auto?: boolean;
}

/** Whether a sweep will change no more: it has ended and so have its trials. */
export function sweepSettled(sweep: ISweep): boolean {
  return (
    sweep.state !== 'running' &&
    (sweep.trials ?? []).every(
      t => !t.job_id || FINAL_STATES.has(t.job_state ?? '')
    )
  );
}

/** This user's sweeps (newest first), polled while the sidebar's Sweeps tab has been shown. */
export class SweepsModel implements IDisposable {
  constructor(options: { service: DanluService } & IPolled) {
    this.service = options.service;
    const interval = options.interval ?? 5000;
    this._poll = new Poll({
      auto: options.auto ?? false,
      factory: () => this._fetch(),
      frequency: { interval, backoff: 2, max: Math.max(60000, interval) },
      name: 'danlu:sweeps',
      standby: 'when-hidden'
    });
  }

  readonly service: DanluService;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get sweeps(): readonly ISweepSummary[] {
    return this._sweeps;
  }

  get error(): string | null {
    return this._error;
  }

  get status(): ViewStatus {
    if (this._error !== null) {
      return 'error';
    }
    if (!this._loaded) {
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
      await this._poll.start();
    }
    await this.refresh();
  }

  async refresh(): Promise<void> {
    if (this.isDisposed) {
      return;
    }
    await this._poll.refresh();
    await this._poll.tick.catch(() => undefined);
  }

  get isDisposed(): boolean {
    return this._poll.isDisposed;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    Signal.clearData(this);
  }

  private async _fetch(): Promise<void> {
    try {
      this._sweeps = await this.service.sweeps();
      this._error = null;
      this._loaded = true;
    } catch (error) {
      this._error = messageOf(error);
      this._changed.emit();
      throw error;
    }
    this._changed.emit();
  }

  private _changed = new Signal<this, void>(this);
  private _error: string | null = null;
  private _loaded = false;
  private _poll: Poll;
  private _started = false;
  private _sweeps: ISweepSummary[] = [];
}

/** One sweep with its trials, polled until it has settled. */
export class SweepModel implements IDisposable {
  constructor(
    options: {
      service: Pick<DanluService, 'sweep' | 'stopSweep'>;
      id: string;
    } & IPolled
  ) {
    this.service = options.service;
    this.id = options.id;
    const interval = options.interval ?? 5000;
    this._poll = new Poll({
      auto: options.auto ?? true,
      factory: () => this._fetch(),
      frequency: { interval, backoff: 2, max: Math.max(60000, interval) },
      name: `danlu:sweep-${options.id}`,
      standby: 'when-hidden'
    });
  }

  readonly service: Pick<DanluService, 'sweep' | 'stopSweep'>;
  readonly id: string;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** The poll (stopped once the sweep has settled). */
  get poll(): Poll {
    return this._poll;
  }

  get sweep(): ISweep | null {
    return this._sweep;
  }

  get error(): string | null {
    return this._error;
  }

  get status(): ViewStatus {
    if (this._error !== null && this._sweep === null) {
      return 'error';
    }
    return this._sweep === null ? 'loading' : 'ready';
  }

  async refresh(): Promise<void> {
    if (this.isDisposed) {
      return;
    }
    if (this._poll.state.phase === 'stopped') {
      await this._poll.start();
    }
    await this._poll.refresh();
    await this._poll.tick.catch(() => undefined);
  }

  /** Stop the sweep (the caller has asked for confirmation); its answer is shown at once. */
  async stop(): Promise<void> {
    this._sweep = await this.service.stopSweep(this.id);
    this._changed.emit();
    await this.refresh();
  }

  get isDisposed(): boolean {
    return this._poll.isDisposed;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    Signal.clearData(this);
  }

  private async _fetch(): Promise<void> {
    try {
      this._sweep = await this.service.sweep(this.id);
      this._error = null;
    } catch (error) {
      this._error = messageOf(error);
      this._changed.emit();
      throw error;
    }
    this._changed.emit();
    if (sweepSettled(this._sweep)) {
      void this._poll.stop(); // nothing will change: Refresh starts it again
    }
  }

  private _changed = new Signal<this, void>(this);
  private _error: string | null = null;
  private _poll: Poll;
  private _sweep: ISweep | null = null;
}
