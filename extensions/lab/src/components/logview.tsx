/**
 * The live log of a job: `GET jobs/{id}/logs/stream` over server-sent events,
 * shown in a `role=log` region that follows the end unless the user scrolls up.
 */
import * as React from 'react';

import { DanluService } from '../handler';

/** Lines kept in the view; older ones are dropped. */
export const MAX_LOG_LINES = 5000;

type StreamState = 'streaming' | 'ended' | 'lost';

export function LogView(props: {
  service: DanluService;
  jobId: string;
}): JSX.Element {
  const { service, jobId } = props;
  const [lines, setLines] = React.useState<string[]>([]);
  const [stream, setStream] = React.useState<StreamState>('streaming');
  const [endState, setEndState] = React.useState('');
  const [attempt, setAttempt] = React.useState(0);
  const ref = React.useRef<HTMLPreElement>(null);
  const stick = React.useRef(true);

  React.useEffect(() => {
    let buffer: string[] = [];
    let timer: number | undefined;
    const flush = () => {
      timer = undefined;
      const added = buffer;
      buffer = [];
      setLines(prev => prev.concat(added).slice(-MAX_LOG_LINES));
    };
    setLines([]);
    setStream('streaming');
    const source = service.streamLogs(jobId, {
      onLine: line => {
        buffer.push(line);
        if (timer === undefined) {
          timer = window.setTimeout(flush, 50);
        }
      },
      onEnd: state => {
        flush();
        setEndState(state);
        setStream('ended');
      },
      onError: () => {
        flush();
        setStream('lost');
      }
    });
    return () => {
      window.clearTimeout(timer);
      source.dispose();
    };
  }, [service, jobId, attempt]);

  React.useLayoutEffect(() => {
    const node = ref.current;
    if (node && stick.current) {
      node.scrollTop = node.scrollHeight;
    }
  }, [lines]);

  const onScroll = () => {
    const node = ref.current;
    if (node) {
      stick.current =
        node.scrollTop + node.clientHeight >= node.scrollHeight - 8;
    }
  };

  return (
    <div className="danlu-log-view">
      <pre
        ref={ref}
        className="danlu-log"
        role="log"
        aria-live="polite"
        aria-label={`Log of job ${jobId}`}
        tabIndex={0}
        onScroll={onScroll}
      >
        {lines.join('\n')}
      </pre>
      <div className="danlu-log-status">
        {stream === 'streaming' && <span>Following the log…</span>}
        {stream === 'ended' && (
          <span>The job has ended{endState ? ` (${endState})` : ''}.</span>
        )}
        {stream === 'lost' && (
          <>
            <span>The log stream was interrupted.</span>{' '}
            <button
              className="jp-Button jp-mod-styled jp-mod-reject"
              onClick={() => setAttempt(n => n + 1)}
            >
              Reconnect
            </button>
          </>
        )}
      </div>
    </div>
  );
}
