/**
 * Small text formatters of the Danlu UI: durations, times, GPU counts and checkpoints.
 */

/** `75` -> `1m 15s`, `3725` -> `1h 02m`; empty for unknown. */
export function formatDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) {
    return '';
  }
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return `${s}s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, '0')}s`;
  }
  const h = Math.floor(s / 3600);
  return `${h}h ${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
}

/** An ISO time or epoch milliseconds as a Date, or null. */
export function toDate(value: string | number | null | undefined): Date | null {
  if (value === null || value === undefined || value === '') {
    return null;
  }
  const date = new Date(value);
  return isNaN(date.getTime()) ? null : date;
}

/** A time relative to `now`: `in 5m`, `2h ago`, `now`. */
export function formatRelative(
  value: string | number | null | undefined,
  now: number = Date.now()
): string {
  const date = toDate(value);
  if (!date) {
    return '';
  }
  const delta = Math.round((date.getTime() - now) / 1000);
  if (Math.abs(delta) < 30) {
    return 'now';
  }
  const text = formatDuration(Math.abs(delta)).split(' ')[0];
  return delta > 0 ? `in ${text}` : `${text} ago`;
}

/** A short local date and time. */
export function formatTime(value: string | number | null | undefined): string {
  const date = toDate(value);
  return date
    ? date.toLocaleString(undefined, {
        month: 'short',
        day: 'numeric',
        hour: '2-digit',
        minute: '2-digit'
      })
    : '';
}

/** The total of a `{"gpus": {flavor: n}}` amount. */
export function gpuTotal(
  amounts: { gpus?: Record<string, number> } | undefined
): number {
  const gpus = amounts?.gpus ?? {};
  return Object.values(gpus).reduce((n, v) => n + (Number(v) || 0), 0);
}

/** A metric value with few digits. */
export function formatNumber(value: number | null | undefined): string {
  if (value === null || value === undefined || !isFinite(value)) {
    return '';
  }
  if (value !== 0 && (Math.abs(value) >= 1e5 || Math.abs(value) < 1e-3)) {
    return value.toExponential(3);
  }
  return String(Number(value.toPrecision(4)));
}

/**
 * A job's last checkpoint: `checkpoint step 1500, 40s ago`; `extraSeconds`
 * (since the job was polled) ages it while the job runs. For a job that
 * ended (`ended`), its age then: `checkpoint step 1500, 40s before the end`.
 * Empty without one.
 */
export function formatCheckpoint(
  checkpoint: { step: number; age_seconds: number } | null | undefined,
  extraSeconds = 0,
  ended = false
): string {
  if (!checkpoint) {
    return '';
  }
  const age = formatDuration(checkpoint.age_seconds + extraSeconds);
  return `checkpoint step ${checkpoint.step}, ${age} ${ended ? 'before the end' : 'ago'}`;
}
