"""MegatronTrainBackend: HF <-> megatron weight conversion, parity with TorchTrainBackend.

The conversion tests need neither megatron nor CUDA. The parity test needs megatron-core: on
CUDA as is (``gpu``); on CPU with two test-only patches for places where megatron names the
CUDA device outright (rope frequencies, the model-parallel RNG around a 0-probability
dropout). Run it on CPU with ``pip install --no-deps --target /tmp/mcore megatron-core==0.16.1``
and ``PYTHONPATH=/tmp/mcore``.
"""

import contextlib
import sys

import pytest
import torch

from rollart_nb.algo import GRPO
from rollart_nb.backends import HFBackend, TorchTrainBackend
from rollart_nb.backends.megatron import MegatronTrainBackend, hf_to_megatron, megatron_to_hf
from rollart_nb.errors import ConfigError
from rollart_nb.models import format_history, tiny_qwen
from rollart_nb.protocols import TrainBackend
from rollart_nb.trajectory import Trajectory, Turn


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return tiny_qwen(seed=0, path=str(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture(scope="module")
def hf_state(ref):
    return ref.load_model().state_dict()


def dims(ref):
    c = ref.load_model().config
    return {"layers": c.num_hidden_layers, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads}


def test_module_imports_without_megatron_and_construction_names_the_fix(ref, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # `import megatron.core` now fails
    with pytest.raises(ConfigError, match=r"pip install 'rollart_nb\[megatron\]'"):
        MegatronTrainBackend(ref)


@pytest.mark.parametrize("tp", [1, 2])
def test_conversion_round_trips_exactly(ref, hf_state, tp):
    d = dims(ref)
    shards = [hf_to_megatron(hf_state, tp=tp, rank=r, **d) for r in range(tp)]
    back = megatron_to_hf(shards, **d)
    assert set(back) == set(hf_state)
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    # tied embeddings: no separate output layer on the megatron side
    assert "output_layer.weight" not in shards[0]


def test_qkv_and_fc1_follow_megatron_layout():
    # 4 query heads in 2 groups, head_dim 1, hidden 1: rows label themselves.
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # heads 0,1 -> group 0; heads 2,3 -> group 1
    k, v = torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    hf = {
        "model.embed_tokens.weight": torch.zeros(4, 1),
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
        "model.layers.0.self_attn.o_proj.weight": torch.tensor([[1.0, 2.0, 3.0, 4.0]]),
        "model.layers.0.input_layernorm.weight": torch.ones(1),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(1),
        "model.layers.0.mlp.gate_proj.weight": torch.tensor([[1.0], [2.0]]),
        "model.layers.0.mlp.up_proj.weight": torch.tensor([[3.0], [4.0]]),
        "model.layers.0.mlp.down_proj.weight": torch.tensor([[5.0, 6.0]]),
        "model.norm.weight": torch.ones(1),
    }
    r0, r1 = (hf_to_megatron(hf, layers=1, heads=4, kv_heads=2, tp=2, rank=r) for r in (0, 1))
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert r0[qkv].flatten().tolist() == [0, 1, 10, 20] and r1[qkv].flatten().tolist() == [2, 3, 11, 21]
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert r0[fc1].flatten().tolist() == [1, 3] and r1[fc1].flatten().tolist() == [2, 4]
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    assert r0[proj].tolist() == [[1, 2]] and r1[proj].tolist() == [[3, 4]]


@pytest.fixture(scope="module", autouse=True)
def _release_process_group():
    """A lone MegatronTrainBackend starts a world-of-one process group in this process; end it
    with the module so later tests (tests/weights/test_weight_nccl.py) see none."""
    yield
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
def megatron_device(request, monkeypatch):
    """``cuda`` (gpu marker), or ``cpu`` with megatron's two hard-coded CUDA calls patched out."""
    pytest.importorskip("megatron.core")
    if request.param == "cpu":
        if torch.cuda.is_available():
            pytest.skip("CUDA present: the gpu variant covers this")
        from megatron.core.tensor_parallel import random as mp_random

        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
        monkeypatch.setattr(mp_random.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    return request.param


def _batch(prompt, step):
    batch = []
    for j, tok in enumerate([40, 41, 42, 43]):
        t = Trajectory(task="t", group_id=f"g{step}")
        t.turns.append(Turn("say 3", prompt_ids=prompt, response_ids=[tok, 7], loss_mask=[1, 1], logprobs=[-5.5, -5.4]))
        t.reward = 1.0 if j == 0 else 0.0
        batch.append(t)
    return batch


def test_pp_is_rejected_with_a_reason(ref, megatron_device):
    with pytest.raises(ConfigError, match="pipeline parallelism is not supported"):
        MegatronTrainBackend(ref, pp=2, device=megatron_device)


def test_matches_torch_trainer_and_checkpoints(ref, tmp_path, megatron_device):
    algo = GRPO(group_size=4, lr=3e-3)
    mt = MegatronTrainBackend(ref, algo, device=megatron_device)
    psutil = pytest.importorskip("psutil")
    wide = [
        c.laddr
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    ]
    assert not wide, f"a lone trainer's process group listens beyond loopback: {wide}"  # no TCPStore
    tt = TorchTrainBackend(ref, algo, device=megatron_device)
    assert isinstance(mt, TrainBackend) and mt.version == 0
    prompt = tt.tokenizer.encode(format_history([("say 3", None)]))
    # float32 on both sides: measured ~0 on CPU; 1e-4 covers GPU kernel differences
    assert mt.logprobs(prompt, [5, 6, 7]) == pytest.approx(tt.logprobs(prompt, [5, 6, 7]), abs=1e-4)
    for step in range(3):
        a, b = mt.train_step(_batch(prompt, step)), tt.train_step(_batch(prompt, step))
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert mt.version == 3
    ms, ts = mt.state_dict(), tt.state_dict()
    assert set(ms) == set(ts)
    # Adam moves each weight by about lr * sign(grad) whatever the gradient's size, so where a
    # gradient is nearly 0, float noise between the two implementations flips the step: a few
    # dozen of the ~1M weights differ by up to 3 steps * lr; every other weight agrees to 5e-5
    n = sum(v.numel() for v in ts.values())
    off = sum(int((ms[k] - ts[k]).abs().gt(5e-5).sum()) for k in ts)
    assert off <= 1e-4 * n, f"{off} of {n} weights differ by more than 5e-5"
    assert max(float((ms[k] - ts[k]).abs().max()) for k in ts) <= 3 * algo.lr
    gen = HFBackend(ref, device=megatron_device)  # generators load the HF-named state as is
    gen.load_weights(ms, mt.version)
    assert gen.recompute(prompt + [5, 6])[-2:] == pytest.approx(mt.logprobs(prompt, [5, 6]), abs=1e-4)

    mt.save_checkpoint(tmp_path / "ck")
    again = MegatronTrainBackend(ref, algo, device=megatron_device)
    again.load_checkpoint(tmp_path / "ck")
    assert again.version == 3
    a, b = mt.train_step(_batch(prompt, 9)), again.train_step(_batch(prompt, 9))
    assert a["loss"] == b["loss"]
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in mt.state_dict().items())
