"""Hardware pools and their discovery from Ray node resources.

A :class:`Pool` is a named set of device slots of one hardware profile across nodes.
Discovery reads each alive node's resources:

- ``accelerator_type:<NAME>`` (set by Ray itself on GPU nodes) -> pool ``<NAME>``, one slot per
  GPU on that node;
- a user mapping ``{"my_resource": "H20"}`` -> pool ``H20``, one slot per unit of ``my_resource``;
- ``rollart_pool_<NAME>`` (declared by :meth:`Session.local`) -> a *simulated* pool;
- nodes with CPUs and no GPU -> pool ``cpu``, one slot per CPU;
- registered serverless endpoints -> pool ``serverless`` (elastic; many slots).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollart_nb._ray import POOL_RESOURCE_PREFIX
from rollart_nb.errors import ConfigError
from rollart_nb.resources.profiles import PROFILES, HardwareProfile, profile

__all__ = [
    "SERVERLESS_SLOTS",
    "Pool",
    "canonical_name",
    "discover_pools",
    "hardware_for_pool",
    "pool_map_problems",
    "pool_problems",
]

SERVERLESS_SLOTS = 1024
"""Slots of the elastic serverless pool: replicas scale on demand, so capacity is not a limit."""


@dataclass
class Pool:
    """A named hardware pool.

    Attributes:
        name: pool name ("H800", "H20", "cpu", "serverless", ...).
        hardware: the pool's :class:`HardwareProfile`.
        slots_per_node: node id -> number of worker slots there.
        resource: the Ray resource one slot consumes ("GPU", "CPU" or a custom one).
        simulated: True when the pool is declared (Session.local), not real hardware.
        used: slots this session's workers hold (kept by the ResourceManager).
        held_elsewhere: slots other sessions of the cluster hold (as the ResourceManager last
            read them from the shared store).
    """

    name: str
    hardware: HardwareProfile
    slots_per_node: dict[str, float] = field(default_factory=dict)
    resource: str = "GPU"
    simulated: bool = False
    used: float = 0.0
    held_elsewhere: float = 0.0

    @property
    def nodes(self) -> list[str]:
        return list(self.slots_per_node)

    @property
    def capacity(self) -> float:
        return float(sum(self.slots_per_node.values()))

    @property
    def free(self) -> float:
        return self.capacity - self.used - self.held_elsewhere

    def __repr__(self) -> str:
        tag = "simulated" if self.simulated else "real"
        return (
            f"Pool({self.name!r}, {self.hardware.name}, {len(self.slots_per_node)} node(s), "
            f"{self.free:g}/{self.capacity:g} free, {tag})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "hardware": self.hardware.name,
            "slots_per_node": self.slots_per_node,
            "resource": self.resource,
            "simulated": self.simulated,
        }


def hardware_for_pool(name: str) -> HardwareProfile:
    """Profile for a pool name: "cpu" -> CPU, "serverless" -> SERVERLESS, else by GPU name."""
    return profile(name)


def discover_pools(
    nodes: list[dict[str, Any]],
    *,
    pool_map: dict[str, str] | None = None,
    serverless: bool = False,
    head_node_id: str | None = None,
) -> dict[str, Pool]:
    """Build pools from node resource dicts (as returned by ``_ray.nodes()``).

    Args:
        nodes: alive nodes, each {"node_id", "resources"}.
        pool_map: custom resource name -> hardware name, for clusters that label GPUs their own way.
        serverless: add the elastic ``serverless`` pool (its slots live on the head node).
        head_node_id: node that hosts serverless slots (default: the first node).
    """
    pool_map = pool_map or {}
    pools: dict[str, Pool] = {}

    def add(name: str, hw: HardwareProfile, node: str, slots: float, resource: str, simulated: bool) -> None:
        p = pools.setdefault(name, Pool(name, hw, resource=resource, simulated=simulated))
        p.slots_per_node[node] = p.slots_per_node.get(node, 0.0) + slots

    for n in nodes:
        res: dict[str, float] = n["resources"]
        nid = n["node_id"]
        claimed = False
        for key, val in res.items():
            if key.startswith(POOL_RESOURCE_PREFIX):
                name = key[len(POOL_RESOURCE_PREFIX) :]
                add(name, hardware_for_pool(name), nid, val, key, True)
                claimed = True
            elif key in pool_map:
                hw = profile(pool_map[key])
                add(hw.name, hw, nid, val, key, False)
                claimed = True
        gpus = res.get("GPU", 0.0)
        acc = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
        if gpus and acc and not claimed:
            name = acc[0]
            known = PROFILES.get(name.upper()) or _known_or_none(name)
            if known is not None:
                add(known.name, known, nid, gpus, "GPU", False)
                claimed = True
        if not claimed and not gpus and res.get("CPU", 0.0) > 0:
            add("cpu", PROFILES["CPU"], nid, res["CPU"], "CPU", False)
    if serverless and "serverless" not in pools and nodes:
        host = head_node_id or nodes[0]["node_id"]
        add("serverless", PROFILES["SERVERLESS"], host, SERVERLESS_SLOTS, "", False)
    kind_order = {"gpu": 0, "cpu": 1, "serverless": 2}
    return dict(sorted(pools.items(), key=lambda kv: (kind_order.get(kv[1].hardware.kind, 3), kv[0])))


def _known_or_none(name: str) -> HardwareProfile | None:
    try:
        return profile(name)
    except Exception:
        return None


def canonical_name(name: str) -> str:
    """A declared pool's name as pools are named: "cpu", "serverless" or the profile's ("h20" -> "H20")."""
    low = name.lower()
    return low if low in ("cpu", "serverless") else PROFILES[name.upper()].name


def pool_problems(pools: object, *, whole: bool) -> list[str]:
    """What is wrong with declared ``pools`` (pool name -> slot count; ``whole``: counts are ints)."""
    if not isinstance(pools, Mapping):
        return [f"pools={pools!r} must map pool name -> slot count, e.g. {{'H800': 2, 'H20': 2, 'cpu': 4}}"]
    p = []
    for name, n in pools.items():
        if not isinstance(name, str) or name.lower() not in ("cpu", "serverless") and name.upper() not in PROFILES:
            p.append(f"pool {name!r} is not a known hardware type ({sorted(PROFILES)}) or 'cpu'")
        if isinstance(n, bool) or not isinstance(n, int if whole else int | float) or n <= 0:
            p.append(f"pool {name!r} needs a positive {'integer' if whole else 'slot'} count, got {n!r}")
    return p


def pool_map_problems(pool_map: object) -> list[str]:
    """What is wrong with ``Session.attach``'s ``pool_map`` (custom resource -> hardware name)."""
    if pool_map is None:
        return []
    if not isinstance(pool_map, Mapping):
        return [f"pool_map={pool_map!r} must map a custom resource name -> hardware name, e.g. {{'my_h20': 'H20'}}"]
    p = []
    for key, hw in pool_map.items():
        try:
            profile(hw)
        except (ConfigError, AttributeError):
            p.append(f"pool_map[{key!r}]={hw!r} is not a known hardware type ({sorted(PROFILES)})")
    return p
