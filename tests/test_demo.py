"""``rollart-nb demo``, the README's first command, end to end (short: a few steps, one task).

Run in a subprocess, as a user runs it: it starts and stops its own ``Session.local()``.
"""

import json
import subprocess
import sys

CLI = "from rollart_nb.cli import main; raise SystemExit(main())"


def demo(*args, timeout=600):
    return subprocess.run([sys.executable, "-c", CLI, "demo", *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_steps_writes_its_report_and_ends_with_result(tmp_path):
    p = demo("--steps", "3", "--tasks", "math", "--no-std", "--kl", "0.1", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT ")
    result = json.loads(lines[-1][len("RESULT ") :])
    assert {"first", "last", "tasks", "steps", "trained_tokens", "aborted_fraction", "wall_s"} <= set(result)
    assert result["wall_s"] > 0 and result["steps"] == 3 and result["interrupted"] is False
    assert set(result["first"]) == set(result["last"]) == set(result["tasks"]) == {"math"}
    assert 0.0 <= result["first"]["math"] <= 1.0
    math_row = result["tasks"]["math"]
    assert math_row["base"] == result["first"]["math"] and math_row["last"] == result["last"]["math"]
    assert math_row["best"] >= math_row["last5_mean"] - 1e-9 and result["trained_tokens"] > 0
    steps = [json.loads(ln) for ln in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    from rollart_nb.config import load
    from rollart_nb.train import TrainConfig

    saved = load(TrainConfig, tmp_path / "config.yaml")  # what ran, as a loadable config
    assert list(saved.tasks) == ["math"] and saved.steps == 3 and saved.algo.scale_by_std is False
    assert (tmp_path / "report.html").read_text().count("plotly") > 0
    svg = (tmp_path / "curves.svg").read_text()  # the curves alone, static: validation line per task
    assert svg.startswith("<svg") and "math validation" in svg and svg.count("<polyline") == 2
    # The per-step table: a header and one row per step.
    assert sum(1 for ln in lines if ln.split()[:1] in (["0"], ["1"], ["2"])) >= 3, p.stdout


def test_demo_rejects_an_unknown_task_with_the_choices():
    p = demo("--steps", "1", "--tasks", "frozenlake,chess", timeout=300)
    assert p.returncode != 0
    assert "chess" in p.stderr and "frozenlake" in p.stderr and "math" in p.stderr


def test_weights_flag_parses_task_shares_and_rejects_junk():
    import pytest

    from rollart_nb.cli import _parse_weights
    from rollart_nb.errors import ConfigError

    assert _parse_weights("frozenlake=1, math=3") == {"frozenlake": 1.0, "math": 3.0}
    for bad in ("math", "math=lots", "math=inf", "=3", "math=1,math=2"):
        with pytest.raises(ConfigError, match="task=number"):
            _parse_weights(bad)


def test_task_config_rejects_a_curriculum_share_outside_0_1():
    import pytest

    from rollart_nb.errors import ConfigError
    from rollart_nb.train import TaskConfig

    with pytest.raises(ConfigError, match="curriculum"):
        TaskConfig(curriculum=1.5)
    assert TaskConfig(curriculum=0.25).curriculum == 0.25


def test_ctrl_c_keeps_the_steps_done_and_still_prints_the_result(tmp_path):
    """Ctrl-C (SIGINT) after the first steps: the step in progress finishes, steps.jsonl and the
    report hold every step done, and the RESULT says it was interrupted."""
    import signal
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CLI,
            "demo",
            "--steps",
            "200",
            "--tasks",
            "math",
            "--validate-every",
            "0",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    steps = tmp_path / "steps.jsonl"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        if steps.exists() and len(steps.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "interrupted: finishing the current step" in out
    result = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["interrupted"] is True and 2 <= result["steps"] < 200
    written = [json.loads(ln) for ln in steps.read_text().splitlines()]
    assert [s["step"] for s in written] == list(range(result["steps"]))
    assert (tmp_path / "report.html").exists() and (tmp_path / "config.yaml").exists()
