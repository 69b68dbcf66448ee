"""pack/unpack: layout, zero-copy views, checksums."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollart_nb.errors import ConfigError, WeightSyncError
from rollart_nb.weights.buckets import ALIGN, Manifest, default_checksum_algo, pack, unpack


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(37, 16, generator=g).to(torch.bfloat16),
        "layer.0.attn": torch.randn(16, 16, generator=g).to(torch.float16),
        "layer.0.mlp": torch.randn(16, 48, generator=g),
        "step": torch.tensor(1234567890123, dtype=torch.int64),
        "positions": torch.arange(100, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "transposed": torch.randn(8, 5, generator=g).t(),  # non-contiguous
        "empty": torch.empty(0, 3),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("bucket_bytes", [256, 1024, 1 << 20])
def test_round_trip_mixed_dtypes(bucket_bytes):
    state = mixed_state()
    manifest, buckets = pack(state, bucket_bytes, version=3)
    assert manifest.version == 3
    assert all(b.dtype == np.uint8 and b.ndim == 1 for b in buckets)
    assert manifest.total_bytes == sum(b.nbytes for b in buckets)
    assert_same(unpack(manifest, buckets), state)


def test_tensors_that_fit_are_never_split_and_are_aligned():
    state = mixed_state()
    manifest, buckets = pack(state, 4096)
    assert max(e.nbytes for e in manifest.tensors) <= 4096
    assert max(manifest.bucket_sizes) <= 4096
    for e in manifest.tensors:
        assert len(e.chunks) == 1, e.name
        assert e.offset % ALIGN == 0
    # Several tensors share a bucket: it is packing, not one tensor per bucket.
    assert manifest.num_buckets < len(state)


def test_tensor_bigger_than_bucket_is_chunked():
    big = torch.randn(1000)  # 4000 bytes
    state = {"a": torch.ones(3), "big": big, "c": torch.arange(5)}
    manifest, buckets = pack(state, 1024)
    entry = {e.name: e for e in manifest.tensors}["big"]
    assert [c.nbytes for c in entry.chunks] == [1024, 1024, 1024, 928]
    assert len({c.bucket for c in entry.chunks}) == 4
    assert all(n <= 1024 for n in manifest.bucket_sizes)
    assert_same(unpack(manifest, buckets), state)


def test_unpack_is_zero_copy_for_unsplit_tensors():
    manifest, buckets = pack({"w": torch.randn(64, 64), "b": torch.randn(64)}, 1 << 20)
    out = unpack(manifest, buckets)
    base = buckets[0].ctypes.data
    for t in out.values():
        assert base <= t.data_ptr() < base + buckets[0].nbytes
    buckets[0][:4] = 0  # the views see writes to the bucket, so no copy was made
    assert out["w"].view(-1)[0].item() == 0.0


def test_read_only_buckets_are_copied_unless_views_requested():
    manifest, buckets = pack({"w": torch.randn(10)}, 1 << 20)
    ro = [b.copy() for b in buckets]
    for b in ro:
        b.flags.writeable = False
    out = unpack(manifest, ro)
    out["w"].add_(1)  # writable: would crash on real read-only memory if it were a view
    views = unpack(manifest, ro, copy_readonly=False)
    assert views["w"].data_ptr() == ro[0].ctypes.data


def test_checksum_corruption_names_the_bucket():
    state = mixed_state()
    manifest, buckets = pack(state, 256)
    assert manifest.num_buckets >= 3
    buckets[2][5] ^= 0xFF
    with pytest.raises(WeightSyncError, match="bucket 2 failed its"):
        unpack(manifest, buckets)


def test_missing_and_truncated_buckets_are_rejected():
    manifest, buckets = pack(mixed_state(), 256)
    with pytest.raises(WeightSyncError, match="partial"):
        unpack(manifest, buckets[:-1])
    buckets[1] = buckets[1][:-1]
    with pytest.raises(WeightSyncError, match="bucket 1 has"):
        unpack(manifest, buckets)


@pytest.mark.parametrize("algo", ["crc32", "xxh3_64"])
def test_checksum_algorithms(algo):
    if algo == "xxh3_64":
        pytest.importorskip("xxhash")
    manifest, buckets = pack(mixed_state(), 512, checksum_algo=algo)
    assert manifest.checksum_algo == algo
    assert len(set(manifest.checksums)) > 1
    buckets[0][0] ^= 1
    with pytest.raises(WeightSyncError, match="bucket 0"):
        unpack(manifest, buckets)


def test_default_checksum_is_the_fast_one():
    try:
        import xxhash  # noqa: F401

        assert default_checksum_algo() == "xxh3_64"
    except ImportError:
        assert default_checksum_algo() == "crc32"


def test_manifest_json_round_trip():
    manifest, _ = pack(mixed_state(), 320, version=9)
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest
    assert again.tensors[0].dtype == "bfloat16"


def test_bad_input_is_a_config_error():
    with pytest.raises(ConfigError, match="multiple of"):
        pack({"w": torch.ones(1)}, 100)
    with pytest.raises(ConfigError, match="not a torch.Tensor"):
        pack({"w": [1, 2]}, 1024)  # type: ignore[dict-item]


def test_pack_on_a_torch_device_returns_tensors():
    state = mixed_state()
    manifest, buckets = pack(state, 512, device="cpu")
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.uint8 for b in buckets)
    assert manifest.checksum_algo == "none"
    assert_same(unpack(manifest, buckets), state)
