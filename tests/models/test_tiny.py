"""tiny_qwen builds a real, loadable, vLLM-compatible model directory."""

import json

import pytest
import torch

from rollart_nb.errors import ConfigError
from rollart_nb.models import ModelRef, format_history, from_pretrained, tiny_qwen


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return tiny_qwen(seed=0, path=str(tmp_path_factory.mktemp("m") / "tiny"))


def test_shapes_fit_vllm(ref):
    tok, model = ref.load_tokenizer(), ref.load_model()
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    assert cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    assert 0.5e6 < ref.params < 2e6 and ref.params == sum(p.numel() for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize(
    "text",
    ["what is 12+3? answer: <answer>15</answer>", "hello world\nleft  right", "You fell into a hole #_@ (x)"],
)
def test_tokenizer_round_trip(ref, text):
    tok = ref.load_tokenizer()
    ids = tok.encode(text)
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_digits_are_single_tokens_and_known_words_whole(ref):
    tok = ref.load_tokenizer()
    assert tok.convert_ids_to_tokens(tok.encode("12 left")) == ["1", "2", " ", "left"]
    assert tok.convert_ids_to_tokens(tok.encode("<answer>7</answer>")) == ["<answer>", "7", "</answer>"]


def test_prompt_format_markers_swallow_spaces(ref):
    tok = ref.load_tokenizer()
    text = format_history([("say 3", "3"), ("again", None)])
    assert text == "<|user|> say 3 <|assistant|> 3 <eos> <|user|> again <|assistant|>"
    toks = tok.convert_ids_to_tokens(tok.encode(text))
    assert toks[:6] == ["<|user|>", "say", " ", "3", "<|assistant|>", "3"]
    assert toks[6] == "<eos>" and toks[-1] == "<|assistant|>"
    assert tok.decode(tok.encode("3 <eos>"), skip_special_tokens=True) == "3"


def test_same_args_reuse_and_same_weights(ref, tmp_path):
    again = tiny_qwen(seed=0, path=ref.path)
    assert again == ref
    other = tiny_qwen(seed=0, path=str(tmp_path / "copy"))
    a, b = ref.load_model().state_dict(), other.load_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = tiny_qwen(seed=1, path=str(tmp_path / "seed1")).load_model().state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_default_cache_dir_is_keyed_by_args(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLART_NB_CACHE", str(tmp_path))
    r1 = tiny_qwen(seed=3)
    assert r1.path.startswith(str(tmp_path)) and tiny_qwen(seed=3).path == r1.path
    r2 = tiny_qwen(seed=3, task_vocab=["north", "->"])
    assert r2.path != r1.path
    tok = r2.load_tokenizer()
    assert tok.convert_ids_to_tokens(tok.encode("go north->")) == ["go", " ", "north", "->"]
    assert r2.load_model().config.vocab_size == len(tok)


def test_medium_size(tmp_path):
    ref = tiny_qwen(size="m", path=str(tmp_path / "m"))
    assert 3e6 < ref.params < 7e6
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32


def test_bad_args_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="size"):
        tiny_qwen(size="xl")
    with pytest.raises(ConfigError, match="task_vocab"):
        tiny_qwen(task_vocab=["", "##x"], path=str(tmp_path / "bad"))
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a tiny_qwen"):
        tiny_qwen(path=str(tmp_path / "foreign"))
    assert (tmp_path / "foreign" / "x.txt").read_text() == "mine"


def test_from_pretrained(ref, tmp_path):
    got = from_pretrained(ref.path)
    assert isinstance(got, ModelRef) and got.params == ref.params and got.path == ref.path
    # A user dir without our metadata: params from safetensors headers.
    model = ref.load_model()
    model.save_pretrained(tmp_path / "user")
    ref.load_tokenizer().save_pretrained(tmp_path / "user")
    user = from_pretrained(tmp_path / "user")
    assert user.name == "user" and user.params == ref.params and user.seed is None
    with pytest.raises(ConfigError, match="config.json"):
        from_pretrained(tmp_path / "nothing")
