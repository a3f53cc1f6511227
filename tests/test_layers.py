"""Imports point downward only (STYLE.md, "Import rule"), read from the source with ``ast``.

Every module under src/bigbatch must have a layer here; a new module fails until it is given one.
Layer 0 is pure (no model, no optimizer), layer 1 is one optimizer step, layer 2 are tools built
on the engine, and the application on top (``train/``, ``cli``, ``demo``) is imported by nothing
but itself and the package's ``__init__`` (the public face, which may import any layer).
Function-level imports count: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "bigbatch"
TOP = 3
# Exactly the list of ../shared/STYLE.md ("Import rule"), module by module; no relabelling.
LAYERS = {
    # layer 0: pure (no model, no optimizer, no process group), and the small shared helpers
    "_tree": 0,
    "_warnings": 0,
    "_units": 0,
    "_rng": 0,
    "split": 0,
    "loss": 0,
    "memory": 0,
    "memory.candidates": 0,  # the planner's choice between measured configurations: pure
    # layer 1: one optimizer step: the engine and its siblings
    "engine": 1,
    "precision": 1,
    "sync": 1,
    "window": 1,
    "stepping": 1,
    "memory.oom": 1,
    "memory.auto": 1,
    "memory.peak": 1,
    "memory.sizing": 1,
    "batchnorm_window": 1,  # the BatchNorm handling the engine itself needs (momentum, warning)
    # layer 2: tools built on the engine
    "batchnorm": 2,
    "cached": 2,  # exact batch-coupled losses (representation-gradient caching)
    "check": 2,
    "_check_probes": 2,
    "_check_runs": 2,
    "_check_diagnoses": 2,
    "distributed": 2,
    "local": 2,  # LocalAccumulation, re-exported by distributed
    "memory.checkpointing": 2,
    "memory.planner": 2,
    "keras": 2,  # the Keras 3 adapter (imports keras inside functions only)
    "_keras_loss": 2,
    # on top: the application, imported by nothing
    "cli": TOP,
    "console": TOP,
    "demo": TOP,
    "__main__": TOP,
}
PACKAGES_ON_TOP = ("train",)  # every module of these packages is on top, present and future
ALLOWED: dict[tuple[str, str], str] = {}  # (module, dependency): reason; empty, and kept so
THIRD_PARTY_AT_IMPORT = {"torch"}  # rule 12: `import bigbatch` needs only torch


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def layer(name: str) -> int:
    if name.split(".")[0] in PACKAGES_ON_TOP:
        return TOP
    return LAYERS[name]


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """``(imported name, line, at module level)`` for every import in the module's source."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = ["bigbatch"] + [p for p in package.split(".") if p]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub.removeprefix("bigbatch.") in known else base
                found.append((target, node.lineno, id(node) in top_level))
    return found


def own(target: str) -> str | None:
    """``"memory.auto"`` for ``"bigbatch.memory.auto"``; ``None`` outside the package."""
    if target == "bigbatch":
        return ""
    return target.removeprefix("bigbatch.") if target.startswith("bigbatch.") else None


def test_every_module_has_a_layer() -> None:
    unknown = [
        n for n in modules() if n and n.split(".")[0] not in PACKAGES_ON_TOP and n not in LAYERS
    ]
    assert not unknown, (
        f"no layer for {unknown}: assign each a layer in tests/test_layers.py LAYERS (0 pure, "
        "1 one optimizer step, 2 tools on the engine, 3 the application) per STYLE.md's import rule."
    )


@pytest.mark.parametrize("name", [n for n in modules() if n])
def test_imports_point_downward(name: str) -> None:
    all_modules = modules()
    if name.split(".")[0] not in PACKAGES_ON_TOP and name not in LAYERS:
        pytest.skip("no layer yet: test_every_module_has_a_layer says which")
    mine, wrong = layer(name), []
    for target, line, _ in imports(name, all_modules[name], set(all_modules)):
        dep = own(target)
        if (
            dep is None
            or (name, dep) in ALLOWED
            or dep.split(".")[0] == name.split(".")[0] == "train"
        ):
            continue
        if dep == "":
            wrong.append(
                f"line {line}: imports the package root `bigbatch`; import the module itself"
            )
        elif dep in all_modules and (layer(dep) > mine or (layer(dep) == TOP and mine < TOP)):
            wrong.append(f"line {line}: imports {dep} (layer {layer(dep)})")
        elif layer(dep) == TOP and name not in ("cli", "console", "__main__"):
            wrong.append(f"line {line}: imports {dep}, part of the application nothing imports")
    assert not wrong, f"{name} (layer {mine}) imports upward:\n" + "\n".join(dict.fromkeys(wrong))


@pytest.mark.parametrize("name", [n for n in modules() if n])
def test_import_bigbatch_needs_only_torch(name: str) -> None:
    all_modules = modules()
    extras = sorted(
        f"line {line}: {target}"
        for target, line, at_top in imports(name, all_modules[name], set(all_modules))
        if at_top
        and own(target) is None
        and target.split(".")[0] not in sys.stdlib_module_names | THIRD_PARTY_AT_IMPORT
    )
    assert not extras, (
        f"{name} imports {extras} at module level; import them inside the function that uses them "
        "(STYLE.md rule 12: `import bigbatch` needs only torch)."
    )


@pytest.mark.parametrize("name", [n for n in modules() if n])
def test_no_module_imports_a_private_name_of_another(name: str) -> None:
    all_modules = modules()
    tree = ast.parse(all_modules[name].read_text())
    private = [
        f"line {node.lineno}: from {node.module} import {alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bigbatch")
        for alias in node.names
        if alias.name.startswith("_")
        and not alias.name.startswith("__")
        and f"{node.module}.{alias.name}".removeprefix("bigbatch.") not in all_modules  # a module
    ]
    assert not private, (
        f"{name} imports private names {private}: make the name public in its module, or give the "
        "shared helper a small module of its own (STYLE.md, import rule)."
    )


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    fake = tmp_path / "split.py"
    fake.write_text(
        "import torch\nfrom bigbatch.engine import Accumulator\n\ndef f():\n    from . import cli\n"
    )
    found = imports("split", fake, {"engine", "cli", "split"})
    assert [(own(t), line) for t, line, _ in found if own(t) is not None] == [
        ("engine", 2),
        ("cli", 5),
    ]
    assert layer("engine") > layer("split") and layer("train.loop") == TOP
