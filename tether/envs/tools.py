"""Tools as plain Python functions, and the environment that lets the model call them.

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: numbers with + - * / and parentheses, e.g. "(12 + 30) * 7".
        '''
        ...

    env:
      tools: [mytools:calculator]        # or the built-in `calculator`

A function's type hints and docstring are its schema (`tool_schema`: the JSON-schema "function" object that
chat templates with tool support take): the first paragraph is its description, an `Args:` section describes
the parameters, an `Example:` section (a JSON object of arguments) gives one concrete call, and a parameter
without a default is required. Where the model's chat template renders tools (`apply_chat_template(...,
tools=...)` uses them), the prompt is rendered with them; where it does not (SmolLM2's, and plain-text prompts),
`plain_instructions` appends the tools and the plain-text format, taught by one concrete call of the first tool
(its `Example:`), to the first user message:

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>

That is also the call format the environment reads in both cases (Hermes/Qwen's). The result comes back as
the next turn, `<tool_response>84</tool_response>`, in the template's "tool" role where it has one.

`Tools` is the environment: a reply with calls gets their results and the episode goes on; a reply without a
call is the final answer and ends it (the task's reward scores it under `env.reward=task`). A malformed call
(not JSON, no such tool, wrong arguments) or a tool that raises does not end the episode and raises nothing:
the model reads an `error: ...` result that says what was wrong, and the call counts in `env/tool_errors`
(every call in `env/tool_calls`).
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
import typing
from typing import Any, Callable, Optional

from ..tasks import Example
from .base import Step

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
"""A tool call in a reply: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the closing tag may be
missing at the reply's end: a model turn stops on it, `CALL_END`, and the reply the environment reads is
cut before its stop string)."""
CALL_END = "</tool_call>"
"""A stop string of every model turn when the environment has tools: the call is answered at once."""

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _json_type(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin is typing.Union:  # Optional[X]: X
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {}
    if origin in (list, tuple):
        inner = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(inner[0])} if inner else {})}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    return {"type": _JSON_TYPES[origin or hint]} if (origin or hint) in _JSON_TYPES else {}


def _docstring_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    head, _, rest = doc.partition("\nArgs:")
    described: dict[str, str] = {}
    name = None
    for line in rest.splitlines():
        m = re.match(r"^\s{0,8}(\w+)\s*(\([^)]*\))?:\s*(.*)$", line)
        if m and not line.startswith(" " * 9):
            name = m.group(1)
            described[name] = m.group(3).strip()
        elif name and line.strip():
            if re.match(r"^\S", line):  # the next section (Returns:)
                break
            described[name] = f"{described[name]} {line.strip()}".strip()
    return " ".join(head.split("\n\n")[0].split()), described


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The JSON-schema "function" object of `fn` (module docstring); a ValueError names what is missing."""
    name = getattr(fn, "__name__", "")
    description, described = _docstring_parts(fn)
    if not description:
        raise ValueError(f"tool {name!r} has no docstring: its first line is the description the model reads")
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {name!r}: *args and **kwargs have no schema; name every parameter")
        if p.name not in hints:
            raise ValueError(f"tool {name!r}: parameter {p.name!r} has no type hint (the schema's type)")
        properties[p.name] = {
            **_json_type(hints[p.name]),
            **({"description": described[p.name]} if p.name in described else {}),
        }
        if p.default is p.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


_EXAMPLE_VALUES = {"string": "example", "integer": 3, "number": 2.5, "boolean": True, "array": [], "object": {}}
"""A parameter's value in a tool's example call when its docstring gives no `Example:` (by its JSON type)."""


def tool_example(fn: Callable) -> dict[str, Any]:
    """The arguments of one concrete call of `fn`: its docstring's `Example:` section (a JSON object, as in
    `calculator`'s), else a value of each required parameter's type. A ValueError names a bad example."""
    name = getattr(fn, "__name__", "")
    doc = inspect.getdoc(fn) or ""
    _, found, rest = doc.partition("\nExample:")
    properties = tool_schema(fn)["function"]["parameters"]
    if found:
        text = " ".join(line.strip() for line in rest.strip().split("\n\n")[0].splitlines())
        try:
            example = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"tool {name!r}: its docstring's Example: is not a JSON object of arguments ({err.msg})")
        unknown = set(example) - set(properties["properties"]) if isinstance(example, dict) else set()
        if not isinstance(example, dict) or unknown:
            raise ValueError(f"tool {name!r}: its docstring's Example: must be a JSON object of its arguments")
        return example
    return {k: _EXAMPLE_VALUES.get(properties["properties"][k].get("type"), "example") for k in properties["required"]}


def plain_instructions(tools: list[Callable]) -> str:
    """The plain-text tool format, appended to the first user message where the chat template has no tools. It
    teaches by one concrete call of the first tool (`tool_example`): a placeholder such as `{"name": "TOOL",
    "arguments": {...}}` was copied verbatim by SmolLM2-135M-Instruct (issue 49)."""
    first = tools[0]
    call = json.dumps({"name": first.__name__, "arguments": tool_example(first)})
    lines = ["You can use these tools:"]
    for fn in tools:
        f = tool_schema(fn)["function"]
        params = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in f["parameters"]["properties"].items())
        lines.append(f"- {f['name']}({params}): {f['description']}")
    lines += [
        "To call a tool, write the call on a line of its own and stop. For example:",
        f"<tool_call>{call}</tool_call>",
        "The result comes back in <tool_response> tags. When you have the answer, reply with it and no tool call.",
    ]
    return "\n".join(lines)


class ToolReturnError(TypeError):
    """A tool returned something other than a string: a bug in the tool, not the model's mistake (a missing
    `return` gives None, which `str()` would have made a successful call). Raised out of the environment's `step`,
    so the episode ends with a fault that names the tool and what it returned (issue 49, defect 7)."""


def tool_result(tools: dict[str, Callable], call: str) -> tuple[str, bool]:
    """(the text of one call's result, whether it was the model's error: a malformed call, an unknown tool, bad
    arguments, or the tool raising on them). Raises only `ToolReturnError`, for a tool whose result is not a
    string."""
    try:
        request = json.loads(call)
    except json.JSONDecodeError as err:
        return f'error: the tool call is not JSON ({err.msg}); write {{"name": ..., "arguments": {{...}}}}', True
    if not isinstance(request, dict) or not isinstance(request.get("name"), str):
        return 'error: a tool call is {"name": TOOL, "arguments": {...}}', True
    fn = tools.get(request["name"])
    if fn is None:
        return f"error: no tool {request['name']!r}; the tools: {', '.join(sorted(tools))}", True
    arguments = request.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return f"error: the arguments of {request['name']} must be an object, got {type(arguments).__name__}", True
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return f"error: {request['name']}: {err}", True
    try:
        result = fn(**arguments)
    except Exception as err:  # a tool's failure is the model's information, not the run's end
        return f"error: {request['name']} raised {type(err).__name__}: {err}", True
    if not isinstance(result, str):
        shown = repr(result) if len(repr(result)) <= 60 else repr(result)[:57] + "..."
        raise ToolReturnError(
            f"the tool {request['name']} returned {shown} ({type(result).__name__}), not a str: a tool returns its "
            "result as text (a function without `return` returns None)"
        )
    return result, False


class Tools:
    """The tools environment (module docstring): `Tools(tools=[fn, ...])`."""

    def __init__(self, tools: list[Callable]):
        if not tools:
            raise ValueError("the tools environment needs at least one tool (env.tools)")
        for fn in tools:
            tool_schema(fn)  # fails now, naming the tool, rather than at the first call
        self.tools = list(tools)
        self.by_name = {fn.__name__: fn for fn in tools}

    def reset(self, example: Example) -> Optional[str]:
        return None  # the task's first user message, rendered with the tools (tether.envs.episodes)

    def step(self, reply: str) -> Step:
        calls = CALL.findall(reply)
        if not calls:
            return Step(done=True, info={"tool_calls": 0, "tool_errors": 0})
        results = [tool_result(self.by_name, c.strip()) for c in calls]
        text = "\n".join(f"<tool_response>{r}</tool_response>" for r, _ in results)
        errors = sum(e for _, e in results)
        return Step(observation=text, role="tool", info={"tool_calls": len(calls), "tool_errors": errors})


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _arith(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    raise ValueError("only numbers, + - * / // % and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % and parentheses, e.g. "(12 + 30) * 7".

    Example:
        {"expression": "12 * 7"}
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _arith(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
