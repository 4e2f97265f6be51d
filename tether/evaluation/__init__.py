"""Benchmark evaluation: n samples per problem, verified, reported as avg@n, pass@k and maj@k.

For one problem with n samples of which c are judged correct by the verifier:

    avg@n  = c / n
    pass@k = 1 - C(n-c, k) / C(n, k)     the unbiased estimator of P(some of k samples is correct)
                                          (Chen et al. 2021, arXiv 2107.03374, eq. 1)
    maj@k  = 1 if the most frequent answer among the first k samples is correct, else 0
                                          (self-consistency, Wang et al. 2022, arXiv 2203.11171)

and a source's (benchmark's) value is the mean over its problems. The verifier is the one the
trainer uses (`tether.rewards`): the task's own reward for synthetic tasks, `math` (math-verify)
for math data, so an evaluation number and a training reward mean the same thing; samples are
scored by the trainer's scoring path (`rewards.score_rollout`). Math answers are extracted
strictly by default, as in training (`reward.strict`): with a template that asks for
`\\boxed{}`, only the final boxed answer counts; `strict=False` (`--lenient`) takes any answer
math-verify finds. The settings (settings.json, results.md, the printed summary) say which was
used under "extraction". Before strict extraction existed, evaluation was lenient.

Where this departs from the papers, and why:
1. pass@k is computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), Chen et al.'s numerically stable
   form, rather than from binomials, which overflow floats for n in the hundreds.
2. maj@k votes on *extracted strings* (the last `\\boxed{}` content, lightly normalised, for
   math; under lenient extraction a completion without a box votes with its last number, the
   plain-text answer the lenient verifier reads, so that a template asking for the number alone
   does not read maj@k 0.000 while avg@1 reads 0.395; the stripped completion for synthetic
   tasks), not on math-verify equivalence classes:
   "0.5" and "\\frac{1}{2}" are two different votes. Grouping by the verifier would need n^2
   verifier calls per problem. Samples without an answer do not vote; ties go to the answer
   that appeared first. The voted answer is judged by the verifier's verdict on its first
   sample, so maj@k uses exactly the verifier of avg@n and pass@k.
3. Samples are drawn in batches of `batch_prompts` problems, each batch seeded from `seed` and
   the keys of its problems. A run that is killed and resumed therefore draws the same samples
   as one that was not (whole batches are written before the next starts); a different
   `batch_prompts` draws different samples from the same distribution.

The package, by concern:
    metrics.py   pass@k, maj@k, answer extraction (per problem)
    data.py      data specs -> problems keyed by (source, id)
    settings.py  `EvalOptions` (the call's options), `EvalSettings` (exactly settings.json),
                 the output directory and resume
    run.py       `evaluate`: load, sample and verify whole batches, append, report
    report.py    per-source metrics, results.json and results.md
    progress.py  progress over problems
The `tether eval` command is `tether.evaluation.command.cmd_eval`; held-out greedy accuracy (training's
`eval/accuracy`) is `tether.rewards.greedy_accuracy`.
"""

from .data import DEFAULT_TASK_PROBLEMS, EvalError, load_eval_data
from ..rewards.answers import extract_answer, normalize_math_answer
from .metrics import maj_at_k, majority_vote, pass_at_k
from .report import problem_row, results_markdown, source_metrics, summarize, summary_markdown
from .run import evaluate
from .settings import DEFAULT_MAX_NEW_TOKENS, EvalOptions, EvalSettings, default_out_dir, read_problems

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TASK_PROBLEMS",
    "EvalError",
    "EvalOptions",
    "EvalSettings",
    "default_out_dir",
    "evaluate",
    "extract_answer",
    "load_eval_data",
    "maj_at_k",
    "majority_vote",
    "normalize_math_answer",
    "pass_at_k",
    "problem_row",
    "read_problems",
    "results_markdown",
    "source_metrics",
    "summarize",
    "summary_markdown",
]
