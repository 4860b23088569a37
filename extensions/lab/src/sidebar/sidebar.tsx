/**
 * The "Danlu" left sidebar: a tab list with the Queue, Experiments and Sweeps
 * views, under the warning that this server is about to be stopped for holding
 * an idle GPU, when it is. Arrow keys move between the tabs (WAI-ARIA tabs pattern); the
 * Experiments view loads, and the Sweeps view starts polling, the first time it
 * is shown.
 */
import { ReactWidget } from '@jupyterlab/apputils';
import { refreshIcon } from '@jupyterlab/ui-components';
import * as React from 'react';

import { danluIcon } from '../components/icons';
import { ExperimentsModel, QueueModel } from '../model';
import { SweepsModel } from '../sweeps';
import { SIDEBAR_ID } from '../tokens';
import { ISidebarActions } from './actions';
import { ExperimentsPanel } from './experiments';
import { QueuePanel } from './queue';
import { SweepsPanel } from './sweeps';
import { IconButton, useSignal } from './common';
import { CullWarningBanner } from './cullwarning';

type Tab = 'queue' | 'experiments' | 'sweeps';
const TABS: { id: Tab; label: string }[] = [
  { id: 'queue', label: 'Queue' },
  { id: 'experiments', label: 'Experiments' },
  { id: 'sweeps', label: 'Sweeps' }
];

export namespace DanluSidebar {
  export interface IOptions {
    queue: QueueModel;
    experiments: ExperimentsModel;
    sweeps: SweepsModel;
    actions: ISidebarActions;
  }
}

export class DanluSidebar extends ReactWidget {
  constructor(readonly options: DanluSidebar.IOptions) {
    super();
    this.id = SIDEBAR_ID;
    this.addClass('danlu-sidebar');
    this.title.icon = danluIcon;
    this.title.caption = 'Danlu';
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'Danlu');
  }

  render(): JSX.Element {
    return <SidebarView {...this.options} />;
  }
}

function SidebarView(props: DanluSidebar.IOptions): JSX.Element {
  const { queue, experiments, sweeps, actions } = props;
  useSignal(queue.changed);
  const [tab, setTab] = React.useState<Tab>('queue');
  const tabRefs = React.useRef<Record<string, HTMLButtonElement | null>>({});

  const [visited, setVisited] = React.useState(false);
  const [sweepsVisited, setSweepsVisited] = React.useState(false);
  React.useEffect(() => {
    if (tab === 'experiments' && !visited) {
      setVisited(true);
      if (experiments.experimentsState.status === 'idle') {
        void experiments.loadExperiments();
      }
    }
    if (tab === 'sweeps' && !sweepsVisited) {
      setSweepsVisited(true);
      void sweeps.start();
    }
  }, [tab]);

  const onKeyDown = (event: React.KeyboardEvent) => {
    const i = TABS.findIndex(t => t.id === tab);
    let next = -1;
    if (event.key === 'ArrowRight' || event.key === 'ArrowDown') {
      next = (i + 1) % TABS.length;
    } else if (event.key === 'ArrowLeft' || event.key === 'ArrowUp') {
      next = (i + TABS.length - 1) % TABS.length;
    } else if (event.key === 'Home') {
      next = 0;
    } else if (event.key === 'End') {
      next = TABS.length - 1;
    }
    if (next >= 0) {
      event.preventDefault();
      setTab(TABS[next].id);
      tabRefs.current[TABS[next].id]?.focus();
    }
  };

  const refresh = () => {
    if (tab === 'queue') {
      void queue.refresh();
    } else if (tab === 'sweeps') {
      void sweeps.refresh();
    } else {
      void experiments.loadExperiments().then(() => experiments.reloadRuns());
    }
  };

  return (
    <div className="danlu-sidebar-body">
      <header className="danlu-header">
        <h2>Danlu</h2>
        {queue.whoami && (
          <span className="danlu-user">{queue.whoami.user}</span>
        )}
        <IconButton icon={refreshIcon} label="Refresh" onClick={refresh} />
      </header>
      <CullWarningBanner warnings={queue.cullWarnings} />
      <div
        className="danlu-tabs"
        role="tablist"
        aria-label="Danlu views"
        onKeyDown={onKeyDown}
      >
        {TABS.map(t => (
          <button
            key={t.id}
            ref={node => {
              tabRefs.current[t.id] = node;
            }}
            type="button"
            role="tab"
            id={`danlu-tab-${t.id}`}
            aria-controls={`danlu-panel-${t.id}`}
            aria-selected={tab === t.id}
            tabIndex={tab === t.id ? 0 : -1}
            className={`danlu-tab${tab === t.id ? ' danlu-mod-active' : ''}`}
            onClick={() => setTab(t.id)}
          >
            {t.label}
          </button>
        ))}
      </div>
      <div
        role="tabpanel"
        id="danlu-panel-queue"
        aria-labelledby="danlu-tab-queue"
        className="danlu-panel"
        hidden={tab !== 'queue'}
      >
        <QueuePanel model={queue} actions={actions} />
      </div>
      <div
        role="tabpanel"
        id="danlu-panel-experiments"
        aria-labelledby="danlu-tab-experiments"
        className="danlu-panel"
        hidden={tab !== 'experiments'}
      >
        {(visited || tab === 'experiments') && (
          <ExperimentsPanel model={experiments} actions={actions} />
        )}
      </div>
      <div
        role="tabpanel"
        id="danlu-panel-sweeps"
        aria-labelledby="danlu-tab-sweeps"
        className="danlu-panel"
        hidden={tab !== 'sweeps'}
      >
        {(sweepsVisited || tab === 'sweeps') && (
          <SweepsPanel model={sweeps} actions={actions} />
        )}
      </div>
    </div>
  );
}
