"""Bucketed, versioned weight transfer from trainers to generation workers.

State dicts are cut into checksummed buckets (:mod:`~rollart_nb.weights.buckets`), published
under a version, and pulled by a :class:`WeightPuller`. Transports
(:class:`rollart_nb.protocols.WeightTransport`):

* :class:`ObjectStoreTransport` — Ray object store (default).
* :class:`MooncakeTransport` — Mooncake store, cross-cluster (the ``mooncake`` extra).
* :class:`NcclTransport` — ``torch.distributed`` broadcast inside one GPU cluster.
* :class:`LocalTransport` — in-process fake for sim backends and tests.

Optional libraries (ray, mooncake) are imported only when a transport is used.
"""

from rollart_nb.weights.buckets import DEFAULT_BUCKET_BYTES, Manifest, TensorEntry, pack, unpack
from rollart_nb.weights.local import LocalTransport
from rollart_nb.weights.metrics import WeightSyncMetrics
from rollart_nb.weights.mooncake import MooncakeMaster, MooncakeTransport
from rollart_nb.weights.nccl import NcclTransport
from rollart_nb.weights.object_store import ObjectStoreTransport
from rollart_nb.weights.puller import WeightPuller

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "LocalTransport",
    "Manifest",
    "MooncakeMaster",
    "MooncakeTransport",
    "NcclTransport",
    "ObjectStoreTransport",
    "TensorEntry",
    "WeightPuller",
    "WeightSyncMetrics",
    "pack",
    "unpack",
]
