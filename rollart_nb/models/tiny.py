"""Real, tiny causal LMs built locally (no hub access): a word-level tokenizer plus a
randomly initialised Qwen2-style model, saved as an ordinary Hugging Face directory.

The directory loads with ``transformers`` (:class:`~rollart_nb.backends.hf.HFBackend`,
:class:`~rollart_nb.backends.torch_train.TorchTrainBackend`) and with vLLM, which is why
``head_dim >= 32`` and ``vocab_size == len(tokenizer)`` hold for every size.

Prompt format (see :func:`format_history`)::

    <|user|> {obs} <|assistant|> {action} <eos> <|user|> {obs} <|assistant|>

The chat markers and ``<eos>`` swallow the spaces around them, so the model's response
starts right at the action and ``decode`` of a response gives the bare action text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import string
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart_nb.errors import ConfigError

__all__ = ["ModelRef", "format_history", "from_pretrained", "tiny_qwen"]

log = logging.getLogger(__name__)

# Bump when the vocabulary or architecture recipe changes: it is part of the cache key.
_RECIPE = 2
_META = "rollart_nb.json"

PAD, EOS, UNK, USER, ASSISTANT = "<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"
# Chat markers are special (dropped by ``skip_special_tokens``); answer tags are not,
# because rewards parse them from the decoded text.
SPECIAL_TOKENS = [PAD, EOS, UNK, USER, ASSISTANT]
ANSWER_TAGS = ["<answer>", "</answer>"]

_WORDS = """
answer the a an is are you your at to of in on and or not what which how many say compute
solve move go step steps action actions valid invalid left right up down goal hole frozen
lake grid map position row col column start reached fell into done yes no true false
reward player agent tile tiles ice safe water plus minus times equals result number
think final please output only one word letter digit hello world again
You The What Answer Move Invalid Goal Hole
""".split()
# Operators, punctuation and FrozenLake glyphs: one token each.
_SYMBOLS = list("+-*/=,.:;!?()[]{}<>#_@|'\"%&^~$") + ["\n", " ", "\t"]
_DIGITS = list(string.digits)
_LETTERS = list(string.ascii_letters)

# (hidden, layers, heads, kv_heads, intermediate); head_dim = hidden // heads = 32.
_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "s": (128, 5, 4, 2, 384),  # ~1M parameters
    "m": (256, 6, 8, 4, 768),  # ~5M parameters
}


@dataclass(frozen=True)
class ModelRef:
    """A pointer to a Hugging Face model directory (cheap to pickle through Ray).

    Attributes:
        path: directory holding ``config.json``, weights and tokenizer files.
        name: short human name, e.g. ``"tiny-qwen-s"``.
        params: parameter count (0 when unknown).
        seed: init seed for built models (None for user models).

    Example:
        >>> ref = tiny_qwen(seed=0)            # doctest: +SKIP
        >>> tok, model = ref.load_tokenizer(), ref.load_model()  # doctest: +SKIP
    """

    path: str
    name: str
    params: int = 0
    seed: int | None = None

    def load_tokenizer(self) -> Any:
        """Load the tokenizer (a ``PreTrainedTokenizerFast``).

        Not ``AutoTokenizer``: transformers 5 maps ``model_type: qwen2`` to the Qwen2 BPE
        tokenizer class and would silently rebuild our word-level vocabulary as something else.
        """
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(self.path)

    def load_model(self, dtype: Any = None, device: Any = None) -> Any:
        """Load the causal LM in ``dtype`` (default float32), in eval mode."""
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype or torch.float32)
        if device is not None:
            model = model.to(device)
        return model.eval()


def format_history(turns: Iterable[tuple[str, str | None]]) -> str:
    """Render ``(observation, action)`` pairs as one prompt string.

    Completed turns render as ``<|user|> obs <|assistant|> action <eos>``; a final turn whose
    action is ``None`` ends with ``<|assistant|>`` so the model continues with its action.

    Example:
        >>> format_history([("say 3", "3"), ("again", None)])
        '<|user|> say 3 <|assistant|> 3 <eos> <|user|> again <|assistant|>'
    """
    parts: list[str] = []
    for obs, action in turns:
        parts.append(f"{USER} {obs} {ASSISTANT}")
        if action is not None:
            parts.append(f"{action} {EOS}")
    return " ".join(parts)


def _vocab(task_vocab: Sequence[str] | None) -> list[str]:
    """Ordered, de-duplicated token list; letters also get ``##`` continuation forms so that
    any ASCII word tokenizes (whole word when known, letter by letter otherwise)."""
    tokens = SPECIAL_TOKENS + ANSWER_TAGS + _SYMBOLS + _DIGITS + _LETTERS
    tokens += ["##" + c for c in _LETTERS] + _WORDS + list(task_vocab or [])
    seen: dict[str, None] = {}
    for t in tokens:
        seen.setdefault(t, None)
    return list(seen)


def build_tokenizer(task_vocab: Sequence[str] | None = None) -> Any:
    """Build the word-level ``PreTrainedTokenizerFast`` (not saved)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bad = [w for w in task_vocab or [] if not isinstance(w, str) or not w or w.startswith("##")]
    if bad:
        raise ConfigError(f"task_vocab entries must be non-empty strings not starting with '##': {bad!r}")
    vocab = {tok: i for i, tok in enumerate(_vocab(task_vocab))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token=UNK, max_input_chars_per_word=100))
    # Every whitespace char, digit, symbol and letter run is its own piece, so decoding is a
    # plain concatenation and text round-trips exactly.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s|\d|[A-Za-z]+|[^\sA-Za-z\d]"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("##", ""), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, lstrip=True, rstrip=True) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ANSWER_TAGS])
    extra = [t for t in task_vocab or [] if not t.isalpha() and len(t) > 1]
    if extra:  # multi-char symbolic task words ("->", "==") must match before splitting
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=None,
        model_max_length=4096,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def _portable_tokenizer_config(file: Path) -> None:
    # transformers 5 writes "TokenizersBackend", a class transformers 4.x (and so older vLLM)
    # does not know; "PreTrainedTokenizerFast" names the same thing in both.
    cfg = json.loads(file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    file.write_text(json.dumps(cfg, indent=2))


def _cache_dir(key: dict[str, Any]) -> Path:
    root = Path(os.environ.get("ROLLART_NB_CACHE", Path.home() / ".cache" / "rollart_nb")) / "models"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"tiny-qwen-{key['size']}-{digest}"


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / _META).read_text())
    except (OSError, ValueError):
        return None


def tiny_qwen(
    task_vocab: list[str] | None = None,
    size: str = "s",
    seed: int = 0,
    path: str | None = None,
    init_std: float | None = None,
) -> ModelRef:
    """Build (or reuse) a tiny random-init Qwen2 causal LM and its word-level tokenizer.

    Args:
        task_vocab: extra whole-word tokens for a task (e.g. ``["north", "south"]``).
        size: ``"s"`` (~1M parameters) or ``"m"`` (~5M).
        seed: ``torch.manual_seed`` for the random init; same args give the same weights.
        path: where to save; default is a cache dir keyed by the arguments, reused if built.
        init_std: std of the normal init of every weight matrix and the embedding. Default
            ``1 / sqrt(hidden)``: 0.02 leaves a 128-wide model nearly blind to its prompt.

    Returns:
        A :class:`ModelRef` to the saved directory.

    Example:
        >>> ref = tiny_qwen(seed=0)  # doctest: +SKIP
        >>> ref.params > 500_000     # doctest: +SKIP
        True
    """
    if size not in _SIZES:
        raise ConfigError(f"unknown tiny_qwen size {size!r}; choose one of {sorted(_SIZES)}")
    hidden, layers, heads, kv_heads, inter = _SIZES[size]
    std = hidden**-0.5 if init_std is None else float(init_std)
    if not 0 < std < 1:
        raise ConfigError(f"init_std must be in (0, 1), got {init_std!r}")
    key = {
        "recipe": _RECIPE,
        "size": size,
        "seed": int(seed),
        "task_vocab": list(task_vocab or []),
        "init_std": round(std, 6),
    }
    target = Path(path) if path is not None else _cache_dir(key)
    meta = _read_meta(target)
    if meta is not None and meta.get("key") == key:
        return ModelRef(str(target), meta["name"], meta["params"], seed)

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(task_vocab)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=std,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=["Qwen2ForCausalLM"],
    )
    # fork_rng: building a model must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.eos_token_id
    params = sum(p.numel() for p in model.parameters())
    name = f"tiny-qwen-{size}"

    _save_atomically(target, key, model, tokenizer, name, params)
    log.info("built %s (%d params) at %s", name, params, target)
    return ModelRef(str(target), name, params, seed)


def _save_atomically(target: Path, key: dict[str, Any], model: Any, tokenizer: Any, name: str, params: int) -> None:
    """Save a built model and its tokenizer at ``target`` (a ConfigError if it holds something else).

    Saved into a temp dir, then renamed: concurrent builders (several Ray workers) never see a
    half-written model, and the loser of the race just discards its copy.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_config(tmp / "tokenizer_config.json")
        (tmp / _META).write_text(json.dumps({"key": key, "name": name, "params": params}))
        old = _read_meta(target)
        if target.exists() and old is None and any(target.iterdir()):
            raise ConfigError(f"path {str(target)!r} exists and is not a tiny_qwen model dir; pick another path")
        if old is not None and old.get("key") != key:  # our own older build with other args
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists() and old is None:
            target.rmdir()
        try:
            os.replace(tmp, target)
        except OSError:
            if (_read_meta(target) or {}).get("key") != key:
                raise
            # Lost the race to an identical concurrent build: keep theirs.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def from_pretrained(path: str | os.PathLike[str], name: str | None = None) -> ModelRef:
    """Wrap a user's own Hugging Face model directory as a :class:`ModelRef`.

    The parameter count is read from safetensors headers when present (no weights loaded).
    """
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{str(p)!r} is not a Hugging Face model dir (no config.json)")
    meta = _read_meta(p)
    if meta is not None:
        return ModelRef(str(p), name or meta["name"], meta["params"], meta.get("key", {}).get("seed"))
    params = 0
    try:
        from safetensors import safe_open

        for f in sorted(p.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    n = 1
                    for d in st.get_slice(k).get_shape():
                        n *= d
                    params += n
    except Exception as e:  # a count is a nicety; an odd file must not block loading
        log.debug("could not count parameters of %s: %s", p, e)
    return ModelRef(str(p), name or p.name, params, None)
