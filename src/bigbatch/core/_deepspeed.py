"""DeepSpeed ZeRO 1-3 as a backend: the window's backwards go through the engine, which steps once.

``make_sync`` (``bigbatch.core._sync``) picks ``DeepSpeedSync`` for a ``deepspeed.initialize``
engine; its ``settings`` check the engine and its ``precision`` is the engine's own
(``EnginePrecision``). Nothing here imports DeepSpeed: the engine is read through its methods.

Note [DeepSpeed windows]
    DeepSpeed (>= 0.19.8, DeepSpeed #8183) lets the caller own the accumulation boundary: with
    ``"managed_gradient_accumulation": false`` in the config, ``engine.backward(loss,
    scale_wrt_gas=False)`` only accumulates (unscaled by the config's gradient_accumulation_steps)
    and ``engine.step()`` is the boundary, whatever the number of backwards before it. ZeRO 2 and
    3 keep the gradients partitioned in their own buffers, out of ``.grad``, so they cannot be
    multiplied by ``W / C`` at step time as for DDP / FSDP (Note [global normalisation]): each
    micro-batch back-propagates ``W · Σ_k w_k · loss_sum_k / C_k`` with every ``C_k`` the window's
    global count, known BEFORE the window (``count_fn``, the count pass, or the samples of a loss
    returned as a mean: Note [backward scale]), and ``W`` the data-parallel ranks DeepSpeed averages
    over. A loss that returns counts and has no ``count_fn`` is counted by a pass before each
    window (one forward without gradients per micro-batch); the low-level ``backward`` cannot know
    its count before the window and is refused. Clipping (the config's ``gradient_clipping``,
    whose default is 1.0), the scheduler given to ``deepspeed.initialize``, fp16 / bf16 and the
    skipped step (``was_step_applied()``: ZeRO also skips fp32 steps whose gradient norm is not
    finite) are the engine's; ``StepResult.grad_norm`` is ``engine.get_global_grad_norm()``, the
    norm before clipping. ZeRO 2 and 3 reduce in every backward (and ZeRO 3 gathers in every
    forward), so their ranks run the same number of micro-batches (Note [micro-batches per rank]);
    ZeRO 1 reduces in ``step()`` (stage 0 is refused: it keeps no gradient norm). The config's ``gradient_accumulation_steps`` is not used
    by a caller-owned window (only by DeepSpeed's reports: ``global_samples`` counts the config's
    micro-batch size per backward): a value other than 1 is ignored with one warning.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch

from bigbatch.core._stepping import NONFINITE
from bigbatch.core._sync import RankSync
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.split import check_choice

SETTINGS = (  # what the engine runs, and the one line saying what to change: first match refused
    (
        lambda e: not hasattr(e, "managed_gradient_accumulation"),
        "this DeepSpeed has no caller-owned windows (managed_gradient_accumulation, DeepSpeed "
        "#8183): pip install 'deepspeed>=0.19.8'.",
    ),
    (
        lambda e: e.pipeline_parallelism,
        "pipeline parallelism (a PipelineModule) steps inside engine.train_batch(): train a plain "
        "module, or use the engine without bigbatch.",
    ),
    (
        lambda e: e.is_deepcompile_enabled(),
        "DeepCompile cannot run caller-owned windows: set "
        '"compile": {"deepcompile": false} in the DeepSpeed config.',
    ),
    (
        lambda e: e.zero_overlap_comm() and e.zero_optimization_stage() < 2,
        'ZeRO stage 0/1 with "overlap_comm": true cannot run caller-owned windows: set '
        '"overlap_comm": false, or use stage 2.',
    ),
    (
        lambda e: e.zero_optimization_stage() == 0,
        "ZeRO stage 0 keeps no gradient norm to report and check: use stage 1 (the same step, "
        "the optimizer states sharded) or DistributedDataParallel.",
    ),
    (
        lambda e: e.sequence_parallel_size > 1,
        "sequence parallelism (Ulysses, sequence_parallel_size > 1) is not supported by bigbatch "
        "yet: drop it from the config.",
    ),
    (
        lambda e: e.managed_gradient_accumulation(),
        'the engine runs its own accumulation: add "managed_gradient_accumulation": false to the '
        "DeepSpeed config (bigbatch steps once per window).",
    ),
)


class DeepSpeedSync(RankSync):
    """A ``deepspeed.initialize`` engine (Note [DeepSpeed windows]): DeepSpeed reduces, clips and
    steps; the engine's backwards carry ``W / C``; ``finish`` calls ``engine.step()``.

    Raises:
        ValueError: the engine runs something bigbatch cannot step exactly (``SETTINGS``), or
            ``auto`` on several ranks with ZeRO 2 / 3 (they reduce in every backward).
    """

    owns_step = True

    def __init__(self, engine: Any, auto: bool = False) -> None:
        refused = next((why for test, why in SETTINGS if test(engine)), None)
        if refused is not None:
            raise ValueError(f"DeepSpeed: {refused}")
        super().__init__(engine, engine.seq_data_parallel_group, auto)
        self.engine, self.world_size = engine, engine.dp_world_size  # what DeepSpeed averages over
        self.equal_micro_batches = engine.zero_optimization_stage() >= 2
        if self.auto and self.equal_micro_batches:
            raise ValueError(
                f'micro_batch_size="auto" on {self.world_size} ranks cannot run ZeRO stage '
                f"{engine.zero_optimization_stage()}: it reduces in every backward, so a rank out "
                "of memory would strand the others. Use a fixed micro_batch_size, or ZeRO stage 1."
            )

    def settings(
        self, model: Any, optimizer: Any, scheduler: Any, max_grad_norm: Any, nonfinite: Any
    ) -> tuple[Any, float | None, str]:
        """``(None, None, nonfinite)``: the engine's scheduler and clipping stay its own.

        Raises:
            ValueError: an optimizer, scheduler or ``max_grad_norm`` other than the engine's.
        """
        e = self.engine
        for wrong, what in (
            (optimizer is not e.optimizer, "pass the optimizer deepspeed.initialize returned"),
            (
                scheduler not in (None, e.lr_scheduler),
                "give the scheduler to deepspeed.initialize(lr_scheduler=...), which steps it in "
                "engine.step(), and not to the Accumulator",
            ),
            (
                max_grad_norm not in (None, e.gradient_clipping()),
                f"max_grad_norm={max_grad_norm} is not allowed: DeepSpeed clips at its config's "
                f'"gradient_clipping": {e.gradient_clipping()} (default 1.0): set it there and '
                "leave max_grad_norm=None",
            ),
        ):
            if wrong:
                raise ValueError(f"DeepSpeed steps these windows: {what}.")
        check_choice("nonfinite", nonfinite, NONFINITE)
        if e.gradient_accumulation_steps() != 1:
            warnings.warn(
                f"DeepSpeed's gradient_accumulation_steps={e.gradient_accumulation_steps()} is not "
                "used: each bigbatch window is one step of any number of micro-batches (Note "
                "[DeepSpeed windows]); set it to 1 (train_batch_size = micro-batch x ranks).",
                BigBatchWarning,
                stacklevel=3,
            )
        return None, None, nonfinite

    def precision(self, precision: object, device: torch.device) -> Any:  # Precision's methods
        """The engine's own precision (its config's ``fp16`` / ``bf16``).

        Raises:
            ValueError: ``precision`` is neither ``"fp32"`` (the default) nor the engine's.
        """
        own = EnginePrecision(self.engine, self.world_size)
        if precision not in ("fp32", own.name):
            raise ValueError(
                f"precision={precision!r} is not allowed with DeepSpeed, whose config runs "
                f'{own.name}: set "{precision}": {{"enabled": true}} in the DeepSpeed config (it '
                "casts the model) and leave precision at its default."
            )
        return own

    def finish(self, scales: dict[str, Any], counts: dict[str, float]) -> float:
        """``engine.step()`` on a window whose backwards carried ``1 / C_k`` (checked); its grad norm.

        Raises:
            RuntimeError: a term's scale was not 1 / its count (nothing was stepped).
        """
        for name, count in counts.items():
            if not math.isclose(count * float(scales[name]), 1.0 if count else 0.0, abs_tol=1e-9):
                raise RuntimeError(
                    f"term {name!r}: the window was scaled by {scales[name]} and counted "
                    f"{count:g}; nothing was stepped (a bigbatch bug)."
                )
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return math.nan if norm is None else float(norm)


class EnginePrecision:
    """The engine's precision, with ``Precision``'s methods: autocast and loss scaling are in
    DeepSpeed's config; ``backward`` is the engine's, ``step`` reports its skipped step."""

    scaler = None  # the loss scaler (fp16) is DeepSpeed's: bigbatch's fp16 path stays off
    autocast_dtype = None

    def __init__(self, engine: Any, world_size: int) -> None:
        self.engine, self.world_size = engine, world_size
        bf16, fp16 = engine.bfloat16_enabled(), engine.fp16_enabled()
        self.name = "bf16" if bf16 else "fp16" if fp16 else "fp32"

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """No autocast: DeepSpeed casts the model itself."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward(W · loss, scale_wrt_gas=False)``: undo DeepSpeed's average over ranks."""
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def unscale_(self, optimizer: Any) -> None:
        """Nothing: DeepSpeed unscales in ``step()``."""

    def step(self, optimizer: Any) -> bool:
        """Whether the engine skipped the step it just took (``DeepSpeedSync.finish``)."""
        return not self.engine.was_step_applied()

    def state_dict(self) -> None:
        """``None``: the loss scaler is saved by ``engine.save_checkpoint``."""

    def load_state_dict(self, state: Any) -> None:
        """Accept ``state_dict``'s ``None``.

        Raises:
            ValueError: a bigbatch loss-scaler state (saved without DeepSpeed).
        """
        if state is not None:
            raise ValueError(
                "this state holds a bigbatch loss scaler; under DeepSpeed the scaler is the "
                "engine's: restore it with engine.load_checkpoint."
            )

    def discard(self) -> None:
        """Drop the window's gradients from the engine's buffers (a discarded window)."""
        self.engine.optimizer.zero_grad(set_to_none=True)  # ZeRO 3's partitions, the .grad
        partial = getattr(self.engine.optimizer, "all_grad_tensors", {})  # ZeRO 2's sums so far
        for group in partial:
            partial[group] = None
