/**
 * Steps the UI scenarios share: run the notebook's training cell as a job
 * through its toolbar button and dialog, follow it in the Queue until it has
 * succeeded, and show runs in the Experiments tab.
 */
import type { IJupyterLabPageFixture } from '@jupyterlab/galata';
import type { Locator } from '@playwright/test';

import { expect, NOTEBOOK, shot, USER } from './fixtures';

export const TRAIN_CELL = 1;
export const JOB_TIMEOUT = 4 * 60 * 1000; // a job here takes ~10-30 s; the 2-core CI machine can be slow

/** Click the cell toolbar button, fill the dialog, submit; return the new job's id from the cell badge. */
export async function runCellAsJob(
  page: IJupyterLabPageFixture,
  lr: string,
  screenshot: boolean
): Promise<string> {
  const cell = (await page.notebook.getCellLocator(TRAIN_CELL)) as Locator;
  expect(cell, `cell ${TRAIN_CELL} of the notebook`).toBeTruthy();
  const badge = cell.locator('.danlu-job-badge');
  const before = (await badge.count())
    ? await badge.first().getAttribute('data-job-id')
    : null;

  await page.notebook.selectCells(TRAIN_CELL);
  const button = cell.getByTitle('Run cell as training job');
  await expect(
    button,
    'cell toolbar button "Run cell as training job"'
  ).toBeVisible();
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
  await expect(param, "a field for the `parameters` cell's lr").toHaveValue(
    '0.1'
  );
  await param.fill(lr);
  if (screenshot) {
    await shot(page, 'run-dialog');
  }
  await dialog.getByRole('button', { name: 'Submit' }).click();
  await expect(dialog).toHaveCount(0);

  // The cell shows a badge that follows the new job.
  await expect
    .poll(
      async () =>
        (await badge.count())
          ? badge.first().getAttribute('data-job-id')
          : null,
      {
        message: 'cell badge .danlu-job-badge[data-job-id] of the new job',
        timeout: 120_000
      }
    )
    .not.toBe(before);
  const jobId = (await badge.first().getAttribute('data-job-id')) as string;
  expect(jobId).toBeTruthy();
  return jobId;
}

export async function openSidebarTab(
  page: IJupyterLabPageFixture,
  name: 'Queue' | 'Experiments' | 'Sweeps'
): Promise<Locator> {
  await page.sidebar.openTab('danlu-sidebar');
  await page.sidebar.setWidth(420, 'left'); // room for the runs table and the chart (and the screenshots)
  const sidebar = page.locator('#danlu-sidebar');
  await expect(sidebar).toBeVisible();
  await sidebar.getByRole('tab', { name }).click();
  return sidebar;
}

/** The job's row in the Queue, once it has succeeded (with its state and log in the message otherwise). */
export async function waitSucceeded(
  page: IJupyterLabPageFixture,
  jobId: string
): Promise<Locator> {
  const sidebar = await openSidebarTab(page, 'Queue');
  const row = sidebar.locator(`li.danlu-job[data-job-id="${jobId}"]`);
  await expect(
    row,
    `li.danlu-job[data-job-id="${jobId}"] in the Queue`
  ).toBeVisible({ timeout: 60_000 });
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
    const log =
      (await page
        .locator('.danlu-log')
        .first()
        .textContent()
        .catch(() => '')) || '';
    throw new Error(`job ${jobId} ended ${state}:\n${log.slice(-3000)}`);
  }
  await expect(row.locator('.danlu-job-state')).toContainText(/succeeded/i);
  return row;
}

/** Open the notebook and wait for its kernel: "Run cell as training job" submits from it. */
export async function openNotebook(
  page: IJupyterLabPageFixture,
  folder: string
): Promise<void> {
  expect(await page.notebook.openByPath(`${folder}/${NOTEBOOK}`)).toBe(true);
  await page.notebook.activate(NOTEBOOK);
  await expect(
    page.locator('.jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator')
  ).toHaveAttribute('data-status', 'idle', { timeout: 120_000 });
}

/**
 * Show the notebook's experiment (<user>/<notebook stem>) in the Experiments tab
 * until its table has a row for each run (asking again when it loaded too early).
 */
export async function showRuns(
  page: IJupyterLabPageFixture,
  runIds: string[]
): Promise<Locator> {
  const sidebar = await openSidebarTab(page, 'Experiments');
  const experiment = sidebar.locator('button.danlu-experiment').filter({
    has: page.getByText(`${USER}/${NOTEBOOK.replace(/\.ipynb$/, '')}`, {
      exact: true
    })
  });
  const table = sidebar.locator('table.danlu-runs');
  for (let attempt = 0; ; attempt++) {
    try {
      await expect(
        experiment,
        "the notebook's experiment in the Experiments list"
      ).toBeVisible({
        timeout: 20_000
      });
      if ((await experiment.getAttribute('aria-pressed')) !== 'true') {
        await experiment.click();
      }
      await expect(table).toBeVisible({ timeout: 20_000 });
      for (const runId of runIds) {
        await expect(table.locator(`tr[data-run-id="${runId}"]`)).toBeVisible({
          timeout: 20_000
        });
      }
      return table;
    } catch (error) {
      if (attempt >= 2) {
        throw error;
      }
      // Loaded before the newest run existed: ask again.
      await sidebar
        .getByRole('button', { name: 'Refresh experiments' })
        .click();
    }
  }
}
