/**
 * Log in once through JupyterHub's login form (the `dummy` authenticator takes
 * any password), follow the OAuth hand-off to the user's server, and save the
 * cookies (hub login, the server's `jupyterhub-user-<name>` cookie, `_xsrf`)
 * as the storageState every test starts from.
 */
import * as fs from 'fs';
import * as path from 'path';

import { chromium, expect, FullConfig } from '@playwright/test';

export default async function globalSetup(config: FullConfig): Promise<void> {
  const use = config.projects[0].use;
  const hubUrl = (
    process.env.DANLU_UI_HUB_URL || 'http://127.0.0.1:8000'
  ).replace(/\/$/, '');
  const user = process.env.DANLU_UI_USER || 'alice';
  const statePath = use.storageState as string;
  fs.mkdirSync(path.dirname(statePath), { recursive: true });

  const browser = await chromium.launch(use.launchOptions);
  const page = await browser.newPage();
  try {
    await page.goto(`${hubUrl}/hub/login`);
    await page.locator('input[name=username]').fill(user);
    await page.locator('input[name=password]').fill('any password');
    await Promise.all([
      page.waitForURL(url => !url.pathname.endsWith('/hub/login'), {
        timeout: 120_000
      }),
      page.locator('input[type=submit], button[type=submit]').first().click()
    ]);
    // The server is already running (the pytest started it): this goes through
    // /hub/api/oauth2/authorize and /user/<name>/oauth_callback to JupyterLab.
    await page.goto(`${hubUrl}/user/${user}/lab`, { timeout: 120_000 });
    await expect(page).toHaveURL(new RegExp(`/user/${user}/lab`), {
      timeout: 120_000
    });
    await page
      .locator('#jupyterlab-splash')
      .waitFor({ state: 'detached', timeout: 120_000 });
    await page.context().storageState({ path: statePath });
  } catch (error) {
    await page
      .screenshot({
        path: path.join(path.dirname(statePath), 'login-failure.png')
      })
      .catch(() => {});
    throw error;
  } finally {
    await browser.close();
  }
}
