/**
 * Pieces shared by the sidebar's views: a hook that re-renders on a model's
 * `changed` signal, the loading / empty / error(+Retry) states, and an icon
 * button with an accessible name.
 */
import { LabIcon } from '@jupyterlab/ui-components';
import { ISignal } from '@lumino/signaling';
import * as React from 'react';

/** Re-render the calling component whenever `signal` is emitted. */
export function useSignal(signal: ISignal<unknown, unknown>): void {
  const [, force] = React.useReducer((n: number) => n + 1, 0);
  React.useEffect(() => {
    const slot = () => force();
    signal.connect(slot);
    force(); // catch an emission between the first render and this effect
    return () => {
      signal.disconnect(slot);
    };
  }, [signal]);
}

/** The current time, ticking every `ms` while `active`. */
export function useNow(active: boolean, ms = 1000): number {
  const [now, setNow] = React.useState(() => Date.now());
  React.useEffect(() => {
    if (!active) {
      return;
    }
    const timer = window.setInterval(() => setNow(Date.now()), ms);
    return () => window.clearInterval(timer);
  }, [active, ms]);
  return now;
}

export function Loading(props: { what: string }): JSX.Element {
  return (
    <div className="danlu-loading" role="status" aria-live="polite">
      Loading {props.what}…
    </div>
  );
}

export function Empty(props: { children: React.ReactNode }): JSX.Element {
  return <div className="danlu-empty">{props.children}</div>;
}

export function ErrorState(props: {
  message: string;
  onRetry: () => void;
}): JSX.Element {
  return (
    <div className="danlu-error" role="alert">
      <p>{props.message}</p>
      <button
        className="jp-Button jp-mod-styled jp-mod-reject"
        onClick={props.onRetry}
      >
        Retry
      </button>
    </div>
  );
}

export function IconButton(props: {
  icon: LabIcon;
  label: string;
  onClick: () => void;
  className?: string;
  disabled?: boolean;
  /** For toggles: whether it is on (aria-pressed). */
  pressed?: boolean;
}): JSX.Element {
  return (
    <button
      type="button"
      className={`jp-Button jp-mod-minimal danlu-icon-button ${props.className ?? ''}`}
      aria-label={props.label}
      title={props.label}
      disabled={props.disabled}
      aria-pressed={props.pressed}
      onClick={props.onClick}
    >
      <props.icon.react
        tag="span"
        className="danlu-icon"
        height="16px"
        width="16px"
      />
    </button>
  );
}
