"""Reading megatron-core's source without importing it: a function's source fingerprint, and the
functions of a module that mention CUDA. Both read the module's file with `ast`, so they give
the same answer before and after the patches are applied."""
from __future__ import annotations

import ast
import hashlib
import importlib.util
from typing import Any


def _find_function(tree: ast.AST, qualname: str) -> ast.AST | None:
    node: Any = tree
    for part in qualname.split("."):
        found = None
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name == part:
                    found = child
        if found is None:
            return None
        node = found
    return node


def source_fingerprint(site: str) -> str:
    """sha256 (first 16 hex) of a function's source text in the installed megatron-core.

    `site` is 'package.module:Qualified.name'. Read from the module's file with `ast`, so it
    is the same before and after the patches are applied.
    """
    module_name, _, qualname = site.partition(":")
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise LookupError(f"module {module_name} not found")
    text = open(spec.origin, encoding="utf-8").read()
    node = _find_function(ast.parse(text), qualname)
    if node is None:
        raise LookupError(f"{site}: function not found in {spec.origin}")
    segment = ast.get_source_segment(text, node) or ""
    return hashlib.sha256(segment.encode()).hexdigest()[:16]


def cuda_sites(module_name: str) -> list[str]:
    """Qualified names of the functions in a module that mention CUDA in code (not comments).

    A CUDA mention: an attribute `.cuda` / `torch.cuda.*` access or a "cuda" string constant.
    Used by the tests to notice new CUDA call sites in a changed megatron-core.
    """
    spec = importlib.util.find_spec(module_name)
    text = open(spec.origin, encoding="utf-8").read()
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                if _mentions_cuda(child):
                    found.append(name)

    visit(ast.parse(text), "")
    return found


def _mentions_cuda(fn: ast.AST) -> bool:
    """Any `<x>.cuda.<attr>` access (torch.cuda.current_stream, .synchronize, .Stream, ...), a
    `.cuda(...)` call, or a "cuda" string constant. (Until the 0.19 review this looked only at
    five torch.cuda calls, and missed 0.19's `torch.cuda.current_stream()` in DDP's grad sync.)"""
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute):
            value = node.value
            if isinstance(value, ast.Attribute) and value.attr == "cuda":
                return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "cuda":
                return True
        if isinstance(node, ast.Constant) and node.value == "cuda":
            return True
    return False
