"""The answer a completion gives: what `tether eval` votes on (maj@k) and what a run's held-out evaluation records
per problem (`heldout.jsonl`), beside the verifier's 0/1 verdict.

Extraction follows the verifier's reading: for math, the last `\\boxed{}` (strict, the default) or, lenient, a
completion's last number when it has no box; for any other task, the stripped completion (what exact_match and
countdown compare). Recording it costs nothing and shows *what* a model answered when it was wrong.
"""

from __future__ import annotations

import re

from .simple import boxed_answers

_LATEX_NOISE = re.compile(r"\\left|\\right|\\[,;:! ]|\\displaystyle|\s+")


def normalize_math_answer(text: str) -> str:
    """A boxed answer reduced for voting: no whitespace, no `$`, no `\\left`/`\\right` or
    spacing commands, `\\dfrac`/`\\tfrac` as `\\frac`, no trailing period."""
    text = _LATEX_NOISE.sub("", text.strip().strip("$"))
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.rstrip(".")


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def extract_answer(completion: str, kind: str, lenient: bool = False) -> str | None:
    """The answer a completion gives, for majority voting; None when it gives none.

    kind "math": the content of the last `\\boxed{}`, normalised (`normalize_math_answer`); with
    `lenient` extraction (a template that asks for no box, or --lenient), a completion without a box
    votes with its last number, thousands commas dropped, as the lenient verifier reads plain text
    (the package header, departure 2). Any other kind: the stripped completion (what exact_match
    and countdown compare).
    """
    if kind == "math":
        boxes = boxed_answers(completion)
        answer = normalize_math_answer(boxes[-1]) if boxes else ""
        if not answer and lenient:
            numbers = _NUMBER.findall(completion)
            answer = numbers[-1].replace(",", "") if numbers else ""
    else:
        answer = completion.strip()
    return answer or None


def answer_kind(example) -> str:
    """The kind `extract_answer` reads: "math" for a math task's example (its answer is boxed or a number), "text"
    otherwise."""
    return "math" if example.meta.get("task") == "math" else "text"
