/**
 * A model kept fresh by a @lumino/polling `Poll`, as the queue and the sweeps are.
 *
 * The poll stands by while the page is hidden and backs off exponentially while
 * the server fails; `refresh()` polls now and resolves once that poll has
 * settled. A subclass says what one poll reads (`load`, which throws on a
 * failure) and what it shows; `changed` is emitted after every poll, successful
 * or not, and `error` holds the last failure's message until a poll succeeds.
 */
import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

/** An error's message, for a view to show. */
export function messageOf(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

export namespace PolledModel {
  export interface IOptions {
    /** Milliseconds between polls while all is well (default 5000). */
    interval?: number;
    /** The longest wait while the server keeps failing (default 60000). */
    maxInterval?: number;
    /** Growth factor of the wait after each failure (default 2). */
    backoff?: number;
    /** Start polling at once (each model has its default). */
    auto?: boolean;
  }
}

export abstract class PolledModel implements IDisposable {
  /** `name` names the poll; `auto` is the model's default for `options.auto`. */
  constructor(name: string, options: PolledModel.IOptions, auto: boolean) {
    const interval = options.interval ?? 5000;
    this._poll = new Poll({
      auto: options.auto ?? auto,
      factory: () => this._fetch(),
      frequency: {
        interval,
        backoff: options.backoff ?? 2,
        max: Math.max(options.maxInterval ?? 60000, interval)
      },
      name,
      standby: 'when-hidden'
    });
  }

  /** Emitted after every poll, successful or not. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** The poll (its `state` tells the phase and the current interval). */
  get poll(): Poll {
    return this._poll;
  }

  /** The last failure's message, or null after a successful poll. */
  get error(): string | null {
    return this._error;
  }

  /** Whether at least one poll has succeeded. */
  get loaded(): boolean {
    return this._loaded;
  }

  /** Poll now; resolves once the poll has settled. */
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

  /** Read what one poll reads into the model; throw on a failure (the poll backs off). */
  protected abstract load(): Promise<void>;

  /** Tell the views that something changed outside a poll (an answer shown at once). */
  protected emitChanged(): void {
    this._changed.emit();
  }

  private async _fetch(): Promise<void> {
    try {
      await this.load();
      this._error = null;
      this._loaded = true;
    } catch (error) {
      this._error = messageOf(error);
      this._changed.emit();
      throw error; // the poll backs off
    }
    this._changed.emit();
  }

  private _changed = new Signal<this, void>(this);
  private _error: string | null = null;
  private _loaded = false;
  private _poll: Poll;
}
