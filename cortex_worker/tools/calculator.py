"""Safe arithmetic: `evaluate("sqrt(2) * (3 + 4)")`, walking the `ast`, never `eval`."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from cortex_worker.tools.errors import ToolError

MAX_LENGTH = 1000
MAX_INT_BITS = 4096
"""Integer results above about 10**1233 are refused (9**9**9 would take minutes)."""

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "log": math.log,
    "log10": math.log10,
    "log2": math.log2,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "floor": math.floor,
    "ceil": math.ceil,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; ToolError says what is not allowed."""
    if len(expression) > MAX_LENGTH:
        raise ToolError(f"expression too long ({len(expression)} characters, at most {MAX_LENGTH})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"invalid expression: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise ToolError("invalid expression: too deeply nested") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("result too large") from None
    except RecursionError:
        raise ToolError("expression too deeply nested") from None
    except (ValueError, TypeError) as exc:
        raise ToolError(f"math error: {exc}") from None


def _eval(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ToolError(f"only numbers are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise ToolError(f"unknown name {node.id!r}; allowed: {', '.join(sorted(CONSTANTS))}")
    if isinstance(node, ast.Call):
        return _call(node)
    raise ToolError(f"not allowed in an expression: {_describe(node)}")


def _call(node: ast.Call) -> Number:
    if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
        raise ToolError(
            f"unknown function {_describe(node.func)}; allowed: {', '.join(sorted(FUNCTIONS))}"
        )
    if node.keywords:
        raise ToolError(f"{node.func.id}() takes no keyword arguments")
    args = [_eval(arg) for arg in node.args]
    if node.func.id == "round" and len(args) == 2 and abs(args[1]) > 100:
        raise ToolError("round(): at most 100 digits")
    return _checked(FUNCTIONS[node.func.id](*args))


def _check_power(base: Number, exponent: Number) -> None:
    if not (isinstance(base, int) and isinstance(exponent, int)):
        return  # float powers overflow into OverflowError, which is caught
    if abs(base) > 1 and exponent > 0 and exponent * math.log2(abs(base)) > MAX_INT_BITS:
        raise ToolError(f"exponent too large: {base}**{exponent} exceeds {MAX_INT_BITS} bits")


def _checked(value: Any) -> Number:
    if isinstance(value, complex):
        raise ToolError("result is a complex number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError(f"result is not a finite number ({value})")
    return value


def _describe(node: ast.AST) -> str:
    try:
        return repr(ast.unparse(node))
    except Exception:
        return type(node).__name__
