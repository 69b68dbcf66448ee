"""SimTokenizer: ids are a fixed function of the word; memoized words cost a dict lookup."""

from __future__ import annotations

import zlib

from rollart_nb.sim import tokenizer as simtok
from rollart_nb.sim.tokenizer import SimTokenizer


def test_ids_follow_the_formula_with_or_without_the_memo(monkeypatch):
    text = " ".join(f"word{i % 700}" for i in range(5000))
    want = [3 + zlib.crc32(w.encode()) % (32000 - 3) for w in text.split()]
    tok = SimTokenizer()
    assert tok.encode(text) == want and tok.encode(text) == want  # cold, then memoized
    assert tok.decode(tok.encode("go left now")) == "go left now"
    monkeypatch.setattr(simtok, "MEMO_WORDS", 10)
    small = SimTokenizer()
    assert small.encode(text) == want and small.encode(text) == want
    assert len(small._ids) == 10  # bounded: later words are hashed each time
