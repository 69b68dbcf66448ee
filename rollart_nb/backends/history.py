"""HistoryStore: the token history a generation backend keeps per trajectory.

A :class:`~rollart_nb.protocols.GenerationRequest` with ``prefix_len > 0`` carries only the
tokens after what the generator already holds (its earlier prompts and its own responses), so a
trajectory's history crosses the network once. The backend keeps each trajectory's ids here
after every turn (:meth:`HistoryStore.keep`: prompt + response) and rebuilds the whole prompt
of the next request from them (:meth:`HistoryStore.resolve`). When the history is missing (an
eviction, a replaced worker) or has another length than the request says, it raises
:class:`~rollart_nb.errors.HistoryMiss` and the sender resends the whole history.

Ids are stored as ``array('i')`` (4 bytes a token); the store is a least-recently-used cache
bounded by a token budget. A backend whose work depends only on lengths (the sim) keeps lengths
alone (``keep_ids=False``) and calls :meth:`HistoryStore.full_len`.

Example:
    >>> from rollart_nb.protocols import GenerationRequest
    >>> store = HistoryStore()
    >>> prompt = store.resolve(GenerationRequest("t0", "math", [5, 6, 7]))
    >>> store.keep("t0", prompt + [8, 1])  # the response was [8, 1]
    >>> store.resolve(GenerationRequest("t0", "math", [9], prefix_len=5))
    [5, 6, 7, 8, 1, 9]
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable

from rollart_nb.errors import ConfigError, HistoryMiss
from rollart_nb.protocols import GenerationRequest

__all__ = ["DEFAULT_HISTORY_TOKENS", "HistoryStore"]

DEFAULT_HISTORY_TOKENS = 1 << 25
"""Default token budget of a :class:`HistoryStore` (32M tokens: 128 MiB of ids)."""


class HistoryStore:
    """Per-trajectory token histories, least recently used evicted beyond ``max_tokens``.

    Args:
        max_tokens: most tokens held over all trajectories; a single history longer than this
            is not kept (its next request misses and is resent whole).
        keep_ids: store the ids (``False``: lengths only, for :meth:`full_len`).
        name: the backend's name, for messages.

    Raises:
        ConfigError: ``max_tokens`` is negative.
    """

    def __init__(self, max_tokens: int = DEFAULT_HISTORY_TOKENS, *, keep_ids: bool = True, name: str = "") -> None:
        if max_tokens < 0:
            raise ConfigError(f"max_tokens must be >= 0, got {max_tokens}", where="HistoryStore")
        self.max_tokens, self.keep_ids, self.name = int(max_tokens), bool(keep_ids), name
        self._ids: OrderedDict[str, array] = OrderedDict()  # keep_ids: traj_id -> ids, oldest first
        self._lens: OrderedDict[str, int] = OrderedDict()  # not keep_ids: traj_id -> length
        self._open: set[str] = set()  # histories whose response was generated elsewhere (PD)
        self._held = 0
        self._counts = {"hits": 0, "misses": 0, "evicted": 0, "resolved_tokens": 0, "sent_tokens": 0}

    def __contains__(self, traj_id: object) -> bool:
        return traj_id in self._ids or traj_id in self._lens

    def __len__(self) -> int:
        return len(self._ids) + len(self._lens)

    def held(self, traj_id: str) -> int | None:
        """Tokens held for ``traj_id`` (None: nothing)."""
        if traj_id in self._ids:
            return len(self._ids[traj_id])
        return self._lens.get(traj_id)

    def full_len(self, request: GenerationRequest) -> int:
        """The whole prompt's length of ``request``, after checking this store holds its prefix.

        Raises:
            HistoryMiss: ``prefix_len > 0`` and the held history is missing or of another length.
        """
        self._check(request)
        return request.full_len

    def resolve(self, request: GenerationRequest) -> list[int]:
        """The whole prompt of ``request``: the held history followed by ``request.prompt_ids``.

        Raises:
            HistoryMiss: ``prefix_len > 0`` and the held history is missing or of another length.
            ConfigError: this store keeps lengths only.
        """
        if not self.keep_ids:
            raise ConfigError("this HistoryStore keeps lengths only (keep_ids=False); use full_len", where="resolve")
        self._check(request)
        if request.prefix_len == 0:
            return list(request.prompt_ids)
        ids = self._ids[request.traj_id].tolist()
        ids.extend(request.prompt_ids)
        return ids

    def keep(self, traj_id: str, ids: Iterable[int]) -> None:
        """Hold ``ids`` (the trajectory's prompt + response so far) for its next request."""
        kept = array("i", ids)
        self._drop(traj_id)
        if len(kept) > self.max_tokens:
            return
        if self.keep_ids:
            self._ids[traj_id] = kept
        else:
            self._lens[traj_id] = len(kept)
        self._held += len(kept)
        self._evict()

    def keep_length(self, traj_id: str, length: int, *, response_elsewhere: bool = False) -> None:
        """Hold a history of ``length`` tokens without its ids (a lengths-only store).

        ``response_elsewhere``: the next response is generated by another node (the decode
        node of a prefill/decode pair), so the next request may hold up to that response more
        than ``length`` tokens and is accepted when its ``prefix_len`` is at least ``length``.

        Raises:
            ConfigError: this store keeps ids (use :meth:`keep`).
        """
        if self.keep_ids:
            raise ConfigError("this HistoryStore keeps ids; use keep(traj_id, ids)", where="keep_length")
        self._drop(traj_id)
        if length > self.max_tokens:
            return
        self._lens[traj_id] = int(length)
        self._held += int(length)
        if response_elsewhere:
            self._open.add(traj_id)
        self._evict()

    def forget(self, traj_id: str) -> None:
        """Drop the history of ``traj_id`` (it ended, or was aborted); no-op when none is held."""
        self._drop(traj_id)

    def stats(self) -> dict[str, int]:
        """``trajectories`` and ``tokens`` held, the ``max_tokens`` budget, and counters since
        construction: ``hits`` / ``misses`` of requests with a prefix, ``evicted`` histories,
        ``resolved_tokens`` (prefix tokens rebuilt here instead of received) and
        ``sent_tokens`` (prompt tokens received)."""
        return {**self._counts, "trajectories": len(self), "tokens": self._held, "max_tokens": self.max_tokens}

    def __repr__(self) -> str:
        return f"HistoryStore({len(self)} trajectories, {self._held}/{self.max_tokens} tokens)"

    # -- internals ------------------------------------------------------------------------
    def _check(self, request: GenerationRequest) -> None:
        tid, want = request.traj_id, request.prefix_len
        self._counts["sent_tokens"] += len(request.prompt_ids)
        if want < 0:
            raise ConfigError(f"trajectory {tid}: prefix_len must be >= 0, got {want}", where="GenerationRequest")
        if want == 0:
            return
        held = self.held(tid)
        ok = held is not None and (held == want or (tid in self._open and held <= want))
        if not ok:
            self._counts["misses"] += 1
            what = "no history" if held is None else f"a history of {held} tokens"
            raise HistoryMiss(
                f"trajectory {tid}: generator {self.name or '?'} holds {what}, the request expects "
                f"{want} (evicted, or served by another worker); resend the whole history with prefix_len=0",
                traj_id=tid,
                expected=want,
                held=held,
            )
        self._counts["hits"] += 1
        self._counts["resolved_tokens"] += want
        (self._ids if self.keep_ids else self._lens).move_to_end(tid)

    def _drop(self, traj_id: str) -> None:
        self._open.discard(traj_id)
        if traj_id in self._ids:
            self._held -= len(self._ids.pop(traj_id))
        elif traj_id in self._lens:
            self._held -= self._lens.pop(traj_id)

    def _evict(self) -> None:
        store = self._ids if self.keep_ids else self._lens
        while self._held > self.max_tokens and store:
            tid = next(iter(store))
            self._drop(tid)
            self._counts["evicted"] += 1
