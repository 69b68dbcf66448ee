"""Browser check that the dashboard is live: JupyterLab in headless Chromium (Debian's, driven by
Playwright's Python API), a SimSession pipeline in wall-clock time (steps of about 0.3 s).

One notebook, three cells: build the pipeline, show ``pipe.dashboard()``, then
``pipe.run(400, background=True)`` and ``time.sleep(20)`` in the same cell. While that cell is
busy the plots must gain points (read from the plotly DOM). Then Pause is clicked and the run
must stop within two steps of the click, and the kernel must have heard the browser's answers
to the updates (``dash.plots.drawn_seq`` close to ``sent_seq``); then the reward is broken
mid-run (code sent to the kernel as JupyterLab does for a cell) and the banner and the
failed-per-step plot must appear;
a reward that always fails must end the run with the banner saying so. Screenshots go to
``artifacts/browser/live_*.png``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from _jupyterlab import chromium_context, jupyterlab, skip_without_a_browser

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts" / "browser"
log = logging.getLogger(__name__)

SETUP = """\
import time
import rollart_nb as rn
from rollart_nb.models import spec
from rollart_nb.sim import SimEnv
from rollart_nb.workers import SimGenerator, SimTrainer

sess = rn.Session.sim({"H800": 2, "H20": 2, "cpu": 2}, seed=1, virtual=False)  # wall-clock sim
m, ts = spec("qwen3-0.6b"), 0.2  # steps of about 0.3 s
gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=m, time_scale=ts)
train = sess.cluster("actor_train", SimTrainer, pool="H800", model=m, time_scale=ts)
tasks = sess.tasks(
    {"math": SimEnv("gem-math", time_scale=ts), "lake": SimEnv("frozenlake", time_scale=ts)}, envs_per_task=4
)
pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4)
"""
SHOW = "dash = pipe.dashboard()\ndash"
BUSY = "pipe.run(400, background=True, progress=False)\ntime.sleep(20)  # a busy cell: the dashboard moves anyway"
FLAKY = """\
def flaky(traj):  # about a third of math trajectories fail
    if int(traj.id, 16) % 3 == 0:
        raise ValueError("flaky reward")
    return 1.0
pipe.swap_reward("math", flaky)
pipe.run(200, background=True, progress=False)
"""
BROKEN = """\
def broken(traj):
    raise ValueError("broken reward")
pipe.swap_reward("math", broken)
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    skip_without_a_browser()
    nbformat = pytest.importorskip("nbformat")
    root = tmp_path_factory.mktemp("lab")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (SETUP, SHOW, BUSY)]
    nbformat.write(nb, root / "live.ipynb")
    with jupyterlab(root, {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}) as lab:
        yield lab


# JavaScript run in the page -----------------------------------------------------------------------
_PLOT_POINTS = """(name) => { const el = document.querySelector(
  `.rollart-dashboard .rollart-plot[data-name="${name}"]`);
  return el && el.data ? el.data.reduce((n, d) => n + (d.x || []).length, 0) : -1; }"""
_TRACE_NAMES = """(name) => { const el = document.querySelector(
  `.rollart-dashboard .rollart-plot[data-name="${name}"]`);
  return el && el.data ? el.data.map(d => d.name || '') : []; }"""
_TEXT = "(sel) => { const el = document.querySelector(sel); return el ? el.innerText : ''; }"
_BUSY_CELL = """() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
  .some(p => p.textContent.includes('*'))"""
_CELLS_RUN = """(n) => { const ps = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
  return ps.length >= n && ps.slice(0, n).every(p => /\\[\\d+\\]/.test(p.textContent)); }"""
# Code for the kernel, sent the way a cell's is (the outputs come back here, not into the notebook)
_EXECUTE = """async (code) => {
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const future = kernel.requestExecute({code, store_history: false});
  let out = '';
  future.onIOPub = (msg) => {
    const t = msg.header.msg_type;
    if (t === 'stream') out += msg.content.text;
    if (t === 'error') out += `ERROR ${msg.content.ename}: ${msg.content.evalue}`;
  };
  await future.done;
  return out; }"""


def test_dashboard_is_live_pauses_fast_and_shows_failures(lab, tmp_path):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    console: list[str] = []
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        ctx = chromium_context(pw, tmp_path / "profile", width=1280)
        page = ctx.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)

        def run(code: str) -> str:
            out = page.evaluate(_EXECUTE, code)
            assert "ERROR" not in out, out
            return out

        try:
            page.goto(f"{lab['base']}/lab/tree/live.ipynb?token={lab['token']}")
            page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=120_000)
            try:  # a fresh JupyterLab may ask which kernel to start: accept its (ipykernel) default
                page.locator(".jp-Dialog .jp-mod-accept").click(timeout=10_000)
            except PlaywrightTimeout:
                log.info("no kernel dialog")
            page.wait_for_function(
                "() => { const s = document.querySelector('.jp-Notebook-ExecutionIndicator');"
                " return s && s.getAttribute('data-status') === 'idle'; }",
                timeout=120_000,
            )
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return true; }")

            # 1. live while a cell is busy: the plots gain points during time.sleep(20)
            page.wait_for_function(_CELLS_RUN, arg=2, timeout=120_000, polling=500)
            page.wait_for_function(
                f"() => ({_PLOT_POINTS})('throughput') > 0 && ({_BUSY_CELL})()", timeout=60_000, polling=200
            )
            samples = []
            while page.evaluate(_BUSY_CELL) and len(samples) < 30:
                samples.append(page.evaluate(_PLOT_POINTS, "throughput"))
                page.wait_for_timeout(1000)
            page.screenshot(path=str(ARTIFACTS / "live_busy.png"))
            assert len(samples) >= 10, f"the busy cell ended early: {samples}"
            assert samples[-1] >= samples[0] + 10 and len(set(samples)) >= 5, (
                f"plots did not move while the cell was busy: {samples}; console: {console[-10:]}"
            )
            # the layout fits the notebook: no plot reaches past the output area
            fit = page.evaluate("""() => { const area = document.querySelector('.rollart-dashboard')
                .closest('.jp-OutputArea').getBoundingClientRect();
                const plots = [...document.querySelectorAll('.rollart-dashboard .rollart-plot')];
                return {area: area.right, right: Math.max(...plots.map(p => p.getBoundingClientRect().right)),
                        n: plots.length}; }""")
            # reward, per task, training, failures, step time, staleness, throughput, utilization
            assert fit["n"] == 8 and fit["right"] <= fit["area"] + 1, fit

            # 2. Pause during a run of ~0.3 s steps stops it within two steps of the click
            page.wait_for_function(_CELLS_RUN, arg=3, timeout=60_000, polling=200)
            page.wait_for_timeout(1500)  # the run goes on after the busy cell
            clicked = page.evaluate("() => Date.now() / 1000")
            page.locator(".rollart-dashboard button", has_text="Pause").first.click()
            page.wait_for_function(
                f"() => ({_TEXT})('.rollart-dashboard .rollart-state') === 'paused'", timeout=30_000, polling=100
            )
            started = json.loads(run("import json; print(json.dumps([r.started_at for r in pipe.reports]))"))
            after = [t for t in started if t > clicked]
            assert len(after) <= 2, f"{len(after)} step(s) began after the Pause click"
            assert len(started) < 400

            # the browser answers each update once drawn, and the (now idle) kernel hears it
            seqs = [0, 0]
            for _ in range(20):
                seqs = json.loads(run("import json; print(json.dumps([dash.plots.drawn_seq, dash.plots.sent_seq]))"))
                if seqs[0] == seqs[1]:
                    break
                page.wait_for_timeout(250)
            drawn_seq, sent_seq = seqs
            assert drawn_seq > 0 and sent_seq - drawn_seq <= 1, f"drawn {drawn_seq} of {sent_seq} update(s)"

            # 3. a reward broken mid-run: the failed-per-step plot and the banner appear
            run(FLAKY)
            page.wait_for_function(
                f"() => ({_TRACE_NAMES})('failures').some(n => n.includes('flaky reward'))",
                timeout=60_000,
                polling=200,
            )
            page.wait_for_function(
                f"() => ({_TEXT})('.rollart-dashboard .rollart-banner').includes('flaky reward')", timeout=30_000
            )
            page.screenshot(path=str(ARTIFACTS / "live_failures.png"))
            run(BROKEN)  # every math trajectory fails now: the rollout stalls and the run fails
            page.wait_for_function(
                f"() => ({_TEXT})('.rollart-dashboard .rollart-state').startsWith('failed')",
                timeout=90_000,
                polling=200,
            )
            banner = page.evaluate(_TEXT, ".rollart-dashboard .rollart-banner")
            state = page.evaluate(_TEXT, ".rollart-dashboard .rollart-state")
            dash = page.locator(".rollart-dashboard").first
            dash.scroll_into_view_if_needed()
            dash.screenshot(path=str(ARTIFACTS / "live_failed.png"))
            run("sess.close()")
            page.wait_for_function(
                f"() => ({_TEXT})('.rollart-dashboard .rollart-state') === 'closed'", timeout=30_000, polling=200
            )
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "live_error.png"))
            raise
        finally:
            ctx.close()
    assert "Run failed" in banner and "broken reward" in banner and "trajectory" in banner, banner
    assert state == "failed: RolloutStalledError", state
    assert not errors, f"JavaScript errors: {errors}"
