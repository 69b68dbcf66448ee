import asyncio
import os
import socket
import time
import warnings

import pytest

from rollart_nb.envs import arun_sandboxed, run_sandboxed
from rollart_nb.errors import ConfigError

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\ndef test_zero():\n    assert add(0, 0) == 0\n"


def test_correct_solution_passes_all_tests():
    r = run_sandboxed(ADD, ADD_TESTS)
    assert (r.passed, r.total, r.score, r.error, r.timed_out) == (3, 3, 1.0, "", False)


def test_wrong_solution_fails_and_reports_which():
    r = run_sandboxed("def add(a, b):\n    return a - b\n", ADD_TESTS)
    assert (r.passed, r.total) == (1, 3)  # only add(0, 0) == 0 holds
    assert [f.split(":")[0] for f in r.failures] == ["0", "1"]


def test_solution_that_does_not_load_scores_zero():
    r = run_sandboxed("def add(a, b) return", ADD_TESTS)
    assert r.passed == 0 and r.total == 3 and "SyntaxError" in r.error


def test_printing_fake_pass_lines_does_not_score():
    fake = "".join(f"PASS {i}\nx PASS {i}\n" for i in range(3))
    r = run_sandboxed(f"print({fake!r})\n", ADD_TESTS)
    assert r.passed == 0 and "PASS 0" in r.stdout


def test_infinite_loop_is_killed_at_the_wall_clock_timeout():
    t0 = time.perf_counter()
    r = run_sandboxed(ADD + "while True:\n    pass\n", ADD_TESTS, timeout_s=1)
    elapsed = time.perf_counter() - t0
    assert r.timed_out and r.passed == 0 and "timed out" in r.error
    assert elapsed < 3


def test_loop_in_a_later_test_keeps_earlier_passes():
    tests = "assert add(1, 2) == 3\ndef test_hang():\n    while True:\n        pass\n"
    r = run_sandboxed(ADD, tests, timeout_s=1)
    assert r.timed_out and (r.passed, r.total) == (1, 2)


def test_socket_connect_to_localhost_is_blocked():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = (
        "try:\n"
        "    import socket\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    CONNECTED = True\n"
        "except Exception as e:\n"
        "    CONNECTED = False\n"
        "    print('blocked', type(e).__name__)\n"
    )
    try:
        r = run_sandboxed(code, "assert CONNECTED is False")
        assert r.passed == 1 and "blocked" in r.stdout
        with pytest.raises(TimeoutError):
            server.accept()  # nobody knocked
    finally:
        server.close()


def test_sockets_processes_and_ctypes_are_refused_inside_the_solution():
    probes = {
        "socket": "import _socket",
        "system": "import os; os.system('true')",
        "fork": "import os; os.fork()",
        "exec": "import os; os.execv('/bin/true', ['true'])",
        "kill": "import os; os.kill(1, 0)",
        "ctypes": "import ctypes",
    }
    code = "REFUSED = []\n" + "".join(
        f"try:\n    {stmt}\nexcept (ImportError, PermissionError, OSError):\n    REFUSED.append({name!r})\n"
        for name, stmt in probes.items()
    )
    r = run_sandboxed(code, f"assert sorted(REFUSED) == {sorted(probes)!r}")
    assert (r.passed, r.total) == (1, 1), (r.failures, r.error)


def test_parent_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("ROLLART_TEST_SECRET", "hunter2")
    code = (
        "import os\n"
        "ENV = sorted(os.environ)\n"
        "print(dict(os.environ))\n"
        "try:\n"
        "    print(open(f'/proc/{os.getppid()}/environ').read())\n"
        "except OSError as e:\n"
        "    print('denied')\n"
    )
    r = run_sandboxed(code, "assert 'ROLLART_TEST_SECRET' not in ENV")
    assert r.passed == 1, r.failures
    assert "hunter2" not in r.stdout + r.stderr


def test_the_work_dir_is_private_and_the_host_is_out_of_reach(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    code = (
        "import os\n"
        "LISTING = os.listdir('.')\n"
        "open('scratch.txt', 'w').write('ok')\n"
        "SCRATCH = open('scratch.txt').read()\n"
        "def attempt(fn):\n"
        "    try:\n"
        "        fn()\n"
        "        return 'done'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
        "WRITE = attempt(lambda: open('/tmp/rollart_escape', 'w'))\n"
        f"READ = attempt(lambda: print(open({str(secret)!r}).read()))\n"
        "ETC = attempt(lambda: print(open('/etc/hostname').read()))\n"
    )
    tests = (
        "assert LISTING == []\n"  # neither the code nor the tests are files the code can read
        "assert SCRATCH == 'ok'\n"
        "assert WRITE != 'done'\n"
        "assert READ != 'done'\n"
        "assert ETC != 'done'\n"
    )
    r = run_sandboxed(code, tests)
    assert (r.passed, r.total) == (5, 5), r.failures
    assert not os.path.exists("/tmp/rollart_escape") and "top secret" not in r.stdout


def test_strict_comparison_checks_exact_types():
    code = "def one():\n    return True\ndef three():\n    return 3.0\ndef pair():\n    return [1, (2, 'x')]\n"
    tests = "assert one() == 1\nassert three() == 3\nassert pair() == [1, (2, 'x')]\nassert pair() != [1, [2, 'x']]\n"
    r = run_sandboxed(code, tests)
    assert [f.split(":")[0] for f in r.failures] == ["0", "1"] and r.passed == 2


def test_values_that_are_not_plain_data_do_not_cross():
    code = "class Yes:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes()\n"
    r = run_sandboxed(code, "assert add(1, 2) == 3")
    assert r.passed == 0 and "not plain data" in r.failures[0]


def test_isolation_none_warns_and_still_grades():
    with pytest.warns(RuntimeWarning, match="WITHOUT OS isolation"):
        r = run_sandboxed(ADD, ADD_TESTS, isolation="none")
    assert (r.passed, r.total) == (3, 3)


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError) as e:
        run_sandboxed(ADD, ADD_TESTS, timeout_s=-1, memory_mb=0, isolation="docker")
    assert len(e.value.problems) == 3


def test_memory_bomb_is_stopped():
    t0 = time.perf_counter()
    r = run_sandboxed("blob = bytearray(2 * 1024**3)\n", "assert len(blob) > 0", memory_mb=128)
    assert r.passed == 0 and "MemoryError" in r.error
    r = run_sandboxed(
        "chunks = []\nwhile True:\n    chunks.append(bytearray(10 * 1024**2))\n",
        "assert True",
        memory_mb=128,
        timeout_s=10,
    )
    assert r.passed == 0 and "MemoryError" in r.error and not r.timed_out
    assert time.perf_counter() - t0 < 8


def test_stdlib_imports_still_work():
    code = "import json, re, math, collections, dataclasses, typing\nfrom typing import List\ndef dumped():\n    return json.dumps([1])\n"
    assert run_sandboxed(code, "assert dumped() == '[1]'").passed == 1


def test_async_variant_matches_and_times_out_without_blocking_the_loop():
    async def main():
        good = arun_sandboxed(ADD, ADD_TESTS)
        hang = arun_sandboxed("while True:\n    pass\n", ADD_TESTS, timeout_s=1)
        t0 = time.perf_counter()
        results = await asyncio.gather(good, hang)
        return results, time.perf_counter() - t0

    (good, hang), elapsed = asyncio.run(main())
    assert good.passed == 3 and hang.timed_out and hang.passed == 0
    assert elapsed < 3


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_temp_dirs_are_removed(tmp_path, monkeypatch, isolation):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run_sandboxed(ADD + "open('junk', 'w').write('x')\nimport os\nos.mkdir('d')\n", ADD_TESTS, isolation=isolation)
        run_sandboxed("while True:\n    pass\n", ADD_TESTS, timeout_s=0.5, isolation=isolation)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def fresh_probe():
    from rollart_nb.sandbox import isolation

    isolation._probe.cache_clear()
    yield isolation
    isolation._probe.cache_clear()


def test_missing_bubblewrap_is_a_clear_error_not_a_weaker_sandbox(fresh_probe, monkeypatch):
    from rollart_nb.errors import SandboxError

    monkeypatch.setattr(fresh_probe.shutil, "which", lambda name: None)
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        run_sandboxed(ADD, ADD_TESTS)


def test_bubblewrap_that_cannot_make_namespaces_is_a_clear_error(fresh_probe, monkeypatch):
    from rollart_nb.errors import SandboxError

    real = fresh_probe.shutil.which
    monkeypatch.setattr(fresh_probe.shutil, "which", lambda name: "/bin/false" if name == "bwrap" else real(name))
    with pytest.raises(SandboxError, match="cannot create namespaces here.*user namespaces"):
        run_sandboxed(ADD, ADD_TESTS)
