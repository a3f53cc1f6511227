"""Everything bigbatch claims, measured on a GPU by one command: a markdown table per part.

A GPU is at hand only now and then, and then for minutes, so the whole run is this one command
(about 7 minutes on one H100; ``--budget`` bounds it), and ``--dry-run`` runs every part at toy
sizes on the CPU so that the suite keeps it working between the times a GPU is at hand.

Parts, each in a process of its own with its own time limit (a part that fails or runs out of
time writes why into its table, keeps the rows it finished, and the other parts still run):

  a  the seed table: a 124M-parameter GPT-2 built from its config (no download) trained by
     ``transformers.Trainer`` on variable-length text, the same logical batch cut five ways (the
     full batch, accumulation, + gradient checkpointing, ``bigbatch.hf.Trainer``, + token windows,
     + the chunked head where this build has it): ms/step, samples/s, tokens/s, peak memory from
     the allocator, speed and memory against the full batch (the research note's R5) and the model
     FLOPs utilisation against a matrix multiply timed on the same card (R2);
  b  token windows under ``torch.compile`` (``token_windows.py --compile --ceiling`` on the GPU):
     issue 22's target, "compiled steady state faster than eager";
  c  the engine's overhead against the hand-written loop (``overhead.py --device cuda``, R1);
  d  ``micro_batch_size="auto"`` against a real CUDA out-of-memory error (a memory cap set with
     ``torch.cuda.set_per_process_memory_fraction``): the micro-batch it finds, and the step still
     equal to the unaccumulated one (float64).

The folder gets ``README.md`` (the card, driver, CUDA, torch and library versions, each part's
status and time) and ``a_seed_table.md`` ... ``d_auto_oom.md`` (+ a ``.log`` of each part's stderr).

Run:
    pip install -e ".[hf,compare]"                          # transformers; Accelerate / Fabric rows
    python benchmarks/gpu.py --out gpu-results               # on the GPU
    python benchmarks/gpu.py --dry-run --out /tmp/gpu-dry    # the check, on a CPU (< 1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib.util
import inspect
import math
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # the other benchmarks; test helpers


@dataclass(frozen=True)
class Sizes:
    """What the parts run at: ``GPU`` (the real run) or ``TOY`` (``--dry-run``, on the CPU)."""

    vocab: int  # (a) GPT-2: vocabulary, width, blocks, heads, context
    width: int
    layers: int
    heads: int
    max_len: int
    median_len: int  # of the log-normal text lengths
    batch: int  # the logical batch (sequences per optimizer step) and its micro-batch
    micro: int
    warmup: int  # optimizer steps before the timed ones
    steps: int
    matmul: int  # the side of the square matrix multiply timed for the peak (R2)
    toy: bool  # (b) token_windows.py at its toy sizes
    backend: str  # torch.compile's backend
    rounds: int
    overhead: tuple[str, ...]  # (c) overhead.py's arguments
    samples: int  # (d) the MLP's batch, input and hidden widths
    features: int
    hidden: int
    limits: dict[str, float] = field(default_factory=dict)  # seconds per part
    budget: float = 0.0  # seconds for the whole run


GPU = Sizes(
    vocab=50257, width=768, layers=12, heads=12, max_len=1024, median_len=320, batch=32, micro=8,
    warmup=2, steps=5, matmul=8192, toy=False, backend="inductor", rounds=3,
    overhead=("--k", "8", "--micro", "64", "--rounds", "20"),
    samples=2048, features=1024, hidden=4096,
    limits={"a": 170, "b": 200, "c": 60, "d": 45}, budget=480,
)  # fmt: skip
TOY = Sizes(
    vocab=128, width=32, layers=2, heads=2, max_len=64, median_len=24, batch=8, micro=2,
    warmup=1, steps=2, matmul=256, toy=True, backend="eager", rounds=1,
    overhead=("--k", "2", "--micro", "8", "--rounds", "2", "--round-ms", "5", "--warmup", "1",
              "--only", "bigbatch train_step"),
    samples=1024, features=64, hidden=256,
    limits={"a": 90, "b": 120, "c": 40, "d": 40}, budget=300,
)  # fmt: skip


class Table:
    """A markdown table printed row by row (a part cut short keeps the rows it finished)."""

    def __init__(self, title: str, headers: list[str]) -> None:
        self.width = len(headers)
        print(f"\n{title}\n\n| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))

    def row(self, *cells: object) -> None:
        print("| " + " | ".join(map(str, cells)) + " |" + " |" * (self.width - len(cells)))


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------- (a) the seed table
def texts(s: Sizes, n: int) -> list[dict[str, list[int]]]:
    """``n`` token sequences of log-normal lengths (median ``s.median_len``, at most ``max_len``)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.empty(n).log_normal_(math.log(s.median_len), 0.6, generator=gen)
    lengths = lengths.clamp(8, s.max_len).long().tolist()
    return [{"input_ids": torch.randint(1, s.vocab, (k,), generator=gen).tolist()} for k in lengths]


def gpt2(s: Sizes) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=s.vocab, n_embd=s.width, n_layer=s.layers, n_head=s.heads, n_positions=s.max_len,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def matmul_peak(s: Sizes, device: torch.device) -> float:
    """FLOP/s of a square matrix multiply in the training's dtype, timed here (R2's denominator)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(s.matmul, s.matmul, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    synchronize(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        a @ b
    synchronize(device)
    return 2 * s.matmul**3 * n / (time.perf_counter() - start)


def seed_runs(s: Sizes) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, trainer, settings) of each row; the trainer "bigbatch" is ``bigbatch.hf.Trainer``."""
    k, b, m = s.batch // s.micro, s.batch, s.micro
    tokens = {"micro_batch_tokens": m * s.max_len}  # a micro-batch's worst case, fewer rows
    return [
        (f"full batch {b} (transformers.Trainer)", "stock", {"per_device": b, "ga": 1}),
        (f"{m} x {k} accumulated (transformers.Trainer)", "stock", {}),
        (f"{m} x {k} + gradient checkpointing (transformers.Trainer)", "stock", {"ckpt": True}),
        (f"{m} x {k} (bigbatch.hf.Trainer)", "bigbatch", {}),
        (f"+ token windows, {tokens['micro_batch_tokens']} tokens", "bigbatch", tokens),
        ("+ chunked LM head (chunked_head=True)", "bigbatch", {**tokens, "chunked_head": True}),
        (f"packed rows of {s.max_len} tokens (pack=)", "bigbatch", {"pack": s.max_len}),
    ]


def train_row(s: Sizes, device: torch.device, trainer: str, settings: dict[str, Any]) -> dict:
    """Train a fresh GPT-2 for ``warmup + steps`` optimizer steps; time, peak, tokens."""
    import transformers
    from integrations.hf_models import collate

    import bigbatch.hf

    settings = dict(settings)
    per_device, ga = settings.pop("per_device", s.micro), settings.pop("ga", s.batch // s.micro)
    ckpt = settings.pop("ckpt", False)
    ends: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            synchronize(device)
            ends.append(time.perf_counter())

    data = texts(s, s.batch * (s.warmup + s.steps))
    model = gpt2(s)
    model.loss_type = "ForCausalLM"  # its labels counted shifted (packing drops first labels)
    if "pack" in settings and device.type == "cuda" and importlib.util.find_spec("flash_attn"):
        model.set_attn_implementation("flash_attention_2")  # varlen: each sample's own scores
    known = inspect.signature(transformers.TrainingArguments).parameters  # 5.x renamed it
    ckpt_name = "activation_checkpointing" if "activation_checkpointing" in known else (
        "gradient_checkpointing")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=per_device, gradient_accumulation_steps=ga,
            max_steps=s.warmup + s.steps, learning_rate=1e-4, lr_scheduler_type="constant",
            bf16=device.type == "cuda", use_cpu=device.type == "cpu", report_to=[],
            save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
            dataloader_num_workers=0, remove_unused_columns=False, **{ckpt_name: ckpt},
        )  # fmt: skip
        cls = bigbatch.hf.Trainer if trainer == "bigbatch" else transformers.Trainer
        t = cls(model=model, args=args, train_dataset=data, data_collator=collate,
                callbacks=[Clock()], **settings)  # fmt: skip
        free_memory(device)
        with bigbatch.measure_peak(device) as peak, contextlib.redirect_stdout(sys.stderr):
            t.train()  # (its end-of-training line goes to the part's log, not the table)
        absolute = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)][s.warmup - 1 :]
    params = sum(p.numel() for p in model.parameters())
    del t, model
    free_memory(device)
    tokens = sum(len(d["input_ids"]) for d in data) / (s.warmup + s.steps)  # real, per step
    return {"s": statistics.median(gaps), "peak": absolute or peak.peak_bytes, "tokens": tokens,
            "params": params}  # fmt: skip


def seed_table(s: Sizes, device: torch.device) -> None:
    import bigbatch.hf

    peak_flops = matmul_peak(s, device)
    where = "peak allocated (torch.cuda.max_memory_allocated)" if device.type == "cuda" else (
        "peak (resident set above the start: the CPU dry run)")  # fmt: skip
    table = Table(
        f"## (a) The seed table: GPT-2 ({s.layers} blocks, width {s.width}) on variable-length "
        f"text, {s.batch} sequences per optimizer step, {s.warmup} warm-up + {s.steps} timed "
        f"steps; {'bf16 autocast' if device.type == 'cuda' else 'float32'}",
        ["run", "ms/step", "samples/s", "tokens/s", where, "speed vs full (R5)",
         "memory vs full", "MFU vs matmul peak (R2)"],
    )  # fmt: skip
    chunked = "chunked_head" in inspect.signature(bigbatch.hf.Trainer.__init__).parameters
    full: dict | None = None
    for label, trainer, settings in seed_runs(s):
        if "chunked_head" in settings and not chunked:
            table.row(label, "not available in this build (chunked_head: issue 26, branch head)")
            continue
        try:
            r = train_row(s, device, trainer, settings)
        except torch.OutOfMemoryError:
            free_memory(device)
            table.row(label, "does not fit (out of memory)")
            continue
        except Exception as exc:  # a row that fails is reported; the others still run
            free_memory(device)
            table.row(label, f"failed: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        full = full or r  # the first row that runs: the full batch where it fits
        flops = (6 * r["params"] + 12 * s.layers * s.width * s.median_len) * r["tokens"]
        table.row(
            label, f"{r['s'] * 1e3:.0f}", f"{s.batch / r['s']:.1f}", f"{r['tokens'] / r['s']:,.0f}",
            gib(r["peak"]), f"{full['s'] / r['s']:.2f}", f"{r['peak'] / full['peak']:.2f}",
            f"{flops / r['s'] / peak_flops:.0%}",
        )  # fmt: skip
    print(
        f"\nThe matrix multiply's peak on this device: {peak_flops / 1e12:.3g} TFLOP/s "
        f"({s.matmul}^3, {'bf16' if device.type == 'cuda' else 'float32'}); FLOPs per real token "
        "6N + 12 L d T (T the median length). Speed and memory are ratios to the first row."
    )


# ---------------------------------------------------------------- (b) token windows, compiled
def compiled(s: Sizes, device: torch.device) -> None:
    import token_windows

    print("## (b) Token windows under torch.compile (token_windows.py --compile --ceiling)")
    if s.toy:
        token_windows.toy_sizes()
    token_windows.DEVICE, token_windows.BACKEND = device, s.backend
    token_windows.part2(s.rounds)
    token_windows.float64_compiled_vs_eager()
    token_windows.ceiling(s.rounds)


# -------------------------------------------------------------------------------- (c) overhead
def overhead(s: Sizes, device: torch.device) -> None:
    import overhead

    print("## (c) The engine's overhead against the hand-written loop (benchmarks/overhead.py)")
    overhead.main(["--device", str(device), *s.overhead])


# ----------------------------------------------------------------------- (d) auto against OOM
def auto_oom(s: Sizes, device: torch.device) -> None:
    """Two capped windows of ``micro_batch_size="auto"`` against the same steps run whole."""
    import torch.nn.functional as F
    from reference import full_batch_step, max_relative_error

    import bigbatch

    torch.manual_seed(0)
    widths = [s.features, s.hidden, s.hidden, s.hidden]
    layers = [
        m
        for a, b in zip(widths, widths[1:], strict=False)
        for m in (torch.nn.Linear(a, b), torch.nn.GELU())
    ]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(s.hidden, 10)).to(device, torch.float64)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(s.samples, s.features, generator=gen, dtype=torch.float64).to(device),
                torch.randint(0, 10, (s.samples,), generator=gen).to(device)) for _ in range(3)]  # fmt: skip

    def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    ref, mine = copy.deepcopy(model), copy.deepcopy(model)
    ref_opt, snapshots, peaks = sgd(ref), [], []
    for batch in batches:  # the unaccumulated steps, uncapped
        with bigbatch.measure_peak(device) as peak:
            full_batch_step(ref, ref_opt, loss, batch)
        snapshots.append(copy.deepcopy(ref))
        peaks.append(peak.peak_bytes)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(grads + 0.3 * (peaks[1] - grads))  # the gradients and 30% of the activations
    acc = bigbatch.Accumulator(mine, sgd(mine), micro_batch_size="auto")
    acc.train_step(batches[0], loss)  # uncapped: the optimizer's state exists before the cap
    free_memory(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = (torch.cuda.memory_reserved(device) + budget) / total
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        cap = f"set_per_process_memory_fraction({fraction:.4f}): {gib(budget)} above what is in use"
    else:  # the dry run: a memory budget stands in for the allocator's limit
        acc = bigbatch.Accumulator(
            mine, acc.optimizer, micro_batch_size="auto", memory_budget=budget
        )
        cap = f"memory_budget={budget} bytes (CPU dry run: no CUDA allocator to cap)"
    table = Table(
        f"## (d) micro_batch_size=\"auto\" against a real out-of-memory error\n\nAn MLP "
        f"{'-'.join(map(str, widths))}-10 in float64, {s.samples} samples per step, SGD with "
        f"momentum; the cap: {cap}. The unaccumulated step's peak: {gib(peaks[1])}.",
        ["step", "micro-batch found", "out-of-memory retries", "peak of the step",
         "relative error vs unaccumulated", "exact (<= 1e-10)"],
    )  # fmt: skip
    try:
        for step in (1, 2):
            r = acc.train_step(batches[step], loss)
            error = max_relative_error(snapshots[step], mine)
            peak = gib(r.peak_bytes) if r.peak_bytes is not None else "-"
            table.row(
                step + 1, r.micro_batch_size, r.oom_retries, peak, f"{error:.1e}", error <= 1e-10
            )
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)


# ------------------------------------------------------------------------------- environment
def environment(s: Sizes, device: torch.device) -> None:
    import importlib.metadata

    from _measure import device_name

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    rows = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or check the script with --dry-run")
        props = torch.cuda.get_device_properties(device)
        rows["card"] = f"{props.name}, {gib(props.total_memory)}, {props.multi_processor_count} SMs"
        rows["driver"] = _driver()
        rows["CUDA (torch built with)"] = str(torch.version.cuda)
        rows["cuDNN"] = str(torch.backends.cudnn.version())
    else:
        rows["card"] = "none: a dry run on the CPU (toy sizes; the figures mean nothing)"
    rows["CPU"] = device_name("cpu")
    rows["torch"] = torch.__version__
    for name in ("transformers", "accelerate", "lightning"):
        rows[name] = version(name)
    rows["bigbatch commit"] = _git("rev-parse", "--short", "HEAD") + (
        " (with uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else "")  # fmt: skip
    rows["python"] = platform.python_version()
    print("| | |\n|---|---|")
    for key, value in rows.items():
        print(f"| {key} | {value} |")


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown (no nvidia-smi)"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE, timeout=20)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


# ------------------------------------------------------------------------------------- runner
PARTS: dict[str, tuple[str, Callable[[Sizes, torch.device], None]]] = {
    "a": ("a_seed_table", seed_table),
    "b": ("b_token_windows_compiled", compiled),
    "c": ("c_overhead", overhead),
    "d": ("d_auto_oom", auto_oom),
}


def _child(fn: Callable[[Sizes, torch.device], None], s: Sizes, device: str, path: Path) -> None:
    """A part in a forked process: its stdout is the table file, its stderr the log file."""
    with (
        open(path.with_suffix(".md"), "w", buffering=1) as table,
        open(path.with_suffix(".log"), "w") as log,
    ):  # noqa: E501
        os.dup2(log.fileno(), 2)
        sys.stdout = table
        code = 0
        try:
            fn(s, torch.device(device))
        except BaseException:  # written into the table; the parent goes on with the next part
            traceback.print_exc()
            print("\n**Failed:**\n\n```\n" + traceback.format_exc()[-2500:] + "```")
            code = 1
        table.flush()
    os._exit(code)


def run_part(name: str, s: Sizes, device: str, out: Path, limit: float) -> tuple[str, float, float]:
    """Run one part in a forked process for at most ``limit`` seconds: (status, wall seconds, CPU
    seconds)."""
    stem, fn = PARTS[name] if name in PARTS else (name, environment)
    process = multiprocessing.get_context("fork").Process(
        target=_child, args=(fn, s, device, out / stem)
    )
    start, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    process.start()
    process.join(max(1.0, limit))
    if process.is_alive():
        process.kill()
        process.join()
        with open(out / f"{stem}.md", "a") as table:
            table.write(f"\n\n**Timed out after {limit:.0f} s**: the rows above finished.\n")
        return "timed out", time.monotonic() - start, _cpu_since(cpu)
    code = process.exitcode
    status = "ok" if code == 0 else "failed" if code == 1 else f"crashed (exit code {code})"
    if code not in (0, 1):
        with open(out / f"{stem}.md", "a") as table:
            table.write(f"\n\n**The part's process died** (exit code {code}): see {stem}.log.\n")
    return status, time.monotonic() - start, _cpu_since(cpu)


def _cpu_since(before: Any) -> float:
    """CPU seconds of the children reaped since ``before`` (a ``getrusage`` reading)."""
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    return now.ru_utime + now.ru_stime - before.ru_utime - before.ru_stime


def refused(args: argparse.Namespace, device: str) -> str | None:
    """Why the arguments cannot run, in one line (checked before anything runs), or ``None``."""
    known = "".join(PARTS)
    if not args.parts or set(args.parts) - set(known) or len(set(args.parts)) < len(args.parts):
        return (
            f"--parts {args.parts!r} is not allowed: give some of the letters {known}, once each."
        )
    if args.budget is not None and not 0 < args.budget < math.inf:
        return f"--budget {args.budget:g} is not allowed: give the seconds the run may take (> 0)."
    existing = next(p for p in (args.out, *args.out.parents) if p.exists())
    if not existing.is_dir():
        return f"--out {args.out}: {existing} is a file; give a folder (it is made if missing)."
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--out {args.out}: {existing} cannot be written here; give a writable folder."
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "no CUDA device here: run on a machine with a GPU, or check the run with --dry-run."
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the tables (made)")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (a check)")
    parser.add_argument("--parts", default="abcd", help="which parts (default: abcd)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --dry-run")
    args = parser.parse_args(argv)
    s = TOY if args.dry_run else GPU
    device = args.device or ("cpu" if args.dry_run else "cuda")
    problem = refused(args, device)
    if problem:
        print(f"gpu.py: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (args.budget or s.budget)
    status, *_ = run_part("environment", s, device, args.out, 60)
    if status != "ok":
        print((args.out / "environment.md").read_text(), file=sys.stderr)
        return 2
    results = {}
    for name in args.parts:
        left = deadline - time.monotonic()
        if left < 5:
            results[name] = ("not run: the global budget is spent", 0.0, 0.0)
            continue
        print(
            f"part {name} ({PARTS[name][0]}): at most {min(s.limits[name], left):.0f} s", flush=True
        )
        results[name] = run_part(name, s, device, args.out, min(s.limits[name], left))
        status, wall, cpu = results[name]
        print(f"part {name}: {status} in {wall:.0f} s ({cpu:.0f} s of CPU)", flush=True)
    title = "# bigbatch on a GPU" + (": dry run (CPU, toy sizes)" if args.dry_run else "")
    command = " ".join(argv if argv is not None else sys.argv[1:])
    index = [title, "", f"`python benchmarks/gpu.py {command}`", "",
             (args.out / "environment.md").read_text(), "",
             "| part | table | status | wall s | CPU s |", "|---|---|---|---|---|"]  # fmt: skip
    for name, (status, wall, cpu) in results.items():
        table = f"[{PARTS[name][0]}.md]({PARTS[name][0]}.md)"
        index.append(f"| {name} | {table} | {status} | {wall:.0f} | {cpu:.0f} |")
    (args.out / "README.md").write_text("\n".join(index) + "\n")
    print(f"wrote {args.out}/README.md and a table per part")
    return 0 if all(status == "ok" for status, *_ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
