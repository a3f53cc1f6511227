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
# The folders are the floors (STYLE.md, the layout; each folder's README says what it may import):
# a module imports its own folder and the floors below it, never a sibling folder on its own floor.
FLOORS = {
    "core": 0,  # the engine: cutting, the window runner, the step (torch only)
    "memory": 1,  # tools on the engine: checkpointing, the planner
    "losses": 1,  # exact batch-coupled and compound losses
    "distributed": 1,  # process groups, local rounds
    "verifier": 2,  # check(): runs the engine and the memory tools
    "integrations": 3,  # Keras, transformers, Lightning: thin callers of the engine
    "app": 4,  # trainer, CLI, report, demo: the [cli] extra; nothing imports it
}
TOP = 5  # the package's public face: __init__, __main__ and the short names (bigbatch.keras, ...)
# Inside core/, the layers of STYLE.md's import rule: 0 pure (no model, no optimizer), 1 one step.
CORE_LAYERS = {
    "_tree": 0, "_warnings": 0, "_units": 0, "_rng": 0, "split": 0, "loss": 0, "head": 0,
    "engine": 1, "_precision": 1, "_sync": 1, "_window": 1, "_stepping": 1, "oom": 1, "peak": 1,
    "_sizing": 1, "_scale": 1, "_tokens": 1, "batchnorm": 1, "cut": 1, "_pack": 1,
    "_pack_audit": 1, "ledger": 1, "_deepspeed": 1,
}  # fmt: skip
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


def layer(name: str) -> tuple[int, int]:
    """``(floor, layer inside the floor)`` of a module (``"core.engine"`` -> ``(0, 1)``)."""
    folder, _, rest = name.partition(".")
    if folder not in FLOORS:
        return (TOP, 0)
    return (FLOORS[folder], CORE_LAYERS.get(rest, 0) if folder == "core" else 0)


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
    """``"core._sizing"`` for ``"bigbatch.core._sizing"``; ``None`` outside the package."""
    if target == "bigbatch":
        return ""
    return target.removeprefix("bigbatch.") if target.startswith("bigbatch.") else None


def test_every_module_has_a_layer() -> None:
    unknown = [
        n
        for n in modules()
        if n and n.startswith("core.") and n.removeprefix("core.") not in CORE_LAYERS
    ]
    folders = {n.split(".")[0] for n, path in modules().items() if path.name == "__init__.py" and n}
    assert not unknown and folders <= set(FLOORS), (
        f"no layer for {unknown or sorted(folders - set(FLOORS))}: give each core module a layer "
        "(CORE_LAYERS) and each folder a floor (FLOORS) in tests/test_layers.py."
    )


def test_every_folder_has_a_readme() -> None:
    missing = [f for f in FLOORS if not (PACKAGE / f / "README.md").is_file()]
    assert not missing, f"{missing} have no README.md (its job, what it may import)"


@pytest.mark.parametrize("name", [n for n in modules() if n])
def test_imports_point_downward(name: str) -> None:
    all_modules = modules()
    mine, wrong = layer(name), []
    for target, line, _ in imports(name, all_modules[name], set(all_modules)):
        dep = own(target)
        if dep is None or (name, dep) in ALLOWED or dep not in all_modules and dep != "":
            continue
        if dep == "":
            if mine[0] < TOP:
                wrong.append(f"line {line}: imports the package root `bigbatch`; import the module")
            continue
        theirs, same_folder = layer(dep), dep.split(".")[0] == name.split(".")[0]
        if theirs > mine or (theirs[0] == mine[0] and not same_folder and mine[0] < TOP):
            wrong.append(f"line {line}: imports {dep} (floor {theirs[0]}, layer {theirs[1]})")
    assert not wrong, f"{name} (floor {mine[0]}) imports upward or sideways:\n" + "\n".join(
        dict.fromkeys(wrong)
    )


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
        "import torch\nfrom bigbatch.core.engine import Accumulator\n\ndef f():\n"
        "    from bigbatch.app import cli\n"
    )
    found = imports("core.split", fake, {"core.engine", "app.cli", "core.split"})
    assert [(own(t), line) for t, line, _ in found if own(t) is not None] == [
        ("core.engine", 2),
        ("app.cli", 5),
    ]
    assert layer("core.engine") > layer("core.split") and layer("app.loop")[0] == FLOORS["app"]
