/**
 * The Danlu JupyterLab extension: its plugin, command ids and wiring.
 *
 * One plugin (`danlu-lab:plugin`, settings in schema/plugin.json, which also
 * puts "Run cell as training job" in the cell toolbar and context menu) creates
 * the REST service and the shared models, the "Danlu" left sidebar, the cell
 * badges, and the commands `danlu:run-cell-as-job`, `danlu:open-tensorboard`,
 * `danlu:open-lineage`, `danlu:open-sweep` and `danlu:refresh`, and a notification once
 * per warning that this server, holding an idle GPU, is about to be stopped. It
 * provides `IDanlu` for other extensions.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  Dialog,
  ICommandPalette,
  InputDialog,
  Notification,
  showDialog,
  showErrorMessage
} from '@jupyterlab/apputils';
import { Cell, CodeCell } from '@jupyterlab/cells';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { PanelLayout } from '@lumino/widgets';

import { JobBadge } from './components/badge';
import { danluIcon } from './components/icons';
import { createLineageWidget, lineageWidgetId } from './components/lineage';
import {
  describeVersion,
  showRegisterModelDialog
} from './components/register';
import { showSubmitDialog } from './components/submit';
import { createSweepWidget, sweepWidgetId } from './components/sweep';
import {
  createTensorBoardWidget,
  tensorBoardWidgetId
} from './components/tensorboard';
import { watchCullWarnings } from './cull';
import { DanluError, DanluService } from './handler';
import {
  ExperimentsModel,
  FormError,
  ICellLike,
  ISubmitOptions,
  JOB_ID_EXPRESSION,
  LOAD_EXTENSION,
  QueueModel,
  jobIdFromReply,
  notebookParameters,
  parseModelRef,
  trainCellCode
} from './model';
import { messageOf } from './polled';
import { ISidebarActions } from './sidebar/actions';
import { DanluSidebar } from './sidebar/sidebar';
import { SweepsModel } from './sweeps';
import { CommandIDs, IDanlu, IJob, IProfile, SIDEBAR_ID } from './tokens';

export { DanluError, DanluService } from './handler';
export * from './model';
export * from './sweeps';
export * from './tokens';

const PLUGIN_ID = 'danlu-lab:plugin';

/** Metadata key of a submitted cell: `{"job_id": "..."}`. */
export const CELL_METADATA_KEY = 'danlu';

const plugin: JupyterFrontEndPlugin<IDanlu> = {
  id: PLUGIN_ID,
  description:
    'Danlu: the job queue and experiments sidebar, "Run cell as training job" and TensorBoard tabs.',
  autoStart: true,
  provides: IDanlu,
  requires: [INotebookTracker],
  optional: [ICommandPalette, ILayoutRestorer, ISettingRegistry],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    settingRegistry: ISettingRegistry | null
  ): IDanlu => {
    const { commands, shell } = app;
    const service = new DanluService({
      serverSettings: app.serviceManager.serverSettings
    });
    const queue = new QueueModel({ service });
    const experiments = new ExperimentsModel({ service });
    const sweeps = new SweepsModel({ service });

    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          const apply = () => {
            const seconds = Number(settings.get('pollInterval').composite) || 5;
            queue.poll.frequency = {
              ...queue.poll.frequency,
              interval: seconds * 1000,
              max: Math.max(queue.poll.frequency.max, seconds * 1000)
            };
          };
          apply();
          settings.changed.connect(apply);
        })
        .catch(reason => console.warn('danlu-lab: no settings', reason));
    }

    // ---- TensorBoard tabs ------------------------------------------------
    commands.addCommand(CommandIDs.openTensorBoard, {
      label: 'Open TensorBoard',
      caption: 'Open TensorBoard over the logs of jobs or MLflow runs',
      icon: danluIcon,
      execute: async args => {
        const jobIds = (args.job_ids as string[] | undefined) ?? [];
        const runIds = (args.run_ids as string[] | undefined) ?? [];
        if (!jobIds.length && !runIds.length) {
          await showErrorMessage(
            'Open TensorBoard',
            'Choose a job, or select runs in the Experiments tab first.'
          );
          return;
        }
        try {
          const tb = await service.tensorboard(
            jobIds.length ? { job_ids: jobIds } : { run_ids: runIds }
          );
          const id = tensorBoardWidgetId(tb.id);
          for (const widget of shell.widgets('main')) {
            if (widget.id === id) {
              shell.activateById(id);
              return;
            }
          }
          const label =
            (args.label as string | undefined) ??
            [...jobIds, ...runIds].join(', ');
          const widget = createTensorBoardWidget(
            tb,
            label,
            service.serverSettings.baseUrl
          );
          shell.add(widget, 'main');
          shell.activateById(widget.id);
        } catch (error) {
          await showErrorMessage(
            'TensorBoard could not be opened',
            messageOf(error)
          );
        }
      }
    });

    // ---- lineage tabs ----------------------------------------------------
    commands.addCommand(CommandIDs.openLineage, {
      label: args =>
        args.name
          ? `Lineage of ${args.name} version ${args.version}`
          : 'Open model lineage…',
      caption:
        'Show what made a model version: its run, job, notebook, data, environment and approvals',
      icon: danluIcon,
      execute: async args => {
        let ref = `${args.name ?? ''}@${args.version ?? ''}`;
        if (!args.name) {
          const answer = await InputDialog.getText({
            title: 'Open model lineage',
            label: 'Model version (NAME@VERSION)',
            placeholder: 'mnist-classifier@1'
          });
          if (!answer.button.accept || !answer.value) {
            return;
          }
          ref = answer.value;
        }
        let name: string;
        let version: string;
        try {
          ({ name, version } = parseModelRef(ref));
        } catch (error) {
          await showErrorMessage('Open model lineage', messageOf(error));
          return;
        }
        const id = lineageWidgetId(name, version);
        for (const widget of shell.widgets('main')) {
          if (widget.id === id) {
            shell.activateById(id);
            return;
          }
        }
        const widget = createLineageWidget(service, name, version);
        shell.add(widget, 'main');
        shell.activateById(widget.id);
      }
    });
    palette?.addItem({ command: CommandIDs.openLineage, category: 'Danlu' });

    // ---- sweep tabs ------------------------------------------------------
    commands.addCommand(CommandIDs.openSweep, {
      label: args => `Sweep ${args.name ?? args.id ?? ''}`,
      caption:
        'Show a sweep: its trials, the best-so-far curve and each parameter against the objective',
      icon: danluIcon,
      execute: args => {
        const id = String(args.id ?? '');
        const name = String(args.name ?? id);
        const widgetId = sweepWidgetId(id);
        for (const widget of shell.widgets('main')) {
          if (widget.id === widgetId) {
            shell.activateById(widgetId);
            return;
          }
        }
        const widget = createSweepWidget(service, id, name, {
          confirmStop: async sweep => {
            const running = sweep.counts?.running ?? 0;
            const result = await showDialog({
              title: 'Stop sweep?',
              body: `Stop sweep "${sweep.name}" (${sweep.id})? Its queued and running trials (${running} running) are cancelled; no new trials start.`,
              buttons: [
                Dialog.cancelButton({ label: 'Keep it' }),
                Dialog.warnButton({ label: 'Stop sweep' })
              ]
            });
            return result.button.accept;
          },
          showError: async (title, message) => {
            await showErrorMessage(title, message);
          }
        });
        shell.add(widget, 'main');
        shell.activateById(widget.id);
      }
    });

    // ---- sidebar ---------------------------------------------------------
    const actions: ISidebarActions = {
      cancel: async (job: IJob) => {
        const result = await showDialog({
          title: 'Cancel job?',
          body: `Cancel job "${job.name}" (${job.id})? ${
            job.state === 'running'
              ? 'Its processes are stopped.'
              : 'It leaves the queue.'
          }`,
          buttons: [
            Dialog.cancelButton({ label: 'Keep it' }),
            Dialog.warnButton({ label: 'Cancel job' })
          ]
        });
        if (!result.button.accept) {
          return;
        }
        try {
          await service.cancel(job.id);
        } catch (error) {
          await showErrorMessage(
            `Job ${job.id} could not be cancelled`,
            messageOf(error)
          );
        }
      },
      openOutput: async (job: IJob) => {
        try {
          const { path } = await service.output(job.id);
          await commands.execute('docmanager:open', { path });
        } catch (error) {
          await showErrorMessage(
            `The output of job ${job.id} could not be opened`,
            messageOf(error)
          );
        }
      },
      openTensorBoard: async (target, label) => {
        await commands.execute(CommandIDs.openTensorBoard, {
          ...target,
          label
        });
      },
      registerModel: async run => {
        const name = await showRegisterModelDialog(run);
        if (!name) {
          return null;
        }
        try {
          const version = await service.registerModel(run.run_id, name);
          Notification.success(`Registered ${describeVersion(version)}.`, {
            autoClose: 6000
          });
          return version;
        } catch (error) {
          await showErrorMessage(
            `Run ${run.run_name || run.run_id} could not be registered as model ${name}`,
            messageOf(error)
          );
          return null;
        }
      },
      openLineage: async (name, version) => {
        await commands.execute(CommandIDs.openLineage, {
          name,
          version: String(version)
        });
      },
      openSweep: async (id, name) => {
        await commands.execute(CommandIDs.openSweep, { id, name });
      }
    };
    const sidebar = new DanluSidebar({ queue, experiments, sweeps, actions });
    shell.add(sidebar, 'left', { rank: 650 });
    restorer?.add(sidebar, SIDEBAR_ID);

    // ---- GPU-aware culling: a notification once per warning -------------
    watchCullWarnings(queue, {
      show: (_warning, text) =>
        Notification.warning(text, {
          autoClose: false,
          actions: [
            {
              label: 'Show in Danlu',
              caption: 'Open the Danlu sidebar, whose banner counts down',
              callback: () => shell.activateById(SIDEBAR_ID)
            }
          ]
        }),
      dismiss: id => Notification.dismiss(id)
    });

    commands.addCommand(CommandIDs.refresh, {
      label: 'Refresh Danlu jobs',
      execute: () => queue.refresh()
    });

    // ---- cell badges -----------------------------------------------------
    const badges = new WeakMap<Cell, JobBadge>();
    const attachBadge = (cell: Cell, jobId: string) => {
      const existing = badges.get(cell);
      if (existing && !existing.isDisposed && existing.jobId === jobId) {
        return;
      }
      existing?.dispose();
      const badge = new JobBadge({ jobId, queue });
      const layout = cell.layout as PanelLayout;
      const input = cell.inputArea?.parent;
      const index = input ? layout.widgets.indexOf(input) : -1;
      if (index >= 0) {
        layout.insertWidget(index + 1, badge);
      } else {
        layout.addWidget(badge);
      }
      badges.set(cell, badge);
    };
    const syncBadges = (panel: NotebookPanel) => {
      for (const cell of panel.content.widgets) {
        const meta = cell.model.getMetadata(CELL_METADATA_KEY) as
          { job_id?: string } | undefined;
        if (meta?.job_id) {
          attachBadge(cell, meta.job_id);
        } else {
          badges.get(cell)?.dispose();
          badges.delete(cell);
        }
      }
    };
    tracker.widgetAdded.connect((_, panel) => {
      const later = () => window.setTimeout(() => syncBadges(panel), 0);
      void panel.context.ready.then(() => {
        syncBadges(panel);
        panel.content.model?.cells.changed.connect(later);
      });
    });

    // ---- run cell as training job ---------------------------------------
    commands.addCommand(CommandIDs.runCellAsJob, {
      label: 'Run cell as training job',
      caption: 'Run cell as training job',
      icon: danluIcon,
      isEnabled: () => tracker.currentWidget !== null,
      execute: async () => {
        const panel = tracker.currentWidget;
        const cell = tracker.activeCell;
        if (!panel || !cell) {
          return;
        }
        if (cell.model.type !== 'code') {
          await showErrorMessage(
            'Run cell as training job',
            'Select a code cell: only code cells can run as a training job.'
          );
          return;
        }
        await runCellAsJob(panel, cell as CodeCell);
      }
    });
    palette?.addItem({ command: CommandIDs.runCellAsJob, category: 'Danlu' });
    palette?.addItem({ command: CommandIDs.refresh, category: 'Danlu' });

    async function runCellAsJob(
      panel: NotebookPanel,
      cell: CodeCell
    ): Promise<void> {
      const title = 'The job was not submitted';
      await panel.sessionContext.ready;
      const kernel = panel.sessionContext.session?.kernel;
      if (!kernel) {
        await showErrorMessage(
          title,
          "This notebook has no kernel. Start one (Kernel > Change Kernel…) and try again: the job is submitted from the notebook's kernel."
        );
        return;
      }

      let profiles: IProfile[] = [];
      let defaultProfile: string | null = null;
      let profilesError: string | null = null;
      try {
        ({ profiles, default: defaultProfile } = await service.profiles());
      } catch (error) {
        profilesError = messageOf(error);
      }
      const cells: ICellLike[] = [];
      for (const c of panel.content.widgets) {
        cells.push({
          source: c.model.sharedModel.getSource(),
          tags: (c.model.getMetadata('tags') as string[] | undefined) ?? null
        });
      }
      const parameters = notebookParameters(cells);
      const source = cell.model.sharedModel.getSource();
      const firstLine = source.split('\n').find(l => l.trim()) ?? '';

      let code = '';
      let previous: ISubmitOptions | undefined;
      for (;;) {
        const value = await showSubmitDialog({
          what: firstLine
            ? `the cell "${firstLine.trim().slice(0, 60)}"`
            : 'this cell',
          profiles,
          defaultProfile,
          profilesError,
          parameters,
          previous
        });
        if (!value) {
          return;
        }
        try {
          code = trainCellCode(value, source);
          break;
        } catch (error) {
          if (!(error instanceof FormError)) {
            throw error;
          }
          await showErrorMessage('Check the form', error.message);
          previous = value;
        }
      }

      const note = Notification.emit(
        'Submitting the cell as a training job…',
        'in-progress',
        {
          autoClose: false
        }
      );
      try {
        const load = await kernel.requestExecute(
          { code: LOAD_EXTENSION, silent: true, store_history: false },
          true
        ).done;
        if (load.content.status === 'error') {
          throw new DanluError(
            `${LOAD_EXTENSION} failed in the kernel: ${load.content.ename}: ${load.content.evalue}. Is the danlu package installed in this kernel's environment?`,
            0
          );
        }
        const reply = await kernel.requestExecute(
          {
            code,
            silent: false,
            store_history: false,
            user_expressions: { job_id: JOB_ID_EXPRESSION }
          },
          true,
          { cellId: cell.model.id }
        ).done;
        const content = reply.content;
        if (content.status === 'error') {
          throw new DanluError(`${content.ename}: ${content.evalue}`, 0);
        }
        if (content.status !== 'ok') {
          throw new DanluError(`The kernel answered "${content.status}".`, 0);
        }
        const jobId = jobIdFromReply(content.user_expressions);
        if (!jobId) {
          const expr = content.user_expressions?.job_id as any;
          throw new DanluError(
            'The kernel ran the submission but no job id came back' +
              (expr?.status === 'error'
                ? ` (${expr.ename}: ${expr.evalue}).`
                : '.'),
            0
          );
        }
        cell.model.setMetadata(CELL_METADATA_KEY, { job_id: jobId });
        attachBadge(cell, jobId);
        Notification.update({
          id: note,
          message: `Submitted job ${jobId}.`,
          type: 'success',
          autoClose: 4000
        });
        void queue.refresh();
      } catch (error) {
        Notification.dismiss(note);
        await showErrorMessage(title, messageOf(error));
      }
    }

    return { service, queue, experiments, sweeps };
  }
};

export default plugin;
