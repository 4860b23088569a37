// Log in to a running Danlu hub through the OpenID provider's own pages, in Chromium, and reach
// JupyterLab (tests/test_oidc.py runs this). The hub's login page -> "Sign in with ..." -> the
// provider's login form (user name, password) -> its consent form -> the hub's spawn form
// (the default profile) -> the user's JupyterLab, loaded (its splash screen gone).
//
// Environment: HUB_URL, USER_NAME, PASSWORD, CHROMIUM (the system's browser: playwright-core
// never downloads one), SCREENSHOT (written on success and on failure).
import { chromium } from 'playwright-core';

const hub = process.env.HUB_URL.replace(/\/$/, '');
const user = process.env.USER_NAME;
const minutes = 60 * 1000;

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM,
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking']
});
const page = await browser.newPage();
let code = 0;
try {
  await page.goto(`${hub}/hub/login`);
  await page.locator('a[href*="oauth_login"]').click();
  await page.waitForURL(url => !url.href.startsWith(hub), { timeout: minutes });
  console.log(`provider login page: ${page.url()}`);
  await page.locator('input[name=login]').fill(user);
  await page.locator('input[name=password]').fill(process.env.PASSWORD);
  await page.locator('button[type=submit]').click();
  await page.locator('button', { hasText: 'Allow' }).click();
  await page.waitForURL(url => url.href.startsWith(hub), { timeout: minutes });
  console.log(`back at the hub: ${page.url()}`);
  if (new URL(page.url()).pathname.includes('/hub/spawn')) {
    await page.locator('form input[type=submit], form button[type=submit]').first().click();
  }
  await page.waitForURL(url => url.pathname.startsWith(`/user/${user}/lab`), { timeout: 3 * minutes });
  await page.locator('#jupyterlab-splash').waitFor({ state: 'detached', timeout: 2 * minutes });
  await page.locator('#jp-main-dock-panel').waitFor({ timeout: minutes });
  console.log(`JupyterLab loaded at ${new URL(page.url()).pathname}`);
  await page.screenshot({ path: process.env.SCREENSHOT });
} catch (error) {
  console.error(`failed at ${page.url()}: ${error}`);
  console.error((await page.content().catch(() => '')).slice(0, 2000));
  await page.screenshot({ path: process.env.SCREENSHOT }).catch(() => {});
  code = 1;
} finally {
  await browser.close();
}
process.exit(code);
