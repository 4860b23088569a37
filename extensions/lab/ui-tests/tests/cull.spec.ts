/**
 * GPU-aware culling, seen in the lab, against a real workbench.
 *
 * alice's server holds one GPU of tests/fakenvml, busy while the other specs
 * run; tests/test_lab_ui.py then makes it idle and runs this spec alone. The
 * Danlu sidebar shows the warning banner (whatever tab is open) with a live
 * countdown, why, and how to keep the server, before the jobs service stops
 * it; the pytest then checks that it was stopped and audited. The screenshot
 * docs/images/lab-cull-warning.png is taken with DANLU_UI_DOCS_IMAGES=1.
 */
import { expect, shot, test } from './fixtures';
import { openSidebarTab } from './jobs';

test('an idle GPU server is warned in the sidebar before it is stopped', async ({
  page
}) => {
  await openSidebarTab(page, 'Queue');
  const banner = page.locator('#danlu-sidebar .danlu-cull-warning');
  await expect(banner, 'the cull warning in the Danlu sidebar').toBeVisible({
    timeout: 120_000
  });
  await expect(banner).toContainText('This server will be stopped in');
  await expect(banner).toContainText('idle');
  await expect(banner).toContainText('CPU profile');
  const countdown = banner.locator('.danlu-cull-countdown');
  const first = await countdown.textContent();
  expect(first).toMatch(/^\d+:\d\d$/);
  await expect
    .poll(async () => countdown.textContent(), {
      message: 'the countdown moving',
      timeout: 10_000
    })
    .not.toBe(first);
  await openSidebarTab(page, 'Sweeps'); // still there on another tab
  await expect(banner).toBeVisible();
  await shot(page, 'cull-warning');
});
