"""What a generated case (strategies.py) means: its model, its batches, the user's callables
(``loss_fn``, ``count_fn``, ``stats_fn``, ``lengths``) and the loss as the full batch defines it.

Every loss is made of *parts*, each a plain ``(sum, count)`` over a batch: the user's
``loss_fn`` returns them per micro-batch in the case's form, and the reference (oracle.py) adds
them up over the whole batch, ``Σ_k w_k S_k / C_k``. What a refusal of the case may name (and
whether the case is bad input that must be refused) is ``expectation``.
"""

from __future__ import annotations

import copy
import io
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from models import mlp
from oracle import OPTIMIZERS, Expect, unchanged_on_refusal
from strategies import BAD_LENGTHS, Cached, Case, Cut, Grads, Loss, Ranks, Resume, Samples, Text

import bigbatch

VOCAB = 11
PAD = -100


# ---------------------------------------------------------------------------- models
class CausalBag(nn.Module):
    """A tiny causal token model (position t sees tokens <= t: its cumulative mean), with
    position embeddings, so left and right padding differ and trimming pad columns is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.pos = nn.Parameter(torch.randn(64, 6) * 0.3)
        self.head = nn.Linear(6, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(ids) + self.pos[: ids.shape[1]])
        steps = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype)[:, None]
        return self.head(h.cumsum(1) / steps + h)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    """``"mlp"`` (6 -> 3 classes), ``"bag"``, or transformers' ``"gpt2"`` / ``"llama"`` from tiny
    configs (no download); float64."""
    if kind == "mlp":
        return mlp(seed=seed)
    if kind == "bag":
        torch.manual_seed(seed)
        return CausalBag().double()
    from integrations import hf_models

    return getattr(hf_models, kind)(seed)


def forward(kind: str, model: nn.Module, f: dict) -> torch.Tensor:
    if kind == "mlp":
        return model(f["x"])
    if kind == "bag":
        return model(f["input_ids"])
    return model(input_ids=f["input_ids"], attention_mask=f["attention_mask"]).logits


# ---------------------------------------------------------------------------- batches
def fields(data: Samples | Text, step: int) -> dict[str, Any]:
    """The named tensors of the case's batch for optimizer step ``step`` (fresh each step)."""
    g = torch.Generator().manual_seed(data.seed * 31 + step)
    return _text(data, g) if isinstance(data, Text) else _samples(data, g)


def _samples(d: Samples, g: torch.Generator) -> dict[str, Any]:
    spread = {
        "random": lambda: torch.rand(d.n, generator=g, dtype=torch.float64),
        "zeros": lambda: torch.zeros(d.n, dtype=torch.float64),
        "ones": lambda: torch.ones(d.n, dtype=torch.float64),
    }
    x = torch.randn(d.n, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (d.n,), generator=g)
    return {"x": x, "y": y, "w": spread[d.weights](), "flag": spread[d.flags]().round()}


def _text(t: Text, g: torch.Generator) -> dict[str, Any]:
    n, width = len(t.lengths), t.width
    lengths, position = torch.tensor(t.lengths), torch.arange(width)[None]
    start = torch.zeros_like(lengths) if t.side == "right" else width - lengths
    real = (position >= start[:, None]) & (position < (start + lengths)[:, None])
    # Left-padded, the first real token is unlabelled (a BOS): its prediction would read a pad
    # position's output, which transformers' models compute from a fully masked attention row,
    # ill-conditioned in float64 (gradients 1e-7 apart under any rescaling of the loss).
    first = start + max(t.prompt, t.side == "left")
    labelled = real & (position >= first[:, None])
    ids = torch.randint(1, VOCAB, (n, width), generator=g) * real
    out = {
        "input_ids": ids,
        "attention_mask": real.long(),
        "labels": ids.masked_fill(~labelled, PAD),
    }
    if "feat" in t.extras:  # per sample, though as wide as the padded length
        out["feat"] = torch.rand(n, width, generator=g, dtype=torch.float64)
    if "tokw" in t.extras:  # per shifted token: one column fewer
        out["tokw"] = torch.rand(n, width - 1, generator=g, dtype=torch.float64)
    return out


SAMPLE_KEYS = ("x", "y", "w", "flag")
TEXT_KEYS = ("input_ids", "labels", "attention_mask")


def pack(data: Samples | Text, f: dict[str, Any]) -> Any:
    """``f`` as the case's batch structure."""
    if isinstance(data, Text):
        extras = {k: f[k] for k in data.extras}
        if data.structure == "tuple":
            return tuple(f[k] for k in (*TEXT_KEYS, *data.extras))
        if data.structure == "nested":
            text = {"input_ids": f["input_ids"], "attention_mask": f["attention_mask"]}
            return {"text": text, "labels": f["labels"], **({"extra": extras} if extras else {})}
        return {k: f[k] for k in ("input_ids", "attention_mask", "labels")} | extras
    f = dict(f)
    if data.column:  # the weights as a per-sample list of strings (cut with the rows)
        f["w"] = [repr(float(v)) for v in f["w"]]
    if data.structure == "tensor":
        return torch.cat([f["x"], f["y"][:, None].double(), f["w"][:, None], f["flag"][:, None]], 1)
    if data.structure == "nested":
        return {"inputs": (f["x"],), "target": {"y": f["y"], "flag": f["flag"]}, "w": f["w"]}
    if data.structure == "dict":
        return f
    values = [f[k] for k in SAMPLE_KEYS]
    return tuple(values) if data.structure == "tuple" else values


def unpack(data: Samples | Text, batch: Any) -> dict[str, Any]:
    """The named tensors of a (micro-)batch of the case's structure."""
    if isinstance(data, Text):
        if data.structure == "tuple":
            return dict(zip((*TEXT_KEYS, *data.extras), batch, strict=True))
        if data.structure == "nested":
            return {**batch["text"], "labels": batch["labels"], **batch.get("extra", {})}
        return dict(batch)
    if data.structure == "tensor":
        return {"x": batch[:, :6], "y": batch[:, 6].long(), "w": batch[:, 7], "flag": batch[:, 8]}
    if data.structure == "nested":
        f = {"x": batch["inputs"][0], **batch["target"], "w": batch["w"]}
    else:
        f = dict(batch) if data.structure == "dict" else dict(zip(SAMPLE_KEYS, batch, strict=True))
    if data.column:
        f["w"] = torch.tensor([float(v) for v in f["w"]], dtype=torch.float64)
    return f


def batches(case: Case) -> list[Any]:
    return [pack(case.data, fields(case.data, s)) for s in range(case.steps)]


# ---------------------------------------------------------------------------- the parts of a loss
def _ce(out: torch.Tensor, f: dict) -> torch.Tensor:
    return F.cross_entropy(out, f["y"], reduction="none")


def _token_ce(logits: torch.Tensor, f: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per shifted token: cross-entropy (0 where unlabelled), and which are labelled."""
    labels = f["labels"][:, 1:]
    keep = labels != PAD
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels.clamp_min(0), reduction="none")
    return ce * keep, keep


def _labelled(f: dict) -> torch.Tensor:
    return (f["labels"][:, 1:] != PAD).sum()


def _seq(logits: torch.Tensor, f: dict) -> torch.Tensor:
    """Each row's token mean, weighted by its ``feat`` mean (GRPO's per-sequence unit)."""
    ce, keep = _token_ce(logits, f)
    weight = f["feat"].mean(-1) if "feat" in f else 1.0
    return (ce.sum(-1) / keep.sum(-1).clamp_min(1) * weight).sum()


Part = tuple[Callable[[torch.Tensor, dict], torch.Tensor], Callable[[dict], Any]]
PARTS: dict[str, dict[str, Part]] = {
    "samples": {  # (sum over the batch, its count from the batch alone)
        "ce": (lambda out, f: _ce(out, f).sum(), lambda f: float(len(f["y"]))),
        "wce": (lambda out, f: (f["w"] * _ce(out, f)).sum(), lambda f: f["w"].sum()),
        "sq": (lambda out, f: (f["flag"] * out.pow(2).sum(-1)).sum(), lambda f: f["flag"].sum()),
        "loose": (lambda out, f: out.pow(2).sum(), lambda f: f["flag"].sum()),  # sum ≠ items
    },
    "tokens": {
        "nll": (lambda out, f: _token_ce(out, f)[0].sum(), _labelled),
        "z": (
            lambda out, f: (out[:, :-1].logsumexp(-1) ** 2 * _token_ce(out, f)[1]).sum(),
            _labelled,
        ),
        "tokw": (lambda out, f: (_token_ce(out, f)[0] * f["tokw"]).sum(), _labelled),
        "seq": (_seq, lambda f: float(len(f["labels"]))),
        "loose": (lambda out, f: (out[..., 0] ** 2 * f["attention_mask"]).sum(), _labelled),
    },
}


def parts_of(case: Case) -> dict[str, Part]:
    return PARTS["samples" if case.model == "mlp" else "tokens"]


# ---------------------------------------------------------------------------- statistics
STAT_KEYS = ("s", "q", "n")  # equal shapes: matched by position instead of key, nothing fails


def statistics(case: Case, out: torch.Tensor, f: dict) -> dict[str, torch.Tensor]:
    """Additive statistics of the outputs of the real items (rows; real tokens)."""
    items = out if case.model == "mlp" else out[f["attention_mask"].bool()]
    items = items.detach()
    return {
        "s": items.sum(0),
        "q": (items**2).sum(0),
        "n": items.new_full(items[0:1].shape[1:], len(items)),
    }


def normalise(out: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """The outputs standardised by the window's statistics (a whole-batch normalisation)."""
    n = stats["n"].clamp_min(1)
    mean = stats["s"] / n
    return (out - mean) / (stats["q"] / n - mean**2 + 1).clamp_min(1e-3).sqrt()


# ---------------------------------------------------------------------------- the user's side
@dataclass
class UserFns:
    loss_fn: Callable[..., Any]
    count_fn: Callable[[Any], Any] | None = None
    stats_fn: Callable[[nn.Module, Any], Any] | None = None


def user_fns(case: Case) -> UserFns:
    """The callables a user of ``train_step`` writes for ``case`` (named neutrally: a raw
    error that quotes a function's name must not look like a refusal naming an argument)."""
    parts, loss = parts_of(case), case.loss

    def compute(model: nn.Module, mb: Any, stats: dict | None = None) -> Any:
        f = unpack(case.data, mb)
        out = forward(case.model, model, f)
        out = out if stats is None else normalise(out, stats)
        values = {k: (parts[p][0](out, f), parts[p][1](f), w) for k, p, w in loss.terms}
        if loss.form == "terms":
            return {k: (s, c) if w == 1.0 else (s, c, w) for k, (s, c, w) in values.items()}
        ((s, c, _),) = values.values()
        return s / c if loss.form == "mean" else (s, c)

    fns = UserFns(lambda model, mb: compute(model, mb))
    if loss.stats in ("fixed", "rotating", "two_args"):
        calls = itertools.count()

        def stats_of(model: nn.Module, mb: Any) -> dict:
            f = unpack(case.data, mb)
            found = statistics(case, forward(case.model, model, f), f)
            turn = next(calls) % 3 if loss.stats == "rotating" else 0
            return {k: found[k] for k in STAT_KEYS[turn:] + STAT_KEYS[:turn]}

        fns.stats_fn = stats_of
        if loss.stats != "two_args":
            fns.loss_fn = compute
    if loss.count_fn != "none":
        fns.count_fn = lambda mb: _counts(case, unpack(case.data, mb))
    return fns


def _counts(case: Case, f: dict) -> Any:
    parts, kind = parts_of(case), case.loss.count_fn
    bend = {
        "right": lambda c: c, "off": lambda c: c + 1, "zero": lambda c: 0, "one": lambda c: 1,
        "nan": lambda c: float("nan"), "negative": lambda c: -(c + 1),
        "nan_tensor": lambda c: torch.tensor(float("nan"), dtype=torch.float64),
    }[kind]  # fmt: skip
    counts = {k: bend(parts[p][1](f)) for k, p, _ in case.loss.terms}
    return counts if case.loss.form == "terms" else next(iter(counts.values()))


def user_lengths(case: Case) -> Callable[[Any], Any] | None:
    mask = lambda b: unpack(case.data, b)["attention_mask"]  # noqa: E731
    return {
        "default": None,
        "mask": lambda b: mask(b).sum(-1),
        "labelled": lambda b: (unpack(case.data, b)["labels"] != PAD).sum(-1),
        "longer": lambda b: mask(b).sum(-1) + 2,
        "zero": lambda b: torch.zeros(len(mask(b)), dtype=torch.long),
        "negative": lambda b: -mask(b).sum(-1) - 1,
        "2d": mask,
        "string": lambda b: "many",
        "none_value": lambda b: None,
    }[case.cut.lengths]


def accumulator_kwargs(case: Case) -> dict[str, Any]:
    cut = case.cut
    kwargs: dict[str, Any] = {"micro_batch_size": cut.micro_batch_size}
    if not cut.trim_padding:
        kwargs["trim_padding"] = False
    if cut.micro_batch_tokens is not None:
        kwargs.update(
            micro_batch_tokens=cut.micro_batch_tokens, pad_to_multiple_of=cut.pad_to_multiple_of
        )
        if cut.lengths != "default":
            kwargs["lengths"] = user_lengths(case)
    return kwargs


def train(
    case: Case, init: nn.Module, windows: list[Any], wrap: Callable = lambda m: m
) -> nn.Module:
    """``case`` trained with bigbatch from ``init`` (``wrap``: e.g. in DDP): the model after."""
    model = copy.deepcopy(init)
    optimizer = OPTIMIZERS[case.optimizer](model.parameters())
    fns = user_fns(case)
    acc = bigbatch.Accumulator(wrap(model), optimizer, **accumulator_kwargs(case))
    for batch in windows:
        with unchanged_on_refusal(model):
            acc.train_step(batch, fns.loss_fn, count_fn=fns.count_fn, stats_fn=fns.stats_fn)
    return model


# ---------------------------------------------------------------------------- the full batch's side
@dataclass
class Plain:
    """The whole-batch loss of ``case`` (a ``loss_fn(model, batch)`` for tests/reference.py).

    A term with no item adds 0. One with no item but a nonzero sum has no full-batch value
    (``S / 0``): it is left out too, and noted (``dropped``): bigbatch must refuse it by name,
    or leave it out and warn. ``empty``: per window, whether no term had an item (the full
    batch takes a zero-gradient step; bigbatch must warn)."""

    case: Case
    empty: list[bool] = field(default_factory=list)
    dropped: set[Any] = field(default_factory=set)

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        case, parts = self.case, parts_of(self.case)
        f = unpack(case.data, batch)
        out = forward(case.model, model, f)
        if case.loss.stats != "none":
            with torch.no_grad():
                stats = statistics(case, forward(case.model, model, f), f)
            out = normalise(out, stats)
        total, counts = out.new_zeros(()), []
        for key, part, weight in case.loss.terms:
            s, c = parts[part][0](out, f), float(parts[part][1](f))
            if c == 0 and float(s.detach()) != 0:
                self.dropped.add(key)
            total = total + (weight * s / c if c else 0 * s)
            counts.append(c)
        self.empty.append(not any(counts))
        return total

    def expect(self, expect: Expect) -> Expect:
        """``expect`` and what the windows seen add to it."""
        names = expect.names | {repr(str(key)) for key in self.dropped}
        warns = expect.warns or any(self.empty) or bool(self.dropped)
        return Expect(frozenset(names), expect.must_refuse, warns)


# ---------------------------------------------------------------------------- what a refusal may name
def expectation(case: Case) -> Expect:
    loss, cut, data = case.loss, case.cut, case.data
    names: set[str] = set()
    must = False
    if loss.count_fn in ("nan", "negative", "nan_tensor"):
        must = True
    if loss.count_fn not in ("none", "right"):
        names.add("count_fn")
    if loss.stats == "two_args":
        must, names = True, names | {"stats_fn", "loss_fn"}
    keys = [k for k, _, _ in loss.terms]
    if 1 in keys and "1" in keys:  # they collide as strings: a refusal must name them
        names.add("'1'")
    if isinstance(data, Text) and cut.micro_batch_tokens is not None:
        must = must or cut.lengths in BAD_LENGTHS
        names |= _token_names(case)
    return Expect(frozenset(names), must)


def _token_names(case: Case) -> set[str]:
    """What a refusal of a token window may name (Note [token windows] in bigbatch.core._tokens:
    left padding, a batch without a top-level attention_mask, a mean over pad rows...)."""
    cut, data, names = case.cut, case.data, set()
    assert isinstance(data, Text)
    exact_lengths = cut.lengths == "mask" and data.side == "right" and 0 not in data.lengths
    if cut.lengths != "default" and not exact_lengths:
        names.add("lengths")
    if cut.lengths == "default" and (data.side == "left" or data.structure != "dict"):
        names.add("micro_batch_tokens")
    names |= set(data.extras)  # "feat": as wide as the padding; "tokw": one column fewer
    if data.extras and data.structure != "dict":  # no key to name: the tensor's path
        names.add("batch[")
    multiple, budget = cut.pad_to_multiple_of, cut.micro_batch_tokens
    mean, over = case.loss.form == "mean", isinstance(budget, int) and (multiple or 0) > budget
    rows = any(kind == "seq" for _, kind, _ in case.loss.terms)  # counted in rows: pad rows too
    if multiple and (mean or over or rows or data.structure == "tuple"):  # a tuple: no pad value
        names.add("pad_to_multiple_of")
    return names


# ---------------------------------------------------------------------------- cached_loss
class Encoder(nn.Module):
    """The MLP as an encoder, with a learnable temperature."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = mlp(seed=seed)
        self.log_scale = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))


def cached_fns(case: Cached, model: Encoder) -> tuple[Callable, Callable]:
    """``encode_fn(model, mb)`` and ``batch_loss_fn(reps[, batch])`` for ``case``: InfoNCE of
    each query against every document of the batch."""

    def encode(m: nn.Module, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        q, d = (mb["q"], mb["d"]) if case.structure == "dict" else mb
        return m.net(q), m.net(d)

    def nce(reps: Any, batch: Any = None) -> Any:
        q, d = reps
        scale = model.log_scale.exp() if case.temperature else 2.0
        per_pair = F.cross_entropy(q @ d.T * scale, torch.arange(len(q)), reduction="none")
        if case.form in ("mean", "one_arg"):
            return per_pair.mean()
        if case.form == "pair":
            return per_pair.sum(), len(q)
        return {"nce": (per_pair.sum(), len(q)), "reg": ((q**2).sum(), q.numel(), 0.1)}

    return encode, (lambda reps: nce(reps)) if case.form == "one_arg" else nce


def cached_batches(case: Cached) -> list[Any]:
    out = []
    for step in range(case.steps):
        g = torch.Generator().manual_seed(case.seed * 31 + step)
        q, d = (torch.randn(case.n, 6, generator=g, dtype=torch.float64) for _ in range(2))
        out.append({"q": q, "d": d} if case.structure == "dict" else (q, d))
    return out


def cached_plain(case: Cached) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The InfoNCE of the whole batch, computed in one piece."""

    def whole(model: nn.Module, batch: Any) -> torch.Tensor:
        encode, nce = cached_fns(case, model)
        out = (
            nce(encode(model, batch))
            if case.form == "one_arg"
            else nce(encode(model, batch), batch)
        )
        if isinstance(out, dict):
            return sum(
                w * s / c for s, c, *rest in out.values() for w in [rest[0] if rest else 1.0]
            )
        return out[0] / out[1] if isinstance(out, tuple) else out

    return whole


# ---------------------------------------------------------------------------- accumulate_grads
def grads_batch(case: Grads) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    n = sum(case.pieces)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def mean_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def train_by_pieces(case: Grads, init: nn.Module) -> nn.Module:
    """The window given piece by piece: ``backward`` in ``micro_batch``, or gradients computed
    by the user and handed over with ``accumulate_grads`` in the container each route names."""
    model = copy.deepcopy(init)
    optimizer = OPTIMIZERS[case.optimizer](model.parameters())
    acc = bigbatch.Accumulator(model, optimizer)
    x, y = grads_batch(case)
    params, start = list(model.parameters()), 0
    for i, (size, route) in enumerate(zip(case.pieces, case.routes, strict=True)):
        rows = slice(start, start + size)
        start += size
        count = {"int": size, "float": float(size), "tensor": torch.tensor(size)}[case.count]
        if route == "backward":
            with acc.micro_batch(last=i == len(case.pieces) - 1):
                acc.backward(F.cross_entropy(model(x[rows]), y[rows], reduction="sum"), count)
            continue
        loss_sum = F.cross_entropy(model(x[rows]), y[rows], reduction="sum")
        grads = torch.autograd.grad(loss_sum, params)
        given = {
            "list": list(grads), "tuple": tuple(grads), "dict": dict(zip(params, grads, strict=True)),
            "generator": (g for g in grads),
        }[route]  # fmt: skip
        acc.accumulate_grads(given, count, loss_sum=loss_sum.detach())
    acc.step()
    return model


# ---------------------------------------------------------------------------- engine state
def resume_case(case: Resume, cut: Cut) -> Case:
    """The token loss of a resumed run, as a ``Case`` cut by ``cut``."""
    loss = Loss("pair", (("loss", "nll", 1.0),))
    return Case("bag", case.text, cut, loss, case.optimizer, steps=2)


def train_resumed(case: Resume, init: nn.Module, windows: list[Any]) -> nn.Module:
    """A step under ``case.first``; its engine state, through ``torch.save``, loaded by an
    ``Accumulator`` built with ``case.second``, which takes the next step."""
    model = copy.deepcopy(init)
    optimizer = OPTIMIZERS[case.optimizer](model.parameters())
    first, second = (resume_case(case, cut) for cut in (case.first, case.second))
    loss = user_fns(first).loss_fn
    acc = bigbatch.Accumulator(model, optimizer, **accumulator_kwargs(first))
    acc.train_step(windows[0], loss)
    saved = io.BytesIO()
    torch.save(acc.state_dict(), saved)
    saved.seek(0)
    acc = bigbatch.Accumulator(model, optimizer, **accumulator_kwargs(second))
    with unchanged_on_refusal(model):
        acc.load_state_dict(torch.load(saved))
        acc.train_step(windows[1], loss)
    return model


# ---------------------------------------------------------------------------- two gloo ranks
def share(case: Case, split: int, rank: int) -> list[Any]:
    """Rank ``rank``'s rows of each window: the first ``split`` rows on rank 0, the rest on 1."""
    rows = slice(0, split) if rank == 0 else slice(split, None)
    out = []
    for step in range(case.steps):
        f = {k: v[rows] for k, v in fields(case.data, step).items()}
        out.append(pack(_part_of(case.data, rows), f))
    return out


def _part_of(data: Samples | Text, rows: slice) -> Samples | Text:
    if isinstance(data, Text):
        return replace(data, lengths=data.lengths[rows])
    return replace(data, n=len(range(data.n)[rows]))


def rank_train(rank: int, world: int, case: Ranks) -> tuple[str, Any]:
    """On a gloo rank: ``case`` trained on this rank's share through DDP. Returns ``("ok",
    parameters)`` or ``(exception type, message)`` (the parent judges it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    windows = share(case.case, case.split, rank)
    try:
        model = train(case.case, make_model(case.case.model), windows, wrap=DDP)
    except Exception as exc:  # noqa: BLE001 - judged in the parent
        return type(exc).__name__, str(exc)
    return "ok", [p.detach() for p in model.parameters()]
