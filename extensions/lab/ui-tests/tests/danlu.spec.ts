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
import type { Locator } from '@playwright/test';

import {
  danluApi,
  DONE_LINE,
  expect,
  FOLDER,
  NOTEBOOK,
  shot,
  test
} from './fixtures';
import {
  openNotebook,
  openSidebarTab,
  runCellAsJob,
  showRuns,
  waitSucceeded
} from './jobs';

test.describe('Danlu lab extension', () => {
  test('run a cell as a job, follow it, read its log, open TensorBoard, compare two runs', async ({
    page,
    baseURL
  }) => {
    const jobs: string[] = [];

    await test.step('open the notebook', async () => {
      await openNotebook(page, FOLDER);
    });

    await test.step('run the training cell as a job (dialog, Submit, badge)', async () => {
      jobs.push(await runCellAsJob(page, '0.1', true));
    });

    let row: Locator;
    await test.step('follow the job in the Queue to succeeded', async () => {
      row = await waitSucceeded(page, jobs[0]);
      await expect(
        page.locator(`.danlu-job-badge[data-job-id="${jobs[0]}"]`)
      ).toHaveAttribute('data-state', 'succeeded', { timeout: 60_000 });
      await shot(page, 'queue');
    });

    await test.step('read its log', async () => {
      await row
        .getByRole('button', { name: `Show log of job ${jobs[0]}` })
        .click();
      const log = page.locator('.danlu-log');
      await expect(log.first()).toBeVisible();
      // Soft: a broken view fails the test but the later views still get checked.
      await expect
        .soft(
          log.first(),
          'the log (GET danlu/api/jobs/ID/logs/stream) shows the printed line'
        )
        .toContainText(`${DONE_LINE}: lr=0.1`, { timeout: 60_000 });
      await shot(page, 'log');
    });

    await test.step('open its TensorBoard', async () => {
      await row
        .getByRole('button', { name: `Open TensorBoard for job ${jobs[0]}` })
        .click();
      const tab = page.locator('[id^="danlu-tensorboard-"]');
      await expect(tab.first()).toBeVisible({ timeout: 60_000 });
      await expect(tab.first().locator('iframe')).toBeVisible();
      const frame = page
        .frameLocator('[id^="danlu-tensorboard-"] iframe')
        .first();
      // TensorBoard's web app, then the scalar the job wrote.
      await expect
        .soft(frame.locator('tb-webapp'), "TensorBoard's web app in the iframe")
        .toBeAttached({
          timeout: 120_000
        });
      await expect
        .soft(
          frame.getByText('loss').first(),
          'the scalar `loss` in TensorBoard'
        )
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
          .poll(
            async () =>
              (await danluApi(page, baseURL as string, `jobs/${id}`))
                .mlflow_run_id,
            {
              message: `job ${id} has an mlflow_run_id`,
              timeout: 60_000
            }
          )
          .toBeTruthy();
        runIds.push(
          (await danluApi(page, baseURL as string, `jobs/${id}`)).mlflow_run_id
        );
      }
      const sidebar = await openSidebarTab(page, 'Experiments');
      const table = await showRuns(page, runIds);
      for (const runId of runIds) {
        await table
          .locator(`tr[data-run-id="${runId}"]`)
          .getByRole('checkbox')
          .check();
      }
      await sidebar.getByRole('button', { name: 'Compare' }).click();
      const chart = page.locator('svg.danlu-compare-chart');
      await expect(chart).toBeVisible({ timeout: 60_000 });
      const metric = page.getByRole('combobox', { name: 'Metric' });
      if (
        (await metric.count()) &&
        (await metric.locator('option[value="loss"]').count())
      ) {
        await metric.selectOption('loss');
      }
      await expect(chart.locator('path.danlu-series')).toHaveCount(2, {
        timeout: 60_000
      });
      await shot(page, 'compare');
    });
  });
});
