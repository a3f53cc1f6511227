"""transformers' Trainer under accelerate's DeepSpeed plugin (ZeRO 1, 2, 3) on 2 gloo ranks.

The same 12 variable-length samples as ``test_hf_ranks.py`` (each step the whole data set, 2
samples per batch, 3 batches per window on each rank, the ranks' tokens unequal), with
``TrainingArguments(deepspeed=config)``: ``bigbatch.hf.Trainer`` sets
``"managed_gradient_accumulation": false`` in its copy of the config and runs each window
through the engine, one ``engine.step()`` per window (Note [trainer window under DeepSpeed]).
It equals one process taking two plain float64 steps on the union, to 1e-6: ZeRO keeps float32
master weights and gradient partitions whatever the model's dtype (Note [DeepSpeed windows]),
so the models train in float32 (the reference starts from the same float32 weights). Cut by
tokens (``micro_batch_tokens``) the windows hold different numbers of micro-batches; the
chunked head (``chunked_head=True``) computes the same step without the logits. The stock
Trainer under the same config is measured beside it: on GPT-2's own loss (a token sum over the
window's count) it is exact too, on a model whose loss is a mean per micro-batch it averages
micro-batch means (printed).

ZeRO 3 partitions every parameter (``stage3_param_persistence_threshold: 0``: by default a
parameter under 100,000 elements, every one of these, stays whole). accelerate turns DeepSpeed
off with ``use_cpu=True``, so these runs pass ``use_cpu=False`` on a machine without GPUs, which
picks DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``). Needs ``pip install -e
".[deepspeed]"`` (skipped without it).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from hf_ranks import trainer_runs  # noqa: E402
from integrations.hf_models import (  # noqa: E402
    Wrapper,
    arguments,
    collate,
    distance,
    gpt2,
    loaded,
    sgd,
    texts,
    wrapper_loss,
)
from integrations.test_hf import counted, plain  # noqa: E402
from token_lm import environment, relative_error  # noqa: E402

pytestmark = pytest.mark.slow  # gloo ranks that start DeepSpeed and transformers

CONFIGURED = {"use_configured_state": True}  # the process state _deepspeed_on_cpu makes
MODELS = {"gpt2": lambda: gpt2().float(), "wrapper": lambda: Wrapper(gpt2().float())}


def _fresh(make):
    """``make``, after a fresh process state (``_deepspeed_on_cpu``): the trainer comes next."""
    return lambda: (_deepspeed_on_cpu(), make())[1]


def config(stage: int) -> dict:
    """What a user writes: transformers fills the "auto" values from the TrainingArguments."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def _deepspeed_on_cpu() -> None:
    """The process state a GPU run gets, made fresh for each trainer (accelerate takes one
    DeepSpeed plugin per process state): without GPUs accelerate finds no backend for DeepSpeed
    and runs one process; it is made here over the open gloo group, then marked DeepSpeed, and
    the ``TrainingArguments`` use it (``use_configured_state``)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState(cpu=True, backend="gloo")
    PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED


SGD = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


def zero_trainer(
    cls, folder: str, ds: dict | None, *, model=None, optimizer=SGD, args=None, **extra
):
    """``cls`` (a Trainer class; ``extra``: its own arguments) on GPT-2, 12 samples, 2 per batch
    and 3 batches per window on each rank, under the DeepSpeed config ``ds`` in a fresh process
    state, or without DeepSpeed (``ds=None``); ``args``: more ``TrainingArguments``."""
    backend = {}
    if ds is not None:
        _deepspeed_on_cpu()
        backend = dict(use_cpu=False, deepspeed=ds, accelerator_config=CONFIGURED)
    return cls(
        model=gpt2().float() if model is None else model,
        args=arguments(folder, 2, 3, ddp_backend="gloo", **backend, **(args or {})),
        train_dataset=texts(12),
        data_collator=collate,
        optimizer_cls_and_kwargs=optimizer,
        **extra,
    )


def _prepare(trainer) -> None:
    """``sgd``'s optimizer (under DeepSpeed the Trainer makes its own: ``deepspeed_init``), and
    each window's ``StepResult`` kept in ``trainer.windows``."""
    from transformers import TrainerCallback

    trainer.optimizer_cls_and_kwargs = SGD
    trainer.windows = []
    window = getattr(trainer, "bigbatch_window", None)

    class Windows(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trainer.windows.append(window.last if window is not None else None)

    trainer.add_callback(Windows())


def _trained(trainer) -> dict:
    """The engine's full parameters (gathered under ZeRO 3), its steps and how it ran."""
    import deepspeed

    engine = trainer.model_wrapped
    params = list(engine.module.parameters())
    partitioned = all(p.numel() == 0 for p in params)  # ZeRO 3's, between forwards
    with deepspeed.zero.GatheredParameters(params):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {
        "params": state,
        "engine_steps": engine.global_steps,
        "managed": engine.managed_gradient_accumulation(),
        "partitioned": partitioned,
        "windows": [(r.micro_batches, r.tokens) for r in trainer.windows if r is not None],
    }


def _rank(rank: int, world: int, tmp: str, stage: int) -> dict:
    import transformers

    import bigbatch.hf

    environment(rank, world)
    exact = functools.partial
    runs = {
        "stock": (transformers.Trainer, MODELS["gpt2"]),
        "stock wrapper": (transformers.Trainer, MODELS["wrapper"]),
        "bigbatch": (bigbatch.hf.Trainer, MODELS["gpt2"]),
        "bigbatch wrapper": (bigbatch.hf.Trainer, MODELS["wrapper"]),
        "bigbatch tokens": (exact(bigbatch.hf.Trainer, micro_batch_tokens=20), MODELS["gpt2"]),
        "bigbatch chunked": (exact(bigbatch.hf.Trainer, chunked_head=True), MODELS["gpt2"]),
    }
    for cls, name in ((transformers.Trainer, "stock"), (bigbatch.hf.Trainer, "bigbatch")):
        runs[f"{name} dropout"] = (cls, lambda: gpt2(dropout=True).float())  # the audit replays
    runs = {k: (cls, _fresh(make)) for k, (cls, make) in runs.items()}  # each audited
    seen: list = []
    args = dict(use_cpu=False, deepspeed=config(stage), accelerator_config=CONFIGURED)
    audits = trainer_runs(
        rank, world, tmp, runs, 29503, _prepare, lambda t: seen.append(_trained(t)), **args
    )
    out = {name: {**run, "audit": audits[name][1]} for name, run in zip(runs, seen, strict=True)}
    out["refused"] = _refused(f"{tmp}/refused", stage)
    return out


def _refused(tmp: str, stage: int) -> str | None:
    """What is refused at construction, in one line: DeepSpeed's own accumulation."""
    import bigbatch.hf

    _deepspeed_on_cpu()
    ds = {**config(stage), "managed_gradient_accumulation": True}
    args = arguments(tmp, 2, 3, use_cpu=False, deepspeed=ds, accelerator_config=CONFIGURED)
    try:
        bigbatch.hf.Trainer(
            model=MODELS["gpt2"](), args=args, train_dataset=texts(12), data_collator=collate
        )
    except ValueError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda s: f"zero{s}")
def ranks(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp(f"ds{request.param}"))
    return request.param, run_ranks(_rank, tmp, request.param, timeout_s=900)


def _reference(name):
    make = MODELS[name]
    base = make().double()  # the float32 weights
    return base, plain(copy.deepcopy(base), counted if name == "gpt2" else wrapper_loss, sgd)


@pytest.mark.parametrize(
    "run, name",
    [
        ("bigbatch", "gpt2"),
        ("bigbatch wrapper", "wrapper"),
        ("bigbatch tokens", "gpt2"),
        ("bigbatch chunked", "gpt2"),
    ],
)
def test_bigbatch_under_zero_equals_one_process_on_the_union(ranks, run, name):
    stage, got = ranks
    base, want = _reference(name)
    want_state = dict(want.named_parameters())
    for rank in got:
        assert rank[run]["managed"] is False and rank[run]["engine_steps"] == 2
        error = relative_error(rank[run]["params"], want_state)
        print(f"ZeRO-{stage} {run}: {error:.2e} from one process on the union")
        assert error < 1e-6


def test_zero3_partitions_every_parameter(ranks):
    """Between forwards ZeRO 3 holds each parameter's partition only; ZeRO 1 and 2 whole."""
    stage, got = ranks
    assert all(
        run["partitioned"] == (stage == 3) for r in got for k, run in r.items() if k != "refused"
    )


def test_windows_of_different_micro_batch_counts(ranks):
    """Cut by tokens, the windows hold other numbers of micro-batches (ZeRO 2 and 3 give every
    rank the most of any: Note [micro-batches per rank]); the ranks count other tokens."""
    stage, got = ranks
    counts = [[n for n, _ in r["bigbatch tokens"]["windows"]] for r in got]
    tokens = [[t for _, t in r["bigbatch"]["windows"]] for r in got]
    assert len({n for per_rank in counts for n in per_rank}) > 1, counts
    assert all(a != b for a, b in zip(*tokens, strict=True)), tokens


def test_the_stock_trainer_is_measured_beside_it(ranks):
    """The stock Trainer under the same config (DeepSpeed's own accumulation): exact on GPT-2's
    own loss (a token sum over the window's count), a mean of micro-batch means on a loss that
    is a mean per micro-batch; printed beside bigbatch's, as the largest relative error of a
    parameter and as the distance from the reference relative to how far the step moved it."""
    stage, got = ranks
    for name, stock, ours in (
        ("gpt2", "stock", "bigbatch"),
        ("wrapper", "stock wrapper", "bigbatch wrapper"),
    ):
        base, want = _reference(name)
        for rank in got:
            assert rank[stock]["managed"] is True
            errors = []
            for run in (stock, ours):
                trained = loaded(MODELS[name], rank[run]["params"]).double()
                worst = relative_error(rank[run]["params"], dict(want.named_parameters()))
                errors.append((worst, distance(trained, want, base)))
            (stock_worst, stock_far), (worst, far) = errors
            print(
                f"ZeRO-{stage} {name}: stock Trainer {stock_worst:.2e} ({stock_far:.2e} of the "
                f"step), bigbatch {worst:.2e} ({far:.2e} of the step)"
            )
            assert stock_worst < 1e-6 if name == "gpt2" else stock_worst > 1e-2


def test_refused_in_one_line(ranks):
    stage, got = ranks
    assert got[0]["refused"] == (
        'bigbatch.hf.exact(Trainer) steps once per window: set "managed_gradient_accumulation": '
        "false in the DeepSpeed config, or leave it out (it has True)."
    )


def test_the_audit_under_zero(ranks):
    """``bigbatch.hf.audit`` reads ZeRO's gradients inside the engine's step (Note [audit under
    DeepSpeed]): bigbatch's trainer exact at both audited steps (token windows, the chunked head,
    GPT-2's dropout replayed), the stock Trainer exact on GPT-2's own loss and not exact on a
    mean per micro-batch, said in words; training unchanged (the runs above are audited)."""
    stage, got = ranks
    for rank in got:
        for run, results in ((k, v["audit"]) for k, v in rank.items() if k != "refused"):
            print(f"ZeRO-{stage} {run}: {[str(r) for r in results]}")
            assert [r.step for r in results] == [1, 2], (run, results)
            if run != "stock wrapper":
                assert all(r.exact for r in results), (run, results)
        wrong = rank["stock wrapper"]["audit"]
        assert all(r.exact is False for r in wrong), wrong
        assert all(r.diagnosis == "per-micro-batch mean on padded data" for r in wrong), wrong
