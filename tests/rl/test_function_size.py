"""House rule for rl/ (issue 26): no function longer than 80 lines or with more than 10 parameters.

Why a test: the policy loss had grown to one 208-line function with 27 parameters one
keyword at a time; this keeps every function of the package small enough to read whole.
Lines: from `def` to the last line of the body (docstring included, decorators not).
Parameters: every name in the signature (self, *args and **kwargs count as one each).
"""
import ast
from pathlib import Path

import megatron_calibclip.rl as rl

MAX_LINES, MAX_PARAMS = 80, 10


def _functions():
    for path in sorted(Path(rl.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                params += (a.vararg is not None) + (a.kwarg is not None)
                yield f"{path.name}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1, params


def test_rule_is_measured_on_the_real_package():
    found = {name.split(" ")[1]: (lines, params) for name, lines, params in _functions()}
    assert len(found) > 40  # the walk really saw the package
    assert "policy_loss" in found and "aggregate" in found


def test_no_function_longer_than_80_lines_or_with_more_than_10_parameters():
    too_long = [(name, lines) for name, lines, _ in _functions() if lines > MAX_LINES]
    too_wide = [(name, params) for name, _, params in _functions() if params > MAX_PARAMS]
    assert too_long == [] and too_wide == []
