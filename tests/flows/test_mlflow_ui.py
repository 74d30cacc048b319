"""What MLflow's UI shows of a registered policy, rendered by headless Chromium against a real `mlflow server`: the
model version's page links its logged model and run and lists the policy's signature; the logged model's page
lists the version; the run's page says who started it. The pages are driven over Chromium's DevTools protocol,
since the version page shows the schema's inputs only once its "Inputs" row is clicked."""

from __future__ import annotations

import base64
import getpass
import json
import os
import re
import shutil
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from dzmodel.config import StagePaths, load_params
from tests.flows.servers import QUIET, background, free_port, mlflow_server
from tests.serve.helpers import HORIZON, tiny_bundle

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
NAME = "dreamzero-demo"


class Page:
    """One Chromium tab over the DevTools protocol: navigate, read the rendered text, run JavaScript, screenshot."""

    def __init__(self, ws):
        self.ws, self.last_id = ws, 0

    def call(self, method: str, **params) -> dict:
        self.last_id += 1
        self.ws.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while True:  # events may come before the answer
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.last_id:
                assert "error" not in message, (method, message["error"])
                return message["result"]

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def text(self) -> str:
        return self.js("document.body ? document.body.innerText : ''") or ""

    def shows(self, *needles: str, timeout: float = 60) -> str:
        """The page's text once it shows every needle (a regular expression); fails with what it shows."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if all(re.search(n, text) for n in needles):
                return text
            assert time.monotonic() < deadline, f"{needles} not all shown; the page shows:\n{text[:4000]}"
            time.sleep(0.5)

    def open(self, url: str, *needles: str) -> str:
        self.call("Page.navigate", url=url)
        return self.shows(*needles)

    def click(self, pattern: str) -> None:
        """Click the element whose own text matches `pattern` (a regular expression)."""
        found = self.js(f"""(() => {{
            const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
            for (let n = walk.nextNode(); n; n = walk.nextNode())
                if (new RegExp({json.dumps(pattern)}).test(n.textContent.trim())) {{
                    n.parentElement.click();
                    return true;
                }}
            return false; }})()""")
        assert found, f"nothing to click shows {pattern!r}"

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


@contextmanager
def chromium_page(folder: Path):
    """Headless Chromium (no network but this host's) with one tab, torn down with its processes."""
    from websockets.sync.client import connect

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("chromium is not installed (make test-slow installs Debian's chromium)")
    port = free_port()
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           f"--user-data-dir={folder / 'profile'}", f"--remote-debugging-port={port}", "--window-size=1400,1600",
           "--proxy-server=http://127.0.0.1:9", "about:blank"]
    with background(cmd, dict(os.environ), folder / "chromium.log", health=f"http://127.0.0.1:{port}/json/version"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            tab = next(t["webSocketDebuggerUrl"] for t in json.loads(r.read()) if t["type"] == "page")
        with connect(tab, max_size=None, open_timeout=30) as ws:
            yield Page(ws)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `mlflow server` and a tiny policy registered in it by the pipeline's code (`Tracker.register`)."""
    from tasks import registry
    from tasks.tracking import Tracker

    base = tmp_path_factory.mktemp("mlflow_ui")
    port = free_port()
    bundle = Path(str(tiny_bundle(base / "build", "libero_sim_tiny")).removesuffix(".tar.gz"))
    with mlflow_server(base / "mlflow", port, base / "mlflow.log"), pytest.MonkeyPatch.context() as mp:
        url = f"http://127.0.0.1:{port}"
        for key, value in QUIET.items():
            mp.setenv(key, value)
        mp.setenv("MLFLOW_TRACKING_URI", url)
        prof = load_params(ROOT / "params.yaml", [], "demo").selected()
        tracker = Tracker.start(prof, "demo", StagePaths(base / "project", "demo"), run_name="demo-ui-1")
        version, _ = registry.register(tracker, prof, {"bundle": str(bundle), "tarball": f"{bundle}.tar.gz", "step": 1,
                                             "version": "0.1.0", "success_rate": None, "action_error": None})
        tracker.end()
        mv = tracker.client.get_model_version(NAME, version)
        logged = tracker.client.get_logged_model(mv.tags["logged_model_id"])
        yield {"url": url, "version": version, "run": tracker.client.get_run(tracker.run_id), "logged": logged}


def test_the_version_page_shows_its_logged_model_run_and_signature(server, tmp_path):
    url, logged, run = server["url"], server["logged"], server["run"]
    with chromium_page(tmp_path) as page:
        page.open(f"{url}/#/models/{NAME}/versions/{server['version']}",  # MLflow 3's page of a model version
                  rf"Source Run\s*:?\s*{re.escape(run.info.run_name)}",
                  rf"Source Model\s*:?\s*{re.escape(logged.name)}",
                  r"Schema\s+Name\s+Type\s+Inputs \(4\)\s+Outputs \(1\)")
        link = page.js("document.querySelector('[data-testid=source-model-link]')?.getAttribute('href')")
        assert link and link.endswith(f"/experiments/{logged.experiment_id}/models/{logged.model_id}"), link
        page.click(r"^Inputs \(\d+\)$")  # the schema's rows show once their group is opened
        page.click(r"^Outputs \(\d+\)$")
        inputs = [rf"{re.escape(name)} \(required\)\s+{re.escape(kind)}" for name, kind in [
            ("observation/image", "Array(any)"), ("observation/wrist_image", "Array(any)"),
            ("observation/state", "Array(double)"), ("prompt", "string")]]
        chunk = rf"actions \(required\)\s+Tensor \(dtype: float32, shape: \[{HORIZON['libero_sim_tiny']},7\]\)"
        page.shows(*inputs, chunk)
        page.screenshot(tmp_path / "model_version.png")
    assert (tmp_path / "model_version.png").stat().st_size > 10_000


def test_the_logged_model_and_run_pages_show_the_version_and_who_made_them(server, tmp_path):
    url, logged, run = server["url"], server["logged"], server["run"]
    user, version = re.escape(getpass.getuser()), rf"{NAME}\s+v{server['version']}"
    with chromium_page(tmp_path) as page:
        page.open(f"{url}/#/experiments/{logged.experiment_id}/models/{logged.model_id}",
                  rf"Model versions\s+{version}", rf"Created by\s+{user}\s")
        page.screenshot(tmp_path / "logged_model.png")
        page.open(f"{url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}",
                  rf"Created by\s+{user}\s", rf"Registered models\s+{version}")
        page.screenshot(tmp_path / "run.png")
