"""benchmarks/gpu.py --dry-run: every part of the GPU run, at toy sizes on the CPU, so that the one
command prepared for the rare minutes a GPU is at hand still works when they come."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import forks
import pytest
from mounts import read_only, tmpfs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # four forked parts: ~30 s of CPU (transformers' Trainer, dynamo's tracing)
def test_the_gpu_run_works_at_toy_sizes_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "benchmarks" / "gpu.py")  # forked: torch imported once (forks)
    done = forks.run([script, "--dry-run", "--out", str(out)], env=env, timeout=900, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    index = (out / "README.md").read_text()
    assert "| torch | " in index and "dry run" in index
    for part in ("a_seed_table", "b_token_windows_compiled", "c_overhead", "d_auto_oom"):
        assert f"[{part}.md]({part}.md) | ok |" in index, index
        table = (out / f"{part}.md").read_text()
        assert "Failed" not in table and "Timed out" not in table, table

    seed = _rows(out / "a_seed_table.md")
    assert [r[0] for r in seed] == [
        "full batch 8 (transformers.Trainer)", "2 x 4 accumulated (transformers.Trainer)",
        "2 x 4 + gradient checkpointing (transformers.Trainer)", "2 x 4 (bigbatch.hf.Trainer)",
        "+ token windows, 128 tokens", "+ chunked LM head (chunked_head=True)",
        "packed rows of 64 tokens (pack=)",
    ]  # fmt: skip
    assert all(float(r[1]) > 0 for r in [*seed[:5], seed[6]])  # ms/step of every row that ran
    assert seed[0][5:7] == ["1.00", "1.00"]  # the ratios' reference is the full batch
    assert seed[5][1] == "not available in this build (chunked_head: issue 26, branch head)" or (
        float(seed[5][1]) > 0
    )

    compiled = (out / "b_token_windows_compiled.md").read_text()
    assert "issue 22's target" in compiled and "relative difference" in compiled
    assert len(_rows(out / "b_token_windows_compiled.md")) == 3 + 3 + 3  # parts 2 and 3

    overhead = _rows(out / "c_overhead.md")
    assert {r[1] for r in overhead} == {"hand loop", "bigbatch train_step"}

    auto = _rows(out / "d_auto_oom.md")
    assert [r[0] for r in auto] == ["2", "3"]
    assert int(auto[0][2]) > 0  # the budget made the second step shrink (retries)
    assert all(r[-1] == "True" for r in auto)  # and it stayed exact


def _rows(path: Path) -> list[list[str]]:
    """The data rows of every markdown table in ``path`` (headers and rule lines left out)."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    rule = [set("".join(c)) <= set("-: ") for c in cells]
    header = rule[1:] + [False]  # a header is the line above a rule
    return [c for c, r, h in zip(cells, rule, header, strict=True) if not (r or h)]


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--parts", "xyz"], "--parts 'xyz' is not allowed: give some of the letters abcd"),
        (["--parts", ""], "--parts '' is not allowed"),
        (["--budget", "0"], "--budget 0 is not allowed: give the seconds the run may take"),
        (["--budget", "-5"], "--budget -5 is not allowed"),
        (["--out", "{file}"], "is a file; give a folder"),
        (["--out", "{file}/sub"], "is a file; give a folder"),
        (["--out", "{readonly}/gpu"], "cannot be written here; give a writable folder"),
        ([], "no CUDA device here: run on a machine with a GPU, or check the run with --dry-run"),
    ],
)
def test_bad_arguments_are_one_line_before_anything_runs(tmp_path, capsys, flags, line):
    """Issue 37: these gave raw tracebacks, ran nothing and exited 1, or exited 0 having measured
    nothing; without a GPU the clear line came inside a traceback."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu

    (tmp_path / "file").write_text("")
    paths = {"file": tmp_path / "file", "readonly": tmp_path / "readonly"}
    out = ["--out", str(tmp_path / "out")] if "--out" not in flags else []
    argv = [f.format(**paths) for f in flags] + out + (["--dry-run"] if flags else [])
    with tmpfs(paths["readonly"]) if "{readonly}" in " ".join(flags) else contextlib.nullcontext():
        if "{readonly}" in " ".join(flags):
            read_only(paths["readonly"])  # a real read-only filesystem (root writes past 0o500)
        assert gpu.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu.py: ") and line in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
