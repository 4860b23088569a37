/**
 * GPU-aware culling in the UI: which cull warnings concern this server, their
 * countdown and sentence, and the JupyterLab notification shown once per
 * warning (the sidebar's banner is in sidebar/cullwarning.tsx).
 *
 * The jobs service stops a notebook server that holds a GPU left idle; before
 * that, `GET servers/warnings` lists the user's servers about to be stopped and
 * `QueueModel` reads it on every poll.
 */
import { PageConfig } from '@jupyterlab/coreutils';
import { IDisposable } from '@lumino/disposable';

import type { QueueModel } from './model';
import { IShownCullWarning } from './tokens';

/**
 * The warnings about the server this page runs on: the one whose hub user and
 * server name are the page's (`hubUser`, `hubServerName`; `""` is the default
 * server). Outside JupyterHub (no `hubUser`) every warning is shown.
 */
export function cullWarningsHere<T extends { user: string; name: string }>(
  warnings: readonly T[],
  hubUser: string = PageConfig.getOption('hubUser'),
  hubServerName: string = PageConfig.getOption('hubServerName')
): T[] {
  if (!hubUser) {
    return [...warnings];
  }
  return warnings.filter(
    w => w.user === hubUser && (w.name ?? '') === (hubServerName ?? '')
  );
}

/** Whole seconds until the warning's deadline at `now`, never below 0. */
export function secondsLeft(
  warning: IShownCullWarning,
  now: number = Date.now()
): number {
  return Math.max(0, Math.ceil((warning.deadline - now) / 1000));
}

/** `240` -> `4:00`, `59` -> `0:59`, `3725` -> `62:05`. */
export function formatCountdown(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, '0')}`;
}

/** The reason as a sentence's clause: without its final period. */
export function cullReason(warning: IShownCullWarning): string {
  return (warning.reason ?? '').trim().replace(/\.+$/, '');
}

/** `This server will be stopped in 4:00: <reason>. <keep>` at `now`. */
export function cullWarningText(
  warning: IShownCullWarning,
  now: number = Date.now()
): string {
  return `This server will be stopped in ${formatCountdown(
    secondsLeft(warning, now)
  )}: ${cullReason(warning)}. ${(warning.keep ?? '').trim()}`.trim();
}

/** How the notifier shows and takes back a notification (JupyterLab's `Notification` in the app). */
export interface ICullNotify {
  /** Show the warning; returns the notification's id. */
  show(warning: IShownCullWarning, text: string): string;
  dismiss(id: string): void;
}

/**
 * Show one notification per (server, cull_at) among the queue's warnings for
 * this server, after every poll; take it back once the warning is gone (the
 * GPU got busy again, or the server was released).
 */
export function watchCullWarnings(
  queue: QueueModel,
  notify: ICullNotify,
  here: (
    warnings: readonly IShownCullWarning[]
  ) => IShownCullWarning[] = cullWarningsHere
): IDisposable {
  const shown = new Map<string, string>();
  const update = () => {
    const current = new Set<string>();
    for (const warning of here(queue.cullWarnings)) {
      const key = `${warning.server}|${warning.cull_at}`;
      current.add(key);
      if (!shown.has(key)) {
        shown.set(key, notify.show(warning, cullWarningText(warning)));
      }
    }
    for (const [key, id] of [...shown]) {
      if (!current.has(key)) {
        notify.dismiss(id);
        shown.delete(key);
      }
    }
  };
  queue.changed.connect(update);
  update();
  let disposed = false;
  return {
    get isDisposed() {
      return disposed;
    },
    dispose() {
      if (!disposed) {
        disposed = true;
        queue.changed.disconnect(update);
      }
    }
  };
}
