"""Generated uses of the chunked head (Note [chunked head] in bigbatch.core.head): the records
hypothesis prints, the strategies that draw them, and what they mean.

* ``HeadCall``: one ``head_cross_entropy`` call (labels of every dtype and range, ignore
  indices, shifts, biases, tied weights, chunk sizes, smoothing, the z-loss, soft-capping, class
  weights, half-precision states, both paths, a second backward and a higher-order one), held
  to the plain head written with ``F.cross_entropy``: float64 to 1e-10, half-precision states
  against the same products upcast to float32; or a refusal naming the argument.
* ``Deferred``: a tiny LM whose output layer (behind ``get_output_embeddings()``) is of a kind
  users and libraries put there, followed by what models do to their logits, trained through
  ``deferred_head`` by the ``Accumulator`` and held to the float64 full batch (oracle.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st
from oracle import Expect
from strategies import OPTIMIZERS, SEEDS

from bigbatch.core import head as chunked

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------- head_cross_entropy
@dataclass(frozen=True)
class HeadCall:
    """``head_cross_entropy`` on ``rows × width`` tokens of a ``vocab``-word head of ``dim``
    inputs. ``labels``: their dtype; ``values``: "valid", "ignored" (some are ``ignore_index``),
    "none" (all), or one bad label in the last column: "over" (= vocab), "negative" (-5),
    "other_pad" (-100 under another ``ignore_index``). ``head``: "linear", "nobias", "tied"
    (the states are its weight's embedding), "matrix", "pair". ``weight``: class weights
    "none", "random", "zeros", "short" (vocab - 1). ``precision``: the states' dtype.
    ``backward``: "once", "twice" (``retain_graph=True``), "create_graph"."""

    rows: int
    width: int
    vocab: int
    labels: str
    values: str
    ignore_index: int
    shift: Any
    head: str
    chunk: int | None
    smoothing: float
    z_loss: float
    softcap: float | None
    weight: str
    precision: str
    path: str
    backward: str
    seed: int


# fmt: off
HEAD_SPACE: dict[str, tuple[list[Any], list[Any]]] = {  # argument: (valid values, bad values)
    "labels": (["int64", "int64", "int32", "uint8"], ["float32", "bool"]),
    "values": (["ignored", "valid", "ignored", "none"], ["over", "negative", "other_pad"]),
    "shift": ([True, False], [2, 0, None, "yes"]),
    "chunk": ([None, 1, 2, 3, 7], [0]),
    "smoothing": ([0.0, 0.0, 0.1, 1.0], [-0.1, 1.5]),
    "z_loss": ([0.0, 0.0, 1e-2], [-1.0]),
    "softcap": ([None, None, 0.7, 3.0], [0.0, -1.0, math.inf]),
    "weight": (["none", "none", "random", "zeros"], ["short"]),
    "precision": (["float64", "float64", "float64", "bfloat16", "float16"], []),
    "backward": (["once", "once", "twice"], ["create_graph"]),
}
# fmt: on
HEAD_FOCI = ("everything", "valid", *HEAD_SPACE)


def drawn(space: dict[str, tuple[list[Any], list[Any]]], focus: str) -> dict[str, Any]:
    """Strategies for each argument: "everything": valid four times in five, else bad;
    "valid": valid only; an argument's name: it from all its values, the others at their first
    valid value (so that one argument's faults are not hidden behind another's)."""

    def one(name: str, good: list[Any], bad: list[Any]) -> st.SearchStrategy[Any]:
        if focus == "everything":
            return st.one_of(*[st.sampled_from(good)] * 4, st.sampled_from(bad or good))
        if focus in ("valid", name):
            return st.sampled_from(good + bad if focus == name else good)
        return st.just(good[0])

    return {name: one(name, *values) for name, values in space.items()}


@st.composite
def head_calls(draw: Any, focus: str = "everything") -> HeadCall:
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    head = st.sampled_from(["linear", "nobias", "tied", "matrix", "pair"])
    args = {name: draw(strategy) for name, strategy in drawn(HEAD_SPACE, focus).items()}
    return HeadCall(
        rows, width, draw(st.integers(2, 9)), ignore_index=draw(st.sampled_from([-100, -100, -1])),
        head=draw(head), path=draw(st.sampled_from(["torch", "ours"])), seed=draw(SEEDS), **args,
    )  # fmt: skip


def head_expectation(call: HeadCall) -> Expect:
    """Bad input the plain head has no value for (or bigbatch's documented limits), and the
    argument a refusal must name."""
    bad = {
        "labels": call.labels in ("float32", "bool")  # (the bad label: the last column's)
        or (
            call.values in ("over", "negative", "other_pad") and (call.width > 1 or not call.shift)
        ),
        "shift": not isinstance(call.shift, bool),
        "chunk_tokens": call.chunk == 0,
        "label_smoothing": not 0 <= call.smoothing <= 1,
        "z_loss": call.z_loss < 0,
        "softcap": call.softcap is not None and not 0 < call.softcap < math.inf,
        "weight": call.weight == "short",
        "create_graph": call.backward == "create_graph",
    }
    names = frozenset(name for name, is_bad in bad.items() if is_bad)
    return Expect(names, must_refuse=bool(names))


def head_inputs(call: HeadCall) -> dict[str, Any]:
    """The tensors of ``call``, float64 leaves (the states are cast in ``bigbatch_head``)."""
    g = torch.Generator().manual_seed(call.seed)
    dim, f64 = 5, torch.float64
    weight = nn.Parameter(torch.randn(call.vocab, dim, generator=g, dtype=f64))
    bias = (
        None
        if call.head in ("nobias", "tied", "matrix")
        else torch.randn(call.vocab, generator=g, dtype=f64)
    )
    ids = torch.randint(0, call.vocab, (call.rows, call.width), generator=g)
    labels = ids.clone()
    if call.values in ("ignored", "none"):
        drop = torch.rand(labels.shape, generator=g) < (0.4 if call.values == "ignored" else 2)
        labels[drop] = call.ignore_index
    bad = {
        "over": call.vocab,
        "negative": -5,
        "other_pad": -100 if call.ignore_index != -100 else -7,
    }
    if call.values in bad:
        labels[0, -1] = bad[call.values]
    dtypes = {"int64": torch.long, "int32": torch.int32, "uint8": torch.uint8,
              "float32": torch.float32, "bool": torch.bool}  # fmt: skip
    if call.labels == "uint8":  # (negative ids wrap: the ignored ones stay the ignore index)
        labels = labels.clamp(min=0) if call.ignore_index < 0 else labels
    classes = {"none": None, "random": torch.rand(call.vocab, generator=g, dtype=f64),
               "zeros": torch.zeros(call.vocab, dtype=f64),
               "short": torch.rand(call.vocab - 1, generator=g, dtype=f64)}  # fmt: skip
    states = None if call.head == "tied" else torch.randn(call.rows, call.width, dim, generator=g)
    return {
        "weight": weight, "bias": None if bias is None else nn.Parameter(bias),
        "states": None if states is None else states.to(f64).requires_grad_(), "ids": ids,
        "labels": labels.to(dtypes[call.labels]), "classes": classes[call.weight],
    }  # fmt: skip


def hidden_of(call: HeadCall, t: dict[str, Any]) -> torch.Tensor:
    """The states the head receives: a leaf, or (tied) the head's weight looked up by token."""
    hidden = torch.tanh(F.embedding(t["ids"], t["weight"])) if call.head == "tied" else t["states"]
    return hidden.to(HALF[call.precision]) if call.precision in HALF else hidden


def plain_head(call: HeadCall, t: dict[str, Any]) -> list[torch.Tensor]:
    """The loss sum, its count and the ``log²Z`` sum written plainly: the logits of the whole
    batch (half-precision states: their products upcast, as under autocast), soft-capped, and
    ``F.cross_entropy``'s sum."""
    hidden, weight, bias = hidden_of(call, t), t["weight"], t["bias"]
    logits = F.linear(
        hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
    )
    logits, labels = (
        logits.to(torch.float32 if call.precision in HALF else torch.float64),
        t["labels"],
    )
    if call.shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    if call.softcap:
        logits = call.softcap * torch.tanh(logits / call.softcap)
    flat, y = logits.flatten(0, 1), labels.flatten().long()
    classes = None if t["classes"] is None else t["classes"].to(flat.dtype)
    ce = F.cross_entropy(flat, y, weight=classes, ignore_index=call.ignore_index,
                         label_smoothing=call.smoothing, reduction="sum")  # fmt: skip
    kept = y != call.ignore_index
    count = kept.sum() if classes is None else classes[y[kept]].sum()
    return [ce, count.to(ce.dtype), torch.logsumexp(flat[kept], -1).square().sum()]


@contextlib.contextmanager
def path(name: str) -> Iterator[None]:
    """torch's ``F.linear_cross_entropy`` where installed, or ours (as on torch < 2.13)."""
    saved = chunked.LINEAR_CE
    chunked.LINEAR_CE = None if name == "ours" else saved
    try:
        yield
    finally:
        chunked.LINEAR_CE = saved


def bigbatch_head(call: HeadCall, t: dict[str, Any]) -> list[torch.Tensor]:
    """The same three values from ``head_cross_entropy`` (the ``log²Z`` sum: 0 without z-loss)."""
    weight, bias = t["weight"], t["bias"]
    head: Any = (weight, bias) if call.head == "pair" else weight
    if call.head in ("linear", "nobias"):  # an nn.Linear holding the leaves
        head = nn.Linear(1, 1)
        head.weight, head.bias = weight, bias
    options = dict(shift=call.shift, ignore_index=call.ignore_index, label_smoothing=call.smoothing,
                   z_loss=call.z_loss, chunk_tokens=call.chunk)  # fmt: skip
    if call.softcap is not None:  # (passed only when used: an older release has no such argument)
        options["softcap"] = call.softcap
    if t["classes"] is not None:
        options["weight"] = t["classes"]
    with path(call.path):
        out = chunked.head_cross_entropy(hidden_of(call, t), head, t["labels"], **options)
    if isinstance(out, dict):
        (ce, count), (z, _, _) = out["ce"], out["z"]
    else:
        (ce, count), z = out, torch.zeros((), dtype=out[0].dtype)
    return [ce, count.to(ce.dtype), z]


def leaves(t: dict[str, Any]) -> list[torch.Tensor]:
    """What the loss is differentiated against."""
    return [x for x in (t["weight"], t["bias"], t["states"]) if x is not None]


# ---------------------------------------------------------------------------- deferred heads
@dataclass(frozen=True)
class Deferred:
    """A tiny LM (embedding, tanh, output layer, then ``transform`` of the logits), trained one
    step through ``deferred_head`` on ``n`` rows of ``width`` tokens cut by ``micro_batch_size``.

    ``layer``: "linear", "nobias", "tied" (the embedding's weight), "weight_norm" (a
    parametrised weight), "frozen" (no gradient), "pre_hook" (a forward pre-hook scales its
    input), "post_hook" (a forward hook scales its output), "lora" (peft-style: the base
    layer's product plus a low-rank one). ``transform``: "none", "scale", "divide", "rscale",
    "softcap" (Gemma 2: ``/ cap``, ``torch.tanh``, ``* cap``), "softcap_method" (``.tanh()``),
    "contiguous" (OPT), "shape" (reads ``.shape``, ``.size(-1)``, ``.dim()``, ``.device``,
    ``.dtype``); what may be refused: "index" (``[..., :]``), "float" (float64 logits cast
    down), "log_softmax"; what no chunked head computes: "add", "neg", "rdiv", "nan".
    ``accelerate``: the forward under bf16 autocast, its output through accelerate's
    ``convert_to_fp32`` (as ``convert_outputs_to_fp32`` wraps it; float64 stays float64)."""

    n: int
    width: int
    micro_batch_size: int
    layer: str
    transform: str
    accelerate: bool
    optimizer: str
    seed: int


VALID = ["none", "scale", "divide", "rscale", "softcap", "softcap_method", "contiguous", "shape"]
MAY_REFUSE, CHANGED = ["index", "float", "log_softmax"], ["add", "neg", "rdiv", "nan"]
DEFERRED_SPACE: dict[str, tuple[list[Any], list[Any]]] = {
    "layer": (["linear", "nobias", "tied", "weight_norm", "frozen", "pre_hook", "post_hook"],
              ["lora"]),
    "transform": (VALID, MAY_REFUSE + CHANGED),
    "accelerate": ([False, True] if importlib.util.find_spec("accelerate") else [False], []),
}  # fmt: skip
DEFERRED_FOCI = ("everything", "valid", *DEFERRED_SPACE)


@st.composite
def deferred_cases(draw: Any, focus: str = "everything") -> Deferred:
    n = draw(st.integers(1, 6))
    args = {name: draw(strategy) for name, strategy in drawn(DEFERRED_SPACE, focus).items()}
    return Deferred(
        n, draw(st.integers(2, 6)), draw(st.integers(1, n)), optimizer=draw(OPTIMIZERS),
        seed=draw(SEEDS), **args,
    )  # fmt: skip


class LoRA(nn.Module):
    """What peft puts in place of a linear layer: ``weight`` is its base layer's, and its
    forward adds a low-rank product."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class TinyLM(nn.Module):
    VOCAB, DIM = 13, 6

    def __init__(self, case: Deferred) -> None:
        super().__init__()
        torch.manual_seed(case.seed)
        self.case, self.embed = case, nn.Embedding(self.VOCAB, self.DIM)
        head: nn.Module = nn.Linear(self.DIM, self.VOCAB, bias=case.layer != "nobias")
        if case.layer == "tied":
            head.weight = self.embed.weight
        elif case.layer == "weight_norm":
            head = nn.utils.parametrizations.weight_norm(head)
        elif case.layer == "frozen":
            head.requires_grad_(False)
        elif case.layer == "pre_hook":
            head.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
        elif case.layer == "post_hook":
            head.register_forward_hook(lambda m, args, out: out * 2.0)
        elif case.layer == "lora":
            head = LoRA(head)
        self.head = head

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> Any:
        if not self.case.accelerate:
            return {"logits": _transformed(self.case.transform, self.head(self.embed(ids).tanh()))}
        from accelerate.utils import convert_to_fp32

        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = _transformed(self.case.transform, self.head(self.embed(ids).tanh()))
            return convert_to_fp32({"logits": logits})


def _transformed(kind: str, x: Any) -> Any:
    if kind == "shape":  # a logging hook's reads
        assert x.shape[-1] == x.size(-1) == TinyLM.VOCAB and x.dim() == 3
        assert x.device.type == "cpu" and x.dtype in (torch.float64, torch.float32)
        return x
    cap = 1.5
    return {"none": lambda: x, "scale": lambda: x * 0.7, "divide": lambda: x / 3.0,
            "rscale": lambda: 2.0 * x, "softcap": lambda: torch.tanh(x / cap) * cap,
            "softcap_method": lambda: (x / cap).tanh() * cap, "contiguous": lambda: x.contiguous(),
            "add": lambda: x + torch.ones(TinyLM.VOCAB, dtype=torch.float64),
            "neg": lambda: -x, "rdiv": lambda: 1.0 / x, "index": lambda: x[..., :],
            "nan": lambda: x * math.nan, "float": lambda: x.float(),
            "log_softmax": lambda: F.log_softmax(x, -1)}[kind]()  # fmt: skip


def make_deferred(case: Deferred) -> TinyLM:
    return TinyLM(case).double()


def deferred_batch(case: Deferred) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(0, TinyLM.VOCAB, (case.n, case.width), generator=g)
    labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.3, -100)
    labels[0, -1] = ids[0, -1]  # a labelled token: no empty window
    return {"ids": ids, "labels": labels}


def deferred_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """The user's loss, written on logits (shifted, as a causal LM's)."""
    from bigbatch.core.loss import token_cross_entropy

    return token_cross_entropy(model(batch["ids"])["logits"], batch["labels"], shift=True)


def deferred_expectation(case: Deferred) -> Expect:
    """What no chunked head computes must be refused (naming the chunked head, or the layer);
    a float64 model's ``.float()`` (a cast down) may be; the rest must step."""
    must = case.transform in CHANGED or case.layer == "lora"
    names = {"chunked head", "chunked_head"} if must or case.transform in MAY_REFUSE else set()
    return Expect(frozenset(names), must_refuse=must)
