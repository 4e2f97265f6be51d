"""A safe evaluator for arithmetic expressions written by a model: never `eval`.

Grammar (recursive descent, left-associative, usual precedence):

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := NUMBER | "(" expr ")"
    NUMBER := "0" | [1-9][0-9]*        (no signs, exponents, decimals or leading zeros)

Arithmetic is exact (`fractions.Fraction`), so "8/3*3" is 8 and no float rounding can make a
wrong answer right. The input is bounded (length, digits per number, nesting depth), so a model
cannot make the verifier slow or blow the recursion limit; "**" and unary minus are syntax
errors. Every failure is an `ExpressionError` with a reason, which rewards turn into score 0.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

_TOKEN = re.compile(r"\s*(?:(0|[1-9][0-9]*)|([-+*/()]))")


class ExpressionError(ValueError):
    """The text is not a valid expression, or cannot be evaluated (division by zero)."""


@dataclass(frozen=True)
class Evaluated:
    """An evaluated expression: its exact value and the numbers it used, in order."""

    value: Fraction
    numbers: tuple[int, ...]


def _tokenize(text: str, max_digits: int) -> list[str]:
    tokens: list[str] = []
    pos, text = 0, text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            bad = text[pos:].lstrip()[:1]
            raise ExpressionError(f"unexpected character {bad!r} at {pos}")
        number = match.group(1)
        if number is not None and len(number) > max_digits:
            raise ExpressionError(f"number longer than {max_digits} digits at {pos}")
        tokens.append(number if number is not None else match.group(2))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[str], max_depth: int) -> None:
        self.tokens, self.pos, self.depth, self.max_depth = tokens, 0, 0, max_depth
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ExpressionError("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op, right = self.take(), self.term()
            value = value + right if op == "+" else value - right
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op, right = self.take(), self.factor()
            if op == "*":
                value = value * right
            elif right == 0:
                raise ExpressionError("division by zero")
            else:
                value = value / right
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if token.isdigit():
            self.numbers.append(int(token))
            return Fraction(int(token))
        if token != "(":
            raise ExpressionError(f"expected a number or '(', got {token!r}")
        self.depth += 1
        if self.depth > self.max_depth:
            raise ExpressionError(f"parentheses nested deeper than {self.max_depth}")
        value = self.expr()
        if self.take() != ")":
            raise ExpressionError("expected ')'")
        self.depth -= 1
        return value


def evaluate(text: str, *, max_length: int = 256, max_digits: int = 6, max_depth: int = 32) -> Evaluated:
    """Parse and evaluate `text` exactly; raises `ExpressionError` with a reason on any failure."""
    if len(text) > max_length:
        raise ExpressionError(f"expression longer than {max_length} characters")
    tokens = _tokenize(text, max_digits)
    if not tokens:
        raise ExpressionError("empty expression")
    parser = _Parser(tokens, max_depth)
    value = parser.expr()
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after a complete expression")
    return Evaluated(value, tuple(parser.numbers))


def check_countdown(text: str, numbers: list[int] | tuple[int, ...], target: int) -> tuple[bool, str]:
    """Whether `text` reaches `target` using each of `numbers` at most once.

    Returns (ok, reason); the reason says what failed ("" when ok). Never raises on `text`.
    """
    try:
        result = evaluate(text)
    except ExpressionError as err:
        return False, f"parse: {err}"
    extra = Counter(result.numbers) - Counter(numbers)
    if extra:
        return False, f"uses numbers not available: {sorted(extra.elements())}"
    if result.value != target:
        return False, f"value {result.value} != target {target}"
    return True, ""
