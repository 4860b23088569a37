/**
 * Playwright configuration of the Danlu lab extension's UI tests.
 *
 * JupyterLab runs behind JupyterHub here (a real `danlu up`, started by
 * tests/test_lab_ui.py), not as the bare `jupyter lab` Galata usually expects:
 * - globalSetup logs in through /hub/login once and saves the cookies
 *   (storageState) every test reuses;
 * - baseURL is the user's server, http://127.0.0.1:PORT/user/<user>, and Galata
 *   appends its appPath '/lab';
 * - Galata's page fixture needs `window.jupyterapp` and the galata helper
 *   extension: the pytest makes the hub spawn servers with both (see
 *   tests/test_lab_ui.py, galata_server_config).
 * The browser is the system's Chromium (Playwright never downloads one).
 */
import * as path from 'path';

import type { GalataOptions } from '@jupyterlab/galata';
import { defineConfig } from '@playwright/test';

const baseConfig = require('@jupyterlab/galata/lib/playwright-config');

const HUB_URL = (
  process.env.DANLU_UI_HUB_URL || 'http://127.0.0.1:8000'
).replace(/\/$/, '');
const USER = process.env.DANLU_UI_USER || 'alice';
const ARTIFACTS =
  process.env.DANLU_UI_ARTIFACTS ||
  path.resolve(__dirname, '../../../test-artifacts/ui-tests');

export default defineConfig<GalataOptions>({
  ...baseConfig,
  testDir: './tests',
  outputDir: path.join(ARTIFACTS, 'results'),
  globalSetup: require.resolve('./global-setup'),
  // Jobs run for real: give each scenario minutes, not the default minute.
  timeout: 8 * 60 * 1000,
  expect: { timeout: 30 * 1000 },
  workers: 1,
  fullyParallel: false,
  retries: 0,
  reporter: [
    ['list'],
    ['html', { open: 'never', outputFolder: path.join(ARTIFACTS, 'report') }]
  ],
  use: {
    ...baseConfig.use,
    baseURL: `${HUB_URL}/user/${USER}`,
    appPath: '/lab',
    storageState: path.join(ARTIFACTS, 'storage-state.json'),
    viewport: { width: 1366, height: 850 },
    actionTimeout: 30 * 1000,
    navigationTimeout: 120 * 1000,
    trace: 'retain-on-failure',
    video: 'off',
    launchOptions: {
      executablePath: process.env.DANLU_UI_CHROMIUM || '/usr/bin/chromium',
      args: [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-quic',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync'
      ]
    }
  }
});
