"""Packed windows vs token windows vs fixed-count micro-batches on variable-length text.

The same logical batch (``N`` sequences, one optimizer step) of a transformers GPT-2 and a
Llama built from configs (no weights downloaded), lengths 20 to 1,000 tokens (log-normal,
median 150), cut three ways:

* fixed count: micro-batches of ``MICRO`` sequences in the batch's order, each trimmed to its
  own longest (``Accumulator(micro_batch_size=MICRO)``);
* token windows: ``Accumulator(micro_batch_tokens=B)``, sorted by length, trimmed;
* packed: the samples packed whole into rows of ``PACK`` tokens
  (``Accumulator(micro_batch_tokens=B, pack=PACK)``), ``B // PACK`` rows a micro-batch, no
  attention mask (transformers keeps the samples apart by ``position_ids``: SDPA with a dense
  block mask on this CPU).

``B`` is the fixed count's largest micro-batch in padded tokens, rounded up to rows of ``PACK``.
Reported per cut: time per real token (median step over rounds taken round-robin, the same real
tokens in every cut), the padding share of the tokens computed, peak memory per step (the
process's resident-set high-water mark under the small mmap threshold, as bigbatch's demo
measures), the micro-batch shapes seen (a compiled model compiles one graph per shape) and, in
float64 on a smaller window, the largest relative parameter difference after one SGD step from
the unpacked full batch (Llama's RMSNorm run in float64: its float32 island would blur it).

Run: PYTHONPATH=src python benchmarks/packing.py [--rounds 3] [--samples 32] [--models gpt2,llama]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
import types

import torch
from _measure import device_name, mib, print_table

import bigbatch
from bigbatch.core._pack import pack
from bigbatch.core.ledger import FlopModel, flop_model, measure_peak_flops, step_ledger
from bigbatch.core.peak import small_mmap_threshold

VOCAB, WIDTH, LAYERS, MICRO, PACK, SHORTEST, LONGEST = 2048, 128, 2, 8, 1024, 20, 1000


def lengths_drawn(gen: torch.Generator, n: int) -> list[int]:
    values = torch.empty(n).log_normal_(math.log(150), 0.9, generator=gen)
    return values.clamp(SHORTEST, LONGEST).long().tolist()


def batch_of(lengths: list[int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Right-padded text in the transformers convention."""
    picked = torch.tensor(lengths)
    mask = torch.arange(int(picked.max()))[None] < picked[:, None]
    ids = torch.randint(1, VOCAB, mask.shape, generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


def rms_float64(self, hidden: torch.Tensor) -> torch.Tensor:
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * hidden * torch.rsqrt(variance + self.variance_epsilon)


def make_model(kind: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=PACK, n_embd=WIDTH, n_layer=LAYERS, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=WIDTH * 43 // 16,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=PACK,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        for module in model.modules():  # (float64 runs: no float32 island)
            if type(module).__name__.endswith("RMSNorm") and dtype == torch.float64:
                module.forward = types.MethodType(rms_float64, module)
    model.config.use_cache = False
    return model.to(dtype).train()


def padded_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return bigbatch.token_cross_entropy(logits, batch["labels"], shift=True)


def packed_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return bigbatch.token_cross_entropy(logits, batch["labels"], shift=True)


class Cut:
    """One way to cut the window, run by an ``Accumulator``; ``shapes``: every micro-batch's
    shape seen, ``last``: the last step's micro-batch shapes."""

    def __init__(self, model: torch.nn.Module, how: str, budget: int) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cut = {"micro_batch_size": MICRO} if how == "fixed" else {"micro_batch_tokens": budget}
        if how == "packed":  # the model's traps checked, the first window audited (Note [packing
            cut["pack"] = PACK  # audit]): its cost is in the first step, not in the timed ones
        self.acc = bigbatch.Accumulator(model, opt, **cut)
        self.loss = packed_loss if how == "packed" else padded_loss
        self.shapes: set[tuple[int, ...]] = set()
        self.last: list[tuple[int, ...]] = []

    def step(self, batch: dict) -> bigbatch.StepResult:
        self.last = []

        def loss(model, piece):
            self.last.append(tuple(piece["input_ids"].shape))
            return self.loss(model, piece)

        result = self.acc.train_step(batch, loss)
        self.shapes.update(self.last)
        return result


def timed(cuts: dict[str, Cut], data: list[dict], rounds: int, flops: FlopModel) -> dict:
    """Round-robin, per cut: the median step's seconds, and the mean padding, micro-batches and
    computed / model FLOPs (``bigbatch.core.ledger``), and the largest peak."""
    found: dict[str, dict[str, list]] = {name: {} for name in cuts}
    with small_mmap_threshold():
        for r in range(rounds):
            batch = data[r % len(data)]
            lengths = batch["attention_mask"].sum(-1).tolist()
            for name in list(cuts)[r % len(cuts) :] + list(cuts)[: r % len(cuts)]:
                with bigbatch.measure_peak("cpu") as peak:
                    start = time.perf_counter()
                    result = cuts[name].step(batch)
                    seconds = time.perf_counter() - start
                ledger = step_ledger(flops, result.count, lengths, cuts[name].last)
                got = {
                    "seconds": seconds,
                    "padding": 1 - ledger.token_efficiency,
                    "micro": result.micro_batches,
                    "computed": ledger.computed_flops / ledger.model_flops,
                    "flops": ledger.model_flops,
                    "peak": peak.peak_bytes,
                }
                for key, value in got.items():
                    found[name].setdefault(key, []).append(value)
    return {
        name: {
            k: max(v)
            if k == "peak"
            else (statistics.median if k == "seconds" else statistics.mean)(v)
            for k, v in got.items()
        }
        for name, got in found.items()
    }


def float64_difference(kind: str, how: str, batch: dict, budget: int) -> float:
    """One SGD step of the cut in float64 against the unpacked full batch's: the largest relative
    parameter difference."""
    base = make_model(kind, torch.float64)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    loss_sum, count = padded_loss(ref, batch)
    (loss_sum / count).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    Cut(model, how, budget).step(batch)
    pairs = zip(ref.parameters(), model.parameters(), strict=True)
    with torch.no_grad():
        return max(float((a - b).norm() / a.norm().clamp_min(1e-30)) for a, b in pairs)


def run(kind: str, n: int, rounds: int, peak: tuple[float, str]) -> None:
    gen = torch.Generator().manual_seed(0)
    data = [batch_of(lengths_drawn(gen, n), gen) for _ in range(rounds)]
    widest = max(
        min(MICRO, n - s) * int(b["attention_mask"][s : s + MICRO].sum(-1).max())
        for b in data
        for s in range(0, n, MICRO)
    )
    budget = -(-widest // PACK) * PACK  # rows of PACK within the fixed count's widest
    base = make_model(kind)
    flops = flop_model(base)
    names = {
        "fixed": f"fixed count ({MICRO} a micro-batch)",
        "tokens": f"token windows ({budget} tokens)",
        "packed": f"packed ({budget // PACK} x {PACK})",
    }
    cuts = {how: Cut(copy.deepcopy(base), how, budget) for how in names}
    for cut in cuts.values():  # warm-up
        cut.step(data[0])
    found = timed(cuts, data, rounds, flops)
    tokens = statistics.mean(int(b["attention_mask"].sum()) for b in data)
    small = batch_of(lengths_drawn(torch.Generator().manual_seed(1), 12), gen)
    small_budget = -(-int(small["attention_mask"].sum(-1).max()) // PACK) * PACK
    rows, t0 = [], found["fixed"]["seconds"]
    for how, got in found.items():
        seconds = got["seconds"]
        rows.append(
            [
                names[how],
                f"{seconds / tokens * 1e6:.1f}",
                f"{seconds / t0:.2f}x",
                f"{got['micro']:.1f}",
                f"{got['padding']:.0%}",
                f"{got['computed']:.2f}x",
                f"{got['flops'] / seconds / peak[0]:.1%}",
                mib(got["peak"]),
                len(cuts[how].shapes),
                f"{float64_difference(kind, how, small, small_budget):.0e}",
            ]
        )
    print_table(
        f"{kind}, {n} sequences of {SHORTEST}-{LONGEST} tokens (log-normal), {tokens:,.0f} real "
        f"tokens a step, {device_name('cpu')}",
        [
            "cut",
            "µs / real token",
            "vs fixed",
            "micro-batches",
            "padding",
            "FLOPs computed / model",
            "MFU",
            "peak",
            "shapes",
            "float64 diff",
        ],
        rows,
    )
    varlen = varlen_share(flops, data)
    print(
        f"\npacked rows computed {found['packed']['computed']:.2f}x the model's FLOPs: a dense "
        f"block mask (SDPA on this CPU) computes every score of a {PACK}-token row. A varlen "
        f"kernel (flash attention with cu_seq_lens: PackCut(varlen=True)) computes each "
        f"sample's own, {varlen:.2f}x."
    )


def varlen_share(flops: FlopModel, data: list[dict]) -> float:
    """What packed rows would compute with a varlen kernel, over the model's FLOPs: the padding's
    linear layers, and each sample's full attention square (no causal skipping)."""
    shares = []
    for batch in data:
        lengths = batch["attention_mask"].sum(-1).tolist()
        rows = len(pack(lengths, PACK))
        square = FlopModel(flops.parameters, flops.layers, flops.width, causal=False)
        computed = step_ledger(square, 0, lengths, [(rows, PACK)])
        padding = 6 * flops.parameters * (computed.computed_tokens - computed.input_tokens)
        shares.append(
            (computed.model_flops + padding) / step_ledger(flops, 0, lengths, []).model_flops
        )
    return statistics.mean(shares)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per cut")
    parser.add_argument("--samples", type=int, default=32, help="sequences per step")
    parser.add_argument("--models", default="gpt2,llama", help="gpt2, llama or both")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    peak = measure_peak_flops(torch.float32, "cpu")
    print(f"peak: {peak[0] / 1e9:.0f} GFLOP/s ({peak[1]}), the MFU's denominator")
    for kind in args.models.split(","):
        run(kind, args.samples, args.rounds, peak)


if __name__ == "__main__":
    main()
