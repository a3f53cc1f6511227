"""Token windows vs fixed-count micro-batches on variable-length text, and compiled shapes.

Part 1: the same logical batch (64 sequences, one optimizer step) of a transformers GPT-2 and a
Llama built from configs (float32, no weights downloaded), on two length distributions:
log-normal lengths, and the docstrings of the Python standard library tokenised with a
byte-level BPE trained on them here (real text that ships on every machine). Each step is cut
two ways:

* fixed count: 8 micro-batches of 8 sequences in the batch's order, each padded to its own
  longest (what a per-batch collator gives: ``DataCollatorWithPadding`` + GA 8);
* token windows: ``Accumulator(micro_batch_tokens=B)``, ``B`` the fixed count's largest
  micro-batch in padded tokens, so no micro-batch computes more than the fixed count's worst
  (the peak memory is no higher).

Reported: the padding computed (% of tokens), time per step (median over rounds taken
round-robin) and peak memory per step (the process's resident-set high-water mark under the
small mmap threshold, as bigbatch's demo measures). Both cuts are exact (the step equals the
full batch's); the float64 tests prove it.

Part 2 (``--compile``): GPT-2 under ``torch.compile`` (Inductor, CPU): token windows eager,
token windows compiled with ``pad_to_multiple_of=64`` (one shape per bucket), and every
micro-batch padded to the longest length (one shape); recompiles (Dynamo's unique graphs),
steady-state seconds per step after the compiles, and, in float64, the compiled step's distance
from the eager one.

Part 3 (``--ceiling``): what compiling can gain on this machine at all, padding aside. The same
micro-batch shapes (4,096 tokens each, 8x512 to 64x64) run forward and backward eagerly, compiled
with one graph per shape (the most a compiler can do), and compiled with rows left dynamic and
lengths static (one graph per length bucket, no pad rows); time per pass of the shapes, and the
ratio to eager. Compiled buckets beat eager only where this gain exceeds the padding they add.

Run: PYTHONPATH=src python benchmarks/token_windows.py [--rounds 5] [--compile] [--ceiling]
     [--device cuda] (parts 2 and 3 on a GPU: ``benchmarks/gpu.py`` runs them there)
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import math
import statistics
import time
import warnings

import torch
from _measure import device_name, mib, print_table, synchronize

import bigbatch
from bigbatch.core.peak import small_mmap_threshold

N, MICRO, MAX_LEN, VOCAB = 64, 8, 512, 8192
WIDTH, LAYERS, BUDGET, MULTIPLE = 256, 4, 4096, 64  # model; parts 2-3's budget and bucket
SHAPES = 4  # part 3's micro-batch shapes: lengths MAX_LEN, MAX_LEN / 2, ...
DEVICE = torch.device("cpu")  # parts 2 and 3 run here (--device)
BACKEND = "inductor"  # torch.compile's backend (benchmarks/gpu.py's dry run: "eager")


def toy_sizes() -> None:
    """Shrink everything for a check that the script runs (``benchmarks/gpu.py --dry-run``)."""
    global N, MICRO, MAX_LEN, VOCAB, WIDTH, LAYERS, BUDGET, MULTIPLE, SHAPES
    N, MICRO, MAX_LEN, VOCAB, WIDTH, LAYERS, BUDGET, MULTIPLE, SHAPES = (
        16,
        4,
        64,
        128,
        32,
        1,
        256,
        16,
        2,
    )


def on_device(batch: dict) -> dict:
    return {k: v.to(DEVICE) for k, v in batch.items()}


STDLIB = (
    "os re json collections itertools functools pathlib argparse logging subprocess typing "
    "dataclasses asyncio email unittest decimal fractions statistics textwrap string csv sqlite3 "
    "urllib.parse datetime calendar random math heapq shutil tempfile zipfile tarfile pickle copy "
    "pprint inspect ast dis tokenize enum contextlib io threading multiprocessing queue socket "
    "ssl signal traceback warnings weakref hashlib base64 struct codecs locale difflib html "
    "smtplib uuid ipaddress operator numbers array timeit pdb doctest configparser zlib lzma "
    "platform shlex optparse graphlib zoneinfo types concurrent.futures selectors email.message "
    "collections.abc importlib.util unittest.mock xml.etree.ElementTree http.client"
).split()


def docstring_lengths() -> list[int]:
    """Token lengths of the standard library's docstrings (byte-level BPE trained on them)."""
    from tokenizers import ByteLevelBPETokenizer

    docs = []
    for name in STDLIB:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 20:
                docs.append(doc)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(docs, vocab_size=VOCAB, min_frequency=2, show_progress=False)
    return [min(len(e.ids), MAX_LEN) for e in tokenizer.encode_batch(docs)]


def lognormal_lengths(gen: torch.Generator, n: int = 20_000) -> list[int]:
    values = torch.empty(n).log_normal_(math.log(96), 0.8, generator=gen)
    return values.clamp(8, MAX_LEN).long().tolist()


def batches(lengths: list[int], steps: int, gen: torch.Generator) -> list[dict]:
    """``steps`` logical batches of ``N`` sequences drawn from ``lengths``, right-padded."""
    out = []
    for _ in range(steps):
        picked = torch.tensor(lengths)[torch.randint(len(lengths), (N,), generator=gen)]
        width = int(picked.max())
        mask = torch.arange(width)[None] < picked[:, None]
        ids = torch.randint(1, VOCAB, (N, width), generator=gen) * mask
        out.append(
            {
                "input_ids": ids,
                "attention_mask": mask.long(),
                "labels": ids.masked_fill(~mask, -100),
            }
        )
    return out


def make_model(kind: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=WIDTH, n_layer=LAYERS, n_head=4
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=WIDTH * 43 // 16,
            num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    return model.to(DEVICE, dtype).train()


def loss_fn(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return bigbatch.token_cross_entropy(logits, batch["labels"], shift=True)


def fixed_pieces(batch: dict) -> list[dict]:
    """8 micro-batches of 8 in the batch's order, each trimmed to its own longest sequence."""
    pieces = []
    for start in range(0, N, MICRO):
        rows = {k: v[start : start + MICRO] for k, v in batch.items()}
        width = int(rows["attention_mask"].sum(-1).max())
        pieces.append({k: v[:, :width] for k, v in rows.items()})
    return pieces


def padding(pieces: list[dict]) -> float:
    real = sum(int(p["attention_mask"].sum()) for p in pieces)
    return 1 - real / sum(p["input_ids"].numel() for p in pieces)


class FixedCount:
    """The fixed-count cut, through the engine's low-level path (exact, like the token windows)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(self, batch: dict) -> float:
        pieces = fixed_pieces(batch)
        for i, piece in enumerate(pieces):
            with self.acc.micro_batch(last=i == len(pieces) - 1):
                self.acc.backward(*loss_fn(self.acc.model, piece))
        self.acc.step()
        return padding(pieces)


class TokenWindows:
    def __init__(self, model: torch.nn.Module, budget: int, **kwargs) -> None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.acc = bigbatch.Accumulator(model, opt, micro_batch_tokens=budget, **kwargs)

    def step(self, batch: dict) -> float:
        result = self.acc.train_step(batch, loss_fn)
        return 1 - result.tokens / result.padded_tokens


def timed(runs: dict, data: list[dict], rounds: int) -> dict[str, tuple[float, float, int]]:
    """Round-robin: ``{name: (padding, median s/step, peak bytes)}``."""
    stats: dict[str, list] = {name: [[], [], []] for name in runs}
    with small_mmap_threshold():
        for r in range(rounds):
            batch = data[r % len(data)]
            for name in list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]:
                with bigbatch.measure_peak("cpu") as peak:
                    start = time.perf_counter()
                    pad = runs[name].step(batch)
                    seconds = time.perf_counter() - start
                for values, v in zip(stats[name], (pad, seconds, peak.peak_bytes), strict=True):
                    values.append(v)
    return {
        name: (statistics.mean(p), statistics.median(s), max(m))
        for name, (p, s, m) in stats.items()
    }


def part1(rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    distributions = {"log-normal": lognormal_lengths(gen), "stdlib docstrings": docstring_lengths()}
    for data_name, lengths in distributions.items():
        data = batches(lengths, rounds, gen)
        budget = max(p["input_ids"].numel() for b in data for p in fixed_pieces(b))
        for kind in ("gpt2", "llama"):
            base = make_model(kind)
            runs = {
                "fixed count (8 x 8)": FixedCount(copy.deepcopy(base)),
                f"token windows ({budget} tokens)": TokenWindows(copy.deepcopy(base), budget),
            }
            for run in runs.values():  # warm-up
                run.step(data[0])
            found = timed(runs, data, rounds)
            t0 = found["fixed count (8 x 8)"][1]
            rows = [
                [name, f"{pad:.0%}", f"{s:.2f}", f"{s / t0:.2f}x", mib(peak)]
                for name, (pad, s, peak) in found.items()
            ]
            print_table(
                f"{kind}, {data_name} lengths: one step of {N} sequences",
                ["cut", "padding", "s/step", "vs fixed", "peak"],
                rows,
            )


def part2(rounds: int) -> None:
    import torch._dynamo

    gen = torch.Generator().manual_seed(1)
    data = [on_device(b) for b in batches(lognormal_lengths(gen), rounds + 2, gen)]
    budget = BUDGET
    base = make_model("gpt2")
    configs = {
        "eager, token windows": (False, {}),
        f"compiled, token windows, pad_to_multiple_of={MULTIPLE}": (
            True,
            {"pad_to_multiple_of": MULTIPLE},
        ),
        "compiled, every micro-batch padded to the longest": (
            True,
            {"pad_to_multiple_of": MAX_LEN},
        ),
    }
    rows, steady = [], {}
    for name, (compiled, kwargs) in configs.items():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = copy.deepcopy(base)
        compile_ = torch.compile(model, backend=BACKEND) if compiled else model
        run = TokenWindows(compile_, budget, **kwargs)
        start = time.perf_counter()
        for batch in data[:2]:  # compiles (every bucket seen in the first steps, mostly)
            run.step(batch)
        synchronize(DEVICE)
        warm = time.perf_counter() - start
        seconds, padding = [], []
        for batch in data[2:]:
            t = time.perf_counter()
            padding.append(run.step(batch))
            synchronize(DEVICE)
            seconds.append(time.perf_counter() - t)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        steady[name] = statistics.median(seconds)
        rows.append(
            [name, f"{statistics.mean(padding):.0%}", graphs, f"{warm:.0f}", f"{steady[name]:.3f}"]
        )
    print_table(
        f"GPT-2 under torch.compile ({BACKEND}, {device_name(DEVICE)}), log-normal lengths",
        ["run", "padding", "graphs compiled", "first 2 steps s", "steady s/step"],
        rows,
    )
    eager, best = steady["eager, token windows"], min(list(steady.values())[1:])
    print(
        f"\nfastest compiled steady state / eager: {best / eager:.2f} (issue 22's target: below 1, "
        f"{'met' if best < eager else 'NOT met'})"
    )


def float64_compiled_vs_eager() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    batch = batches(lognormal_lengths(gen), 1, gen)[0]
    batch = on_device({k: v[:16, :128] for k, v in batch.items()})
    batch["attention_mask"][:, 0] = 1
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    eager = make_model("gpt2", torch.float64)
    for m in eager.modules():  # Inductor draws dropout masks from its own generator
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    compiled, init = copy.deepcopy(eager), copy.deepcopy(eager)
    kw = {"budget": 512, "pad_to_multiple_of": MULTIPLE}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        TokenWindows(eager, **kw).step(batch)
        TokenWindows(torch.compile(compiled, backend=BACKEND), **kw).step(batch)
    # the updates compared (zero-initialised biases make a per-tensor relative error meaningless)
    triples = zip(init.parameters(), eager.parameters(), compiled.parameters(), strict=True)
    eager_update, compiled_update = zip(*[(e - i, c - i) for i, e, c in triples], strict=True)
    flat = [torch.cat([t.detach().flatten() for t in u]) for u in (eager_update, compiled_update)]
    error = float((flat[0] - flat[1]).norm() / flat[0].norm())
    print(
        f"\nfloat64, dropout off: compiled ({BACKEND}) vs eager, one AdamW step's update: "
        f"relative difference {error:.1e}"
    )


def bucket_padding(windows: int = 50, budget: int = 4096, multiple: int = 64) -> None:
    """Padding of the ways to give a compiler few shapes, computed on the cut alone (no model)."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor(lognormal_lengths(gen))
    ways = {  # rows padded to: a one-shape bucket, a power of two, none (rows left dynamic)
        "rows padded to the bucket's row count (one shape per bucket)": ("mixed", "full"),
        "rows padded to a power of two": ("mixed", "pow2"),
        "rows dynamic, one length bucket per micro-batch": ("bucket", "none"),
    }
    rows = []
    for name, (group, pad_rows) in ways.items():
        real = computed = 0
        shapes = set()
        for _ in range(windows):
            order = sorted(lengths[torch.randint(len(lengths), (N,), generator=gen)].tolist())[::-1]
            real, start = real + sum(order), 0
            while start < N:
                length = -(-order[start] // multiple) * multiple
                full = max(1, budget // length)
                take = min(full, N - start)
                if group == "bucket":  # only samples of this length bucket
                    shorter = (r for r in range(1, take) if order[start + r] <= length - multiple)
                    take = next(shorter, take)
                pow2 = min(full, 1 << (take - 1).bit_length())
                padded = {"full": full, "pow2": pow2}.get(pad_rows, take)
                computed += padded * length
                shapes.add((padded if pad_rows != "none" else 0, length))
                start += take
        rows.append([name, f"{1 - real / computed:.0%}", len(shapes)])
    print_table(
        f"Padding for few shapes: {windows} windows of {N} log-normal lengths, {budget} tokens, "
        f"pad_to_multiple_of={multiple} (no model run)",
        ["rows", "padding", "shapes"],
        rows,
    )


def ceiling(rounds: int) -> None:
    import torch._dynamo as dynamo

    bucket_padding(budget=BUDGET, multiple=MULTIPLE)

    shapes = [(BUDGET // (MAX_LEN >> i), MAX_LEN >> i) for i in range(SHAPES)]
    base, gen = make_model("gpt2"), torch.Generator().manual_seed(3)
    inputs = [torch.randint(1, VOCAB, shape, generator=gen).to(DEVICE) for shape in shapes]

    def one_pass(model: torch.nn.Module, mark: bool) -> float:
        start = time.perf_counter()
        for ids in inputs:
            ids, mask = ids.clone(), torch.ones_like(ids)
            for t in (ids, mask) if mark else ():  # rows dynamic, length static
                dynamo.maybe_mark_dynamic(t, 0)
                dynamo.mark_static(t, 1)
            loss_fn(model, {"input_ids": ids, "attention_mask": mask, "labels": ids})[0].backward()
        synchronize(DEVICE)
        return time.perf_counter() - start

    runs = {
        "eager": (copy.deepcopy(base), False),
        "compiled, one graph per shape": (
            torch.compile(copy.deepcopy(base), dynamic=False, backend=BACKEND),
            False,
        ),
        "compiled, rows dynamic": (torch.compile(copy.deepcopy(base), backend=BACKEND), True),
    }
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, len(shapes) + 1)
    for model, mark in runs.values():  # compiles
        one_pass(model, mark)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):  # round-robin, so a change of load falls on every run
        for name in list(runs)[r % 3 :] + list(runs)[: r % 3]:
            seconds[name].append(one_pass(*runs[name]))
    eager = statistics.median(seconds["eager"])
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    rows = [[name, f"{s:.2f}", f"{s / eager:.2f}x"] for name, s in medians.items()]
    print_table(
        f"GPT-2 forward + backward, the same {SHAPES} shapes of {BUDGET:,} tokens (no padding), "
        f"{BACKEND} on {device_name(DEVICE)}",
        ["run", "s per pass", "vs eager"],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    global DEVICE, BACKEND
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per cut")
    parser.add_argument("--compile", action="store_true", help="also run part 2 (slow on a CPU)")
    parser.add_argument(
        "--ceiling", action="store_true", help="part 3: compile's own gain (only it, or after 2)"
    )
    parser.add_argument(
        "--device", default="cpu", help="where parts 2 and 3 run (cuda: part 1 is left out)"
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    args = parser.parse_args(argv)
    DEVICE, BACKEND = torch.device(args.device), args.backend
    torch.set_num_threads(2)
    print(f"device: {device_name(DEVICE)}")
    if args.ceiling and not args.compile:
        return ceiling(args.rounds)
    if DEVICE.type == "cpu":
        part1(args.rounds)
    if args.compile:
        part2(args.rounds)
        float64_compiled_vs_eager()
    if args.ceiling:
        ceiling(args.rounds)


if __name__ == "__main__":
    main()
