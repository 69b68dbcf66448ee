"""Browser checks: JupyterLab runs 01_quickstart in headless Chromium and the widgets render;
the trajectory viewer's token overlay of 32k tokens draws in time, coloured as computed.

JupyterLab is served on 127.0.0.1 (random port, a token, a temp root holding a copy of the
notebook); Debian's Chromium is driven by Playwright's Python API (no Playwright browser
download). The test runs all cells through JupyterLab's own command ("Run all"), waits for the dashboard's
plotly plots and the trajectory viewer, checks that the dashboard followed the background run on
its own (a point per step), fails on any page error or traceback, and saves a screenshot to
``artifacts/browser/quickstart.png``.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path

import pytest
from _jupyterlab import chromium_context, jupyterlab, skip_without_a_browser

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts" / "browser"
RUN_TIMEOUT_S = 360
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    skip_without_a_browser()
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", root / "01_quickstart.ipynb")
    with jupyterlab(root) as lab:
        yield lab


_THROUGHPUT_POINTS = """() => { const el = document.querySelector(
  '.rollart-dashboard .rollart-plot[data-name="throughput"]');
  return el && el.data ? Math.max(0, ...el.data.map(d => (d.x || []).length)) : -1; }"""
_ALL_RUN = """() => {
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
  return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
}"""


def test_quickstart_runs_and_renders_widgets(lab, tmp_path):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as pw:
        ctx = chromium_context(pw, tmp_path / "profile")
        page = ctx.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
        page.goto(f"{lab['base']}/lab/tree/01_quickstart.ipynb?token={lab['token']}")
        page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=120_000)
        try:  # a fresh JupyterLab may ask which kernel to start: accept its (ipykernel) default
            page.locator(".jp-Dialog .jp-mod-accept").click(timeout=15_000)
        except PlaywrightTimeout:
            log.info("no kernel dialog")
        page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.commands.hasCommand('notebook:run-all-cells')", timeout=60_000
        )
        # the kernel must be up before Run All, or the first cells queue behind its start
        page.wait_for_function(
            "() => { const s = document.querySelector('.jp-Notebook-ExecutionIndicator');"
            " return s && s.getAttribute('data-status') === 'idle'; }",
            timeout=120_000,
        )
        # not awaited: the command's promise settles only when every cell has run
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return true; }")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        try:
            page.wait_for_function(_ALL_RUN, timeout=RUN_TIMEOUT_S * 1000, polling=1000)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "quickstart_timeout.png"))
            raise
        page.wait_for_selector(".rollart-dashboard .js-plotly-plot", timeout=60_000)
        page.wait_for_selector(".rollart-viewer", timeout=60_000)
        # Shown after the first step, the dashboard moved on its own with the background run's 3
        # steps (pipe.run(3, background=True), then pipe.wait(): no cell redrew it).
        try:
            page.wait_for_function(f"() => ({_THROUGHPUT_POINTS})() >= 4", timeout=30_000)
        except PlaywrightTimeout:
            pass  # asserted below with the count
        throughput_points = page.evaluate(_THROUGHPUT_POINTS)
        try:  # plotly draws asynchronously after the last redraw: wait for every plot's title
            page.wait_for_function(
                """() => { const t = [...document.querySelectorAll(
                '.rollart-dashboard .js-plotly-plot')].filter(el => el.data)
                .map(el => (el.layout.title || {}).text || '').filter(x => x);
                return new Set(t).size >= 4; }""",
                timeout=30_000,
            )
        except PlaywrightTimeout:
            log.warning("dashboard plots still drawing after 30 s")
        plots = page.evaluate("""() => [...document.querySelectorAll('.rollart-dashboard .js-plotly-plot')]
            .filter(el => el.data).map(el => ({title: (el.layout.title || {}).text || '',
                                                points: el.data.reduce((n, d) => n + (d.x || []).length, 0)}))""")
        bars = page.locator(".rollart-dashboard .js-plotly-plot .trace.bars").count()
        lines = page.locator(".rollart-dashboard .js-plotly-plot .scatterlayer .trace").count()
        tracebacks = page.locator(".jp-OutputArea-output:has-text('Traceback')").count()
        viewer_text = page.locator(".rollart-viewer").inner_text()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        dash = page.locator(".rollart-dashboard").first
        dash.scroll_into_view_if_needed()
        dash.screenshot(path=str(ARTIFACTS / "quickstart.png"))
        page.screenshot(path=str(ARTIFACTS / "quickstart_page.png"))
        ctx.close()
    assert not errors, f"JavaScript errors: {errors}"
    assert tracebacks == 0, "a cell raised: see artifacts/browser/quickstart_page.png"
    # JupyterLab may keep a second rendering of an output in the DOM: count distinct plots
    assert len({p["title"] for p in plots}) >= 4, (
        f"expected the dashboard's 5 plots, found {plots}; console: {console[-15:]}"
    )
    assert all(p["points"] > 0 for p in plots), f"a dashboard plot has no data: {plots}"
    assert bars > 0 and lines > 0, "dashboard plots rendered without data"
    assert "trajectories" in viewer_text and "turn 0" in viewer_text
    assert throughput_points == 4, f"the dashboard did not follow the background run: {throughput_points} step(s)"


_DRAWN = """() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(() => done({
  tokens: document.querySelectorAll('.rn-overlay .rn-t').length, height: document.body.offsetHeight }))))"""


def test_token_overlays_draw_a_32k_token_trajectory_within_two_seconds(tmp_path):
    """The viewer's token pane for 32k tokens coloured by the importance ratio: drawn by
    Chromium in under 2 s, each token's colour and tooltip as the overlay computed them."""
    skip_without_a_browser()
    from playwright.sync_api import sync_playwright

    from rollart_nb.nb.overlay import token_html
    from rollart_nb.trajectory import Trajectory, Turn

    t = Trajectory("math", id="long", start_version=0)
    ids: list[int] = []
    for k in range(32):  # 32 turns of 512 prompt-side and 512 response tokens
        prompt = ids + [(k * 7 + i) % 1000 for i in range(512)]
        resp = [(k * 13 + i) % 1000 for i in range(512)]
        u = Turn(f"obs {k}", "act", prompt, resp, logprobs=[-1.0] * 512, loss_mask=[1] * 512, version=k // 8)
        t.turns.append(u)
        ids = prompt + resp
    # the trainer's logprob: the sampler's everywhere, but twice as likely at the first response token
    lp = [math.nan] + [-1.0] * (len(ids) - 1)
    lp[512] = -1.0 + math.log(2.0)
    t.train = {"step": 0, "version": 0, "advantage": 0.5, "rows": [{"logprob": lp, "entropy": lp, "loss_weight": lp}]}
    page_html = "<html><body>" + token_html(t, "importance_ratio") + "</body></html>"
    with sync_playwright() as pw:
        ctx = chromium_context(pw, tmp_path / "profile")
        try:
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_content("<p>warm up</p>")
            t0 = time.perf_counter()
            page.set_content(page_html)
            drawn = page.evaluate(_DRAWN)
            render_s = time.perf_counter() - t0
            tokens = page.locator(".rn-overlay .rn-t")
            doubled, same = tokens.nth(512), tokens.nth(513)
            red = doubled.evaluate("e => getComputedStyle(e).backgroundColor")
            white = same.evaluate("e => getComputedStyle(e).backgroundColor")
            title = doubled.get_attribute("title")
        finally:
            ctx.close()
    log.info("32k-token overlay drawn in %.2f s", render_s)
    assert drawn["tokens"] == 32 * 1024 and drawn["height"] > 1000 and not errors
    assert render_s < 2.0, f"the overlay of 32k tokens took {render_s:.2f} s to draw"
    assert red == "rgb(178, 24, 43)" and white == "rgb(255, 255, 255)"  # ratio 2: the scale's top; 1: its middle
    assert "pos 512" in title and "sampler -1, trainer -0.3069, ratio 2" in title and "adv 0.5" in title
