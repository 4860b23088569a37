/**
 * A sweep in the lab, against a real workbench.
 *
 * The sweep is started through the jobs API as alice (DANLU_UI_TOKEN, which
 * tests/test_lab_ui.py sets), the way `%%train --sweep` starts one: 8 trials,
 * 2 at a time, of a small notebook that writes `loss` with SummaryWriter for a
 * few steps (auto-logging carries it into the trial's MLflow run, where the
 * sweep reads the objective). Then, in the lab: the Sweeps tab lists it, it
 * opens in a tab, its trials appear with their states, the best-so-far curve
 * and the parameters' scatters (a log axis for the loguniform `lr`) draw, the
 * screenshot docs/images/lab-sweep.png is taken (with DANLU_UI_DOCS_IMAGES=1),
 * and Stop (after its confirmation) stops the sweep: no trial runs on, and
 * the jobs of the stopped ones are cancelled.
 */
import { danluApi, expect, FOLDER, shot, test } from './fixtures';
import { JOB_TIMEOUT, openSidebarTab } from './jobs';

const HUB_URL = (
  process.env.DANLU_UI_HUB_URL || 'http://127.0.0.1:8000'
).replace(/\/$/, '');
const TOKEN = process.env.DANLU_UI_TOKEN || '';
const FINAL = ['succeeded', 'failed', 'cancelled', 'timed_out'];

/** A parameters cell (lr, decay) and a short training loop logging `loss` each step. */
function sweepNotebook(kernel: string, display: string): object {
  const cell = (id: string, source: string, tags: string[] = []) => ({
    cell_type: 'code',
    id,
    execution_count: null,
    metadata: tags.length ? { tags } : {},
    outputs: [],
    source
  });
  return {
    cells: [
      cell('params', 'lr = 0.1\ndecay = 0.0', ['parameters']),
      cell(
        'train',
        [
          'import time',
          'from torch.utils.tensorboard import SummaryWriter',
          '',
          'writer = SummaryWriter()',
          'w = 0.0',
          'for step in range(1, 9):',
          '    w -= lr * (2 * (w - 3.0) + decay * w)',
          '    writer.add_scalar("loss", (w - 3.0) ** 2 + decay, step)',
          '    writer.flush()',
          '    time.sleep(1.0)',
          'writer.close()',
          'print(f"danlu-ui-sweep trial finished: lr={lr} decay={decay}")'
        ].join('\n')
      )
    ],
    nbformat: 4,
    nbformat_minor: 5,
    metadata: {
      kernelspec: { name: kernel, display_name: display, language: 'python' }
    }
  };
}

test.describe('Danlu sweeps', () => {
  test('a sweep in the sidebar and its tab: trials, curve, scatters, then Stop', async ({
    page,
    baseURL
  }) => {
    test.skip(
      !TOKEN,
      "DANLU_UI_TOKEN (alice's API token) is not set: tests/test_lab_ui.py sets it"
    );
    const base = (baseURL as string).replace(/\/$/, '');
    let sweepId = '';

    await test.step('start a sweep of 8 trials through the jobs API', async () => {
      const specs = await (
        await page.request.get(`${base}/api/kernelspecs`)
      ).json();
      const kernel = specs.default as string;
      const display = specs.kernelspecs[kernel].spec.display_name as string;
      const response = await page.request.post(
        `${HUB_URL}/services/danlu/api/v1/sweeps`,
        {
          headers: { Authorization: `token ${TOKEN}` },
          data: {
            name: 'ui-sweep',
            job: {
              notebook: sweepNotebook(kernel, display),
              profile: 'python',
              name: 'ui-sweep',
              resources: { nproc: 1 },
              cwd: FOLDER,
              source: { notebook_path: `${FOLDER}/sweep.ipynb` }
            },
            sweep: ['lr=loguniform(0.01,0.5)', 'decay=uniform(0,0.5)'],
            objective: 'loss:min',
            trials: 8,
            parallel: 2,
            scheduler: 'none',
            sampler: 'random',
            seed: 7
          }
        }
      );
      expect(response.status(), `POST /sweeps: ${await response.text()}`).toBe(
        201
      );
      sweepId = (await response.json()).id;
      expect(sweepId).toMatch(/^[0-9a-f]{12}$/);
    });

    const tab = page.locator(`[id="danlu-sweep-${sweepId}"]`);
    await test.step('the Sweeps tab lists it; it opens in a tab', async () => {
      const sidebar = await openSidebarTab(page, 'Sweeps');
      const item = sidebar.locator(
        `li.danlu-sweep-item[data-sweep-id="${sweepId}"]`
      );
      await expect(item, 'the sweep in the Sweeps tab').toBeVisible({
        timeout: 60_000
      });
      await expect(item).toHaveAttribute('data-state', 'running');
      await item.getByRole('button', { name: 'Open sweep ui-sweep' }).click();
      await expect(tab).toBeVisible({ timeout: 60_000 });
    });

    await test.step('trials appear with their states; curve and scatters draw', async () => {
      const rows = tab.locator('table.danlu-trials tbody tr[data-trial]');
      await expect
        .poll(async () => rows.count(), {
          message: 'trials in the table',
          timeout: 120_000
        })
        .toBeGreaterThanOrEqual(2);
      for (const state of await rows.evaluateAll(els =>
        els.map(e => e.getAttribute('data-state'))
      )) {
        expect([
          'running',
          'complete',
          'pruned',
          'failed',
          'stopped'
        ]).toContain(state);
      }
      // A trial completes: the best-so-far curve has a point, the scatters dots.
      await expect(
        tab.locator('tr[data-trial][data-state="complete"]').first(),
        'a complete trial'
      ).toBeVisible({ timeout: JOB_TIMEOUT });
      await expect(tab.locator('path.danlu-best-curve')).toBeVisible({
        timeout: 30_000
      });
      const lr = tab.locator('.danlu-scatter[data-param="lr"]');
      await expect(lr).toHaveAttribute('data-axis', 'log');
      await expect(
        tab.locator('.danlu-scatter[data-param="decay"]')
      ).toHaveAttribute('data-axis', 'linear');
      await expect(
        lr.locator('circle.danlu-scatter-point').first()
      ).toBeVisible();
      await expect(tab.locator('a.danlu-sweep-mlflow')).toHaveAttribute(
        'target',
        '_blank'
      );
      await shot(page, 'sweep');
    });

    await test.step('Stop, confirmed, stops the sweep and its trials', async () => {
      const stop = tab.getByRole('button', { name: 'Stop sweep' });
      await expect(stop, 'the Stop button of a running sweep').toBeVisible();
      await stop.click();
      const dialog = page.locator('.jp-Dialog');
      await expect(dialog).toContainText('Stop sweep');
      await dialog.getByRole('button', { name: 'Stop sweep' }).click();
      await expect(tab.locator('.danlu-sweep')).toHaveAttribute(
        'data-state',
        'stopped',
        { timeout: 120_000 }
      );
      await expect(stop).toHaveCount(0);

      // The API agrees: no trial runs on, and the stopped ones' jobs end cancelled.
      await expect
        .poll(
          async () => {
            const sweep = await danluApi(page, base, `sweeps/${sweepId}`);
            return sweep.trials.every(
              (t: { state: string; job_state: string | null }) =>
                t.state !== 'running' &&
                (t.job_state === null || FINAL.includes(t.job_state))
            );
          },
          {
            message: 'every trial ended and every trial job final',
            timeout: 120_000
          }
        )
        .toBe(true);
      const sweep = await danluApi(page, base, `sweeps/${sweepId}`);
      expect(sweep.state).toBe('stopped');
      const stopped = sweep.trials.filter(
        (t: { state: string }) => t.state === 'stopped'
      );
      expect(
        stopped.length,
        'trials stopped by Stop (8 trials, 2 at a time: some were still under way)'
      ).toBeGreaterThan(0);
      for (const t of stopped) {
        if (t.job_id) {
          expect(t.job_state, `trial ${t.number}'s job`).toBe('cancelled');
        }
      }
      await expect(
        tab.locator('tr[data-trial][data-state="stopped"]').first()
      ).toBeVisible({ timeout: 30_000 });
    });
  });
});
