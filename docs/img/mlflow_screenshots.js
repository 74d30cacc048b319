// The MLflow screenshots in this folder, taken with headless Chromium through playwright-core:
//   npm install --prefix /tmp/pw playwright-core          # outside the checkout; Debian's chromium drives it
//   .venv/bin/mlflow ui --backend-store-uri sqlite:///$PWD/mlruns/mlflow.db --port 5077 &
//   NODE_PATH=/tmp/pw/node_modules node docs/img/mlflow_screenshots.js [http://127.0.0.1:5077] [experiment id, default 1]
// mlflow_runs.png: the experiment's runs (classic ML view) with parameter and metric columns picked in "Columns";
// mlflow_registry.png: the registered model's versions with their provenance tags.
const { chromium } = require('playwright-core');
const base = process.argv[2] || 'http://127.0.0.1:5077';
const experiment = process.argv[3] || '1';
const out = __dirname;

async function closeAssistant(page) {
  const close = page.locator('button[aria-label="Close"]');
  if (await close.count()) await close.first().click();
}

(async () => {
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium', args: ['--no-sandbox'] });
  let page = await browser.newPage({ viewport: { width: 1800, height: 560 } });
  await page.goto(`${base}/#/experiments/${experiment}/runs?workflowType=machine_learning`, { waitUntil: 'networkidle' });
  await page.waitForTimeout(3000);
  await closeAssistant(page);
  for (const name of ['train.lr', 'train.seed', 'package.version', 'action_error.ratio', 'train.final_loss']) {
    if (!(await page.locator('input[placeholder="Search columns"]').count())) {
      await page.getByRole('button', { name: 'Columns', exact: true }).click();
      await page.waitForTimeout(500);
    }
    await page.fill('input[placeholder="Search columns"]', name);
    await page.waitForTimeout(400);
    await page.locator('[role=dialog]').getByText(name, { exact: true }).first().click();
  }
  await page.keyboard.press('Escape');
  await page.waitForTimeout(1500);
  await page.screenshot({ path: `${out}/mlflow_runs.png` });

  page = await browser.newPage({ viewport: { width: 1500, height: 1000 } });
  await page.goto(`${base}/#/models/dreamzero-demo`, { waitUntil: 'networkidle' });
  await page.waitForTimeout(3000);
  await closeAssistant(page);
  await page.waitForTimeout(500);
  await page.screenshot({ path: `${out}/mlflow_registry.png` });
  await browser.close();
})();
