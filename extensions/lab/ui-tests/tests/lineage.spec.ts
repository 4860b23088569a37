/**
 * Models and lineage in the lab, clicked through against a real workbench.
 *
 * Needs the jobs service's models API (POST/GET /models and
 * GET /lineage/models/{name}/{version}, issue 9): where the service does not
 * have it yet, `GET danlu/api/models` (or the registration itself) answers 404
 * `no_endpoint` and the test skips, saying so. The run to register is that of
 * the notebook tests/test_lab_ui.py writes: the job runner uploads its input
 * and output notebooks and its log as the run's artifacts, which is what a
 * registration without a logged model takes.
 *
 * One scenario: run the training cell (which reads the catalog dataset that
 * tests/test_lab_ui.py registered) as a job, register its run as a model with
 * the Experiments row's "Register model" button (a bad name first, which the
 * dialog refuses), see the version's approval in the row, have an approver (an
 * admin, through the jobs API: DANLU_UI_APPROVER_TOKEN) approve it, open its
 * lineage tab, check the graph against GET danlu/api/lineage/... (the whole
 * chain: dataset version, environment, notebook and cell, job, run, model
 * version, approval), click a node and take the screenshot
 * docs/images/lab-lineage.png (with DANLU_UI_DOCS_IMAGES=1).
 */
import { danluApi, expect, FOLDER, shot, test } from './fixtures';
import { openNotebook, runCellAsJob, showRuns, waitSucceeded } from './jobs';

const HUB_URL = (
  process.env.DANLU_UI_HUB_URL || 'http://127.0.0.1:8000'
).replace(/\/$/, '');
const APPROVER_TOKEN = process.env.DANLU_UI_APPROVER_TOKEN || '';
const DATASET = process.env.DANLU_UI_DATASET || '';

/** Whether an answer is the jobs service saying it has no such endpoint (the models API is not there). */
async function noModelsApi(response: {
  status(): number;
  text(): Promise<string>;
}): Promise<boolean> {
  if (response.status() !== 404) {
    return false;
  }
  try {
    return JSON.parse(await response.text()).reason === 'no_endpoint';
  } catch {
    return false;
  }
}

test.describe('Danlu models and lineage', () => {
  test('register a run as a model from the Experiments view, then open its lineage graph', async ({
    page,
    baseURL
  }) => {
    const base = (baseURL as string).replace(/\/$/, '');
    const probe = await page.request.get(`${base}/danlu/api/models`);
    test.skip(
      await noModelsApi(probe),
      'the jobs service has no models API yet (GET /models answered 404 no_endpoint)'
    );
    expect(probe.status(), `GET danlu/api/models: ${await probe.text()}`).toBe(
      200
    );

    let jobId = '';
    let runId = '';
    await test.step('run the training cell as a job', async () => {
      await openNotebook(page, FOLDER);
      jobId = await runCellAsJob(page, '0.3', false);
      await waitSucceeded(page, jobId);
      await expect
        .poll(
          async () =>
            (await danluApi(page, base, `jobs/${jobId}`)).mlflow_run_id,
          {
            message: `job ${jobId} has an mlflow_run_id`,
            timeout: 60_000
          }
        )
        .toBeTruthy();
      runId = (await danluApi(page, base, `jobs/${jobId}`)).mlflow_run_id;
    });

    const name = `ui-lineage-${jobId}`;
    let version = '';
    await test.step("register its run with the row's Register model button", async () => {
      const table = await showRuns(page, [runId]);
      const row = table.locator(`tr[data-run-id="${runId}"]`);
      await row.locator('button.danlu-register-model').click();

      const dialog = page.locator('.jp-Dialog');
      const field = dialog.locator('[name="model-name"]');
      await expect(field).toBeVisible();
      // A name the service would refuse: said as it is typed, and the dialog comes back on Register.
      await field.fill('not a name');
      await expect(dialog.locator('.danlu-form-error')).toContainText(
        'cannot be in a model name'
      );
      await dialog.getByRole('button', { name: 'Register' }).click();
      await expect(dialog.locator('.danlu-form-error')).toBeVisible();
      await expect(dialog.locator('[name="model-name"]')).toHaveValue(
        'not a name'
      );

      await dialog.locator('[name="model-name"]').fill(name);
      await expect(dialog.locator('.danlu-form-error')).toBeHidden();
      const posted = page.waitForResponse(
        // the lab adds a cache-busting query to its requests: match the path
        r =>
          new URL(r.url()).pathname.endsWith('/danlu/api/models') &&
          r.request().method() === 'POST',
        { timeout: 180_000 }
      );
      await dialog.getByRole('button', { name: 'Register' }).click();
      const response = await posted;
      if (await noModelsApi(response)) {
        await page.locator('.jp-Dialog').getByRole('button').last().click(); // the error's OK
        test.skip(
          true,
          'the jobs service has no models API yet (POST /models answered 404 no_endpoint)'
        );
      }
      expect(
        response.status(),
        `POST danlu/api/models: ${await response.text()}`
      ).toBe(201);
      const registered = await response.json();
      expect(registered.name).toBe(name);
      expect(registered.run_id).toBe(runId);
      version = String(registered.version);

      const entry = row.locator(`.danlu-registered[data-model="${name}"]`);
      await expect(entry).toBeVisible();
      await expect(entry).toHaveAttribute('data-version', version);
      await expect(entry).toHaveAttribute('data-approval', registered.approval);
      await expect(entry.locator('.danlu-approval')).toHaveText(
        registered.approval
      );
    });

    await test.step('an approver approves it (the jobs API, as an admin)', async () => {
      test.skip(
        !APPROVER_TOKEN,
        'DANLU_UI_APPROVER_TOKEN is not set (tests/test_lab_ui.py sets it)'
      );
      const decided = await page.request.post(
        `${HUB_URL}/services/danlu/api/v1/models/${encodeURIComponent(name)}/versions/${version}/decisions`,
        {
          headers: { Authorization: `token ${APPROVER_TOKEN}` },
          data: {
            decision: 'approve',
            comment: 'trained on ui-points; fine for the docs'
          }
        }
      );
      expect(
        decided.status(),
        `POST .../decisions: ${await decided.text()}`
      ).toBe(200);
      expect((await decided.json()).approval).toBe('approved');
    });

    await test.step('open its lineage and check the graph against the API', async () => {
      const row = page.locator(`tr[data-run-id="${runId}"]`);
      await row
        .getByRole('button', {
          name: `Open lineage of ${name} version ${version}`
        })
        .click();
      const tab = page.locator(`[id="danlu-lineage-${name}-v${version}"]`);
      await expect(tab).toBeVisible({ timeout: 60_000 });
      const graph = tab.locator('svg.danlu-lineage-graph');
      await expect(graph).toBeVisible({ timeout: 60_000 });

      const lineage = await danluApi(
        page,
        base,
        `lineage/models/${name}/${version}`
      );
      const ids = new Set<string>(
        lineage.nodes.map((n: { id: string }) => n.id)
      );
      await expect(graph.locator('g.danlu-lineage-node')).toHaveCount(ids.size);
      const kinds = new Set<string>(
        lineage.nodes.map((n: { kind: string }) => n.kind)
      );
      const expected = [
        'model_version',
        'run',
        'job',
        'notebook',
        'cell',
        'environment'
      ];
      if (DATASET) {
        expected.push('dataset_version');
      }
      if (APPROVER_TOKEN) {
        expected.push('approval');
      }
      for (const kind of expected) {
        expect(kinds, `the lineage has a ${kind} node`).toContain(kind);
        await expect(
          graph.locator(`g.danlu-lineage-node[data-kind="${kind}"]`).first()
        ).toBeVisible();
      }
      const drawn = lineage.edges.filter(
        (e: { from: string; to: string }) =>
          ids.has(e.from) && ids.has(e.to) && e.from !== e.to
      );
      await expect(graph.locator('path.danlu-lineage-edge')).toHaveCount(
        drawn.length
      );
      await expect(tab.locator('.danlu-approval')).toHaveAttribute(
        'data-approval',
        lineage.model.approval
      );

      // The run's box: its details, and its MLflow link opening in a new tab.
      const runNode = graph
        .locator('g.danlu-lineage-node[data-kind="run"]')
        .first();
      await runNode.click();
      const detail = tab.locator('.danlu-lineage-node-detail');
      await expect(detail).toBeVisible();
      await expect(detail.locator('.danlu-lineage-detail-kind')).toHaveText(
        'MLflow run'
      );
      const link = detail.locator('a.danlu-link');
      if (await link.count()) {
        await expect(link).toHaveAttribute('target', '_blank');
      }
      await page.sidebar.close('left'); // the graph gets the width of the page
      await shot(page, 'lineage');
    });
  });
});
