"""SimTokenizer: ids are a fixed function of the word (in any process); memoized words cost a dict lookup."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest

from rollart_nb.errors import ConfigError
from rollart_nb.protocols import Tokenizer
from rollart_nb.sim import tokenizer as simtok
from rollart_nb.sim.tokenizer import SimTokenizer


def test_ids_follow_the_formula_with_or_without_the_memo(monkeypatch):
    text = " ".join(f"word{i % 700}" for i in range(5000))
    want = [3 + zlib.crc32(w.encode()) % (32000 - 3) for w in text.split()]
    tok = SimTokenizer()
    assert tok.encode(text) == want and tok.encode(text) == want  # cold, then memoized
    assert isinstance(tok, Tokenizer) and tok.eos_token_id == 1 and len(tok) == 32000
    assert tok.decode(tok.encode("go left now")) == "go left now"
    assert tok.encode("hello  world\n") == [3 + zlib.crc32(b"hello") % 31997, 3 + zlib.crc32(b"world") % 31997]
    assert tok.decode([1, 0, 99999]) == "w99999"  # specials skipped, unseen ids spelled out
    monkeypatch.setattr(simtok, "MEMO_WORDS", 10)
    small = SimTokenizer()
    assert small.encode(text) == want and small.encode(text) == want
    assert len(small._ids) == 10  # bounded: later words are hashed each time
    with pytest.raises(ConfigError):
        SimTokenizer(3)


def test_ids_are_stable_across_processes():
    # A fixed, different string-hash seed in the child: ids must not depend on hash().
    code = "from rollart_nb.sim import SimTokenizer; print(SimTokenizer(1000).encode('a b c'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout == f"{SimTokenizer(1000).encode('a b c')}\n"
