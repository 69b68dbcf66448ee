"""Session lifecycle: local twice, closed-state errors, attach from a second process, timeouts."""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import rollart_nb as rn
from rollart_nb.errors import ConfigError, ConnectError, StateError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_twice_replaces_cleanly_and_closed_state_names_fix():
    s1 = rn.Session.local({"H800": 1, "cpu": 1}, serverless=False)
    assert s1.state == "attached" and set(s1.pools) == {"H800", "cpu"}
    assert all(p.simulated for p in s1.pools.values())
    with pytest.warns(UserWarning, match="closing the previous"):
        s2 = rn.Session.local({"H20": 1})
    assert s1.state == "closed" and s2.state == "attached"
    with pytest.raises(StateError, match=r"Session is closed; create a new one with rn.Session.local\(\)"):
        s1.cluster("x", rn.Worker)
    assert s2.pools["H20"].capacity == 1 and "serverless" in s2.pools
    s2.close()
    s2.close()  # idempotent
    with rn.Session.local({"cpu": 1}, serverless=False) as s3:  # and again after close
        assert list(s3.pools) == ["cpu"]
    assert s3.state == "closed"


def test_a_failed_local_start_leaves_no_ray_behind():
    """A dead Redis URL fails the start; the corrected call then runs in the same process."""
    import ray

    with pytest.raises(rn.errors.RollartError, match="(?i)redis"):
        rn.Session.local({"cpu": 1}, serverless=False, store=f"redis://127.0.0.1:{free_port()}/0")
    assert not ray.is_initialized()
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ or not os.environ["RAY_AUTH_TOKEN_PATH"].startswith(
        os.path.join(tempfile.gettempdir(), "rollart_auth_")
    )
    with rn.Session.local({"cpu": 1}, serverless=False) as s:
        assert s.state == "attached"


def test_local_config_errors_report_every_problem():
    with pytest.raises(ConfigError) as ei:
        rn.Session.local({"H8000": 1, "H20": 0})
    assert len(ei.value.problems) == 2


def test_pools_given_as_a_list_name_the_expected_shape():
    import ray

    with pytest.raises(ConfigError, match=r"pools=\['H800'\] must map pool name -> slot count, e.g. \{'H800': 2"):
        rn.Session.local(pools=["H800"])
    with pytest.raises(ConfigError, match=r"must map a custom resource name -> hardware name, e.g. \{'my_h20'"):
        rn.Session.attach(f"127.0.0.1:{free_port()}", pool_map=["H20"])
    with pytest.raises(ConfigError, match=r"pool_map\['my_gpu'\]='H2O' is not a known hardware type"):
        rn.Session.attach(f"127.0.0.1:{free_port()}", pool_map={"my_gpu": "H2O"})
    assert not ray.is_initialized()  # refused before Ray starts or is reached


def test_attach_to_a_refused_port_fails_at_once_with_what_to_check():
    port = free_port()
    t = time.monotonic()
    with pytest.raises(ConnectError, match=f"connection refused at 127.0.0.1:{port}") as e:
        rn.Session.attach(f"127.0.0.1:{port}", timeout_s=30)
    assert time.monotonic() - t < 3  # not retried for the whole timeout
    assert "ray status" in str(e.value) and "6379" in str(e.value)


def test_attach_from_a_second_process_to_ray_start():
    """`ray start --head` with H20 GPUs and token auth; another Python process attaches with the
    token from an environment variable and uses the pool."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    token_file = os.path.join(tmp, "token")
    with open(token_file, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(token_file, 0o600)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    head_env = {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_file}
    env = {**base, "HOME": tmp, "TEAM_TOKEN": open(token_file).read()}
    head = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            "--num-gpus=2",
            '--resources={"accelerator_type:H20": 1}',
            "--include-dashboard=false",
            f"--temp-dir={tmp}",
            "--block",
            "--node-ip-address=127.0.0.1",
        ],
        env=head_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60  # `ray start --block` returns nothing when it is up: wait for its port
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
                time.sleep(0.2)
        code = textwrap.dedent(f"""
            import json, rollart_nb as rn
            class W(rn.Worker):
                @rn.register()
                def hw(self):
                    return self.hardware
            s = rn.Session.attach("127.0.0.1:{port}", timeout_s=60, token_env="TEAM_TOKEN")
            c = s.cluster("g", W, pool="H20", replicas=2)
            print(json.dumps({{"pools": {{n: [p.capacity, p.simulated] for n, p in s.pools.items()}},
                               "hw": c.hw()}}))
            s.close()
        """)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["pools"]["H20"] == [2.0, False]
        assert res["hw"] == ["H20", "H20"]
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # gcs_server ignores SIGTERM
        head.wait(timeout=30)
        subprocess.run(["pkill", "-9", "-f", tmp], check=False)
