"""A rollout engine on vLLM, colocated with training: the same `RolloutBatch` as the `hf` engine.

vLLM is what the field samples rollouts with (TRL's `use_vllm`, verl, OpenRLHF). Here it runs in
the trainer's own process and on its device (`tether.rollout.vllm_compat` lists every vLLM
internal this touches), and fills the contract of `tether.rollout.base` the way `hf` does:

  1. token ids: prompts go in as tether's own token ids and completions come back as ids, so the
     trainer's tokenisation is the only one; texts are decoded by `completion_texts`, the `hf`
     engine's function (stop token dropped, cut before a stop string);
  2. `sampler_logprobs`: vLLM's `processed_logprobs`, the log-prob of each sampled token after
     temperature and top-p, i.e. under the distribution it was drawn from (`hf`'s definition;
     greedy: the unscaled model's log-softmax, as in `hf`);
  3. stopping: eos, the model's generation-config eos ids and `stop_token_ids` are passed as
     vLLM stop ids, stop strings as vLLM stop strings; the token that ended generation stays in
     the completion with mask True, finish reason "stop"; `max_new_tokens` is vLLM's `max_tokens`;
  4. seeds: row j of a call with seed s samples with vLLM's per-request seed `s * 1_000_003 + j`
     (mod 2**63), so the same seed gives the same tokens whatever else is in the batch; seed None
     leaves vLLM's own stream (not reproducible).

Weights: the engine starts with random weights (`load_format="dummy"`: only the config and the
tokenizer are written, to a temporary directory, since vLLM loads a model by path; a tied model's
config untied, `vllm_compat` item 6), pushes the policy's at once, refusing to start when any
layer's did not load, and, before every `generate`, pushes the live policy's weights if any parameter changed in place
since the last
push (tracked by torch's per-tensor version counters, so an optimiser step, a `load_state_dict` or
a LoRA update is seen and an unchanged model costs nothing). Under LoRA the pushed weights are
the merged ones, W + scale * B A, computed without touching the trained model. A resumed run
builds a new engine from the model loaded from the checkpoint, and so samples from it.

Departures from the `hf` engine, and why:
  1. Different random streams: vLLM draws with its own sampler (exponential race per request
     generator), so for one seed `vllm` and `hf` sample different tokens from the same
     distribution. Same-seed runs of `vllm` reproduce each other on one machine; they are not
     bitwise equal to `hf` runs.
  2. Log-probs are vLLM's kernels' (float32 on CPU: about 1e-6 from the trainer's teacher-forced
     ones; bf16 on a GPU: the usual train-inference mismatch, which `objective.rollout_correction`
     and the `mismatch/*` metrics exist for).
  3. `compile`: "auto" runs vLLM eagerly on a CPU and with its compiled CUDA graphs on CUDA;
     True compiles everywhere, False never (`enforce_eager`).
  4. Precision: vLLM runs in the policy's parameter dtype (float32 master weights: float32), with
     the trainer's autocast switched off around it; on a GPU that is exact but slower than bf16
     sampling (not measured: no GPU was lent to the session that wrote this).
"""

from __future__ import annotations

import copy
import gc
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Literal

import torch

from . import vllm_compat
from .base import TRUNCATED, FinishReason, RolloutBatch, SamplingParams
from .hf import PromptsOrIds, _eos_ids, completion_texts


def request_seed(seed: int, row: int) -> int:
    """vLLM's per-request seed for row `row` of a call seeded `seed` (module docstring, 4)."""
    return (seed * 1_000_003 + row) % 2**63


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under Hugging Face names, with LoRA adapters merged in.

    A peft LoRA layer (`base_layer` plus `lora_A`/`lora_B`) yields `<name>.weight` =
    base weight + its delta weight (peft's `get_delta_weight`: scale * B A); the adapters' own
    parameters are not yielded, and `.base_layer.` leaves the other names. Plain models: their
    `named_parameters`, unchanged, a tied weight under each of its names. Detached: nothing here joins the autograd
    graph.
    """
    merged: set[str] = set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
                weight = module.base_layer.weight
                for adapter in module.active_adapters:
                    if adapter in getattr(module, "lora_A", {}):
                        weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
                merged.add(f"{name}.base_layer.weight")
                yield f"{name}.weight", weight.detach()
        # remove_duplicate=False: a tied output layer is yielded under its own name too (`lm_head.weight`),
        # which the engine's untied copy of the model loads (vllm_compat item 6)
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in merged or ".lora_" in name:
                continue
            yield name.replace(".base_layer.", "."), param.detach()


def _fingerprint(model: torch.nn.Module) -> tuple:
    """What changes when any parameter is replaced or written in place (torch's version counters)."""
    return tuple((id(p), p.data_ptr(), p._version) for p in model.parameters())


class VLLMEngine(PromptsOrIds):
    """Batched sampling with an in-process vLLM engine that follows the live policy (module docstring).

    Args:
        model: the policy (a Hugging Face causal LM; under LoRA the peft-wrapped base model).
        tokenizer: its tokenizer, with a pad token (`tether.model.loading.prepare_tokenizer`).
        compile: "auto" (CUDA graphs on CUDA, eager elsewhere), True or False (module docstring).
        add_special_tokens: passed to the tokenizer when encoding prompts.
        max_model_len: the longest prompt + completion the engine serves; None: the model's
            `max_position_embeddings`, at most 4096.
        kv_cache_bytes: memory for vLLM's KV cache (CPU or GPU); the default is
            `rollout.vllm_kv_cache_mb`'s, 1 GiB (23k tokens of SmolLM2-135M in float32).
        gpu_memory_utilization: vLLM's share of the GPU it may assume (on CUDA: training shares it).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        compile: bool | Literal["auto"] = "auto",
        add_special_tokens: bool = False,
        max_model_len: int | None = None,
        kv_cache_bytes: int = 1024 << 20,
        gpu_memory_utilization: float = 0.3,
    ):
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer has no pad token; load it with tether.model.loading.load_model or set one")
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be true, false or 'auto', got {compile!r}")
        self.model, self.tokenizer, self.add_special_tokens = model, tokenizer, add_special_tokens
        config = model.config
        self.max_model_len = max_model_len or min(getattr(config, "max_position_embeddings", 4096), 4096)
        dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        eager = not compile if compile != "auto" else self.device.type != "cuda"
        self._dir = tempfile.TemporaryDirectory(prefix="tether-vllm-")  # removed with the engine
        if getattr(config, "tie_word_embeddings", False):  # vllm_compat item 6: vLLM's copy is untied
            config = copy.deepcopy(config)
            config.tie_word_embeddings = False
        config.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)
        tic = time.perf_counter()
        self.llm = vllm_compat.make_llm(
            Path(self._dir.name),
            dtype=dtype,
            enforce_eager=eager,
            max_model_len=self.max_model_len,
            kv_cache_memory_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        self.start_seconds = time.perf_counter() - tic
        self.eager = eager
        self._pushed: tuple | None = None
        self.sync_seconds = 0.0  # the last weight push's time (0 when none was needed)
        try:
            self.sync_weights()  # now: an engine whose weights do not all load never starts
        except RuntimeError:
            # shut vLLM down here, not whenever the garbage collector finds it: its teardown resets
            # process-wide parallel state that a later engine in this process relies on
            self.llm = None
            gc.collect()
            raise

    missing_reason = staticmethod(vllm_compat.missing_reason)

    def decode_path(self, device: torch.device) -> str:
        """One line saying how `generate` samples (for a log)."""
        mode = "eager" if self.eager else "compiled, CUDA graphs"
        return f"vLLM in-process engine ({mode}; started in {self.start_seconds:.1f} s)"

    def sync_weights(self, force: bool = False) -> bool:
        """Push the policy's current weights into the engine if they changed; True when pushed."""
        fingerprint = _fingerprint(self.model)
        if fingerprint == self._pushed and not force:
            self.sync_seconds = 0.0
            return False
        tic = time.perf_counter()
        with vllm_compat.preserved_process_state():
            failed = vllm_compat.push_weights(self.llm, policy_weights(self.model))
        if failed:
            raise RuntimeError(
                f"vLLM engine: the policy's weights did not load into {', '.join(sorted(set(failed)))} (vLLM's reload "
                f"skipped them), so it would sample from their old or random values; not sampling. This model's "
                f"architecture ({type(self.model).__name__}) needs support in tether/rollout/vllm_compat.py; "
                "use rollout.engine=hf meanwhile"
            )
        self._pushed, self.sync_seconds = fingerprint, time.perf_counter() - tic
        return True

    def _sample(
        self, rows: list[list[int]], prompt_index: list[int], params: SamplingParams, seed: int | None
    ) -> RolloutBatch:
        longest = max(len(e) for e in rows) + params.max_new_tokens
        if longest > self.max_model_len:
            raise ValueError(
                f"a prompt of {longest - params.max_new_tokens} tokens + max_new_tokens "
                f"{params.max_new_tokens} exceeds the vLLM engine's max_model_len {self.max_model_len}; "
                "shorten the prompts or max_new_tokens, or build the engine with a larger max_model_len"
            )
        self.sync_weights()
        stop_ids = _eos_ids(self.model, self.tokenizer, params.stop_token_ids)
        requests = [
            vllm_compat.sampling_params(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                max_tokens=params.max_new_tokens,
                stop=list(params.stop_strings),
                stop_token_ids=stop_ids,
                logprobs=0,
                skip_special_tokens=True,
                seed=None if seed is None else request_seed(seed, j),
            )
            for j in range(len(rows))
        ]
        # the trainer samples under its bf16 autocast on CUDA; vLLM runs its own kernels in its own dtype
        with (
            vllm_compat.preserved_process_state(),
            torch.autocast("cuda", enabled=False),
            torch.autocast("cpu", enabled=False),
        ):
            outputs = self.llm.generate([{"prompt_token_ids": r} for r in rows], requests, use_tqdm=False)
        return self._assemble(rows, prompt_index, [o.outputs[0] for o in outputs], set(stop_ids), params)

    def _assemble(
        self,
        rows: list[list[int]],
        prompt_index: list[int],
        outs: list[Any],
        stop_ids: set[int],
        params: SamplingParams,
    ) -> RolloutBatch:
        pad = self.tokenizer.pad_token_id
        ids = [list(o.token_ids) for o in outs]
        lengths = [len(i) for i in ids]
        width = max(lengths)
        completion_ids = torch.full((len(ids), width), pad, dtype=torch.long)  # (N, T)
        logprobs = torch.zeros((len(ids), width), dtype=torch.float32)  # (N, T)
        for row, (tokens, out) in enumerate(zip(ids, outs)):
            completion_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[row, : len(tokens)] = torch.tensor(
                [step[token].logprob for token, step in zip(tokens, out.logprobs)], dtype=torch.float32
            )
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (N, T)
        stopped = [o.finish_reason == "stop" for o in outs]
        reasons: list[FinishReason] = ["stop" if s else TRUNCATED for s in stopped]
        completions = completion_texts(self.tokenizer, ids, lengths, stopped, stop_ids, params.stop_strings)
        return RolloutBatch(
            prompt_ids=[list(r) for r in rows],
            completion_ids=completion_ids.to(self.device),
            sampler_logprobs=logprobs.to(self.device),
            mask=mask.to(self.device),
            finish_reasons=reasons,
            completions=completions,
            prompt_index=prompt_index,
        )
