"""The audit both adapters share: an accumulated step checked against the same trainer's step
on the window as one batch, within the rounding allowed, and what went wrong said in words.

``bigbatch.hf.audit`` (``bigbatch.integrations._hf_audit``) and ``bigbatch.lightning.audit``
record an audited window (``start``: a ``Window``) and call ``check`` after its last backward:
it computes the one-batch gradient from the same weights and random state (Note [audit]), both
sides with dropout off (``dropout_off``: Note [audit dropout]); ``judge`` compares within the
rounding allowed (``rounding``: Note [audit tolerance]) and diagnoses a difference
(``diagnose``: Note [audit diagnosis]); ``finish`` names the steps training never reached.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.dropout import _DropoutNd

from bigbatch.core import _rng
from bigbatch.core._tree import tensor_leaves
from bigbatch.core._window import Backup
from bigbatch.core.loss import as_terms, mean_of
from bigbatch.core.split import batch_size
from bigbatch.integrations._frameworks import held, reshard
from bigbatch.verifier._runs import Grads, Watch, differences, observe

logger = logging.getLogger("bigbatch")
Own = Callable[[Any], tuple[float, ...]]
"""A micro-batch's own one-batch loss and count (and the count read the other way: every label
where the loss shifts them, the shifted ones where it does not)."""
COUNTED = "count mismatch: labels counted otherwise than the loss counts them (shifted or not)"
RANDOM = "the loss draws random numbers besides dropout (noise in forward): audit without them"
_RATE = re.compile("drop|noise")  # dropout rates, NEFTune's noise_alpha, MoE routers' jitter_noise


@dataclass
class AuditResult:
    """One audited optimizer step.

    Attributes:
        step: the optimizer step (1 is the first).
        exact: every parameter's gradient is within ``tolerance`` of the one-batch gradient;
            ``None``: not checked (a difference where the loss draws random numbers besides
            dropout, which ``diagnosis`` names: Note [audit dropout]).
        grad_norm_ratio: ‖accumulated gradient‖ / ‖one-batch gradient‖ (1 when right).
        loss_ratio: the loss the trainer accumulated / the one-batch loss.
        difference: the largest relative difference of a parameter's gradient.
        tolerance: the rounding allowed, from the precision the model computes in and the
            window's size (Note [audit tolerance]).
        rounding: where the tolerance comes from ("float32 rounding over 2,400 items").
        diagnosis: what went wrong, in words ("" when exact; Note [audit diagnosis]).
    """

    step: int
    exact: bool | None
    grad_norm_ratio: float
    loss_ratio: float
    difference: float
    tolerance: float
    diagnosis: str = ""
    rounding: str = ""

    def __str__(self) -> str:
        verdict = "exact" if self.exact else f"NOT exact: {self.diagnosis}"
        verdict = f"not checked: {self.diagnosis}" if self.exact is None else verdict
        return (
            f"bigbatch audit, step {self.step}: {verdict} (gradient norm ×"
            f"{self.grad_norm_ratio:.4g}, loss ×{self.loss_ratio:.4g} of the one-batch step; "
            f"largest difference {self.difference:.1e}, tolerance {self.tolerance:.0e}: "
            f"{self.rounding})"
        )


@dataclass
class Audit:
    """The steps to audit and, as training reaches them, one ``AuditResult`` each; when training
    ends, ``not_reached`` holds the steps it never audited (and a warning names them)."""

    steps: tuple[int, ...]
    results: list[AuditResult] = field(default_factory=list)
    not_reached: tuple[int, ...] = ()


def check_steps(steps: int | tuple[int, ...]) -> tuple[int, ...]:
    """``steps`` as a tuple of positive ints (an int is one step).

    Raises:
        ValueError: anything else.
    """
    found = tuple(steps) if isinstance(steps, Iterable) else (steps,)  # 1.5: refused below
    if not found or not all(type(s) is int and s > 0 for s in found):
        raise ValueError(f"steps={steps!r} is not allowed: use positive ints, e.g. 1 or (1, 100).")
    return found


@dataclass
class Window:
    """An audited window as it runs (Note [audit]): the micro-batches as the trainer computed on
    them, the random state before the first, what each back-propagated."""

    step: int
    accumulation_steps: int
    rng: Any
    batches: list[Any] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)


def finish(log: Audit, last: int) -> None:
    """Training ended at step ``last``: the steps asked for and never audited go to
    ``log.not_reached``, with a warning (an audit that says nothing must not look like a pass)."""
    log.not_reached = tuple(s for s in log.steps if s not in {r.step for r in log.results})
    if missed := ", ".join(map(str, log.not_reached)):
        logger.warning(f"bigbatch audit: step {missed} not audited: training ended at step {last}")


def start(log: Audit, step: int, accumulation_steps: int, device: Any) -> Window | None:
    """A window about to run (its random state now) if ``step`` is audited, else ``None``."""
    audited = step in log.steps
    return Window(step, accumulation_steps, _rng.capture(torch.device(device))) if audited else None


def shares(outs: list[tuple[Any, Any]]) -> list[float]:
    """What each micro-batch's loss adds to the loss of a window normalised as bigbatch does
    (each term over its count in the window), from ``(micro_batch, loss)`` pairs: what each
    back-propagated, for the diagnosis (Note [audit diagnosis])."""
    terms = [as_terms(out, batch_size(b)) for b, out in outs]
    totals = {k: sum(float(t[k].count) for t in terms) or 1.0 for k in terms[0]}
    return [sum(x.weight * float(x.loss_sum) / totals[k] for k, x in t.items()) for t in terms]


def window_mean(out: Any, rows: int) -> torch.Tensor:
    """A loss (a mean over ``rows`` samples, ``(sum, count)`` or named terms) as one batch: each
    term over its count on every rank, times the ranks (whose gradients are averaged)."""
    terms, world = as_terms(out, rows), _world()
    if world == 1:
        return mean_of(terms)
    counts = torch.tensor([float(t.count) for t in terms.values()], dtype=torch.float64)
    torch.distributed.all_reduce(counts)
    each = [t.weight * t.loss_sum / c for t, c in zip(terms.values(), counts.tolist(), strict=True)]
    return world * sum(each)  # type: ignore[return-value]


def gradients(model: torch.nn.Module) -> Grads:
    """Every trainable parameter's gradient by name (zeros where there is none), detached."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {
        n: torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        if p.grad is None
        else _whole(p.grad.detach()).clone()
        for n, p in named
    }


class Reads:
    """Where ``check`` reads the gradients: each parameter's ``.grad``, filled by back-propagation."""

    def accumulated(self, model: torch.nn.Module) -> Grads:
        """The window's gradients as the trainer accumulated them."""
        return gradients(model)

    def of(self, model: torch.nn.Module, value: torch.Tensor) -> Grads:
        """The gradients of ``value``, the one-batch loss (on this rank)."""
        value.backward()
        return gradients(model)

    def replayed(self, model: torch.nn.Module, replay: Callable[[], None]) -> Grads:
        """The gradients of the trainer's window replayed (``replay``, ``.grad`` cleared)."""
        replay()
        return gradients(model)

    def held(self) -> contextlib.AbstractContextManager[None]:
        """What holds while the audit computes (nothing here)."""
        return contextlib.nullcontext()


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """A sharded gradient (FSDP2's ``DTensor``) gathered whole on every rank; others as they are."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def check(
    log: Audit,
    window: Window,
    model: torch.nn.Module,
    loss: Callable[[], torch.Tensor],
    own: Own,
    average: bool,
    scope: Callable[[], Any],
    replay: Callable[[], None],
    reads: Reads | None = None,
) -> None:
    """Compare the window's accumulated gradients with the gradient of ``loss()``, the trainer's
    loss on the joined batch (within the context manager ``scope()``), and add the
    ``AuditResult`` to ``log``.

    ``average``: average the one-batch gradients over the ranks (a model DDP does not wrap);
    ``own(micro_batch)``: its own one-batch loss and count, for the diagnosis; ``replay()``: the
    trainer's window again, back-propagated as it did (synchronised over the ranks), refilling
    ``window`` (Note [audit dropout]); ``reads``: where the gradients are (``Reads``: ``.grad``;
    a DeepSpeed engine's partitions: ``bigbatch.integrations._audit_zero``).

    Note [audit]
        An optimizer step under accumulation should equal the step the same trainer takes on the
        window's micro-batches joined into one batch. An audited window records its micro-batches,
        the random state before the first, and what each micro-batch back-propagated (its loss after
        the trainer's scaling). After the window's last backward, before clipping and the optimizer
        step, the audit keeps the accumulated gradients aside, restores that random state, runs the
        trainer's own loss on the joined batch once with gradients (the one extra forward and
        backward; dropout off: Note [audit dropout]), compares, and puts the gradients, the buffers
        and the random state back: training goes on as if nothing had happened. The tolerance is the
        rounding that forward and backward can make (Note [audit tolerance]). On several ranks every
        rank compares and all agree on the verdict (one all-reduce); a loss given as ``(sum,
        count)`` or named terms is read over every rank's count (``window_mean``), as the window
        normalises it. The joined batch is computed at once, so the audited step holds the whole
        window's activations (about k times a micro-batch's). Recomputing it micro-batch by
        micro-batch in the big batch's normalisation would not be a one-batch reference: it is what
        accumulation does, so it would miss what the audit is for, a loss or module coupling the
        samples across micro-batches and a normalisation that is wrong. The memory is said where the
        audit is documented instead; audit where the window fits.
    """
    reads = reads or Reads()
    acc, params = reads.accumulated(model), list(model.parameters())
    device, kept = params[0].device, [p.grad for p in params]
    backup = Backup(model, [], None, device)  # the buffers and the random state (Note [audit])
    model.zero_grad(set_to_none=True)
    _rng.restore(window.rng, device)  # the window's first
    try:
        with dropout_off(model) as dropped, reads.held():  # (Note [audit dropout])
            with scope():
                with observe(model) as precision:  # dropout called as a function, off too
                    value = loss()
                grads = reads.of(model, value)
                for g in grads.values() if average else ():
                    torch.distributed.all_reduce(g)
                    g /= torch.distributed.get_world_size()
            if dropped or precision.dropout:  # the window again, with dropout off
                model.zero_grad(set_to_none=True)
                _rng.restore(window.rng, device)
                with Watch():
                    acc = reads.replayed(model, replay)
            with scope(), Watch():  # the diagnosis's losses with dropout off too
                whole = float(value.detach())
                result = judge(window, acc, grads, whole, precision.dtype, own, loss)
                log.results.append(result)
    finally:  # the gradients, the buffers and the random state as they were
        backup.restore(lambda: None)
        for p, old in zip(params, kept, strict=True):
            p.grad = old
        reshard(model)


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module) -> Iterator[bool]:
    """Within the block the dropout and noise rates of ``model``'s modules in training are 0:
    each dropout's ``p``, each float attribute named for dropout or noise (``attention_dropout``,
    ``dropout_p``, ``layerdrop``: what transformers' attention passes its kernel in training;
    NEFTune's ``neftune_noise_alpha``). Yields whether there were any.

    Note [audit dropout]
        Dropout draws its masks per call, so the trainer's micro-batches drew other masks than the
        joined batch would: with dropout on, the two gradients differ whatever the accumulation does
        (GPT-2's default 0.1 gave a false alarm with a wrong cause). So the audit computes both
        sides with dropout off. ``dropout_off`` sets every dropout rate of the modules in training
        to 0 for the audit's runs: each dropout's ``p`` and each float attribute named for dropout
        (``attention_dropout``, ``dropout_p``, ``layerdrop``: transformers' attention passes these
        to its kernel, ``dropout_p=0.0 if not self.training else ...``), so the rates stay 0 when a
        gradient checkpoint recomputes its block in backward and whatever ``model.train()`` the
        trainer calls. Noise rates are set to 0 the same way (float attributes named for noise:
        NEFTune's ``neftune_noise_alpha``, MoE routers' ``jitter_noise``). ``observe``'s function
        mode (Note [dropout in check] in ``bigbatch.verifier._runs``) also turns off dropout called
        as a function with a constant rate, in forward. Where either turned a rate off, the
        accumulated side is computed again: the trainer's own window replayed from the same weights
        (``replay``: its ``training_step`` over the recorded batches, with its accumulation steps,
        its scaling and its backward; on bigbatch's trainers, its engine), whose gradients are
        compared and whose returns the diagnosis reads (its own losses with dropout off too). The
        replay runs the trainer's normalisation, so a wrong one is found with dropout on as without,
        and the step taken is the one the trainer computed with its masks: the gradients, buffers,
        random state, rates and the trainer's counters (TRL's ``_step``, its token count) are put
        back. It costs one more forward and backward of the window, where dropout is on. Rejected:
        the same masks on both sides (drawn per call for tensors of other shapes: possible only
        where shapes and call order match, not in general); the audited window itself run with
        dropout off (training would change at that step); ``eval()`` (BatchNorm would use its
        running statistics, and transformers' layers stop checkpointing); the function mode alone (a
        checkpoint's recompute runs outside it: with dropout back on there, the audit crashed
        ``SFTTrainer``, whose default is gradient checkpointing). Other random numbers (noise drawn
        in ``forward`` at a constant scale) stay: where the gradients differ and the same loss
        computed again, on the numbers drawn next, differs by more than the tolerance, the result is
        no verdict but ``exact=None``, "not checked", saying why (they may differ for that alone).
    """
    rates = [
        (m, k, 0.0)
        for m in model.modules()
        if m.training
        for k, v in vars(m).items()
        if type(v) is float
        and v > 0
        and (_RATE.search(k) or isinstance(m, _DropoutNd) and k == "p")
    ]
    with held(rates):
        yield bool(rates)


def judge(
    window: Window,
    acc: Grads,
    grads: Grads,
    loss: float,
    dtype: torch.dtype,
    own: Own,
    again: Callable[[], torch.Tensor],
) -> AuditResult:
    """Compare the accumulated gradients ``acc`` with the one-batch gradients ``grads`` (of
    ``loss``, computed down to ``dtype``); diagnose a difference (Note [audit diagnosis]), or
    leave it undecided where ``again()``, the same loss on the random numbers drawn next, is
    another (Note [audit dropout])."""
    items = sum(max((t.numel() for _, t in tensor_leaves(b)), default=1) for b in window.batches)
    tolerance = rounding(dtype, items)
    worst = max(differences(acc, grads).values(), default=0.0)
    returned, whole, disagree = sum(window.returns), loss, 0.0
    if _world() > 1:  # every rank takes the same path from here: agree on the worst difference
        norms = torch.stack([g.double().norm() for g in acc.values()])
        spread = torch.cat([torch.tensor([worst], dtype=torch.float64), norms, -norms])
        torch.distributed.all_reduce(spread, op=torch.distributed.ReduceOp.MAX)
        worst, (highest, lowest) = float(spread[0]), spread[1:].view(2, -1)  # lowest: negated
        disagree = float((highest + lowest).abs().max())
        totals = torch.tensor([returned, loss], dtype=torch.float64)
        torch.distributed.all_reduce(totals)  # the loss ratio of the whole window
        returned, whole = totals.tolist()
    result = AuditResult(
        window.step,
        worst <= tolerance,
        _norm(acc) / max(_norm(grads), 1e-300),
        returned / whole if whole else math.nan,
        worst,
        tolerance,
        rounding=f"{str(dtype).removeprefix('torch.')} rounding over {items:,} items",
    )
    if not result.exact:
        with torch.no_grad():  # another loss from other random numbers: they may be the cause
            drawn = abs(float(again()) - loss) > tolerance * abs(loss)
        ranks_differ = disagree > 1e-9 * _norm(acc)
        diagnosis = RANDOM if drawn else diagnose(window, loss, ranks_differ, own, tolerance)
        result.exact, result.diagnosis = (None if drawn else False), diagnosis
    (logger.info if result.exact else logger.warning)(str(result))
    return result


def rounding(dtype: torch.dtype, items: int) -> float:
    """The relative gradient difference rounding can make: computing down to ``dtype`` over
    ``items``.

    Note [audit tolerance]
        The accumulated and the one-batch gradient differ by rounding alone when the step is exact:
        each sums the window's items in another order. The relative difference allowed is twice the
        epsilon of the lowest precision an operation on the gradient path computes in (its outputs
        rounded: a float32 island in a float64 model, bf16 under autocast), plus the
        accumulation over the window's ``R`` items (its largest tensor's elements: tokens), which
        runs in float32 below float64: ``4 · eps(float32) · √R`` (float32 over 2,400 tokens: 2e-5),
        and never less than 1e-10 (float64). Only operations whose output carries a gradient count
        (``observe``): a metric computed in bf16 under ``no_grad`` does not make a float64 model's
        tolerance bf16's. The tolerance is in every ``AuditResult`` and printed with its verdict; it
        never exceeds the rounding of the precision really computed in, so an error larger than that
        rounding is always reported (one below bf16's, 2e-2, cannot be told from it: a bf16 run's
        line says bf16). Measured: TRL's DPO under bf16 autocast, 3e-3 to 5e-3 apart (2e-2 allowed);
        float32 islands in float64, 1e-7 apart (2e-5 allowed over 2,400 tokens).
    """
    low = dtype != torch.float64  # below float64, sums run in float32 (half types' too)
    sums = torch.finfo(torch.float32 if low else torch.float64).eps * 4 * math.sqrt(items)
    return max(1e-10, 2 * torch.finfo(dtype).eps * low + sums)


def diagnose(window: Window, loss: float, ranks_differ: bool, own: Own, tolerance: float) -> str:
    """What went wrong in an audited step that is not exact, in words.

    Note [audit diagnosis]
        When a step is not exact, each micro-batch's loss is computed again without gradient (its
        own one-batch loss ``L_i``), and the weight the trainer gave it, ``a_i`` = what it
        back-propagated / ``L_i`` (on bigbatch's trainers, which back-propagate at the window's
        scale: what its loss adds to the window's, each term over its window count, ``shares``), is
        read against its right weight ``w_i = n_i / N`` (its share of the window's tokens, or
        samples). ``a_i = 1/k`` (``k`` accumulation steps) where the ``n_i`` differ: a mean of
        micro-batch means, "per-micro-batch mean on padded data"; ``a_i = 1``: "÷ accumulation steps
        missing"; ``a_i = 1/k²``: "÷ accumulation steps applied twice"; ``a_i = 1/k`` on a short
        last window of ``m < k`` micro-batches: "last window mis-scaled"; weights that follow none
        of these: "loss term normalised locally" (a term divided inside each micro-batch, so summed
        ``k`` times). With the right weights, gradients that differ between ranks mean "ranks did
        not synchronise"; else the loss of the joined batch is not the weighted mean of its
        micro-batches' losses: "loss couples samples across micro-batches" (contrastive, pairwise, a
        batch statistic: ``bigbatch.cached_loss`` or a statistics pass). Where the labels counted
        the other way (shifted, or every label: ``own``'s third value) give the weights found, or
        weigh the losses 100 times closer to the joined batch's (a shifted mean weighed by every
        label: 1e-10 of the loss off, against 0, where the gradients were 3% apart), the
        micro-batches were counted otherwise than the loss counts: "count mismatch".
    """
    if ranks_differ:
        return "ranks did not synchronise"
    with torch.no_grad():
        outs = [own(b) for b in window.batches]
    losses, counts, others = ([o[i] for o in outs] for i in (0, 1, -1))
    k, m = window.accumulation_steps, len(losses)
    a = [r / x if x else math.nan for r, x in zip(window.returns, losses, strict=True)]

    def close(inverse: list[float]) -> bool:  # a_i = 1 / inverse_i for every micro-batch
        return all(abs(ai * t - 1) < 1e-3 for ai, t in zip(a, inverse, strict=True))

    def right(counted: list[float]) -> bool:  # weighted by these counts
        return close([sum(counted) / n if n else math.inf for n in counted])

    def off(counted: list[float]) -> float:  # the losses weighted by these counts, off the loss
        mean = sum(x * n for x, n in zip(losses, counted, strict=True)) / (sum(counted) or 1)
        return abs(mean - loss)

    if k > 1 and close([k] * m) and (m < k or len(set(counts)) > 1):
        return "last window mis-scaled" if m < k else "per-micro-batch mean on padded data"
    if k > 1 and close([1.0] * m):
        return "÷ accumulation steps missing"
    if k > 1 and close([k * k] * m):
        return "÷ accumulation steps applied twice"
    if not right(counts):  # not the right weights
        return COUNTED if right(others) else "loss term normalised locally"
    if off(others) < 0.01 * off(counts):  # the losses weighted by the other count: the loss
        return COUNTED
    if off(counts) > max(tolerance, 1e-6) * abs(loss):
        return "loss couples samples across micro-batches"
    return "gradients differ where the losses agree"


def _norm(grads: Grads) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads.values()])))


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
