/**
 * The Danlu lab extension, clicked through against a real workbench.
 *
 * tests/test_lab_ui.py starts `danlu up`, alice's server and writes
 * <DANLU_UI_FOLDER>/<DANLU_UI_NOTEBOOK>: cell 0 tagged `parameters` (`lr = 0.1`),
 * cell 1 a tiny training loop writing `loss` with SummaryWriter and printing
 * DONE_LINE. One scenario, in order: run cell 1 as a job from its toolbar
 * button, follow it in the Queue to `succeeded`, read its log, open its
 * TensorBoard, run it again with another lr, compare both runs in Experiments.
 * The selectors are the contract's (/work/notes/lab-contract.md).
 */
import type { IJupyterLabPageFixture } from '@jupyterlab/galata';
import type { Locator } from '@playwright/test';

import { danluApi, DONE_LINE, expect, FOLDER, NOTEBOOK, shot, test, USER } from './fixtures';

const TRAIN_CELL = 1;
const JOB_TIMEOUT = 4 * 60 * 1000; // a job here takes ~10-30 s; the 2-core CI machine can be slow

/** Click the cell toolbar button, fill the dialog, submit; return the new job's id from the cell badge. */
async function runCellAsJob(page: IJupyterLabPageFixture, lr: string, screenshot: boolean): Promise<string> {
  const cell = (await page.notebook.getCellLocator(TRAIN_CELL)) as Locator;
  expect(cell, `cell ${TRAIN_CELL} of the notebook`).toBeTruthy();
  const badge = cell.locator('.danlu-job-badge');
  const before = (await badge.count()) ? await badge.first().getAttribute('data-job-id') : null;

  await page.notebook.selectCells(TRAIN_CELL);
  const button = cell.getByTitle('Run cell as training job');
  await expect(button, 'cell toolbar button "Run cell as training job"').toBeVisible();
  await button.click();

  const dialog = page.locator('.jp-Dialog');
  await expect(dialog).toBeVisible();
  // The profiles come from GET danlu/api/profiles; the default profile is selected.
  const profile = dialog.locator('[name="profile"]');
  await expect(profile).toBeVisible();
  await expect(profile.locator('option[value="python"]')).toHaveCount(1);
  await profile.selectOption('python');
  const nproc = dialog.locator('[name="nproc"]');
  if (await nproc.count()) {
    await nproc.fill('1');
  }
  const param = dialog.locator('[name="param-lr"]');
  await expect(param, 'a field for the `parameters` cell\'s lr').toHaveValue('0.1');
  await param.fill(lr);
  if (screenshot) {
    await shot(page, 'run-dialog');
  }
  await dialog.getByRole('button', { name: 'Submit' }).click();
  await expect(dialog).toHaveCount(0);

  // The cell shows a badge that follows the new job.
  await expect
    .poll(async () => ((await badge.count()) ? badge.first().getAttribute('data-job-id') : null), {
      message: 'cell badge .danlu-job-badge[data-job-id] of the new job',
      timeout: 120_000
    })
    .not.toBe(before);
  const jobId = (await badge.first().getAttribute('data-job-id')) as string;
  expect(jobId).toBeTruthy();
  return jobId;
}

async function openSidebarTab(page: IJupyterLabPageFixture, name: 'Queue' | 'Experiments'): Promise<Locator> {
  await page.sidebar.openTab('danlu-sidebar');
  await page.sidebar.setWidth(420, 'left'); // room for the runs table and the chart (and the screenshots)
  const sidebar = page.locator('#danlu-sidebar');
  await expect(sidebar).toBeVisible();
  await sidebar.getByRole('tab', { name }).click();
  return sidebar;
}

/** The job's row in the Queue, once it has succeeded (with its state and log in the message otherwise). */
async function waitSucceeded(page: IJupyterLabPageFixture, jobId: string): Promise<Locator> {
  const sidebar = await openSidebarTab(page, 'Queue');
  const row = sidebar.locator(`li.danlu-job[data-job-id="${jobId}"]`);
  await expect(row, `li.danlu-job[data-job-id="${jobId}"] in the Queue`).toBeVisible({ timeout: 60_000 });
  await expect
    .poll(async () => row.getAttribute('data-state'), {
      message: `job ${jobId} reaching data-state=succeeded`,
      timeout: JOB_TIMEOUT,
      intervals: [1000]
    })
    .toMatch(/^(succeeded|failed|cancelled|timed_out)$/);
  const state = await row.getAttribute('data-state');
  if (state !== 'succeeded') {
    await row.getByRole('button', { name: `Show log of job ${jobId}` }).click();
    const log = (await page.locator('.danlu-log').first().textContent().catch(() => '')) || '';
    throw new Error(`job ${jobId} ended ${state}:\n${log.slice(-3000)}`);
  }
  await expect(row.locator('.danlu-job-state')).toContainText(/succeeded/i);
  return row;
}

test.describe('Danlu lab extension', () => {
  test('run a cell as a job, follow it, read its log, open TensorBoard, compare two runs', async ({
    page,
    baseURL
  }) => {
    const jobs: string[] = [];

    await test.step('open the notebook', async () => {
      expect(await page.notebook.openByPath(`${FOLDER}/${NOTEBOOK}`)).toBe(true);
      await page.notebook.activate(NOTEBOOK);
      // The kernel runs the %%train submission: wait until it is up.
      await expect(page.locator('.jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator')).toHaveAttribute(
        'data-status',
        'idle',
        { timeout: 120_000 }
      );
    });

    await test.step('run the training cell as a job (dialog, Submit, badge)', async () => {
      jobs.push(await runCellAsJob(page, '0.1', true));
    });

    let row: Locator;
    await test.step('follow the job in the Queue to succeeded', async () => {
      row = await waitSucceeded(page, jobs[0]);
      await expect(page.locator(`.danlu-job-badge[data-job-id="${jobs[0]}"]`)).toHaveAttribute(
        'data-state',
        'succeeded',
        { timeout: 60_000 }
      );
      await shot(page, 'queue');
    });

    await test.step('read its log', async () => {
      await row.getByRole('button', { name: `Show log of job ${jobs[0]}` }).click();
      const log = page.locator('.danlu-log');
      await expect(log.first()).toBeVisible();
      // Soft: a broken view fails the test but the later views still get checked.
      await expect
        .soft(log.first(), 'the log (GET danlu/api/jobs/ID/logs/stream) shows the printed line')
        .toContainText(`${DONE_LINE}: lr=0.1`, { timeout: 60_000 });
      await shot(page, 'log');
    });

    await test.step('open its TensorBoard', async () => {
      await row.getByRole('button', { name: `Open TensorBoard for job ${jobs[0]}` }).click();
      const tab = page.locator('[id^="danlu-tensorboard-"]');
      await expect(tab.first()).toBeVisible({ timeout: 60_000 });
      await expect(tab.first().locator('iframe')).toBeVisible();
      const frame = page.frameLocator('[id^="danlu-tensorboard-"] iframe').first();
      // TensorBoard's web app, then the scalar the job wrote.
      await expect.soft(frame.locator('tb-webapp'), 'TensorBoard\'s web app in the iframe').toBeAttached({
        timeout: 120_000
      });
      await expect
        .soft(frame.getByText('loss').first(), 'the scalar `loss` in TensorBoard')
        .toBeVisible({ timeout: 120_000 });
      await shot(page, 'tensorboard');
    });

    await test.step('run it again with another lr', async () => {
      await page.activity.activateTab(NOTEBOOK);
      jobs.push(await runCellAsJob(page, '0.2', false));
      expect(jobs[1]).not.toBe(jobs[0]);
      await waitSucceeded(page, jobs[1]);
    });

    await test.step('compare both runs in Experiments', async () => {
      const runIds: string[] = [];
      for (const id of jobs) {
        // The run id is the job's (what the Experiments rows are keyed by).
        await expect
          .poll(async () => (await danluApi(page, baseURL as string, `jobs/${id}`)).mlflow_run_id, {
            message: `job ${id} has an mlflow_run_id`,
            timeout: 60_000
          })
          .toBeTruthy();
        runIds.push((await danluApi(page, baseURL as string, `jobs/${id}`)).mlflow_run_id);
      }
      const sidebar = await openSidebarTab(page, 'Experiments');
      // The notebook's experiment, <user>/<notebook stem>, holds both runs.
      const experiment = sidebar
        .locator('button.danlu-experiment')
        .filter({ has: page.getByText(`${USER}/${NOTEBOOK.replace(/\.ipynb$/, '')}`, { exact: true }) });
      const table = sidebar.locator('table.danlu-runs');
      for (let attempt = 0; ; attempt++) {
        try {
          await expect(experiment, 'the notebook\'s experiment in the Experiments list').toBeVisible({
            timeout: 20_000
          });
          if ((await experiment.getAttribute('aria-pressed')) !== 'true') {
            await experiment.click();
          }
          await expect(table).toBeVisible({ timeout: 20_000 });
          for (const runId of runIds) {
            await expect(table.locator(`tr[data-run-id="${runId}"]`)).toBeVisible({ timeout: 20_000 });
          }
          break;
        } catch (error) {
          if (attempt >= 2) {
            throw error;
          }
          // Loaded before the second run existed: ask again.
          await sidebar.getByRole('button', { name: 'Refresh experiments' }).click();
        }
      }
      for (const runId of runIds) {
        await table.locator(`tr[data-run-id="${runId}"]`).getByRole('checkbox').check();
      }
      await sidebar.getByRole('button', { name: 'Compare' }).click();
      const chart = page.locator('svg.danlu-compare-chart');
      await expect(chart).toBeVisible({ timeout: 60_000 });
      const metric = page.getByRole('combobox', { name: 'Metric' });
      if ((await metric.count()) && (await metric.locator('option[value="loss"]').count())) {
        await metric.selectOption('loss');
      }
      await expect(chart.locator('path.danlu-series')).toHaveCount(2, { timeout: 60_000 });
      await shot(page, 'compare');
    });
  });
});
