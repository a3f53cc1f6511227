"""Generated uses of the Trainer drop-in (``bigbatch.hf.Trainer``): its settings and the stock
Trainer's (precision, label keys and ``label_names``, ``chunked_head``, ``loss_fn``, data-parallel
ranks) on tiny models of several kinds, held to the stock Trainer's one-batch run.

* ``TrainerCase``: what hypothesis prints; ``trainer_cases(focus)`` draws one, ``focus`` naming
  the settings drawn together (``TRAINER_FOCI``: models, the chunked head, precision, label
  keys, ``loss_fn``, ranks; the others benign, as ``FOCI`` in strategies.py);
  ``trainer_expectation`` says what a refusal must name.
* The oracle: the stock ``transformers.Trainer`` trains the window as one batch (every rank's
  rows, in one process); the drop-in, ``per_device`` rows × ``steps`` per window (on ``ranks``
  gloo ranks), must end within the rounding of the dtype both compute in (float64: 1e-10, as
  the stock run's own float32 roundings are the drop-in's; the chunked head against transformers'
  float32 loss: 1e-5; bf16 autocast: bf16's epsilon), relative to how far the step moved the
  model; or refuse, naming the argument.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from oracle import Expect
from strategies import SEEDS

BENIGN = {
    "model": "gpt2", "precision": "float64", "labels": "labels", "chunked_head": False,
    "loss_fn": None, "empty": 0, "ranks": 1,
}  # fmt: skip
# each focus: how many cases, the settings drawn together (the rest benign), the first values
# first (a case of them is the first one drawn); few cases: each trains two Trainers
TRAINER_FOCI: dict[str, tuple[int, dict[str, list[Any]]]] = {
    "model": (3, {"model": ["tagger", "gemma2", "llama"]}),
    "chunked_model": (3, {"chunked_head": [True], "model": ["gemma2", "tagger", "llama"]}),
    "chunked_head": (2, {"chunked_head": ["no", 1]}),
    "precision": (2, {"precision": ["bf16"], "chunked_head": [True, False], "model": ["llama"]}),
    "labels": (2, {"labels": ["targets", "label", "none"], "chunked_head": [True, False]}),
    "loss_fn": (2, {"loss_fn": ["abc", "one_arg"]}),
    "ranks": (1, {"ranks": [2], "empty": [2, 0]}),  # in order: rank 0 gets the empty rows
}
FLOAT32, BF16 = 1e-5, torch.finfo(torch.bfloat16).eps


@dataclass(frozen=True)
class TrainerCase:
    """``bigbatch.hf.Trainer`` on a tiny ``model`` ("gpt2", "llama", "tagger": a token tagger
    of one's own, "gemma2": soft-capped logits, computing in float64) in ``precision``
    ("float64", or "bf16": a float32 model under ``bf16=True``), its labels under ``labels``
    ("labels", "label", "none", or "targets" with ``label_names=["targets"]``), ``per_device``
    rows × ``steps`` per window, ``short`` rows fewer in the data, ``empty`` one-token rows first,
    on ``ranks`` gloo ranks (in order: rank 0 gets the empty rows)."""

    model: str
    precision: str
    labels: str
    chunked_head: Any
    loss_fn: Any
    empty: int
    ranks: int
    per_device: int
    steps: int
    short: int
    seed: int


@st.composite
def trainer_cases(draw: Any, focus: str) -> TrainerCase:
    drawn = {k: draw(st.sampled_from(v)) for k, v in TRAINER_FOCI[focus][1].items()}
    per_device, steps = draw(st.integers(2, 4)), draw(st.integers(2, 3))
    short = draw(st.integers(0, 1)) if focus != "ranks" else 0  # (ranks: equal shares)
    return TrainerCase(
        **{**BENIGN, **drawn}, per_device=per_device, steps=steps, short=short, seed=draw(SEEDS)
    )


def trainer_expectation(case: TrainerCase) -> Expect:
    """What a refusal of ``case`` must name; ``must_refuse`` where it is bad input or no step
    is defined (the stock Trainer finds no loss without labels)."""
    names = set()
    if not isinstance(case.chunked_head, bool):
        names.add("chunked_head")
    if case.loss_fn is not None:
        names.add("loss_fn")
    if case.labels != "labels":  # stock: "The model did not return a loss from the inputs"
        names |= {"labels", "did not return a loss"}
    if case.chunked_head is True and case.model == "tagger":  # not a causal LM
        names.add("chunked_head")
    return Expect(frozenset(names), must_refuse=bool(names))


def model_of(case: TrainerCase) -> torch.nn.Module:
    from integrations.hf_models import gpt2, llama, tagger
    from integrations.test_hf_chunked_head import gemma2

    made = {"gpt2": gpt2, "llama": llama, "tagger": tagger, "gemma2": gemma2}[case.model]()
    return made.float() if case.precision == "bf16" else made


def data_of(case: TrainerCase) -> list[dict]:
    """Every rank's rows, the ``empty`` one-token rows first."""
    from integrations.hf_models import texts

    rows = case.ranks * case.per_device * case.steps - case.short
    return [{"input_ids": [5 + i]} for i in range(case.empty)] + texts(rows, case.seed)[
        case.empty :
    ]


def collator(case: TrainerCase) -> Any:
    """``collate`` (``tags`` for the tagger), its labels under ``case.labels``."""
    from integrations.hf_models import collate, tags

    def collated(samples: list[dict]) -> dict:
        batch = (tags if case.model == "tagger" else collate)(samples)
        labels = batch.pop("labels")
        return {**batch, **({} if case.labels == "none" else {case.labels: labels})}

    return collated


def trained(case: TrainerCase, model: torch.nn.Module, stock: bool, tmp: str) -> Any:
    """``model`` trained two steps by the stock Trainer on the window as one batch, or by the
    drop-in with ``case``'s settings; the trainer."""
    import transformers
    from integrations.hf_models import arguments, sgd

    import bigbatch.hf

    rows = case.ranks * case.per_device * case.steps
    batch, steps = (rows, 1) if stock else (case.per_device, case.steps)
    args = arguments(
        tmp, batch, steps, bf16=case.precision == "bf16", train_sampling_strategy="sequential",
        label_names=["targets"] if case.labels == "targets" else None,
        **({"ddp_backend": "gloo"} if case.ranks > 1 and not stock else {}),
    )  # fmt: skip
    loss_fn = {"abc": "abc", "one_arg": lambda model: 0.0}.get(case.loss_fn)
    ours = {"chunked_head": case.chunked_head, "loss_fn": loss_fn}
    cls = transformers.Trainer if stock else bigbatch.hf.Trainer
    trainer = cls(
        model=model, args=args, train_dataset=data_of(case), data_collator=collator(case),
        optimizers=sgd(model), **({} if stock else ours),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


def on_rank(rank: int, world: int, case: TrainerCase, tmp: str) -> tuple[str, Any]:
    """On a gloo rank: the drop-in trained on ``case``; ``("ok", parameters)`` or ``(exception
    type, message)`` (the parent judges it)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29502")
    try:
        trainer = trained(case, model_of(case), False, tmp)
    except Exception as exc:  # noqa: BLE001 - judged in the parent
        return type(exc).__name__, str(exc)
    return "ok", [p.detach().clone() for p in trainer.model.parameters()]


def tolerance(case: TrainerCase) -> float:
    """The rounding of what both runs compute in (the module's docstring)."""
    if case.precision == "bf16":
        return BF16
    return FLOAT32 if case.chunked_head is True else 1e-10


def copied(model: torch.nn.Module, parameters: list[torch.Tensor]) -> torch.nn.Module:
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p, value in zip(out.parameters(), parameters, strict=True):
            p.copy_(value)
    return out
