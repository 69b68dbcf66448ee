"""LogTailWidget: a temporary log dir written over time; only new lines show, filtered, paused, closed."""

import time

import pytest

pytest.importorskip("ipywidgets")

from rollart_nb.logs import LogFollower  # noqa: E402
from rollart_nb.nb.logtail import LogTailWidget  # noqa: E402


def _write(path, *lines, newline=True):
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + ("\n" if newline else ""))


def _stamp(i, text):
    return f"2025-01-01 12:00:{i:02d},000 INFO user: {text}"


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def logs(tmp_path):
    _write(tmp_path / "pipeline_rollout.log", *(_stamp(i, f"old {i}") for i in range(5)))
    return tmp_path


def test_starts_with_the_last_lines_and_gains_exactly_the_new_ones(logs):
    w = LogTailWidget(str(logs), last=3, watch=False)
    assert w.text.splitlines() == [_stamp(i, f"old {i}") for i in (2, 3, 4)]
    assert "old 4" in w.pane.value and w.updates == 1
    _write(logs / "pipeline_rollout.log", _stamp(10, "new a"), _stamp(11, "new b"))
    assert w.refresh() is True
    assert w.text.splitlines() == [_stamp(4, "old 4"), _stamp(10, "new a"), _stamp(11, "new b")]  # bounded
    assert w.refresh() is False and w.updates == 2  # nothing new: no update
    _write(logs / "pipeline_rollout.log", _stamp(12, "half"), newline=False)  # still being written
    w.refresh()
    assert "half" not in w.text
    _write(logs / "pipeline_rollout.log", " done")
    w.refresh()
    assert w.text.splitlines()[-1] == _stamp(12, "half done")


def test_lines_are_escaped_and_secrets_redacted(logs):
    w = LogTailWidget(str(logs), watch=False)
    _write(logs / "pipeline_rollout.log", _stamp(20, "<b>bold</b> api_key=sk-live-123456789 Bearer abcdefghijklmnop"))
    w.refresh()
    assert "sk-live-123456789" not in w.text and "abcdefghijklmnop" not in w.text
    assert "sk-live-123456789" not in w.pane.value and "&lt;b&gt;bold&lt;/b&gt;" in w.pane.value


def test_a_file_that_appears_later_and_the_worker_filter(logs):
    w = LogTailWidget(str(logs), watch=False)
    assert [v for _label, v in w.worker_filter.options] == ["", "pipeline_rollout"]
    _write(logs / "actor_train_0.log", _stamp(30, "train 1"), _stamp(31, "train 2"))
    _write(logs / "pipeline_rollout.log", _stamp(32, "rollout 1"))
    w.refresh()
    assert [v for _label, v in w.worker_filter.options] == ["", "actor_train_0", "pipeline_rollout"]
    assert w.text.splitlines()[-3:] == [
        f"[actor_train_0] {_stamp(30, 'train 1')}",
        f"[actor_train_0] {_stamp(31, 'train 2')}",
        f"[pipeline_rollout] {_stamp(32, 'rollout 1')}",
    ]
    w.worker_filter.value = "actor_train_0"
    assert w.text.splitlines() == [_stamp(30, "train 1"), _stamp(31, "train 2")]
    assert "rollout" not in w.pane.value
    _write(logs / "env_worker.log", _stamp(33, "env"))  # a new file: a new option; the choice stays
    w.refresh()
    assert "env_worker" in [v for _label, v in w.worker_filter.options]
    assert w.worker_filter.value == "actor_train_0" and "env" not in w.text
    named = LogTailWidget(str(logs), worker="pipeline.rollout", watch=False)  # as sess.logs names it
    assert "train" not in named.text and "rollout 1" in named.text


def test_a_truncated_file_is_read_again_from_its_start(logs):
    w = LogTailWidget(str(logs), watch=False)
    with open(logs / "pipeline_rollout.log", "w", encoding="utf-8") as f:
        f.write(_stamp(40, "after truncation") + "\n")
    w.refresh()
    assert w.text.splitlines()[-1] == _stamp(40, "after truncation")
    assert w.text.count("after truncation") == 1


def test_pause_stops_updates_and_resume_catches_up(logs):
    w = LogTailWidget(str(logs), poll_s=0.05)
    try:
        _write(logs / "pipeline_rollout.log", _stamp(50, "live 1"))
        assert _until(lambda: "live 1" in w.pane.value)
        w.pause_button.click()
        assert w.paused and w.pause_button.description == "Resume"
        shown, updates = w.pane.value, w.updates
        _write(logs / "pipeline_rollout.log", _stamp(51, "while paused"))
        time.sleep(0.4)
        assert w.pane.value == shown and w.updates == updates
        w.pause_button.click()
        assert "while paused" in w.pane.value
        w.clear_button.click()
        assert w.text == ""
        _write(logs / "pipeline_rollout.log", _stamp(52, "after clear"))
        assert _until(lambda: w.text == _stamp(52, "after clear"))
    finally:
        w.close()


def test_close_stops_the_thread(logs):
    w = LogTailWidget(str(logs), poll_s=0.05)
    assert w._thread is not None and w._thread.is_alive()
    w.close()
    assert not w._thread.is_alive()


def test_the_follower_reads_only_new_bytes(tmp_path):
    path = tmp_path / "w.log"
    _write(path, "a" * 50)
    f = LogFollower(str(tmp_path), last=10, max_bytes=1000)
    assert f.poll() == [("w", "a" * 50)]
    with open(path, "r+", encoding="utf-8") as fh:  # bytes already read change in place: not read again
        fh.write("z" * 50)
    _write(path, "b")
    assert f.poll() == [("w", "b")]
    _write(path, "x" * 3000, "tail")  # more than max_bytes at once: the newest bytes only
    assert f.poll() == [("w", "tail")]


def test_sess_log_tail_follows_the_sessions_log_dir():
    import rollart_nb as rn

    sess = rn.Session.sim({"H800": 1, "cpu": 1}, seed=1)
    try:
        w = sess.log_tail("rollout", last=7)
        assert isinstance(w, LogTailWidget) and w.log_dir == sess.runtime.log_dir
        assert w.worker == "rollout" and w.last == 7
        w.close()
        assert not w._thread.is_alive()
        left = sess.log_tail()  # never closed by hand: the session stops it
    finally:
        sess.close()
    left._thread.join(timeout=5)
    assert not left._thread.is_alive()
