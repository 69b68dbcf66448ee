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
    assert set(result) == {"first", "last", "wall_s"} and result["wall_s"] > 0
    assert set(result["first"]) == set(result["last"]) == {"math"}
    assert 0.0 <= result["first"]["math"] <= 1.0
    steps = [json.loads(ln) for ln in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
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


def test_demo_config_rejects_a_curriculum_share_outside_0_1():
    import pytest

    from rollart_nb.demo import DemoConfig
    from rollart_nb.errors import ConfigError

    with pytest.raises(ConfigError, match="math_curriculum"):
        DemoConfig(math_curriculum=1.5)
    assert DemoConfig(math_curriculum=0.25).math_curriculum == 0.25
