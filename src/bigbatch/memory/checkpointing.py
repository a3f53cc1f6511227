"""Activation checkpointing for any model: recompute in backward what forward did not keep.

Three policies, chosen per call of ``enable_checkpointing`` for the blocks it wraps:

* ``"full"``: the block keeps only its inputs and recomputes everything in backward;
* ``"selective"``: the block keeps the outputs of its expensive ops (matrix products, attention
  kernels, convolutions) and recomputes the cheap rest (Note [selective checkpointing]);
* ``"offload"``: nothing is recomputed; what the block keeps goes to host memory
  (Note [offloading]).

Note [checkpointing in place]
    A chosen block keeps its class, its parameters and its ``state_dict`` keys: only its
    ``forward`` is replaced, by an instance attribute (``_CheckpointedForward``) that runs the
    original forward under non-reentrant ``torch.utils.checkpoint`` (or under ``save_on_cpu``).
    Saving and loading state dicts is therefore unaffected, ``disable_checkpointing`` restores
    the block exactly (it deletes the attribute, or puts back a forward that was there before),
    and enabling twice wraps nothing twice. Non-reentrant checkpoint restores the RNG state
    before recomputing, so dropout draws the same mask in the recompute as in the forward.

Note [running statistics under recompute]
    The function handed to ``checkpoint`` runs twice: once in the forward and once more in
    backward to recompute what was not saved. A BatchNorm in training mode updates its running
    statistics on every call, so a naive recompute updates them twice (pytorch/pytorch#96136).
    So before each forward that records gradients the wrapper makes spare copies of the
    ``running_mean``, ``running_var`` and ``num_batches_tracked`` buffers of the block's modules;
    the recompute runs with the spares in their place (its update lands there) and the real
    buffers are put back afterwards, so the statistics equal those of a model that was never
    checkpointed. The swap is attribute assignment, no tensor operation, because under the
    selective policy every operation of the recompute must be one the forward ran.

Note [selective checkpointing]
    ``policy="selective"`` runs the block under ``checkpoint`` with torch's selective contexts
    (``create_selective_checkpoint_contexts``, torch >= 2.4): the forward saves the outputs of
    the ops in ``_EXPENSIVE`` and the recompute returns those instead of running them again, so
    backward re-runs only norms, activations, softmax, dropout and additions, whose results are
    most of a transformer block's activation memory. Two rules keep gradients identical:

    * Randomness. The recompute starts from the forward's RNG state, and a saved op is not run
      again, so it draws nothing. An op that draws random numbers (an attention kernel called
      with ``dropout_p > 0``) is therefore never saved, else every later random op of the block
      would draw different numbers than in the forward.
    * In-place changes. A saved output must not be changed in place later (``nn.ReLU
      (inplace=True)`` or ``+=`` right after a ``Linear``): the recompute would read the changed
      value. torch refuses that in backward with a bare message ("Tensor cached during selective
      activation checkpoint has been mutated"); for changes inside the block the wrapper checks
      the saved outputs' versions when the block's forward ends and says which op and what to
      change. (It lets go of them there: they hold the graph, which holds the wrapper. A change
      made after the block returned still meets torch's message in backward.)

Note [key/value caches under recompute]
    transformers models with ``use_cache=True`` (their default) hand each block a ``Cache``
    object to which the attention appends this forward's keys and values. A recompute appends
    them again, and the attention then sees twice the positions: a crash with an attention mask
    ("The size of tensor a (96) must match the size of tensor b (48)"), or a cache of the wrong
    length. So while gradients are recorded, a block that ``enable_checkpointing`` wrapped for
    recompute gets ``None`` instead of the cache, as transformers' own checkpointing does: its
    keys and values are not cached, which training does not use. A cache that already holds
    positions for the block (a prefix) cannot be left out without changing the result, so it
    is refused with a ``ValueError``.

Note [offloading]
    ``policy="offload"`` recomputes nothing: the block runs once under
    ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, so each tensor autograd keeps for
    backward is copied to pinned host memory in the forward and back to the GPU in backward.
    It frees GPU memory only; on the CPU it would copy every saved tensor and free nothing, so it
    is refused when CUDA is not available, and for a block whose input is not on a CUDA device.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from bigbatch.core._tree import tensor_leaves

POLICIES = ("full", "selective", "offload")
_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")
# Ops whose outputs the selective policy saves (Note [selective checkpointing]): matrix
# products (nn.Linear and torch.matmul end in mm / addmm / bmm), fused attention kernels and
# convolutions. Names that an older torch lacks are left out.
_EXPENSIVE = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm addmm bmm baddbmm convolution _scaled_dot_product_flash_attention "
        "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_efficient_attention "
        "_scaled_dot_product_cudnn_attention _scaled_dot_product_fused_attention_overrideable"
    ).split()
    if hasattr(torch.ops.aten, name)
)
_Saved = list[tuple[Any, torch.Tensor, int]]  # (op, output, its version when saved)
_Stats = list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]  # (module, name, buffer, spare)


class _CheckpointedForward:
    """A block's forward run under a checkpointing policy; see Note [checkpointing in place]."""

    def __init__(self, module: nn.Module, policy: str) -> None:
        # The forward that was set on the instance before us (another wrapper's), if any.
        self.previous = module.__dict__.get("forward")
        self.module, self.policy = module, policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.previous or type(self.module).forward.__get__(self.module)
        if self.policy == "offload":
            return _offloaded(self.module, forward, args, kwargs)
        if not torch.is_grad_enabled():  # nothing is recorded, so nothing will be recomputed
            return forward(*args, **kwargs)
        args = tuple(_without_cache(self.module, a) for a in args)
        kwargs = {k: _without_cache(self.module, v) for k, v in kwargs.items()}
        stats: _Stats = [
            (sub, name, b, b.clone())
            for sub in self.module.modules()
            for name, b in sub.named_buffers(recurse=False)
            if name in _RUNNING_STATS
        ]
        saved, ran = _Saved(), list[bool]()  # ran: the first call is the forward, later recompute

        def run(*inputs: Any) -> Any:
            if ran:
                with _swapped(stats):  # Note [running statistics under recompute]
                    return forward(*inputs, **kwargs)
            ran.append(True)
            try:
                output = forward(*inputs, **kwargs)
                _refuse_changed(self.module, saved)
                return output
            finally:
                saved.clear()  # it holds outputs, and so the graph that holds ``run``: no cycle

        context_fn = _context_fn(self.policy, saved)
        return torch_checkpoint.checkpoint(run, *args, use_reentrant=False, context_fn=context_fn)


@contextlib.contextmanager
def _swapped(stats: _Stats) -> Iterator[None]:
    for sub, name, _, spare in stats:
        setattr(sub, name, spare)
    try:
        yield
    finally:  # also when checkpoint stops the recompute early
        for sub, name, buffer, _ in stats:
            setattr(sub, name, buffer)


def _context_fn(policy: str, saved: _Saved | None) -> Any:
    """``checkpoint``'s ``context_fn`` for ``policy``: torch's selective contexts for
    ``selective_policy`` (``saved`` collects the saved outputs), else no-op contexts."""
    if policy != "selective":
        return torch_checkpoint.noop_context_fn
    return functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, functools.partial(_recorded, saved)
    )


def selective_policy(
    ctx: Any, func: Any, *args: Any, **kwargs: Any
) -> torch_checkpoint.CheckpointPolicy:
    """What ``policy="selective"`` saves: the outputs of expensive ops that draw no random numbers.

    A policy function for ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (see
    Note [selective checkpointing]); usable with your own ``checkpoint`` calls too.

    Args:
        ctx: torch's ``SelectiveCheckpointContext`` (unused).
        func: the aten op that ran (an ``OpOverload``).
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        ``CheckpointPolicy.MUST_SAVE`` for matrix products, convolutions and attention kernels
        (unless called with ``dropout_p > 0``), else ``CheckpointPolicy.PREFER_RECOMPUTE``.

    Example:
        >>> a = torch.ones(2, 2)
        >>> selective_policy(None, torch.ops.aten.mm.default, a, a).name
        'MUST_SAVE'
    """
    policy = torch_checkpoint.CheckpointPolicy
    saved = func in _EXPENSIVE and not _draws_random(func, args, kwargs)
    return policy.MUST_SAVE if saved else policy.PREFER_RECOMPUTE


def _recorded(
    saved: _Saved | None, ctx: Any, func: Any, *args: Any, **kwargs: Any
) -> torch_checkpoint.CheckpointPolicy:
    decision = selective_policy(ctx, func, *args, **kwargs)
    if decision.name == "MUST_SAVE" and saved is not None and not ctx.is_recompute:
        # op_output: torch >= 2.6 passes it; older versions save nothing to check
        saved += [(func, t, t._version) for _, t in tensor_leaves(getattr(ctx, "op_output", None))]
    return decision


def _draws_random(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of ``func`` draws random numbers (Note [selective checkpointing])."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":  # an attention kernel: random only with dropout
            default = args[i] if i < len(args) else argument.default_value
            return bool(kwargs.get("dropout_p", default))
    return True


def _refuse_changed(module: nn.Module, saved: _Saved) -> None:
    changed = next((func for func, t, version in saved if t._version != version), None)
    if changed is not None:
        raise ValueError(
            f"policy='selective': the output of {changed} in a checkpointed "
            f"{type(module).__name__} is changed in place after it ran (nn.ReLU("
            "inplace=True), `h += x` after a Linear), so the recompute cannot reuse "
            "it: use inplace=False, h = h + x, or policy='full'."
        )


def is_kv_cache(value: Any) -> bool:
    """Is ``value`` a transformers key/value ``Cache``? Read from ``sys.modules``: a model that
    holds one has imported transformers, and ``import bigbatch`` must not import it."""
    cache_type = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return isinstance(cache_type, type) and isinstance(value, cache_type)


def _without_cache(module: nn.Module, value: Any) -> Any:
    """``None`` for a transformers cache handed to a recomputed block (Note [key/value caches
    under recompute]); any other argument as it is."""
    if not is_kv_cache(value) or getattr(module, "_can_checkpoint_with_cache", False):
        return value
    layers = (getattr(m, "layer_idx", None) for m in module.modules())
    if held := value.get_seq_length(next((i for i in layers if isinstance(i, int)), 0)):
        raise ValueError(
            f"a checkpointed {type(module).__name__} got a key/value cache that "
            f"already holds {held} positions: its recompute would add these keys "
            "and values again. While training, call the model with use_cache=False "
            "and no past_key_values, or disable_checkpointing(model)."
        )
    return None


def _offloaded(
    module: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run the block once, its saved tensors kept in pinned host memory (Note [offloading])."""
    first = next((t for _, t in tensor_leaves((args, kwargs))), None)
    if first is not None and first.device.type != "cuda":
        raise ValueError(
            f"policy='offload': the input of {type(module).__name__} is on "
            f"{first.device}, and offloading frees GPU memory only: move the model "
            "and the batch to CUDA, or use policy='selective' or 'full'."
        )
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        return forward(*args, **kwargs)


def enable_checkpointing(
    model: nn.Module,
    blocks: Sequence[type | str] | None = None,
    *,
    fraction: float = 1.0,
    policy: str = "full",
) -> nn.Module:
    """Recompute the model's repeated blocks in backward instead of keeping their activations.

    Activation memory falls to roughly one block's worth plus the blocks' inputs, for about
    one more forward pass of time (``policy="full"``); ``policy="selective"`` keeps the outputs
    of matrix products, attention and convolutions and recomputes only the cheap operations
    between them: less time, a little less saving. Gradients are unchanged (dropout included:
    the recompute sees the same random mask), and BatchNorm running statistics are updated once
    per forward as without checkpointing. The model is changed in place; its ``state_dict`` keys
    do not change. Calling it again replaces the previous choice (the latest call decides).

    A transformers model (one with ``activation_checkpointing_enable`` /
    ``gradient_checkpointing_enable``) is switched with its own method, non-reentrant, when
    ``blocks`` is ``None``, ``fraction`` is 1 and the policy is ``"full"`` or ``"selective"``;
    otherwise its blocks are wrapped here, and get no key/value cache while gradients are
    recorded (Note [key/value caches under recompute]).

    Args:
        model: the module to change.
        blocks: which modules to checkpoint: ``None`` finds them (the children of the model's
            largest ``ModuleList`` / ``Sequential`` whose children share one type), or a list of
            module classes, or a list of qualified names as in ``model.named_modules()``
            (``"layers.0"``).
        fraction: in (0, 1]: checkpoint only the first ``max(1, round(fraction * N))`` of the
            ``N`` blocks, to buy only the saving a memory budget needs.
        policy: ``"full"`` (recompute the whole block), ``"selective"`` (recompute all but the
            expensive ops' outputs; torch >= 2.4; Note [selective checkpointing]) or
            ``"offload"`` (recompute nothing, keep the block's activations in pinned host
            memory; CUDA only; Note [offloading]).

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: no repeated blocks were found, a name is unknown, a class matches nothing,
            ``fraction`` is not in (0, 1], ``policy`` is not one of the three, or the policy
            cannot run here (selective on torch < 2.4, offload without CUDA).

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
        >>> net = enable_checkpointing(net, fraction=2 / 3, policy="selective")
        >>> len(checkpointed_blocks(net))
        2
    """
    _check_arguments(fraction, policy)
    switch = _hf_switch(model, "enable") if (blocks, fraction) == (None, 1) else None
    if switch is not None and policy != "offload":
        disable_checkpointing(model)
        context = {"context_fn": _context_fn(policy, None)} if policy == "selective" else {}
        switch(**{switch.__name__.replace("enable", "kwargs"): {"use_reentrant": False, **context}})
        return model
    chosen = find_blocks(model, blocks)  # before changing anything: a bad call changes nothing
    disable_checkpointing(model)
    for _, module in chosen[: max(1, math.floor(fraction * len(chosen) + 0.5))]:
        module.forward = _CheckpointedForward(module, policy)  # type: ignore[method-assign]
    return model


def _check_arguments(fraction: float, policy: str) -> None:
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(
            f"fraction={fraction!r} is not allowed: use a number in (0, 1], e.g. "
            "fraction=0.5 for the first half of the blocks, 1 for all."
        )
    if policy not in POLICIES:
        raise ValueError(
            f"policy={policy!r} is not allowed: use 'full' (recompute whole blocks), "
            "'selective' (save matmul/attention/convolution outputs, recompute the "
            "rest) or 'offload' (to host memory, CUDA only)."
        )
    if policy == "selective" and not hasattr(
        torch_checkpoint, "create_selective_checkpoint_contexts"
    ):
        raise ValueError(
            f"policy='selective' needs torch >= 2.4 (selective activation "
            f"checkpointing); this is torch {torch.__version__}: pip install "
            "'torch>=2.4', or use policy='full'."
        )
    if policy == "offload" and not torch.cuda.is_available():
        raise ValueError(
            "policy='offload' moves activations from GPU memory to host memory, and "
            "CUDA is not available here (on the CPU it would free nothing): use "
            "policy='selective' or 'full'."
        )


def disable_checkpointing(model: nn.Module) -> nn.Module:
    """Undo ``enable_checkpointing`` (every policy): every block runs its own forward again.

    Returns:
        ``model``, changed in place (a model without checkpointing is returned unchanged).
    """
    for module in model.modules():
        if isinstance(wrapper := module.__dict__.get("forward"), _CheckpointedForward):
            del module.forward
            if wrapper.previous is not None:
                module.forward = wrapper.previous  # type: ignore[method-assign]
    switch = _hf_switch(model, "disable")
    if switch and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        switch()
    return model


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules that ``enable_checkpointing`` wrapped (not the HF switch)."""
    wrapped = lambda m: isinstance(m.__dict__.get("forward"), _CheckpointedForward)  # noqa: E731
    return [name for name, module in model.named_modules() if wrapped(module)]


def find_blocks(
    model: nn.Module, blocks: Sequence[type | str] | None = None
) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs ``enable_checkpointing`` would wrap, in model order.

    Raises:
        ValueError: see ``enable_checkpointing``.
    """
    if blocks is None:
        return _repeated_blocks(model)
    if isinstance(blocks, (str, type)) or not all(isinstance(b, (str, type)) for b in blocks):
        raise ValueError(
            f"blocks={blocks!r} is not allowed: use None, a list of module classes "
            "(blocks=[MyBlock]) or names (blocks=['layers.0'])."
        )
    names = dict(model.named_modules())
    if unknown := [b for b in blocks if isinstance(b, str) and b not in names]:
        some = ", ".join(repr(n) for n in list(names)[1:8])
        raise ValueError(
            f"blocks={list(blocks)!r}: no module named {unknown[0]!r} in the model; "
            f"names are those of model.named_modules(), e.g. {some}."
        )
    classes = tuple(b for b in blocks if isinstance(b, type))
    if absent := [c.__name__ for c in classes if not any(isinstance(m, c) for m in names.values())]:
        raise ValueError(f"blocks={list(blocks)!r}: no module of class {absent[0]} in the model.")
    wanted = [n for n, m in names.items() if n in blocks or (classes and isinstance(m, classes))]
    inside = lambda n: any(n.startswith(o + ".") for o in wanted if o != n)  # noqa: E731
    return [(n, names[n]) for n in wanted if not inside(n)]  # inside: recomputed with its block


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    groups = [
        [(f"{name}.{n}" if name else n, c) for n, c in container.named_children()]
        for name, container in model.named_modules()
        if isinstance(container, (nn.ModuleList, nn.Sequential))
    ]
    if not (repeated := [g for g in groups if len(g) >= 2 and len({type(c) for _, c in g}) == 1]):
        raise ValueError(
            f"blocks=None: found no repeated blocks in {type(model).__name__} (no "
            "ModuleList or Sequential whose children share one type). Name them: "
            "enable_checkpointing(model, blocks=[MyBlock] or ['enc.0'])."
        )
    return max(repeated, key=len)  # the first of the largest


def _hf_switch(model: nn.Module, what: str) -> Any:
    """transformers' own switch (``activation_...`` since v5, ``gradient_...`` before); ``None``
    without one, or in the format before transformers 4.35, which ignores checkpoint arguments."""
    setter = getattr(model, "_set_gradient_checkpointing", None)
    old = setter is not None and "value" in inspect.signature(setter).parameters  # before 4.35
    if old or not getattr(model, "supports_gradient_checkpointing", False):
        return None
    switch = getattr(model, f"activation_checkpointing_{what}", None)
    return switch or getattr(model, f"gradient_checkpointing_{what}", None)
