"""FrozenLake as a multi-turn text env (wraps gymnasium's ``FrozenLake-v1``).

The grid is rendered one row per line (``P`` player, ``F`` frozen, ``H`` hole, ``G`` goal)
and repeated every turn: a prefill-heavy task. ``compact=True`` (default) writes rows without
spaces (``PFFF``) and no message for a plain move, about half the tokens of ``compact=False``
(``P F F F``, "moved right .").

The move is the last of ``left``, ``right``, ``up``, ``down`` in the action text (whole words,
any case). Text with none of them is a no-op turn (reward 0) that still counts.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from rollart_nb.envs.arithmetic import HELDOUT_SEED_BASE
from rollart_nb.errors import ConfigError, StateError

__all__ = ["FrozenLake"]

_MOVES = {"left": 0, "down": 1, "right": 2, "up": 3}  # gymnasium's action ids
_DELTAS = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
_MOVE_RE = re.compile(r"\b(left|right|up|down)\b", re.IGNORECASE)
_INTRO = "frozen lake . you are P . reach G . avoid H . say left right up or down ."
_INTRO_COMPACT = "go to G . avoid H ."


def parse_move(action: str) -> str | None:
    """The move named last in ``action`` ("left"/"right"/"up"/"down"), or None."""
    found = _MOVE_RE.findall(action)
    return found[-1].lower() if found else None


class FrozenLake:
    """Walk from a start cell to the goal without falling into a hole.

    ``seed`` picks the ``seed % n``-th start cell from which the goal is reachable, so
    ``validation_seeds()`` enumerates every start once. With ``random_maps=True`` the seed
    generates the map instead; with ``holdout=n`` too, ``n`` validation maps (seeds at or above
    :data:`~rollart_nb.envs.arithmetic.HELDOUT_SEED_BASE`) never appear in training.

    Args:
        size: side of the square grid (default map: gymnasium's 4x4 / 8x8 when they fit).
        is_slippery: gymnasium's slippery dynamics (a move may slide sideways).
        max_turns: turns before truncation; default ``2 * (size - 1) + 4``.
        map: rows of ``S F H G`` letters, overrides ``size``.
        random_maps: generate a new map per seed instead of moving the start cell.
        compact: the short rendering (see the module docstring); False for the spaced one.
        holdout: with ``random_maps``, the number of distinct maps kept out of training for
            validation (0: validation is the first 16 distinct maps, which training also meets).

    Example:
        >>> env = FrozenLake()
        >>> obs, info = env.reset(seed=env.validation_seeds()[0])
        >>> obs, reward, terminated, truncated, info = env.step("right")
    """

    shape = "prefill"

    def __init__(
        self,
        size: int = 4,
        is_slippery: bool = False,
        max_turns: int | None = None,
        map: list[str] | None = None,
        random_maps: bool = False,
        compact: bool = True,
        holdout: int = 0,
    ) -> None:
        problems = []
        if not isinstance(holdout, int) or holdout < 0 or (holdout and not random_maps):
            problems.append(f"holdout={holdout!r} must be a whole number >= 0, and > 0 only with random_maps=True")
        if map is not None:
            if not map or any(len(r) != len(map) for r in map):
                problems.append("map must be a non-empty square list of strings")
            elif set("".join(map)) - set("SFHG") or "".join(map).count("G") != 1:
                problems.append("map may only hold S F H G letters, with exactly one G")
            else:
                size = len(map)
        if size < 2:
            problems.append(f"size must be >= 2, got {size}")
        if max_turns is not None and max_turns < 1:
            problems.append(f"max_turns must be >= 1, got {max_turns}")
        if problems:
            raise ConfigError(problems, where="FrozenLake")
        self.size = size
        self.is_slippery = is_slippery
        self.max_turns = max_turns if max_turns is not None else 2 * (size - 1) + 4
        self.random_maps = random_maps
        self.compact = compact
        self.holdout = holdout
        self._heldout: dict[tuple[str, ...], int] | None = None  # held-out map -> its seed, built lazily
        self.layout = [r.replace("S", "F") for r in (map or self._default_map(size))]
        self._starts = self._start_cells(self.layout)
        if not random_maps and not self._starts:
            raise ConfigError("no frozen cell can reach the goal", where="FrozenLake map")
        self._gym: Any = None
        self._gym_desc: tuple[str, ...] | None = None
        self._turn = 0
        self._done = True

    # -- hints for the model builder / validation ---------------------------------
    @property
    def vocab(self) -> list[str]:
        """Words used by observations and actions."""
        words = (
            set(_INTRO.split())
            | set(_INTRO_COMPACT.split())
            | {
                "P",
                "F",
                "H",
                "G",
                "S",
                "moved",
                "invalid",
                "action",
                "fell",
                "in",
                "a",
                "hole",
                "reached",
                "the",
                "goal",
                "out",
                "of",
                "turns",
                "left",
                "right",
                "up",
                "down",
            }
        )
        return sorted(words)

    def validation_seeds(self) -> list[int]:
        """Seeds that together cover every distinct start configuration once."""
        if self.random_maps:
            if self.holdout:
                return list(self._heldout_maps().values())
            return self._distinct_map_seeds(16)
        return list(range(len(self._starts)))

    def validation_maps(self) -> list[tuple[str, ...]]:
        """With ``random_maps``: the map of every validation seed (``S`` start, ``G`` goal)."""
        return [self.map_for(s) for s in self.validation_seeds()]

    def map_for(self, seed: int) -> tuple[str, ...]:
        """The map ``reset(seed)`` plays with ``random_maps`` (a held-out one only for a validation seed)."""
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        if not self.random_maps:
            raise ConfigError("map_for needs random_maps=True", where="FrozenLake")
        seed = int(seed)
        desc = tuple(generate_random_map(self.size, seed=seed))
        if not self.holdout or seed >= HELDOUT_SEED_BASE:
            return desc
        heldout = self._heldout_maps()
        while desc in heldout:  # a training seed never plays a validation map
            seed = (seed * 1103515245 + 12345) % HELDOUT_SEED_BASE
            desc = tuple(generate_random_map(self.size, seed=seed))
        return desc

    def _heldout_maps(self) -> dict[tuple[str, ...], int]:
        if self._heldout is None:
            from gymnasium.envs.toy_text.frozen_lake import generate_random_map

            found: dict[tuple[str, ...], int] = {}
            seed = HELDOUT_SEED_BASE
            while len(found) < self.holdout:
                if seed - HELDOUT_SEED_BASE > 1000 * self.holdout:
                    raise ConfigError(
                        f"only {len(found)} distinct {self.size}x{self.size} maps found for holdout={self.holdout}; "
                        "ask for fewer or a larger size",
                        where="FrozenLake",
                    )
                found.setdefault(tuple(generate_random_map(self.size, seed=seed)), seed)
                seed += 1
            self._heldout = found
        return self._heldout

    # -- env protocol --------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        seed = 0 if seed is None else int(seed)
        if self.random_maps:
            desc = list(self.map_for(seed))
        else:
            r, c = self._starts[seed % len(self._starts)]
            rows = [list(row) for row in self.layout]
            rows[r][c] = "S"
            desc = ["".join(row) for row in rows]
        self._make_gym(desc)
        state, _ = self._gym.reset(seed=seed)
        self._turn, self._done = 0, False
        info = {"start": divmod(int(state), self.size), "map": list(desc)}
        intro = _INTRO_COMPACT if self.compact else _INTRO
        return f"{intro}\n{self._render(int(state))}", info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise StateError("FrozenLake has no open episode (not reset yet, or it ended); call reset() first")
        self._turn += 1
        move = parse_move(action)
        truncated = self._turn >= self.max_turns
        if move is None:
            state = int(self._gym.unwrapped.s)
            self._done = truncated
            msg = "invalid action ." if self.compact else "invalid action . say left right up or down ."
            return f"{msg}\n{self._render(state)}", 0.0, False, truncated, {"move": None}
        state, reward, terminated, _, _ = self._gym.step(_MOVES[move])
        state = int(state)
        cell = self._desc[state // self.size][state % self.size]
        if cell == "G":
            msg = "reached the goal ."
        elif cell == "H":
            msg = "fell in a hole ."
        elif self.compact:
            msg = "out of turns ." if truncated else ""
        else:
            msg = f"moved {move} ." + (" out of turns ." if truncated else "")
        self._done = bool(terminated) or truncated
        info = {"move": move, "position": divmod(state, self.size)}
        return (
            f"{msg}\n{self._render(state)}" if msg else self._render(state),
            float(reward),
            bool(terminated),
            truncated and not terminated,
            info,
        )

    # -- helpers -------------------------------------------------------------------
    def solve(self) -> list[str] | None:
        """Shortest move list from the current state to the goal (deterministic dynamics),
        or None if unreachable. Handy as a scripted policy in tests and demos."""
        if self._gym is None:
            raise StateError("FrozenLake has no episode to solve; call reset() before solve()")
        start = divmod(int(self._gym.unwrapped.s), self.size)
        return _shortest_path(list(self._desc), start)

    def demonstrate(self, seed: int | None = None) -> list[tuple[str, str]]:
        """A worked solution of ``reset(seed)``: the ``(observation, move)`` turns of a shortest path
        to the goal (deterministic dynamics; slippery ice may not follow it). Leaves the env reset
        to ``seed`` and walked to the goal."""
        obs, _ = self.reset(seed)
        turns: list[tuple[str, str]] = []
        for move in self.solve() or []:
            turns.append((obs, move))
            obs, _, terminated, truncated, _ = self.step(move)
            if terminated or truncated:
                break
        return turns

    def _distinct_map_seeds(self, count: int) -> list[int]:
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        seen, seeds = set(), []
        for seed in range(count * 20):  # small maps repeat; stop once enough are distinct
            desc = tuple(generate_random_map(self.size, seed=seed))
            if desc not in seen:
                seen.add(desc)
                seeds.append(seed)
                if len(seeds) == count:
                    break
        return seeds

    @staticmethod
    def _default_map(size: int) -> list[str]:
        from gymnasium.envs.toy_text.frozen_lake import MAPS, generate_random_map

        key = f"{size}x{size}"
        # A fixed seed keeps the map of a given size the same across processes and runs.
        return list(MAPS[key]) if key in MAPS else generate_random_map(size, seed=0)

    @staticmethod
    def _start_cells(layout: list[str]) -> list[tuple[int, int]]:
        cells = [(r, c) for r, row in enumerate(layout) for c, ch in enumerate(row) if ch == "F"]
        return [rc for rc in cells if _shortest_path(layout, rc) is not None]

    @property
    def _desc(self) -> tuple[str, ...]:
        """The map the gymnasium env was built from (set together with ``_gym`` by ``reset``)."""
        if self._gym_desc is None:
            raise StateError("FrozenLake has no map yet; call reset() first")
        return self._gym_desc

    def _make_gym(self, desc: list[str]) -> None:
        if self._gym_desc == tuple(desc):
            return
        import gymnasium

        # Truncation is ours (max_turns); gymnasium's TimeLimit must never fire first.
        self._gym = gymnasium.make("FrozenLake-v1", desc=desc, is_slippery=self.is_slippery, max_episode_steps=10**9)
        self._gym_desc = tuple(desc)

    def _render(self, state: int) -> str:
        pr, pc = divmod(state, self.size)
        rows = []
        for r, row in enumerate(self._desc):
            cells = ["P" if (r, c) == (pr, pc) else ("F" if ch == "S" else ch) for c, ch in enumerate(row)]
            rows.append(("" if self.compact else " ").join(cells))
        return "\n".join(rows)

    def __getstate__(self) -> dict[str, Any]:
        # The gymnasium env is rebuilt on the next reset; shipping it through Ray is waste.
        state = dict(self.__dict__)
        state.update(_gym=None, _gym_desc=None, _done=True)
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenLake:
        # Every EnvManager and validation run copies its template. The layout, start cells and
        # held-out maps are never changed after they are built, so copies share them.
        new = object.__new__(type(self))
        new.__dict__.update(self.__getstate__())
        return new

    def __repr__(self) -> str:
        return (
            f"FrozenLake(size={self.size}, is_slippery={self.is_slippery}, max_turns={self.max_turns}, "
            f"compact={self.compact}"
            + (", random_maps=True" if self.random_maps else "")
            + (f", holdout={self.holdout}" if self.holdout else "")
            + ")"
        )


def _shortest_path(desc: list[str], start: tuple[int, int]) -> list[str] | None:
    n = len(desc)
    prev: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cur = queue.popleft()
        if desc[cur[0]][cur[1]] == "G":
            path = []
            while prev[cur] is not None:
                cur, move = prev[cur]  # type: ignore[misc]
                path.append(move)
            return path[::-1]
        for move, (dr, dc) in _DELTAS.items():
            nxt = (cur[0] + dr, cur[1] + dc)
            if 0 <= nxt[0] < n and 0 <= nxt[1] < n and nxt not in prev and desc[nxt[0]][nxt[1]] != "H":
                prev[nxt] = (cur, move)
                queue.append(nxt)
    return None
