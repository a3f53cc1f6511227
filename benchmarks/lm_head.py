"""The language-model head: the model's own loss, bigbatch's chunked head, TRL's fused head.

Three parts, each measured side by side in one process (Note [honest CPU peaks]: glibc's mmap
threshold fixed at 64 KiB for the whole run, so every peak is live tensors, not fragmentation):

1. **The head** (``--part head``): GPT-2 (tied embeddings) and Llama (untied ``lm_head``) built
   from configs, vocabularies of 32K and 128K, hidden size ``--dim``, 2K to 8K tokens per
   micro-batch (``--full``: to 16K, skipping what would not fit in this machine's memory), 10%
   of the labels padding. Given the hidden states, each loss runs forward and backward: the
   model's own (``model.loss_function`` on ``lm_head(hidden)``: transformers'
   ``ForCausalLMLoss``), ``bigbatch.head_cross_entropy`` (its default chunk; and its own path,
   forced, as label smoothing, the z-loss, half precision and torch < 2.13 run), TRL's fused head
   (``trl.kernels.ChunkedLogProbFunction``, what ``add_fused_lm_head`` and the SFT trainer run).
   "Added MiB" is the peak above what was in use before (the hidden states and weights were),
   the head's own memory; time is the median of ``--rounds`` interleaved rounds. The target:
   bigbatch's added memory <= 0.25x the model's own at <= 1.0x its time.
2. **The frontier** (``--part frontier``): ``benchmarks/memory.py``'s checkpointing frontier
   (GPT-2-like, 4 layers, width 256, 128 tokens, vocabulary 8,192, batch 8) with the model's
   own loss and with the chunked head (``--chunk`` tokens per chunk: the default chunk holds
   this micro-batch's 1,024 tokens whole), all twelve configurations in the same interleaved
   rounds, every ratio to the own loss without checkpointing. The target: >= 50% of the
   activation memory saved at <= 1.15x the time.
3. **The token budget** (``--part budget``): a 2-layer Llama (hidden ``--dim``, vocabulary
   128K) trains one batch of variable-length text (``--batch`` sequences of up to ``--seq``
   tokens) cut by token budgets, AdamW: the peak of a step (a fresh model copy, its optimizer
   state, two steps) and the median step time, per budget, with and without the chunked head;
   the largest budget whose peak fits ``--budget`` (larger ones are not run once one does not
   fit). The target: it at least doubles.

Run:
    PYTHONPATH=src python benchmarks/lm_head.py                  # all three (~30 min, 2 cores)
    PYTHONPATH=src python benchmarks/lm_head.py --part head --full
    PYTHONPATH=src python benchmarks/lm_head.py --chunks         # time per chunk size (Note [chunk size])
    PYTHONPATH=src python benchmarks/lm_head.py --quick          # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory as frontier  # noqa: E402  # benchmarks/memory.py
from _measure import device_name, print_table  # noqa: E402

import bigbatch  # noqa: E402
from bigbatch.core import head as chunked  # noqa: E402
from bigbatch.core._units import parse_bytes  # noqa: E402
from bigbatch.core.head import with_chunked_head  # noqa: E402
from bigbatch.core.peak import small_mmap_threshold  # noqa: E402

VOCABS = (32768, 131072)
CASES = [("gpt2", 32768, (2048, 4096, 8192)), ("llama", 131072, (2048, 4096))]
"""The default sweep (family, vocabulary, tokens): a 2-core CPU takes ~10 minutes for it."""
FULL_TOKENS = (2048, 4096, 8192, 16384)
HEAD_MEMORY, HEAD_TIME = 0.25, 1.0  # the head's target: added memory and time, to the own loss


def build(family: str, vocab: int, dim: int, layers: int = 1) -> nn.Module:
    """A causal LM of ``family`` from its config (random weights, nothing downloaded)."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=max(1, dim // 64),
            n_positions=2048, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config).train()
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=max(1, dim // 64), num_key_value_heads=max(1, dim // 64),
        max_position_embeddings=2048, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


# ----------------------------------------------------------------------------- 1. the head
def head_losses(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> dict[str, Callable[[], float]]:  # fmt: skip
    """Each loss's forward + backward from ``hidden``; each returns the loss value."""
    head, vocab = model.get_output_embeddings(), model.config.vocab_size

    def own() -> torch.Tensor:
        return model.loss_function(logits=head(hidden), labels=labels, vocab_size=vocab)

    def ours() -> torch.Tensor:
        loss_sum, count = bigbatch.head_cross_entropy(hidden, head, labels)
        return loss_sum / count

    def fallback() -> torch.Tensor:  # bigbatch's own path, as on torch < 2.13
        op, chunked.LINEAR_CE = chunked.LINEAR_CE, None
        try:
            return ours()
        finally:
            chunked.LINEAR_CE = op

    def fused() -> torch.Tensor:
        from trl.kernels import ChunkedLogProbFunction

        h, y = hidden[:, :-1].reshape(-1, hidden.shape[-1]), labels[:, 1:].reshape(-1)
        kept = y != -100
        log_probs = ChunkedLogProbFunction.apply(
            h[kept], head.weight, head.bias, y[kept], 1.0, 32768, None, 1.0, ("log_probs",)
        )[0]  # add_fused_lm_head's call, with its tile of 32,768 words
        return -log_probs.sum() / kept.sum()

    def run(loss: Callable[[], torch.Tensor]) -> Callable[[], float]:
        def step() -> float:
            value = loss()
            value.backward()
            hidden.grad = None
            model.zero_grad(set_to_none=True)
            return float(value.detach())

        return step

    found = {"model's own loss": run(own), "bigbatch chunked head": run(ours),
             "bigbatch own path": run(fallback)}  # fmt: skip
    try:
        import trl.kernels  # noqa: F401

        found["TRL fused head"] = run(fused)
    except ImportError:  # TRL not installed: its column says so
        pass
    return found


def available_bytes() -> int:
    with open("/proc/meminfo") as info:
        return next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable"))


def measure_head(family: str, vocab: int, tokens: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:  # fmt: skip
    """Added peak bytes and median seconds of each loss at ``tokens`` per micro-batch."""
    model, seq = build(family, vocab, args.dim), min(tokens, 1024)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens // seq, seq, args.dim, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (tokens // seq, seq), generator=gen)
    labels[:, -seq // 10 :] = -100  # 10% padding
    losses = head_losses(model, hidden, labels)
    if 3 * tokens * vocab * 4 > 0.8 * available_bytes():  # three float32 copies of the logits
        losses.pop("model's own loss")
    rows: dict[str, dict[str, float]] = {}
    for name, step in losses.items():  # peaks first, each after one untimed call
        value = step()
        with bigbatch.measure_peak("cpu") as peak:
            step()
        rows[name] = {"added": peak.peak_bytes, "loss": value, "times": []}  # type: ignore[dict-item]
    for _ in range(args.rounds):  # interleaved: a load that comes and goes touches all alike
        for name, step in losses.items():
            start = time.perf_counter()
            step()
            rows[name]["times"].append(time.perf_counter() - start)  # type: ignore[attr-defined]
    for row in rows.values():
        row["seconds"] = statistics.median(row.pop("times"))  # type: ignore[arg-type]
    return rows


NAMES = ["model's own loss", "bigbatch chunked head", "bigbatch own path", "TRL fused head"]


def run_head(args: argparse.Namespace) -> None:
    verdicts: list[str] = []
    for family, vocab, sweep in args.cases:
        table = [head_row(family, vocab, tokens, args, verdicts) for tokens in sweep]
        headers = ["tokens"] + [f"{n} {c}" for n in ("own", "bigbatch", "fallback", "TRL")
                                for c in ("added MiB", "s", "memory", "time")]  # fmt: skip
        print_table(f"The head, {family} (hidden {args.dim}, vocabulary {vocab:,}): forward + "
                    "backward from the hidden states, ratios to the model's own loss", headers, table)  # fmt: skip
    print(f"\n- target: the chunked head's added memory <= {HEAD_MEMORY}x the model's own loss at "
          f"<= {HEAD_TIME}x its time:")  # fmt: skip
    for line in verdicts:
        print(f"  - {line}")


def head_row(family: str, vocab: int, tokens: int, args: argparse.Namespace, verdicts: list[str]) -> list[object]:  # fmt: skip
    """One row of the head's table; its verdict appended to ``verdicts``."""
    rows = measure_head(family, vocab, tokens, args)
    own = rows.get(NAMES[0])
    cells: list[object] = [f"{tokens:,}"]
    for name in NAMES:
        r = rows.get(name)
        if r is None:
            cells += ["does not fit" if name == NAMES[0] else "not installed", "-", "-", "-"]
            continue
        cells += [f"{r['added'] / 2**20:,.0f}", f"{r['seconds']:.2f}",
                  *(_ratios(r, own) if own else ["-", "-"])]  # fmt: skip
    if own:
        ours = rows[NAMES[1]]
        memory, seconds = ours["added"] / own["added"], ours["seconds"] / own["seconds"]
        met = memory <= HEAD_MEMORY and seconds <= HEAD_TIME
        verdicts.append(f"{family} {vocab // 1024}K, {tokens:,} tokens: {memory:.2f}x the "
                        f"memory at {seconds:.2f}x the time: {'met' if met else 'NOT met'}")  # fmt: skip
        spread = max(abs(r["loss"] - own["loss"]) for r in rows.values()) / own["loss"]
        assert spread < 1e-4, f"the losses disagree ({spread:.1e}): {rows}"
    return cells


def _ratios(r: dict[str, float], own: dict[str, float]) -> list[str]:
    return [f"{r['added'] / own['added']:.2f}", f"{r['seconds'] / own['seconds']:.2f}"]


def run_chunks(args: argparse.Namespace) -> None:
    """Time of the chunked head per chunk size, 4,096 tokens (Note [chunk size])."""
    for vocab in args.vocabs:
        model, gen = build("llama", vocab, args.dim), torch.Generator().manual_seed(0)
        hidden = torch.randn(4, 1024, args.dim, generator=gen).requires_grad_()
        labels = torch.randint(0, vocab, (4, 1024), generator=gen)
        head = model.get_output_embeddings()
        chunks = [16, 32, 64, 128, 256, 512, 1024, 2048]
        times: dict[int, list[float]] = {c: [] for c in chunks}
        for _ in range(args.rounds + 1):
            for c in chunks:
                start = time.perf_counter()
                loss_sum, count = bigbatch.head_cross_entropy(hidden, head, labels, chunk_tokens=c)
                (loss_sum / count).backward()
                times[c].append(time.perf_counter() - start)
        table = [[c, f"{c * vocab * 4 / 2**20:,.0f}", f"{statistics.median(t[1:]):.2f}"]
                 for c, t in times.items()]  # fmt: skip
        print_table(f"Chunk sizes, vocabulary {vocab:,}, hidden {args.dim}, 4,096 tokens (the "
                    "first round untimed)", ["chunk tokens", "chunk logits MiB", "s"], table)  # fmt: skip


# ----------------------------------------------------------------------------- 2. the frontier
def run_frontier(args: argparse.Namespace) -> None:
    settings = argparse.Namespace(layers=4, dim=256, seq=128, vocab=8192, batch=8, device="cpu")
    if args.quick:
        vars(settings).update(layers=2, dim=128, seq=32, vocab=512, batch=4)
    model, ids, own_loss = frontier.gpt2(settings, "cpu")

    def chunked(m: nn.Module, b: torch.Tensor) -> torch.Tensor:  # the Python API, its chunk given
        hidden = m.transformer(input_ids=b).last_hidden_state
        loss_sum, count = bigbatch.head_cross_entropy(hidden, m.lm_head, b, chunk_tokens=args.chunk)
        return loss_sum / count

    points = {  # every configuration of both losses, timed in the same interleaved rounds
        f"{name} {label}".replace("own none", "none"): frontier.FrontierPoint(model, f, policy, loss)
        for name, loss in (("own", own_loss), ("chunked", chunked))
        for label, f, policy in frontier.frontier_configs("cpu")
    }  # fmt: skip
    for i in range(2 + args.rounds):  # two warm-up rounds: allocator, thread pools, AdamW state
        for point in points.values():
            if i == 2:  # the warm-up's readings go
                point.seconds.clear()
                point.activation_bytes.clear()
            point.step(ids, "cpu")
    rows = {k: {"seconds": statistics.median(p.seconds), "activation": statistics.median(p.activation_bytes)}
            for k, p in points.items()}  # fmt: skip
    title = (f"Checkpointing frontier with the chunked head ({args.chunk} tokens per chunk), "
             f"GPT-2-like (4 layers, width 256, vocabulary {settings.vocab:,}, batch "
             f"{settings.batch} x {settings.seq}), on {device_name('cpu')}, median of "
             f"{args.rounds} interleaved rounds; ratios to the model's own loss without "
             "checkpointing ('none')")  # fmt: skip
    frontier.print_frontier(rows, title)


# ----------------------------------------------------------------------------- 3. the token budget
def text_batch(args: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.seq // 4, args.seq + 1, (args.batch,), generator=gen)
    mask = torch.arange(args.seq)[None] < lengths[:, None]
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return bigbatch.token_cross_entropy(out.logits, batch["labels"], shift=True)


def peak_of(model: nn.Module, batch: dict, loss: Callable, tokens: int) -> tuple[int, Callable]:
    """Peak of a fresh copy, its AdamW state and two steps; and a step of that copy, to time."""
    with bigbatch.measure_peak("cpu") as peak:
        work = copy.deepcopy(model)
        acc = bigbatch.Accumulator(work, torch.optim.AdamW(work.parameters(), lr=1e-4),
                                   micro_batch_tokens=tokens)  # fmt: skip
        for _ in range(2):
            acc.train_step(batch, loss(work))
    return peak.peak_bytes, lambda: acc.train_step(batch, loss(work))


def run_budget(args: argparse.Namespace) -> None:
    vocab = args.vocabs[-1]
    model, batch = build("llama", vocab, args.dim, layers=2), text_batch(args, vocab)
    budget = parse_bytes(args.budget) or 0
    losses = {"own": lambda m: lm_loss, "chunked": lambda m: with_chunked_head(lm_loss, m)}
    peaks: dict[tuple[str, int], int] = {}
    steps: dict[tuple[str, int], Callable] = {}
    for tokens in args.budget_tokens:  # peaks; larger budgets not run once one does not fit
        for name, loss in losses.items():
            if all(peaks.get((name, t), 0) <= budget for t in args.budget_tokens if t < tokens):
                peaks[name, tokens], step = peak_of(model, batch, loss, tokens)
                if peaks[name, tokens] <= budget:
                    steps[name, tokens] = step
    times: dict[tuple[str, int], list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):  # the configurations that fit, timed in interleaved rounds
        for key, step in steps.items():
            start = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - start)
    seconds = {k: statistics.median(t) for k, t in times.items()}
    print_budget(args, vocab, batch, budget, peaks, seconds)


def print_budget(args: argparse.Namespace, vocab: int, batch: dict, budget: int,
                 peaks: dict, seconds: dict) -> None:  # fmt: skip
    table = []
    for tokens in args.budget_tokens:
        cells: list[object] = [f"{tokens:,}"]
        for name in ("own", "chunked"):
            peak, s = peaks.get((name, tokens)), seconds.get((name, tokens))
            cells += ["-" if peak is None else f"{peak / 2**20:,.0f}", "-" if s is None else f"{s:.2f}",
                      "yes" if peak is not None and peak <= budget else "no"]  # fmt: skip
        table.append(cells)
    real = int(batch["attention_mask"].sum())
    print_table(f"Token budgets under {args.budget}: Llama, 2 layers, hidden {args.dim}, vocabulary "
                f"{vocab:,}, one step of {args.batch} sequences ({real:,} real tokens), AdamW; "
                f"time: median of {args.rounds} interleaved rounds of the budgets that fit",
                ["token budget", "own peak MiB", "own s/step", "own fits", "chunked peak MiB",
                 "chunked s/step", "chunked fits"], table)  # fmt: skip
    largest = {n: max((t for (m, t) in seconds if m == n), default=0) for n in ("own", "chunked")}
    for name, t in largest.items():
        said = f"{t:,} tokens at {seconds[name, t]:.2f} s/step" if t else "none"
        print(f"- largest token budget within {args.budget}, {name}: {said}")
    grew = largest["chunked"] / largest["own"] if largest["own"] else float("inf")
    print(f"- target: the token budget that fits at least doubles: {grew:.1f}x: "
          f"{'met' if grew >= 2 else 'NOT met'}")  # fmt: skip


QUICK = {"cases": [("gpt2", 4096, (512,)), ("llama", 4096, (512,))], "vocabs": [4096], "dim": 64, "rounds": 2,
         "budget_tokens": [128, 512], "batch": 4, "seq": 128, "budget": "1GiB"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "head", "frontier", "budget"], default="all")
    parser.add_argument("--full", action="store_true", help="the head at 2K to 16K tokens")
    parser.add_argument("--chunks", action="store_true", help="only: time per chunk size")
    parser.add_argument("--dim", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--rounds", type=int, default=3, help="timed interleaved rounds")
    parser.add_argument("--chunk", type=int, default=256, help="part 2: tokens per chunk")
    parser.add_argument("--budget", default="2GiB", help="part 3's memory budget")
    parser.add_argument("--batch", type=int, default=8, help="part 3: sequences per step")
    parser.add_argument("--seq", type=int, default=512, help="part 3: longest sequence")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    args = parser.parse_args()
    full = [(f, v, FULL_TOKENS) for f in ("gpt2", "llama") for v in VOCABS]
    vars(args).update(cases=full if args.full else CASES, vocabs=list(VOCABS),
                      budget_tokens=[512, 1024, 2048, 4096])  # fmt: skip
    if args.quick:
        vars(args).update(QUICK)
    torch.set_num_threads(args.threads)
    small_mmap_threshold().__enter__()  # Note [honest CPU peaks], for every row of this process
    print(f"# bigbatch LM-head benchmark on {device_name('cpu')} (torch {torch.__version__})")
    print("command: python benchmarks/lm_head.py " + " ".join(sys.argv[1:]))
    if args.chunks:
        return run_chunks(args)
    for part, run in (("head", run_head), ("frontier", run_frontier), ("budget", run_budget)):
        if args.part in ("all", part):
            run(args)


if __name__ == "__main__":
    main()
