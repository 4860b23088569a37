/**
 * The banner at the top of the Danlu sidebar, whatever tab is selected, while
 * this server holds an idle GPU and is about to be stopped: the time left,
 * counting down every second, why, and how to keep the server.
 */
import * as React from 'react';

import {
  cullReason,
  cullWarningsHere,
  formatCountdown,
  secondsLeft
} from '../cull';
import { IShownCullWarning } from '../tokens';
import { useNow } from './common';

export function CullWarningBanner(props: {
  /** All of the user's warnings; the banner keeps those about this server. */
  warnings: readonly IShownCullWarning[];
}): JSX.Element | null {
  const warnings = cullWarningsHere(props.warnings);
  // Re-render every second only while a warning shows (the timer is cleared
  // when none does); the time is read now, as the ticker's may date from before
  // the warning came.
  useNow(warnings.length > 0);
  const now = Date.now();
  if (!warnings.length) {
    return null;
  }
  return (
    <div className="danlu-cull-warnings">
      {warnings.map(warning => (
        <div
          key={`${warning.server}|${warning.cull_at}`}
          className="danlu-cull-warning"
          role="alert"
          data-server={warning.server}
        >
          This server will be stopped in{' '}
          {/* role=timer: its live updates are not announced every second */}
          <strong className="danlu-cull-countdown" role="timer">
            {formatCountdown(secondsLeft(warning, now))}
          </strong>
          : {cullReason(warning)}. {warning.keep}
        </div>
      ))}
    </div>
  );
}
