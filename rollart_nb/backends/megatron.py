"""Training on megatron-core (CUDA, tensor parallel): the ``megatron`` train backend.

Same contract as :class:`~rollart_nb.backends.torch_train.TorchTrainBackend`: the same rows
(:func:`~rollart_nb.backends.torch_train.build_rows`), the same GRPO loss and weights, and
:meth:`MegatronTrainBackend.state_dict` in Hugging Face naming, so ``hf`` and ``vllm``
generators load it as they load the torch trainer's.

The model is megatron-core's ``GPTModel`` (local layer spec) configured as the HF Qwen2/Llama
checkpoint; :func:`hf_to_megatron` and :func:`megatron_to_hf` convert the fused q/k/v and
gate/up layouts. Every TP rank must call :meth:`train_step` with the same batch.

Not yet: pipeline parallelism (``pp > 1``), data parallelism inside one backend (run one
backend per model replica), Transformer Engine kernels.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_nb.algo.grpo import (
    GRPO,
    batch_advantages,
    grpo_loss,
    mean_response_length,
    step_metrics,
)
from rollart_nb.algo.provenance import TokenRecorder
from rollart_nb.backends.torch_train import Row, batch_rows, micro_batches, row_tensors
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.models.tiny import ModelRef, from_pretrained
from rollart_nb.trajectory import Trajectory

if TYPE_CHECKING:
    import torch

__all__ = ["MegatronTrainBackend", "hf_to_megatron", "megatron_to_hf"]

log = logging.getLogger(__name__)

_INSTALL = "megatron-core is not installed; on a CUDA machine pip install 'rollart_nb[megatron]'"
_STATE_FILE = "trainer.pt"
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")  # split on dim 1
_COL_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")  # dim 0


def hf_to_megatron(
    hf: dict[str, torch.Tensor], *, layers: int, heads: int, kv_heads: int, tp: int = 1, rank: int = 0
) -> dict[str, torch.Tensor]:
    """HF Qwen2/Llama weights -> tensor-parallel rank ``rank``'s megatron ``GPTModel`` weights.

    Args:
        hf: HF state dict (``lm_head.weight`` optional when embeddings are tied).
        layers / heads / kv_heads: model shape; ``tp`` must divide ``kv_heads``.
        tp / rank: tensor-parallel size and this rank.
    """
    import torch

    def part(t: Any, dim: int) -> Any:
        return t.chunk(tp, dim=dim)[rank].clone()

    out = {"embedding.word_embeddings.weight": part(hf["model.embed_tokens.weight"], 0)}
    for i in range(layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            q = hf.get(f"{p}self_attn.q_proj.{kind}")
            if q is None:
                continue
            k, v = hf[f"{p}self_attn.k_proj.{kind}"], hf[f"{p}self_attn.v_proj.{kind}"]
            # megatron's layout: per query group g, [its q heads; k_g; v_g] (rank r holds groups r*G/tp..)
            rest = q.shape[1:]
            qkv = torch.cat(
                [q.reshape(kv_heads, -1, *rest), k.reshape(kv_heads, -1, *rest), v.reshape(kv_heads, -1, *rest)],
                dim=1,
            ).reshape(-1, *rest)
            out[f"{m}self_attention.linear_qkv.{kind}"] = part(qkv, 0)
        out[f"{m}self_attention.linear_proj.weight"] = part(hf[f"{p}self_attn.o_proj.weight"], 1)
        out[f"{m}input_layernorm.weight"] = hf[f"{p}input_layernorm.weight"].clone()
        out[f"{m}pre_mlp_layernorm.weight"] = hf[f"{p}post_attention_layernorm.weight"].clone()
        # Gated MLP: each rank's fc1 is [its slice of gate; its slice of up].
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat(
            [part(hf[f"{p}mlp.gate_proj.weight"], 0), part(hf[f"{p}mlp.up_proj.weight"], 0)]
        )
        out[f"{m}mlp.linear_fc2.weight"] = part(hf[f"{p}mlp.down_proj.weight"], 1)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    if "lm_head.weight" in hf and not _same(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
        out["output_layer.weight"] = part(hf["lm_head.weight"], 0)
    return out


def megatron_to_hf(
    shards: list[dict[str, torch.Tensor]], *, layers: int, heads: int, kv_heads: int
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron`: all TP ranks' weights (in rank order) -> HF naming.

    ``lm_head.weight`` is always present (a copy of the embeddings when they are tied), as in
    a HF model's own ``state_dict()``.
    """
    import torch

    def whole(name: str, dim: int) -> Any:
        return torch.cat([s[name] for s in shards], dim=dim)

    hf = {"model.embed_tokens.weight": whole("embedding.word_embeddings.weight", 0)}
    for i in range(layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            name = f"{m}self_attention.linear_qkv.{kind}"
            if name not in shards[0]:
                continue
            qkv = whole(name, 0)
            rest = qkv.shape[1:]
            per_group = qkv.reshape(kv_heads, -1, *rest)
            head_dim = per_group.shape[1] // (heads // kv_heads + 2)
            q, k, v = per_group.split([heads // kv_heads * head_dim, head_dim, head_dim], dim=1)
            hf[f"{p}self_attn.q_proj.{kind}"] = q.reshape(-1, *rest).clone()
            hf[f"{p}self_attn.k_proj.{kind}"] = k.reshape(-1, *rest).clone()
            hf[f"{p}self_attn.v_proj.{kind}"] = v.reshape(-1, *rest).clone()
        hf[f"{p}self_attn.o_proj.weight"] = whole(f"{m}self_attention.linear_proj.weight", 1)
        hf[f"{p}input_layernorm.weight"] = shards[0][f"{m}input_layernorm.weight"].clone()
        hf[f"{p}post_attention_layernorm.weight"] = shards[0][f"{m}pre_mlp_layernorm.weight"].clone()
        halves = [s[f"{m}mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        hf[f"{p}mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
        hf[f"{p}mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
        hf[f"{p}mlp.down_proj.weight"] = whole(f"{m}mlp.linear_fc2.weight", 1)
    hf["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    tied = "output_layer.weight" not in shards[0]
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"].clone() if tied else whole("output_layer.weight", 0)
    return hf


def _same(a: Any, b: Any) -> bool:
    return a.shape == b.shape and (a.data_ptr() == b.data_ptr() or bool((a == b).all()))


class MegatronTrainBackend:
    """A :class:`~rollart_nb.protocols.TrainBackend`: GRPO on megatron-core, tensor parallel.

    Args:
        model: a :class:`ModelRef` or a path to a HF Qwen2/Llama model directory.
        algo: the :class:`GRPO` config.
        seed: seeds torch (and megatron's model-parallel RNG on CUDA).
        tp: tensor-parallel size (this process is one TP rank; torch.distributed env from the launcher).
        pp: pipeline-parallel size; only 1 for now.
        device: ``"cuda"`` (default); ``"cpu"`` runs the same code slowly, for checks.

    Example:
        >>> trainer = MegatronTrainBackend(rn.models.tiny_qwen(), GRPO(group_size=4))  # doctest: +SKIP
        >>> trainer.train_step(scored_trajectories)["loss"]                              # doctest: +SKIP
        >>> gen.load_weights(trainer.state_dict(), trainer.version)                      # doctest: +SKIP
    """

    def __init__(
        self,
        model: ModelRef | str,
        algo: GRPO | None = None,
        seed: int = 0,
        tp: int = 1,
        pp: int = 1,
        *,
        device: str | None = None,
    ) -> None:
        try:
            import megatron.core  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"{_INSTALL} ({e})", where="MegatronTrainBackend") from e
        import torch
        from transformers import AutoConfig

        self.ref = model if isinstance(model, ModelRef) else from_pretrained(model)
        self.algo = algo or GRPO()
        self.seed, self.tp = seed, tp
        device = device or "cuda"
        cfg = AutoConfig.from_pretrained(self.ref.path)
        self.hf_config = cfg
        problems = []
        if device.split(":")[0] == "cuda" and not torch.cuda.is_available():
            problems.append("needs CUDA, which this machine lacks; use TorchTrainBackend on CPU")
        if not (isinstance(tp, int) and tp >= 1):
            problems.append(f"tp must be an int >= 1, got {tp!r}")
        if pp != 1:
            problems.append(f"pp={pp}: pipeline parallelism is not supported yet; use pp=1 and tp for size")
        if getattr(cfg, "model_type", "") not in ("qwen2", "llama"):
            problems.append(f"model_type {getattr(cfg, 'model_type', None)!r}: only qwen2 and llama convert")
        for field in ("num_key_value_heads", "vocab_size", "intermediate_size"):
            if isinstance(tp, int) and tp >= 1 and getattr(cfg, field, 0) % tp:
                problems.append(f"{field}={getattr(cfg, field)} is not divisible by tp={tp}")
        if problems:
            raise ConfigError(problems, where="MegatronTrainBackend")

        torch.manual_seed(seed)
        random.seed(seed)
        self.device = torch.device(device)
        self._init_parallel(tp)
        self.tokenizer = self.ref.load_tokenizer()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model = self._build_model()
        self._load_hf(self.ref.load_model(dtype=torch.float32).state_dict())
        self.reference = None
        if self.algo.kl_coef > 0:  # the KL anchor is the policy we start from
            self.reference = self._build_model().requires_grad_(False)
            self.reference.load_state_dict(self.model.state_dict())
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.algo.lr, weight_decay=self.algo.weight_decay
        )
        self.version = 0

    # -- TrainBackend -------------------------------------------------------------------
    def train_step(self, batch: list[Trajectory]) -> dict[str, Any]:
        """One optimizer step on scored trajectories (same on every TP rank); bumps :attr:`version`.
        Returns the same metrics and ``token_records`` as the torch backend's.

        Raises:
            ConfigError: empty batch, unscored trajectories, or no trainable tokens.
        """
        t0 = time.perf_counter()
        if self.algo.epochs != 1 or self.algo.tis != "off":
            raise ConfigError(
                f"GRPO(epochs={self.algo.epochs}, tis={self.algo.tis!r}): this backend makes one optimizer step "
                "per batch, without importance weights; use epochs=1 and tis='off' (no 'correct' staleness "
                "policy), or the torch backend",
                where="MegatronTrainBackend",
            )
        rows = sorted(batch_rows(batch), key=lambda r: len(r.ids))  # similar lengths share a micro-batch
        rewards, adv = batch_advantages(self.algo, batch)
        mask, weights, by_task, row_adv = row_tensors(rows, adv, [t.task for t in batch], self.algo.loss_agg)
        recorder = TokenRecorder(batch, rows)

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for lo, hi in micro_batches(
            [len(r.ids) for r in rows], self.algo.micro_batch_size, self.algo.micro_batch_tokens
        ):
            part, sl = rows[lo:hi], slice(lo, hi)
            ids = self._ids(part)
            w = ids.shape[1] - 1  # the micro-batch's width of next-token positions
            loss, metrics = self._micro_loss(
                part,
                ids,
                mask[sl, :w].to(self.device),
                row_adv[sl].to(self.device),
                weights[sl, :w].to(self.device),
                {t: x[sl, :w] for t, x in by_task.items()},
                recorder,
            )
            loss.backward()  # weights sum to 1 over the batch: accumulation is exact
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        grad_norm = self._clip_grads(self.algo.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.model.eval()
        self.version += 1
        sums.update(recorder.metrics())
        out: dict[str, Any] = step_metrics(
            sums,
            grad_norm=grad_norm,
            rewards=rewards,
            adv=adv,
            num_trajectories=len(batch),
            num_rows=len(rows),
            num_tokens=float(mask.sum()),
            step_s=time.perf_counter() - t0,
            version=self.version,
            response_length=mean_response_length(batch),
            task_response_length=mean_response_length(batch, by_task=True),
        )
        out["token_records"] = recorder.records(adv, self.version - 1)
        return out

    def _micro_loss(
        self,
        part: list[Row],
        ids: torch.Tensor,
        m: torch.Tensor,
        adv: torch.Tensor,
        weights: torch.Tensor,
        task_w: dict[str, torch.Tensor],
        recorder: TokenRecorder,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The GRPO loss of the micro-batch ``part`` (``ids`` [b, L]); ``m``, ``adv``, ``weights``
        and ``task_w`` are its rows' trained-token mask [b, L-1], advantages [b] and loss weights;
        ``recorder`` takes the per-token figures."""
        import torch

        # The entropy is always measured; with no bonus, without grad (the update is unchanged).
        new_lp, entropy = self._token_logprobs(self.model, ids, with_entropy=self.algo.entropy_coef > 0, entropy_mask=m)
        recorder.add(part, new_lp, entropy, weights)
        old = torch.full((len(part), ids.shape[1]), math.nan)
        for i, r in enumerate(part):
            old[i, : len(r.ids)] = torch.tensor(r.old_logprobs)
        old = old[:, 1:].to(self.device)
        old = torch.where(torch.isnan(old), new_lp.detach(), old)
        ref_lp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_lp = self._token_logprobs(self.reference, ids)[0]
        return grpo_loss(
            new_lp,
            old,
            adv,
            m,
            clip_eps=self.algo.clip_eps,
            clip_eps_high=self.algo.clip_eps_high,
            weights=weights,
            ref_logprobs=ref_lp,
            kl_coef=self.algo.kl_coef,
            entropy=entropy,
            entropy_coef=self.algo.entropy_coef,
            task_weights=task_w,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole-model weights in HF naming, as CPU tensors (gathered over TP; every rank gets them)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        local = {k: v.detach() for k, v in self.model.named_parameters()}
        if self.tp == 1:
            shards = [local]
        else:
            group = ps.get_tensor_model_parallel_group()
            shards = [{} for _ in range(self.tp)]
            for k, v in local.items():
                parts = [torch.empty_like(v) for _ in range(self.tp)]
                dist.all_gather(parts, v.contiguous(), group=group)
                for s, t in zip(shards, parts, strict=True):
                    s[k] = t
        hf = megatron_to_hf(shards, **self._dims())
        return {k: v.to("cpu", copy=True) for k, v in hf.items()}

    # -- probes and checkpoints ---------------------------------------------------------
    def logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Logprobs of ``response_ids`` after ``prompt_ids`` under the current weights, shape [R]."""
        import torch

        if not prompt_ids:
            raise ConfigError("logprobs needs a non-empty prompt")
        self.model.eval()
        with torch.no_grad():
            ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.device)
            lp, _ = self._token_logprobs(self.model, ids)
        return lp[0, len(prompt_ids) - 1 :].tolist()

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> Path:
        """Save a servable HF dir under ``model/`` (TP rank 0) and each rank's optimizer and RNG."""
        import torch
        from megatron.core import parallel_state as ps
        from transformers import AutoModelForCausalLM

        d, rank = Path(directory), ps.get_tensor_model_parallel_rank()
        (d / "model").mkdir(parents=True, exist_ok=True)
        hf = self.state_dict()  # collective: every rank takes part
        if rank == 0:
            model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
            model.load_state_dict(hf)
            model.save_pretrained(d / "model")
            self.tokenizer.save_pretrained(d / "model")
        state = {
            "version": self.version,
            "optimizer": self.optimizer.state_dict(),
            "algo": self.algo.to_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "reference": None if self.reference is None else self.reference.state_dict(),
        }
        # Written last and atomically: its presence marks a complete checkpoint of this rank.
        name = _STATE_FILE if self.tp == 1 else f"trainer-tp{rank}.pt"
        torch.save(state, d / (name + ".tmp"))
        os.replace(d / (name + ".tmp"), d / name)
        log.info("saved megatron trainer checkpoint version %d to %s", self.version, d)
        return d

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same architecture and tp required)."""
        import torch
        from megatron.core import parallel_state as ps
        from safetensors.torch import load_file

        d = Path(directory)
        name = _STATE_FILE if self.tp == 1 else f"trainer-tp{ps.get_tensor_model_parallel_rank()}.pt"
        if not (d / name).is_file():
            raise StateError(f"{str(d)!r} holds no complete trainer checkpoint ({name} missing)")
        state = torch.load(d / name, map_location="cpu", weights_only=True)
        hf: dict[str, Any] = {}
        for f in sorted((d / "model").glob("*.safetensors")):
            hf.update(load_file(str(f)))
        self._load_hf(hf)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.reference is not None and state.get("reference") is not None:
            self.reference.load_state_dict(state["reference"])
        self.version = int(state["version"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

    # -- internals ----------------------------------------------------------------------
    def _dims(self) -> dict[str, int]:
        c = self.hf_config
        return {"layers": c.num_hidden_layers, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads}

    def _init_parallel(self, tp: int) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        cuda = self.device.type == "cuda"
        if cuda:  # before NCCL starts: its communicator binds to the current device
            index = self.device.index
            torch.cuda.set_device(index if index is not None else int(os.environ.get("LOCAL_RANK", 0)))
        if not dist.is_initialized():
            if "RANK" in os.environ:  # launched by torchrun / a Ray worker group
                dist.init_process_group("nccl" if cuda else "gloo")
            elif tp == 1:  # a lone trainer process: a world of one
                # An in-memory store: a TCPStore would listen on every interface, unauthenticated.
                dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
            else:
                raise ConfigError(
                    f"tp={tp} needs {tp} processes with torch.distributed env (RANK, WORLD_SIZE, "
                    "MASTER_ADDR, MASTER_PORT); launch with torchrun or a Ray worker group"
                )
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
        elif ps.get_tensor_model_parallel_world_size() != tp:
            raise ConfigError(
                f"megatron is already initialised with tp={ps.get_tensor_model_parallel_world_size()}, "
                f"not {tp}; one process hosts one parallel layout"
            )
        if cuda:
            model_parallel_cuda_manual_seed(self.seed)

    def _build_model(self) -> Any:
        import torch
        import torch.nn.functional as F
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        c = self.hf_config
        rope = getattr(c, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        config = TransformerConfig(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_key_value_heads,
            kv_channels=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            layernorm_epsilon=c.rms_norm_eps,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=self.tp,
            params_dtype=torch.float32,  # float32 like TorchTrainBackend: the logprobs match HF's
            use_cpu_initialization=self.device.type == "cpu",
            perform_initialization=False,  # HF weights are loaded right after
            # No fused kernels: they need CUDA extensions and some alter numerics.
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
        )
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=c.vocab_size,
            max_sequence_length=c.max_position_embeddings,
            parallel_output=True,
            share_embeddings_and_output_weights=bool(getattr(c, "tie_word_embeddings", False)),
            position_embedding_type="rope",
            rotary_base=theta,
        )
        return model.to(self.device).eval()

    def _load_hf(self, hf: dict[str, Any]) -> None:
        import torch
        from megatron.core import parallel_state as ps

        shard = hf_to_megatron(hf, tp=self.tp, rank=ps.get_tensor_model_parallel_rank(), **self._dims())
        params = dict(self.model.named_parameters())
        missing, unexpected = sorted(set(params) - set(shard)), sorted(set(shard) - set(params))
        wrong = [k for k in params.keys() & shard.keys() if params[k].shape != shard[k].shape]
        if missing or unexpected or wrong:
            raise ConfigError(
                f"HF weights of {self.ref.path!r} do not map onto the megatron model "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong[:5]})"
            )
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(shard[k].to(dtype=p.dtype, device=p.device))

    def _ids(self, rows: list[Row]) -> torch.Tensor:
        import torch

        # Right padding: real tokens keep positions 0..L-1 and causal attention never sees pads.
        ids = torch.full((len(rows), max(len(r.ids) for r in rows)), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.ids)] = torch.tensor(r.ids)
        return ids.to(self.device)

    def _token_logprobs(
        self, model: Any, ids: Any, with_entropy: bool = False, entropy_mask: Any = None
    ) -> tuple[Any, Any]:
        """Logprob of token t given tokens < t, t = 1..L-1: shape [B, L-1], and the per-token entropy
        [B, L-1] or None: with ``with_entropy`` differentiable at every position (for an entropy
        bonus), else with ``entropy_mask`` [B, L-1] at its positions only, without grad."""
        import torch
        from megatron.core import tensor_parallel

        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device).expand_as(ids)
        # Explicit causal mask (True = hidden): megatron's default one is built on "cuda" by name.
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=ids.device), diagonal=1)[None, None]
        logits = model(input_ids=ids, position_ids=pos, attention_mask=causal)[:, :-1].float()  # [B, L-1, V/tp]
        entropy = None
        if with_entropy:
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            logp = torch.log_softmax(full, -1)
            entropy = -(logp.exp() * logp).sum(-1)
        elif entropy_mask is not None:
            entropy = self._entropy_at(logits, entropy_mask)
        # The vocab-parallel CE never materialises the full vocabulary on one rank; it edits its
        # input in place, hence the copy.
        lp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), ids[:, 1:])
        return lp, entropy

    def _entropy_at(self, logits: Any, mask: Any, chunk_tokens: int = 1024) -> Any:
        """Entropy [B, T] of vocab-parallel ``logits`` [B, T, V/tp] where ``mask`` [B, T] is set (0
        elsewhere), without grad: each rank sums over its vocabulary slice and the sums are reduced
        over TP, so no rank holds the whole vocabulary. Only trained tokens, a chunk at a time."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        out = torch.zeros(logits.shape[:2], dtype=logits.dtype, device=logits.device)
        rows, cols = (mask > 0).nonzero(as_tuple=True)
        with torch.no_grad():
            for i in range(0, rows.numel(), chunk_tokens):
                r, c = rows[i : i + chunk_tokens], cols[i : i + chunk_tokens]
                x = logits[r, c].detach()
                top = x.max(-1).values
                if group is not None:
                    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
                shifted = x - top[:, None]
                z = shifted.exp()
                sums = torch.stack([z.sum(-1), (z * shifted).sum(-1)])  # S and sum z (x - max)
                if group is not None:
                    dist.all_reduce(sums, group=group)
                out[r, c] = sums[0].log() - sums[1] / sums[0]  # H = log S - sum z (x - max) / S
        return out

    def _clip_grads(self, max_norm: float) -> float:
        """Global grad norm over TP (replicated params counted once), then clip; returns the norm."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = [p for p in self.model.parameters() if p.grad is not None]
        sq = torch.zeros((), device=self.device)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p):
                sq += p.grad.float().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(sq, group=ps.get_tensor_model_parallel_group())
        norm = float(sq.sqrt())
        if math.isfinite(max_norm) and norm > max_norm:
            for p in params:
                p.grad.mul_(max_norm / (norm + 1e-6))
        return norm
