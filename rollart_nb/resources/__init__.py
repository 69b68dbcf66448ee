"""Resource plane: hardware profiles, pools, metadata stores and the ResourceManager."""

from rollart_nb.resources.manager import Binding, ResourceManager
from rollart_nb.resources.pools import Pool, discover_pools
from rollart_nb.resources.profiles import PROFILES, HardwareProfile, profile
from rollart_nb.resources.store import GcsStore, MemoryStore, RedisStore, make_store

__all__ = [
    "Binding",
    "GcsStore",
    "HardwareProfile",
    "MemoryStore",
    "PROFILES",
    "Pool",
    "RedisStore",
    "ResourceManager",
    "discover_pools",
    "make_store",
    "profile",
]
