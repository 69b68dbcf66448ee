"""Hardware profiles as data: what a pool's devices can do and what they cost.

Used for routing (compute- vs bandwidth-optimized) and by the ``sim`` backend's roofline
model. Numbers are from public spec sheets (dense bf16, no sparsity); prices are indicative
on-demand cloud list prices per device-hour and only used for equal-cost comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROFILES", "HardwareProfile", "profile"]


@dataclass(frozen=True)
class HardwareProfile:
    """One device type.

    Attributes:
        name: canonical name ("H800", "H20", "CPU", ...).
        kind: "gpu", "cpu" or "serverless".
        bf16_tflops: peak dense bf16 TFLOP/s per device.
        mem_bw_gbps: memory bandwidth in GB/s per device.
        mem_gb: device memory in GB.
        price_per_hour: indicative USD per device-hour.
        optimized_for: "compute", "bandwidth" or "general".
        nvlink_gbps: GB/s of one device's link to the others of its node (NVLink; 0: none,
            so no tensor parallelism across devices).
        net_gbps: GB/s of one device's network link to other nodes (in the RollArt paper's
            deployment: 400 Gbit/s InfiniBand inside a cluster, 200 Gbit/s Ethernet between
            the H800 training cluster and the H20 cluster, §7 "Infrastructure").
        pass_overhead_s: fixed seconds of one forward pass besides its FLOPs and bytes
            (kernel launches, framework dispatch). 0 for the spec-sheet profiles, where a
            pass of a served model is far longer; a profile measured on a small model
            (:mod:`rollart_nb.bench.calibrate`) has it.
    """

    name: str
    kind: str
    bf16_tflops: float
    mem_bw_gbps: float
    mem_gb: float
    price_per_hour: float
    optimized_for: str
    nvlink_gbps: float = 0.0
    net_gbps: float = 0.0
    pass_overhead_s: float = 0.0

    @property
    def compute_optimized(self) -> bool:
        return self.optimized_for == "compute"

    @property
    def bandwidth_optimized(self) -> bool:
        return self.optimized_for == "bandwidth"

    @property
    def flops_per_byte(self) -> float:
        """Ridge point of the roofline (FLOP per byte of memory traffic)."""
        return self.bf16_tflops * 1e12 / (self.mem_bw_gbps * 1e9)


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in [
        # H800 SXM: same compute as H100 SXM (989 dense bf16 TFLOP/s, 3.35 TB/s HBM3, 80 GB);
        # NVIDIA H100 datasheet; the H800 differs in NVLink bandwidth only (400 GB/s against 900).
        # Network: 400 Gbit/s InfiniBand = 50 GB/s (RollArt §7). Price: ~$2.5/h cloud list.
        HardwareProfile("H800", "gpu", 989.0, 3350.0, 80.0, 2.50, "compute", nvlink_gbps=400.0, net_gbps=50.0),
        # H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (989 TFLOP/s bf16 dense, 3.35 TB/s, 80 GB,
        # NVLink 900 GB/s); one 400 Gbit/s NIC per GPU (DGX H100) = 50 GB/s.
        HardwareProfile("H100", "gpu", 989.0, 3350.0, 80.0, 2.99, "compute", nvlink_gbps=900.0, net_gbps=50.0),
        # H20: NVIDIA HGX H20 spec (148 TFLOP/s bf16 dense, 4.0 TB/s HBM3, 96 GB, NVLink 900 GB/s);
        # RollArt Table 2. Network to the H800 training cluster: 200 Gbit/s Ethernet = 25 GB/s (§7).
        # Price: ~0.35x an H800 per hour (the paper's equal-cost mix: 72 H800 ~ 208 H20).
        HardwareProfile("H20", "gpu", 148.0, 4000.0, 96.0, 0.87, "bandwidth", nvlink_gbps=900.0, net_gbps=25.0),
        # A100 SXM 80GB: NVIDIA A100 datasheet (312 TFLOP/s bf16 dense, 2.039 TB/s, 80 GB, NVLink
        # 600 GB/s); 200 Gbit/s HDR InfiniBand per GPU (DGX A100) = 25 GB/s.
        HardwareProfile("A100", "gpu", 312.0, 2039.0, 80.0, 1.79, "compute", nvlink_gbps=600.0, net_gbps=25.0),
        # A generic server CPU socket (e.g. 2x Xeon 8480+: ~2x 56 cores AMX ~ order of 10s of
        # TFLOP/s bf16 at best; we model 5 TFLOP/s, 300 GB/s DDR5) for env servers.
        HardwareProfile("CPU", "cpu", 5.0, 300.0, 512.0, 0.10, "general"),
        # Serverless: an elastic pool (billed per use; reward functions). Modelled as one
        # H800-class device per replica, price counted only while a replica is up.
        HardwareProfile("SERVERLESS", "serverless", 989.0, 3350.0, 80.0, 2.50, "general"),
    ]
}

_ALIASES = {
    "H800": "H800",
    "H800-SXM": "H800",
    "NVIDIA-H800": "H800",
    "H100": "H100",
    "H100-SXM": "H100",
    "NVIDIA-H100": "H100",
    "H100-80GB": "H100",
    "H20": "H20",
    "NVIDIA-H20": "H20",
    "A100": "A100",
    "A100-80G": "A100",
    "A100-40G": "A100",
    "NVIDIA-A100": "A100",
    "CPU": "CPU",
    "SERVERLESS": "SERVERLESS",
}


def profile(name: str) -> HardwareProfile:
    """Look up a hardware profile by name or common alias (case-insensitive).

    Example:
        >>> profile("h20").bandwidth_optimized
        True
    """
    key = _ALIASES.get(name.upper().replace("_", "-"))
    if key is None and name.upper() in PROFILES:  # a registered profile (e.g. a measured one)
        key = name.upper()
    if key is None:
        from rollart_nb.errors import ConfigError

        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[key]
