"""Compact token storage: one append-only sequence per trajectory, read through views.

A multi-turn trajectory's turn ``k`` is prompted with the whole history so far, so storing every
turn's prompt as its own list costs memory quadratic in the number of turns. Instead the
EnvManager appends each turn's new tokens to one :class:`TokenSeq` (``array('i')``, 4 bytes per
token) and each :class:`~rollart_nb.trajectory.Turn` holds :class:`TokenView` s into it: its
prompt is ``seq[0:P]`` and its response ``seq[P:P+R]``.

A view behaves as a read-only ``list[int]`` (length, indexing, slices as lists, iteration,
``==`` with lists, ``+`` with lists) and pickles together with its buffer: the views of one
trajectory pickled together (a trajectory shipped through Ray, a checkpoint) store the buffer
once.

Example:
    >>> seq = TokenSeq([5, 6, 7])
    >>> prompt = seq.view(0, 3)
    >>> response = seq.extend([8, 9])
    >>> prompt + response, response == [8, 9], len(seq)
    ([5, 6, 7, 8, 9], True, 5)
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, SupportsIndex, overload

__all__ = ["TokenSeq", "TokenView", "Tokens", "starts_with"]


class Tokens:
    """An observation its env tokenized itself: token ids, plus text to show.

    An env may return one from ``reset``/``step`` in place of a string. The EnvManager then
    appends ``ids`` between the ids of the user and assistant tags as they are, without
    tokenizing anything, so tokenization runs where the env runs (an env actor or service
    process, in parallel with the rollout) and costs the rollout a copy. The ids must come from
    the policy model's tokenizer. ``text`` is what the viewer and ``Turn.observation`` show.

    Args:
        ids: the observation's token ids (a list, or an ``array('i')``: copied without building
            int objects).
        text: the observation as text, for display (optional).

    Example:
        >>> obs = Tokens(tok.encode(screen), text=screen)   # doctest: +SKIP
        >>> return obs, reward, done, False, {}             # doctest: +SKIP
    """

    __slots__ = ("ids", "text")

    def __init__(self, ids: Iterable[int], text: str = "") -> None:
        self.ids = ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
        self.text = str(text)

    def __len__(self) -> int:
        return len(self.ids)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        shown = self.text if len(self.text) <= 40 else self.text[:40] + "..."
        return f"Tokens(<{len(self.ids)} ids>, text={shown!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Tokens, (self.ids, self.text))


class TokenSeq:
    """An append-only sequence of token ids stored as ``array('i')``.

    Appending never moves or changes ids already stored, so views taken earlier stay valid
    (:meth:`truncate` drops a tail no view refers to: a turn generated again).

    Args:
        ids: initial ids.
    """

    __slots__ = ("buffer",)

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self.buffer = array("i", ids)

    def __len__(self) -> int:
        return len(self.buffer)

    def extend(self, ids: Iterable[int]) -> TokenView:
        """Append ``ids``; returns the view of the appended span."""
        start = len(self.buffer)
        if type(ids) is list:
            self.buffer.fromlist(ids)  # a list's ints in one pass (extend takes each through an iterator)
        else:
            self.buffer.extend(ids)
        return TokenView(self.buffer, start, len(self.buffer))

    def tail(self, start: int = 0) -> array:
        """A copy of the ids from ``start`` on, as ``array('i')`` (what a request ships)."""
        return self.buffer[start:]

    def truncate(self, n: int) -> None:
        """Drop the ids from position ``n`` on (views that end at or before ``n`` stay valid)."""
        del self.buffer[n:]

    def view(self, start: int = 0, stop: int | None = None) -> TokenView:
        """A read-only view of ``[start, stop)`` (``stop`` defaults to the current end)."""
        return TokenView(self.buffer, start, len(self.buffer) if stop is None else stop)

    def __repr__(self) -> str:
        return f"TokenSeq(<{len(self.buffer)} tokens>)"


class TokenView(Sequence[int]):
    """A read-only ``[start, stop)`` span of a shared ``array('i')``, behaving as a ``list[int]``.

    Args:
        buffer: the shared ids (only appended to by its owner).
        start: first position.
        stop: one past the last position.
    """

    __slots__ = ("_buf", "_start", "_stop")

    def __init__(self, buffer: array, start: int = 0, stop: int | None = None) -> None:
        stop = len(buffer) if stop is None else stop
        if not 0 <= start <= stop <= len(buffer):
            raise IndexError(f"TokenView [{start}, {stop}) is outside a buffer of {len(buffer)} ids")
        self._buf, self._start, self._stop = buffer, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, i: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: SupportsIndex | slice) -> int | list[int]:
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            return self._buf[self._start + lo : self._start + hi : step].tolist() if step > 0 else self.tolist()[i]
        k = i.__index__()
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError("TokenView index out of range")
        return self._buf[self._start + k]

    def __iter__(self) -> Iterator[int]:
        return iter(self._buf[self._start : self._stop])

    def tolist(self) -> list[int]:
        """The ids as a new ``list[int]``."""
        return self._buf[self._start : self._stop].tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenView):
            if other._buf is self._buf and other._start == self._start and other._stop == self._stop:
                return True
            return self._buf[self._start : self._stop] == other._buf[other._start : other._stop]
        if isinstance(other, list | tuple):
            return len(other) == len(self) and self.tolist() == list(other)
        if isinstance(other, array):
            return other.typecode == "i" and self._buf[self._start : self._stop] == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares equal to lists, which are unhashable

    def __add__(self, other: Any) -> list[int]:
        if isinstance(other, TokenView | list | tuple):
            return self.tolist() + list(other)
        return NotImplemented

    def __radd__(self, other: Any) -> list[int]:
        if isinstance(other, list | tuple):
            return list(other) + self.tolist()
        return NotImplemented

    def __reduce__(self) -> tuple[type[TokenView], tuple[array, int, int]]:
        # The buffer is one object: pickle's memo stores it once for all views pickled together.
        return TokenView, (self._buf, self._start, self._stop)

    def __repr__(self) -> str:
        return repr(self.tolist())

    def same_buffer(self, other: Any) -> bool:
        """True when ``other`` is a view of the same buffer."""
        return isinstance(other, TokenView) and other._buf is self._buf

    @property
    def start(self) -> int:
        """First position in the shared buffer."""
        return self._start

    @property
    def stop(self) -> int:
        """One past the last position in the shared buffer."""
        return self._stop


def starts_with(ids: Sequence[int], parts: Sequence[Sequence[int]]) -> bool:
    """True when ``ids`` begins with the concatenation of ``parts``.

    Views of one buffer laid out back to back from ``ids``'s start are compared by position
    alone (no id is read), so checking that each turn extends the previous one costs O(turns).
    """
    if isinstance(ids, TokenView) and all(ids.same_buffer(p) for p in parts):
        pos = ids.start
        for p in parts:
            assert isinstance(p, TokenView)
            if p.start != pos:
                break
            pos = p.stop
        else:
            return pos <= ids.stop
    seen: list[int] = []
    for p in parts:
        seen.extend(p)
    return len(ids) >= len(seen) and list(ids[: len(seen)]) == seen
