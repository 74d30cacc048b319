// prefect_flow_run.png: a flow run of sft-pipeline (its name, the task graph with its edges, the log), taken with
// headless Chromium through playwright-core. The UI asks the API at its default address, so serve on port 4200:
//   npm install --prefix /tmp/pw playwright-core
//   PREFECT_HOME=$PWD/.prefect .venv/bin/prefect server start --port 4200 &      # the database `make demo` filled
//   NODE_PATH=/tmp/pw/node_modules node docs/img/prefect_screenshot.js FLOW_RUN_ID
const { chromium } = require('playwright-core');
(async () => {
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium', args: ['--no-sandbox'] });
  const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
  await page.goto(`http://127.0.0.1:4200/runs/flow-run/${process.argv[2]}`, { waitUntil: 'networkidle' });
  await page.waitForTimeout(6000);  // the graph draws after the data arrives
  await page.screenshot({ path: `${__dirname}/prefect_flow_run.png` });
  await browser.close();
})();
