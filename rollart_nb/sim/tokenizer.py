"""A deterministic word-level tokenizer for the simulator (one whitespace word = one token).

Ids depend only on the word (CRC-32), never on process state, so every worker of a cluster
encodes the same text to the same ids without sharing a vocabulary file. Token counts are
exact by construction, which lets sim envs produce observations of a chosen length.
Each word's id is computed once and memoized (up to :data:`MEMO_WORDS` distinct words), so
encoding text of a known vocabulary costs a dict lookup a word.
"""

from __future__ import annotations

import zlib

__all__ = ["MEMO_WORDS", "SimTokenizer"]

MEMO_WORDS = 1 << 20
"""Most distinct words whose ids a :class:`SimTokenizer` memoizes (later words are hashed each time)."""


class SimTokenizer:
    """Maps each whitespace-separated word to ``3 + crc32(word) % (vocab_size - 3)``.

    Ids 0, 1, 2 are pad, eos and unk. ``decode`` returns the words this process has seen
    encoded (a reverse cache filled by ``encode``) and ``"w<id>"`` for any other id, so
    ``decode(encode(text))`` round-trips whitespace-normalized text unless two words collide.

    Args:
        vocab_size: number of ids (at least 4).

    Example:
        >>> tok = SimTokenizer()
        >>> ids = tok.encode("go left")
        >>> len(ids), tok.decode(ids)
        (2, 'go left')
    """

    pad_token_id = 0
    eos_token_id = 1
    unk_token_id = 2
    _SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<unk>"}

    def __init__(self, vocab_size: int = 32000) -> None:
        if vocab_size < 4:
            from rollart_nb.errors import ConfigError

            raise ConfigError(f"vocab_size must be >= 4, got {vocab_size}", where="SimTokenizer")
        self.vocab_size = vocab_size
        self._words: dict[int, str] = {}
        self._ids: dict[str, int] = {}  # word -> id memo, at most MEMO_WORDS entries
        self._names: list[str] | None = None  # id -> decoded word ("" for specials), built on first decode

    def token_id(self, word: str) -> int:
        """The id of one word."""
        return 3 + zlib.crc32(word.encode("utf-8")) % (self.vocab_size - 3)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, one per whitespace-separated word."""
        words = text.split()
        memo = self._ids
        ids = list(map(memo.get, words))  # one dict lookup a known word, in C
        if None not in ids:
            return ids  # type: ignore[return-value]
        for k, i in enumerate(ids):
            if i is None:
                word = words[k]
                ids[k] = i = self.token_id(word)
                if i not in self._words:  # first word wins on a collision: decode stays stable
                    self._words[i] = word
                    if self._names is not None:
                        self._names[i] = word
                if len(memo) < MEMO_WORDS:
                    memo[word] = i
        return ids  # type: ignore[return-value]  # every None was replaced

    def decode(self, ids: list[int]) -> str:
        """Words joined by single spaces; special ids are skipped."""
        names = self._names
        if names is None:
            names = self._names = [self._words.get(i, f"w{i}") for i in range(self.vocab_size)]
            for i in self._SPECIAL:
                names[i] = ""
        try:
            return " ".join(filter(None, map(names.__getitem__, ids)))  # a table lookup a token, in C
        except (IndexError, TypeError):  # an id outside the vocabulary
            return " ".join(self._words.get(i, f"w{i}") for i in ids if i not in self._SPECIAL)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"SimTokenizer(vocab_size={self.vocab_size})"
