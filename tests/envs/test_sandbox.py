import asyncio
import os
import socket
import time

import pytest

from rollart_nb.envs import arun_sandboxed, run_sandboxed

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


def test_raw_socket_module_and_processes_are_blocked():
    tests = "\n".join(
        f"try:\n    {stmt}\n    ok = False\nexcept (ImportError, PermissionError):\n    ok = True\nassert ok"
        for stmt in (
            "import _socket",
            "import os; os.system('true')",
            "import os; os.fork()",
            "import os; os.execv('/bin/true', ['true'])",
            "import os; os.kill(1, 0)",
            "import ctypes",
        )
    )
    r = run_sandboxed("", tests)
    assert (r.passed, r.total) == (6, 6), r.failures


def test_parent_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("ROLLART_TEST_SECRET", "hunter2")
    code = (
        "import os\n"
        "print(dict(os.environ))\n"
        "try:\n"
        "    print(open(f'/proc/{os.getppid()}/environ').read())\n"
        "except PermissionError as e:\n"
        "    print('denied')\n"
    )
    r = run_sandboxed(code, "assert 'ROLLART_TEST_SECRET' not in os.environ")
    assert r.passed == 1 and "denied" in r.stdout
    assert "hunter2" not in r.stdout + r.stderr


def test_files_outside_the_temp_dir_are_off_limits_and_tests_are_hidden():
    code = (
        "import os\n"
        "LISTING = os.listdir('.')\n"
        "open('scratch.txt', 'w').write('ok')\n"
        "SCRATCH = open('scratch.txt').read()\n"
    )
    tests = (
        "assert LISTING == []\n"  # the hidden tests were removed before the code ran
        "assert SCRATCH == 'ok'\n"
        "def test_no_write_outside():\n"
        "    try:\n"
        "        open('/tmp/rollart_escape', 'w')\n"
        "    except PermissionError:\n"
        "        return\n"
        "    raise AssertionError('wrote outside')\n"
        "def test_no_read_outside():\n"
        "    try:\n"
        "        open('/etc/hostname').read()\n"
        "    except (PermissionError, FileNotFoundError):\n"
        "        return\n"
        "    raise AssertionError('read outside')\n"
    )
    r = run_sandboxed(code, tests)
    assert (r.passed, r.total) == (4, 4), r.failures
    assert not os.path.exists("/tmp/rollart_escape")


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
    code = "import json, re, math, collections, dataclasses, typing\nfrom typing import List\n"
    assert run_sandboxed(code, "assert json.dumps([1]) == '[1]'").passed == 1


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


def test_temp_dirs_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    run_sandboxed(ADD + "open('junk', 'w').write('x')\nimport os\nos.mkdir('d')\n", ADD_TESTS)
    run_sandboxed("while True:\n    pass\n", ADD_TESTS, timeout_s=0.5)
    assert list(tmp_path.iterdir()) == []
