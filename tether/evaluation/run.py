"""The evaluation run: the problems and the model loaded, whole batches sampled, verified through
the trainer's scoring path and appended to `problems.jsonl`, then the report written."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..config.sections import SMALL_MODEL_PARAMS, EnvConfig, RolloutConfig
from ..rewards.answers import answer_kind, extract_answer
from ..rewards import (
    PerExample,
    RewardFn,
    check_verdicts,
    get_reward,
    reward_options,
    score_batch,
    score_rollout,
)
from ..schema import ConfigError, from_dict
from ..tasks import TASKS, Example, stable_hash
from .data import EvalError, load_eval_data, problem_key, unique_problems
from .progress import progress
from .report import write_results

if TYPE_CHECKING:  # the rollout brings torch, which an evaluation imports only once its options are checked
    from ..rollout import RolloutBatch

from .settings import PROBLEMS_FILE, EvalOptions, EvalSettings, check_settings, default_out_dir, read_problems


def evaluate(model_path: str | Path, data_specs: Sequence[str], **options: Any) -> dict[str, Any]:
    """Sample `n` completions per problem of `data_specs`, verify them, report per source.

    Args:
        model_path: hub id or local directory (loaded with `tether.model.loading.load_model`); with an
            engine object given it only names the model in the settings.
        data_specs: `load_eval_data` specs (task:NAME[:k=v...], a JSONL/Parquet path, a hub name).
        options: the fields of `EvalOptions`, by name: n=16, ks=(1, 4, 16), temperature=0.6,
            top_p=0.95, max_new_tokens=None, out_dir=None, seed=0, batch_prompts=8, progress=True,
            reward=None, strict=True, template="boxed", limit=None, stop_strings=(), engine=None,
            device="auto", dtype="auto", threads=0.

    Returns:
        {"settings", "ks", "data", "summary": {source: metrics}, "problems": [rows]}, also
        written to out_dir/results.json and, as Markdown tables, out_dir/results.md.
    """
    opts = EvalOptions(**options)
    ks = opts.kept_ks()
    settings = EvalSettings.of(model_path, data_specs, opts)
    settings.sampling()  # bad sampling values fail here, before anything loads
    if settings.engine is not None:
        _check_engine(settings.engine)
    out = Path(opts.out_dir) if opts.out_dir is not None else default_out_dir(model_path, data_specs, settings)
    check_settings(out, settings, write=False)  # a mismatch fails before anything loads or is written
    created = not out.exists()
    try:
        return _run(out=out, settings=settings, options=opts, ks=ks, model_path=model_path, data_specs=data_specs)
    except BaseException:
        if created and out.exists() and not (out / PROBLEMS_FILE).exists():  # a failed start leaves nothing
            shutil.rmtree(out, ignore_errors=True)
        raise


def _run(
    *,
    out: Path,
    settings: EvalSettings,
    options: EvalOptions,
    ks: list[int],
    model_path: str | Path,
    data_specs: Sequence[str],
) -> dict[str, Any]:
    done = read_problems(out / PROBLEMS_FILE)
    engine = options.engine
    by_name = engine is None or isinstance(engine, str)
    tokenizer = _tokenizer_for(model_path) if by_name else getattr(engine, "tokenizer", None)
    examples = unique_problems(
        [ex for spec in data_specs for ex in load_eval_data(spec, tokenizer, settings.template, options.limit)]
    )
    todo = [ex for ex in examples if problem_key(ex) not in done]
    _set_threads(options.threads)
    if todo and by_name:
        engine = _engine_for(model_path, options.device, options.dtype, engine or "hf")
    check_settings(out, settings)
    verifiers, params = Verifiers(options.reward, settings.strict), settings.sampling()
    if todo and settings.env:
        engine = _episodes(engine, settings, verifiers)
    try:
        with (
            (out / PROBLEMS_FILE).open("a", encoding="utf-8") as f,
            progress(options.progress, len(examples), len(examples) - len(todo)) as advance,
        ):
            for start in range(0, len(todo), options.batch_prompts):
                batch = todo[start : start + options.batch_prompts]
                records = _sample_batch(engine, batch, settings, params, verifiers)
                f.write("".join(json.dumps(r) + "\n" for r in records))  # one write: a batch lands whole
                f.flush()
                done.update({(r["source"], r["id"]): r for r in records})
                advance(len(batch))
    finally:
        verifiers.close()
    return write_results(out, settings, ks, list(data_specs), [done[problem_key(ex)] for ex in examples])


# ---------------------------------------------------------------- sampling and verifying


class Verifiers:
    """Each problem's 0/1 verifier: its task's own reward, or `reward` for every problem; a named
    reward that has a `strict` option gets `strict`. `reward` is all of them as one reward
    (`rewards.PerExample`), so samples are scored as the trainer scores them (`rewards.score_rollout`)."""

    def __init__(self, reward: str | RewardFn | None, strict: bool):
        self.chosen, self.strict = reward, strict
        self.built: dict[str, Any] = {}
        self.reward = PerExample(self.pick)

    def _named(self, name: str) -> Any:
        if name not in self.built:
            self.built[name] = get_reward(name, **({"strict": self.strict} if "strict" in reward_options(name) else {}))
        return self.built[name]

    def pick(self, ex: Example) -> RewardFn:
        """The verifier of `ex`."""
        if self.chosen is None:
            return self._named(TASKS.get(ex.meta["task"]).reward)
        return self._named(self.chosen) if isinstance(self.chosen, str) else self.chosen

    def verdicts(self, scored: RolloutBatch) -> list[bool]:
        """Each sample's verdict; a score other than 0 or 1 is refused (accuracy is a verdict, `rewards.accuracy`)."""
        for ex, result in zip(scored.examples, scored.results):
            check_verdicts([result], self.pick(ex), [ex])
        return [result.score == 1.0 for result in scored.results]

    def close(self) -> None:
        """Stop the workers of the rewards built here (math-verify's)."""
        for fn in self.built.values():
            getattr(fn, "close", lambda: None)()


def _sample_batch(
    engine: Any, batch: list[Example], settings: EvalSettings, params: Any, verifiers: Verifiers
) -> list[dict[str, Any]]:
    """Generate and verify n samples for each problem of `batch`; one record per problem."""
    keys = ("\x01".join(problem_key(ex)) for ex in batch)
    batch_seed = stable_hash("\x00".join([str(settings.seed), *keys])) % 2**63
    from ..rollout import draw  # lazy: torch

    rollout = draw(engine, batch, settings.n, params, batch_seed)  # n episodes each with an environment
    scored = score_rollout(verifiers.reward, rollout, batch)  # the trainer's scoring path
    correct, lengths = verifiers.verdicts(scored), [int(x) for x in rollout.completion_lengths.tolist()]
    records = []
    for p, ex in enumerate(batch):
        rows = [i for i, q in enumerate(rollout.prompt_index) if q == p]
        if len(rows) != settings.n:
            raise RuntimeError(f"engine returned {len(rows)} samples for problem {ex.id!r}, expected {settings.n}")
        kind = answer_kind(ex)
        records.append(
            {
                "source": ex.meta["source"],
                "id": ex.id,
                "answer": ex.answer,
                "correct": [int(correct[i]) for i in rows],
                "answers": [extract_answer(rollout.completions[i], kind, lenient=not settings.strict) for i in rows],
                "lengths": [lengths[i] for i in rows],
                "finish": [rollout.finish_reasons[i] for i in rows],
                "completions": [rollout.completions[i] for i in rows],
                **(
                    {
                        "turns": [rollout.episodes[i]["transcript"] for i in rows],
                        "info": [rollout.episodes[i]["info"] for i in rows],
                    }
                    if rollout.episodes is not None
                    else {}
                ),
            }
        )
    return records


def _episodes(engine: Any, settings: EvalSettings, verifiers: Verifiers) -> Any:
    """An `EpisodeRunner` on `engine` for the settings' env section, its environments judged by each problem's
    verifier (the `judge` of an environment that takes one)."""
    from ..envs import build_runner  # lazy: torch, and a user's environment module, only for an env

    def judge(reply: str, example: Example) -> float:
        return float(score_batch(verifiers.pick(example), [reply], [example])[0].score)

    env = from_dict(EnvConfig, settings.env, "env")
    context = getattr(getattr(engine, "model", None), "config", None)
    try:
        return build_runner(
            env,
            RolloutConfig(max_new_tokens=settings.max_new_tokens),
            engine,
            engine.tokenizer,
            judge,
            getattr(context, "max_position_embeddings", None),
        )
    except ConfigError as err:
        raise EvalError(str(err)) from None


# ---------------------------------------------------------------- the model


def _tokenizer_for(model_path: str | Path) -> Any:
    """The model's tokenizer alone, so that data specs fail before a (slow) model load."""
    from ..model.loading import (
        _check_source,
        load_tokenizer,
    )  # lazy: torch, after the data specs and options are checked

    _check_source(str(model_path))  # the helpful "neither a directory nor a hub id" error
    return load_tokenizer(model_path)


def _set_threads(setting: int) -> None:
    """torch's CPU threads by the trainer's rule (`model.devices.cpu_threads`: 0 auto, -1 torch's default); the
    auto choice is said on stderr, as the trainer logs it."""
    import torch  # lazy: torch, after the data specs are checked

    from ..model.devices import cpu_threads  # lazy: torch

    threads, why = cpu_threads(setting)
    if threads:
        torch.set_num_threads(threads)
    if why:
        print(why, file=sys.stderr)


def _check_engine(name: str) -> None:
    """An unknown or uninstalled engine fails before anything is loaded or written."""
    from ..rollout import engine_problem  # lazy: torch, after the data specs and options are checked

    problem = engine_problem(name)
    if problem:
        raise EvalError(f"--engine: {problem}")


def _engine_for(model_path: str | Path, device: str, dtype: str, name: str = "hf") -> Any:
    from ..model.devices import place_model  # lazy: torch, after the data specs and options are checked
    from ..model.loading import load_model  # lazy: torch, after the data specs and options are checked
    from ..rollout import get_engine  # lazy: torch, after the data specs and options are checked

    model, tokenizer = load_model(model_path, dtype=dtype, device="cpu" if device == "auto" else device)
    if device == "auto":  # the trainer's rule: a model too small to keep a GPU busy stays on the CPU
        place_model(model, "auto", SMALL_MODEL_PARAMS, key="device", log=lambda line: print(line, file=sys.stderr))
    return get_engine(name, model=model, tokenizer=tokenizer)


__all__ = ["Verifiers", "evaluate"]
