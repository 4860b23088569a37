/**
 * Galata's fixtures, adapted to a JupyterLab behind JupyterHub.
 *
 * Galata's own `tmpPath`, `kernels`, `sessions` and `terminals` fixtures call
 * the Jupyter REST API with root-relative paths (`/api/contents/...`) and no
 * XSRF header, which under JupyterHub land on the hub, not on
 * `/user/<name>/api/...`. So the test folder is the one tests/test_lab_ui.py
 * prepared in the user's home (`DANLU_UI_FOLDER`), kept after the run, and the
 * kernels the scenario starts are left to the workbench's teardown. Galata's
 * `mockUser` is off: its route, /.*\/api\/me.*\/, also swallows Danlu's
 * `danlu/api/metric-history` and answers it with a fake identity. The rest
 * (page start-up and readiness, the in-memory workspace and settings mocks, the
 * notebook, sidebar and activity helpers) is Galata's.
 */
import * as fs from 'fs';
import * as path from 'path';

import {
  expect,
  IJupyterLabPageFixture,
  test as galataTest
} from '@jupyterlab/galata';
import { Page } from '@playwright/test';

export const USER = process.env.DANLU_UI_USER || 'alice';
export const FOLDER = process.env.DANLU_UI_FOLDER || 'ui-tests';
export const NOTEBOOK = process.env.DANLU_UI_NOTEBOOK || 'train.ipynb';
/** The line the training cell prints (tests/test_lab_ui.py writes the cell). */
export const DONE_LINE = 'danlu-ui-test finished';

const SCREENSHOTS = path.resolve(__dirname, '..', 'screenshots');
const DOCS_IMAGES = path.resolve(
  __dirname,
  '..',
  '..',
  '..',
  '..',
  'docs',
  'images'
);

export const test = galataTest.extend({
  tmpPath: async ({}, use) => {
    await use(FOLDER);
  },
  kernels: async ({}, use) => {
    await use(null);
  },
  sessions: async ({}, use) => {
    await use(null);
  },
  terminals: async ({}, use) => {
    await use(null);
  },
  mockUser: false
});

export { expect };

/**
 * Screenshot of the whole page into ui-tests/screenshots/<view>.png; with
 * DANLU_UI_DOCS_IMAGES=1 also into docs/images/lab-<view>.png, unless the test
 * has already failed a (soft) check: the docs only get views that work.
 */
export async function shot(page: Page, view: string): Promise<void> {
  fs.mkdirSync(SCREENSHOTS, { recursive: true });
  const file = path.join(SCREENSHOTS, `${view}.png`);
  await page.screenshot({ path: file });
  if (
    process.env.DANLU_UI_DOCS_IMAGES === '1' &&
    galataTest.info().errors.length === 0
  ) {
    fs.mkdirSync(DOCS_IMAGES, { recursive: true });
    fs.copyFileSync(file, path.join(DOCS_IMAGES, `lab-${view}.png`));
  }
}

/** GET a Danlu REST endpoint of the user's server with the page's cookies. */
export async function danluApi(
  page: IJupyterLabPageFixture,
  baseURL: string,
  endpoint: string
): Promise<any> {
  const response = await page.request.get(
    `${baseURL.replace(/\/$/, '')}/danlu/api/${endpoint}`
  );
  expect(
    response.status(),
    `GET danlu/api/${endpoint}: ${await response.text()}`
  ).toBe(200);
  return response.json();
}
