"""The math verification worker process (run as a script by `tether.rewards.math_verifier`),
and the answer extraction it shares with the rest of tether.

Standard library plus math-verify only, and started by file path rather than `-m`, so a
worker (re)start does not pay for importing torch through `tether/__init__`. That is also why
the `\\boxed{}` scanners live here: the worker needs them, and `tether.rewards.simple` and
`tether.evaluation` import them from here (one implementation). The worker talks to the parent
over one socket wrapped in `multiprocessing.connection.Connection`:

    parent -> worker  (sys_path, pickled verify_fn or None, strict)   once, at start
    worker -> parent  "ready" | ("error", message)
    parent -> worker  [(completion, gold), ...]                        a batch, or None to stop
    worker -> parent  (index, score, reason)                           one message per item

Scoring (`math_verify_score`), with math-verify's default options otherwise:
1. Extraction. Strict (the default): only the completion's final answer in `\\boxed{...}` is
   read, that is its last top-level box together with the boxes that only separators join to
   it (", ", "and", "\\quad": "\\boxed{1}, \\boxed{2}" is the list {1, 2}, at most
   `MAX_FINAL_BOXES` of them); a completion without a box scores 0 ("no \\boxed{} answer"), so
   "blah 2 blah" and "The answer is 2." earn nothing against gold "2", and a boxed step followed
   by prose and a later box counts only the later box. Lenient (`strict=False`, tether's only
   behaviour before strict existed): math-verify reads the whole completion, and any LaTeX or
   bare number it finds (the last, by its priorities) is the answer.
2. Normalisation, the same on the gold and on the answer text:
   - a trailing percent after a number is dropped ("28\\%", "28 %", "$28$ %", "28 percent",
     "28 pct", "62.5%" all read as the number written), so gold "28\\%" accepts 28 and
     "28 percent". Departure from math-verify, which reads "62.5%" as 0.625 but "\\boxed{28\\%}"
     only as a string: a percent answer is compared by the number written before the sign.
   - in LaTeX (the gold, a boxed answer), digits joined by commas are one number only as
     thousands groups after a non-zero lead ("1,220" = 1220, "1,234,567"); otherwise they are a
     list of answers: "1,22" is the set {1, 22}, as the datasets' golds use it ("11,13", "-2,1"
     list the solutions), never the decimal 1.22. That is math-verify's own LaTeX reading except
     for a zero lead, which it reads as a decimal ("\\boxed{0,111}" = 0.111) and tether as the
     list {0, 111}. Lenient extraction leaves other plain text to math-verify, which reads a
     comma between bare digits as a decimal comma ("The answer is 1,22" = 1.22).
3. Gold. A gold is parsed as `\\boxed{gold}` (math-verify's strongest anchor for bare LaTeX;
   on MATH-500, Minerva and OlympiadBench it self-verifies every gold), or as written when it
   already holds `\\boxed`. When that yields only strings (no mathematical object), the other
   readings are tried in turn (`$gold$` when the gold has no math delimiters, then the gold as
   written) and the first that yields an object is used. A gold's parse is cached, since G
   samples share one, except when a time limit cut it short: that one is retried by the next
   completion, and the completion in hand scores 0 with reason "timeout" (counted in
   `reward/timeouts`). (Before, the empty result was cached for the worker's life, and every
   later completion for that gold scored 0 as "did not parse".)
4. Time limits. math-verify's own limit (`INNER_TIMEOUT_S` per parse and per comparison) is
   detected by the elapsed time of the call (`_limited`), which no logging configuration can
   switch off. (Its "Timeout ..." log warning is not enough: with the `math_verify` logger at
   ERROR a gold whose parse timed out would be cached as what a weaker reading found,
   `\\frac{3}{56} + 0` as [0, '0'], and the right answer would score 0 against it.)
"""

from __future__ import annotations

import logging
import pickle
import re
import sys
import time
from collections import OrderedDict
from functools import lru_cache, partial
from itertools import product
from multiprocessing.connection import Connection
from typing import Any, Callable

INNER_TIMEOUT_S = 2  # math-verify's own (signal-based) parse / verify limits, per call
MAX_FINAL_BOXES = 64  # boxes read as one final answer (a run of 100k boxes is not an answer)
GOLD_CACHE_SIZE = 4096

_BRACE = re.compile(r"[{}]")
# What may stand between the boxes of one final answer: spacing, commas, "and", "or", math delimiters.
_BOX_SEPARATOR = re.compile(
    r"(?:\s|[,;.$~]|\\[,;:! ]|\\q?quad|\\[()\[\]]|\band\b|\bor\b|\\text\{\s*(?:and|or|,)?\s*\})*"
)
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[")  # an unescaped $, or \( or \[
_BOXED = "\\boxed{"
_PERCENT = re.compile(
    r"(?P<keep>[\d}](?:\s|\$|\\[,;:! ]|~)*)"  # a number's last character, then spacing or a closing $
    r"(?:\\%|%|\\text\{\s*(?:\\%|%|percent(?:age)?|pct)\s*\}|\\mathrm\{\s*(?:percent|pct)\s*\}"
    r"|percent(?:age)?\b|pct\b)"
)
# Digits in three-digit groups after a zero lead ("0,111"): math-verify's LaTeX reading makes them
# a decimal, tether a list (module docstring, item 2). Other comma-joined digits it already reads
# as tether does (thousands, or a set).
_ZERO_LED_GROUPS = re.compile(r"(?<![\d.,])0\d{0,2}(?:,\d{3})+(?![\d,])")


def _boxes(text: str, limit: int | None = None) -> list[tuple[int, int, bool]]:
    """(content start, content end, top level) of each closed `\\boxed{...}`, in closing order.

    One pass over the braces with a stack, so adversarial input ("\\boxed{" repeated without
    closing, deep nesting) stays linear; unclosed boxes are ignored. A box is top level when no
    other box encloses it. With `limit`, stops after that many boxes have closed.
    """
    opens: list[tuple[int, bool]] = []  # (content start, opened by "\\boxed{")
    open_boxes = 0
    found: list[tuple[int, int, bool]] = []
    for match in _BRACE.finditer(text):
        i = match.start()
        if text[i] == "{":
            is_box = i + 1 >= len(_BOXED) and text.startswith(_BOXED, i + 1 - len(_BOXED))
            opens.append((i + 1, is_box))
            open_boxes += is_box
        elif opens:
            start, is_box = opens.pop()
            if is_box:
                open_boxes -= 1
                found.append((start, i, open_boxes == 0))
                if limit is not None and len(found) == limit:
                    break
    return found


def boxed_answers(text: str, limit: int = 64) -> list[str]:
    """Contents of the `\\boxed{...}` in `text` (at most `limit`), in order, braces balanced.

    Linear in `len(text)` (see `_boxes`). When there are more than `limit` boxes, the first
    `limit` to close are kept.
    """
    return [text[start:end] for start, end, _ in sorted(_boxes(text, limit))]


def final_boxed(text: str) -> list[str]:
    """The contents of the final answer's boxes: the last top-level `\\boxed{...}` of `text`, with
    the boxes before it that only separators join to it ("\\boxed{1}, \\boxed{2}",
    "\\boxed{1} \\quad \\text{and} \\quad \\boxed{2}"); [] when there is no box.

    "\\boxed{3} is a step; so \\boxed{81}" gives ["81"]; "\\boxed{\\boxed{81}}" gives ["\\boxed{81}"].
    """
    top = sorted((start, end) for start, end, top_level in _boxes(text) if top_level)
    if not top:
        return []
    run = [top[-1]]
    for start, end in reversed(top[:-1]):
        if len(run) == MAX_FINAL_BOXES or not _BOX_SEPARATOR.fullmatch(text, end + 1, run[0][0] - len(_BOXED)):
            break
        run.insert(0, (start, end))
    return [text[start:end] for start, end in run]


def normalize_answer(text: str) -> str:
    """Answer text with a trailing percent after a number dropped, and zero-led comma groups
    spaced into a list (module docstring, item 2): "28\\%" -> "28",
    "0,111" -> "0, 111"; "1,220" and "1,22" are left to math-verify (1220 and {1, 22})."""
    text = _PERCENT.sub(lambda m: m.group("keep"), text)
    return _ZERO_LED_GROUPS.sub(lambda m: m.group().replace(",", ", "), text)


@lru_cache(maxsize=1)
def _quiet_log() -> None:
    """Keep math-verify's warnings ("Timeout during parsing: <input>", which quotes the whole and
    possibly megabyte-long input) off the terminal. They are not read: see `_limited`."""
    logger = logging.getLogger("math_verify")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False


def _limited(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    """`fn(*args, **kwargs)` under math-verify's own time limit (`INNER_TIMEOUT_S`), and whether
    that limit cut it short.

    math-verify 0.9 enforces its limit with `signal.alarm` and, on expiry, returns "no match"
    ([] from `parse`, False from `verify`), saying so only in a log warning, which a process that
    sets the `math_verify` logger to ERROR never sees (module docstring, item 4). The alarm fires
    after `INNER_TIMEOUT_S` seconds, never before, and interrupts the call at the next Python
    instruction, so a call that found nothing in at least that long was cut short, and one that
    took less was not: a test no logging configuration switches off. (A call that found something
    was not cut short, however long it took.)
    """
    _quiet_log()
    start = time.monotonic()
    result = fn(*args, **kwargs)
    return result, not result and time.monotonic() - start >= INNER_TIMEOUT_S


def _timed_parse(text: str, **options: Any) -> tuple[list, bool]:
    """math-verify's `parse` of `text`, and whether its time limit cut it short."""
    from math_verify import parse

    return _limited(parse, text, parsing_timeout=INNER_TIMEOUT_S, **options)


_GOLD_CACHE: OrderedDict[str, list] = OrderedDict()


def _has_object(parsed: list) -> bool:
    return any(not isinstance(item, str) for item in parsed)


def parse_gold(gold: str) -> tuple[list, bool]:
    """The gold's parse (module docstring, item 3), and whether a time limit cut it short.

    Cached per gold (G samples share one), unless a time limit cut it short: a parse that
    failed for lack of time is not a property of the gold, so it is never remembered.
    """
    if gold in _GOLD_CACHE:
        _GOLD_CACHE.move_to_end(gold)
        return _GOLD_CACHE[gold], False
    text = normalize_answer(gold)
    if "\\boxed" in text:
        readings = [text]
    elif _MATH_DELIMITER.search(text):
        readings = [f"\\boxed{{{text}}}", text]
    else:
        readings = [f"\\boxed{{{text}}}", f"${text}$", text]
    first: list = []
    for reading in readings:
        parsed, timed_out = _timed_parse(reading)
        if timed_out:
            return [], True
        if _has_object(parsed):
            first = parsed
            break
        first = first or parsed
    _GOLD_CACHE[gold] = first
    if len(_GOLD_CACHE) > GOLD_CACHE_SIZE:
        _GOLD_CACHE.popitem(last=False)
    return first, False


def _answer(completion: str, strict: bool) -> tuple[list, bool, str]:
    """(parsed answer, timed out, reason when there is no answer) of a completion."""
    if strict:
        boxes = [box for box in final_boxed(completion) if box.strip()]
        if not boxes:
            return [], False, "no \\boxed{} answer (strict extraction)"
        text = ", ".join(f"\\boxed{{{normalize_answer(box)}}}" for box in boxes)
    else:
        text = normalize_answer(completion)
    parsed, timed_out = _timed_parse(text)
    return parsed, timed_out, "no answer found in completion"


def math_verify_score(completion: str, gold: str, strict: bool = True) -> tuple[float, str]:
    """(1.0, "") if math-verify finds the completion's answer equal to `gold`, else (0.0, reason).

    `strict`: only the final top-level `\\boxed{}` counts (module docstring, item 1). The reason
    is "timeout" when one of math-verify's own time limits cut the work short.
    """
    from math_verify import verify

    gold_parsed, timed_out = parse_gold(gold)
    if timed_out:
        return 0.0, "timeout"
    if not gold_parsed:
        return 0.0, f"gold answer {gold[:40]!r} did not parse"
    answer, timed_out, missing = _answer(completion, strict)
    if timed_out:
        return 0.0, "timeout"
    if not answer:
        return 0.0, missing
    timed_out = False
    for g, a in product(gold_parsed, answer):  # as `verify` does on lists, one time limit per pair
        same, cut = _limited(verify, g, a, timeout_seconds=INNER_TIMEOUT_S)
        if same:
            return 1.0, ""
        timed_out = timed_out or cut
    if timed_out:
        return 0.0, "timeout"
    return 0.0, f"answer {str(answer[-1])[:40]!r} != gold {gold[:40]!r}"


def serve(conn: Connection, verify_fn: Callable[[str, str], tuple[float, str]]) -> None:
    """Answer batches until the parent sends None or goes away."""
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        for i, (completion, gold) in enumerate(batch):
            try:
                score, reason = verify_fn(completion, gold)
            except Exception as err:  # a verifier bug on odd input must not kill the worker
                score, reason = 0.0, f"verifier error: {type(err).__name__}: {str(err)[:80]}"
            conn.send((i, float(score), str(reason)))


def limit_memory(megabytes: int) -> None:
    """Cap this process's address space, so that an answer like 9^9^9^9 that sympy tries to
    build fails with MemoryError (reason "verifier error") instead of exhausting the machine."""
    if megabytes > 0:
        import resource  # lazy: POSIX only, and only when a memory cap is set

        resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    limit_memory(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    sys_path, pickled_fn, strict = conn.recv()
    sys.path[:] = sys_path
    try:
        import math_verify  # noqa: F401  (imported before "ready": its cost is not billed to an item)

        verify_fn = partial(math_verify_score, strict=strict) if pickled_fn is None else pickle.loads(pickled_fn)
    except Exception as err:  # report any start-up failure to the parent instead of dying silently
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send("ready")
    serve(conn, verify_fn)


if __name__ == "__main__":
    main()
