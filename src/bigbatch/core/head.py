"""A language model's loss from its hidden states, in chunks: the logits are never all alive.

Note [chunked head]
    A causal LM's largest tensors in training are its head's logits, ``tokens × vocabulary``,
    and the float32 copy, softmax and gradient its loss keeps (Llama 3's 128K vocabulary at 8K
    tokens: 4 GiB per copy). Accumulation does not shrink them per token. ``head_cross_entropy``
    takes the hidden states *before* the head and computes the token cross-entropy a chunk of
    tokens at a time, so one chunk's logits are alive at once. It returns ``(loss_sum, count)``
    (Note [window normalisation] in ``bigbatch.core.loss``): the chunks add up sums and the
    engine divides once by the window's count, so chunking stays exact under accumulation,
    which the peers' wrappers got wrong (Liger #802, TRL PR #5890). Tokens whose label is
    ignored (padding, prompts) are dropped before the head and cost nothing. Two paths:

    * torch's ``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions`` (torch >= 2.13),
      for the plain loss on float32 / float64 hidden states: it forms the gradient during its
      forward (three matrix products, as the plain head) and its backward only scales it.
    * ``_Chunked``, ours, for what torch's op does not do (label smoothing, the z-loss,
      half-precision hidden states, whose loss sum the op returns in their dtype: bf16 keeps 3
      digits of a sum over thousands of tokens) and on torch < 2.13. It keeps each token's
      log-sum-exp and recomputes a chunk's logits in backward (four products), so the
      gradient is formed from the upstream one as autograd's is, fp16's loss scale included.
      Half-precision hidden states multiply in their dtype, as the plain head under autocast,
      and every sum and softmax is in float32.

Note [chunk size]
    ``chunk_tokens`` when given; else as many tokens as keep one chunk's float32 logits within
    ``chunk_memory`` bytes; by default within ``CHUNK_BYTES`` (64 MiB) and at least
    ``CHUNK_TOKENS`` (256). Measured on a 2-core CPU (hidden 256, float32, forward and backward
    of 4,096 tokens, ``benchmarks/lm_head.py --chunks``): the time falls as chunks grow up to
    about 512 tokens at a 32K vocabulary (64 MiB: 6.1 s; 256 tokens 8.5 s, 32 tokens 21.8 s) and
    128-1,024 at 128K (28-25 s; 64 tokens 36 s, 16 tokens 81 s): each chunk adds the weight's
    gradient once more and runs products with a short side. torch's own ``aspect_ratio`` choice
    sizes a chunk's logits like the input (32 tokens at 32K), 4.6x slower than 1,024 (issue 31).

Note [deferred head]
    ``deferred_head(model)`` lets a loss written on logits (``token_cross_entropy(out.logits,
    labels)``) run chunked without a change: within the block the model's output layer
    (``get_output_embeddings()``) returns a ``HeadLogits`` holding what it received instead of
    computing the logits, and ``token_cross_entropy`` computes it with ``head_cross_entropy``.
    A model that multiplies or divides its logits by a number (Cohere's ``logit_scale``,
    Granite's ``logits_scaling``) gets the same scale on the hidden states, exactly; anything
    else done to them (Gemma 2's soft-capping ``tanh``, a metric's ``argmax``) is refused in
    one line rather than computed wrong. The trainer's ``--chunked-head`` and
    ``bigbatch.hf.Trainer(chunked_head=True)`` use it.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from bigbatch.core._units import parse_bytes

LINEAR_CE = getattr(F, "linear_cross_entropy", None)
"""torch's chunked op (torch >= 2.13); ``None`` before: ``_Chunked`` computes every case."""
CHUNK_BYTES, CHUNK_TOKENS = 64 * 2**20, 256
"""One chunk's float32 logits by default, and its least tokens (Note [chunk size])."""
HALF = (torch.float16, torch.bfloat16)


def head_cross_entropy(
    hidden: torch.Tensor,
    head: Any,
    labels: torch.Tensor,
    *,
    shift: bool = True,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_tokens: int | None = None,
    chunk_memory: int | str | None = None,
) -> Any:
    """Token cross-entropy of a linear head on ``hidden``, in chunks, as ``(loss_sum, count)``.

    Equal to ``token_cross_entropy(head(hidden), labels, shift=shift)`` (with ``label_smoothing``:
    ``F.cross_entropy``'s) without ever holding the whole ``tokens × vocabulary`` logits
    (Note [chunked head]). Use it in a ``loss_fn`` with the hidden states before a language model's
    head: the memory of a micro-batch is then bounded by the model, not its vocabulary.

    Args:
        hidden: ``[..., hidden_size]`` states the head maps to logits.
        head: the output layer: an ``nn.Linear`` (with or without bias; a tied embedding's
            weight works), a ``[vocab, hidden_size]`` weight, or a ``(weight, bias)`` pair.
        labels: ``[...]`` target ids; ``ignore_index`` marks tokens not counted.
        shift: predict token ``t+1`` from position ``t`` (a causal LM with unshifted labels).
        ignore_index: the label of tokens not counted.
        label_smoothing: in ``[0, 1]``, as ``F.cross_entropy``'s.
        z_loss: weight of the z-loss (PaLM: ``1e-4``), the mean squared log-partition
            ``log²Σexp(logits)`` per token, computed in the same pass.
        chunk_tokens: tokens per chunk (Note [chunk size]).
        chunk_memory: without ``chunk_tokens``: bytes one chunk's float32 logits may take
            (``"16MiB"``); default: 64 MiB, and at least 256 tokens (Note [chunk size]).

    Returns:
        ``(loss_sum, count)``: the summed loss over labelled tokens (float32 for half-precision
        states) and their number (a 0-dim tensor); with ``z_loss`` the named terms
        ``{"ce": (loss_sum, count), "z": (z_sum, count, z_loss)}`` (Note [named terms]).

    Raises:
        ValueError: ``label_smoothing`` outside ``[0, 1]``, a negative ``z_loss``, a chunk size
            that is not positive; shapes that do not match.
        TypeError: ``head`` is none of the above.

    Example:
        >>> head, hidden = torch.nn.Linear(8, 50), torch.randn(2, 5, 8)
        >>> loss_sum, count = head_cross_entropy(hidden, head, torch.randint(0, 50, (2, 5)))
        >>> int(count)
        8
    """
    weight, bias = _weights(head)
    _check(hidden, weight, labels, label_smoothing, z_loss)
    if shift:
        hidden, labels = hidden[..., :-1, :], labels[..., 1:]
    flat = labels.reshape(-1)
    kept = flat != ignore_index
    rows = kept.nonzero().squeeze(1)  # ignored tokens never reach the head
    h = hidden.reshape(-1, hidden.shape[-1])[rows]  # (index_select's backward: 5-10x slower)
    y = flat[rows].long()
    chunk = chunk_size(weight.shape[0], chunk_tokens, chunk_memory)
    with torch.autocast(h.device.type, enabled=False):  # the dtypes are chosen here
        w, b = weight.to(h.dtype), None if bias is None else bias.to(h.dtype)
        if LINEAR_CE is None or label_smoothing or z_loss or h.dtype in HALF:
            ce, z = _Chunked.apply(h, w, b, y, chunk, float(label_smoothing))
        else:
            options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk)  # type: ignore[attr-defined]
            ce = LINEAR_CE(h, w, y, linear_bias=b, reduction="sum", options=options)
    if not z_loss:
        return ce, kept.sum()
    return {"ce": (ce, kept.sum()), "z": (z, kept.sum(), float(z_loss))}


def chunk_size(vocab: int, chunk_tokens: object, chunk_memory: object) -> int:
    """Tokens per chunk (Note [chunk size]).

    Raises:
        ValueError: ``chunk_tokens`` is not a positive integer, or ``chunk_memory`` not a size.
    """
    if chunk_tokens is None and chunk_memory is None:
        return max(CHUNK_TOKENS, CHUNK_BYTES // (4 * vocab))
    if chunk_tokens is None:
        return max(1, (parse_bytes(chunk_memory, "chunk_memory") or 0) // (4 * vocab))
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(
            f"chunk_tokens={chunk_tokens!r} is not allowed: use a positive integer (tokens per "
            "chunk), or None to size chunks by chunk_memory."
        )
    return chunk_tokens


def _weights(head: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(head, torch.Tensor):
        return head, None
    if isinstance(head, tuple) and len(head) == 2:
        return head
    if isinstance(getattr(head, "weight", None), torch.Tensor):
        return head.weight, getattr(head, "bias", None)
    raise TypeError(
        f"head={type(head).__name__} is not allowed: pass the output layer (an nn.Linear), its "
        "[vocab, hidden] weight, or a (weight, bias) pair."
    )


def _check(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, smoothing: Any, z: Any
) -> None:
    if not (isinstance(smoothing, (int, float)) and 0 <= smoothing <= 1):
        raise ValueError(f"label_smoothing={smoothing!r} is not allowed: use a number in [0, 1].")
    if not (isinstance(z, (int, float)) and 0 <= z < float("inf")):
        raise ValueError(f"z_loss={z!r} is not allowed: use a weight >= 0 (e.g. 1e-4), or 0.")
    if (
        weight.dim() != 2
        or hidden.shape[-1] != weight.shape[1]
        or hidden.shape[:-1] != labels.shape
    ):
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, head weight {tuple(weight.shape)} and labels "
            f"{tuple(labels.shape)} do not match: hidden is [..., d], the weight [vocab, d], "
            "labels [...]."
        )


class _Chunked(torch.autograd.Function):
    """Our chunked path (Note [chunked head]): sums of the loss and of ``log²Z`` over chunks;
    saves each token's log-sum-exp and recomputes the chunk's logits in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        y: torch.Tensor,
        chunk: int,
        smoothing: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.float32 if h.dtype in HALF else h.dtype
        lse = torch.empty(len(h), dtype=acc, device=h.device)
        ce, z = torch.zeros(2, dtype=acc, device=h.device).unbind()
        for s in range(0, len(h), chunk):
            logits = F.linear(h[s : s + chunk], w, b).to(acc)
            top = lse[s : s + chunk] = torch.logsumexp(logits, 1)
            nll = top - logits.gather(1, y[s : s + chunk, None]).squeeze(1)
            if smoothing:  # F.cross_entropy's: (1 - ε) nll + ε (mean over the vocabulary)
                nll = (1 - smoothing) * nll + smoothing * (top - logits.mean(1))
            ce, z = ce + nll.sum(), z + top.square().sum()
        ctx.save_for_backward(h, w, b, y, lse)
        ctx.chunk, ctx.smoothing = chunk, smoothing
        return ce, z

    @staticmethod
    def backward(ctx: Any, g_ce: torch.Tensor, g_z: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        h, w, b, y, lse = ctx.saved_tensors
        want = ctx.needs_input_grad
        grad_h = torch.empty_like(h) if want[0] else None
        grad_w = torch.zeros_like(w, dtype=lse.dtype) if want[1] else None
        grad_b = torch.zeros_like(b, dtype=lse.dtype) if want[2] else None
        eps, step = ctx.smoothing, ctx.chunk
        rows = torch.arange(min(step, len(h)), device=h.device)
        with torch.autocast(h.device.type, enabled=False):  # a backward called under autocast
            for s in range(0, len(h), step):
                top, hs = lse[s : s + step, None], h[s : s + step]
                d = F.linear(hs, w, b).to(lse.dtype).sub_(top).exp_()  # the softmax
                d.mul_(g_ce + 2 * g_z * top)  # d log²Z / d logits = 2 log Z · softmax
                d[rows[: len(d)], y[s : s + step]] -= g_ce * (1 - eps)
                if eps:
                    d.sub_(g_ce * eps / w.shape[0])
                if grad_h is not None:
                    grad_h[s : s + step] = d.to(w.dtype) @ w
                if grad_w is not None:
                    grad_w.addmm_(d.t(), hs.to(d.dtype))
                if grad_b is not None:
                    grad_b += d.sum(0)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grad_h, cast(grad_w, w), cast(grad_b, b), None, None, None


class HeadLogits:
    """The logits of an output layer, not computed: what it received (Note [deferred head]).

    ``token_cross_entropy`` computes them in chunks; multiplying or dividing by a number scales
    them exactly; anything else raises, naming what was asked.
    """

    def __init__(self, hidden: torch.Tensor, head: torch.nn.Module, scale: float = 1.0) -> None:
        self.hidden, self.head, self.scale = hidden, head, scale

    def cross_entropy(self, labels: torch.Tensor, **kwargs: Any) -> Any:
        """``head_cross_entropy`` of these logits (its keyword arguments)."""
        weight, bias = _weights(self.head)
        if self.scale == 1.0:
            return head_cross_entropy(self.hidden, (weight, bias), labels, **kwargs)
        bias = None if bias is None else bias * self.scale
        return head_cross_entropy(self.hidden * self.scale, (weight, bias), labels, **kwargs)

    def __mul__(self, other: object) -> HeadLogits:
        if isinstance(other, bool) or not isinstance(other, numbers.Real):
            raise _refused(f"multiplying them by a {type(other).__name__}")
        return HeadLogits(self.hidden, self.head, self.scale * float(other))

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> HeadLogits:
        if isinstance(other, bool) or not isinstance(other, numbers.Real) or not other:
            raise _refused(f"dividing them by {other!r}")
        return self * (1.0 / float(other))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # a probe (copy, pickle): not there, as for any object
            raise AttributeError(name)
        raise _refused(f".{name}")

    def __getitem__(self, index: object) -> Any:
        raise _refused("indexing")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _refused(getattr(func, "__name__", str(func)))


def _refused(what: str) -> TypeError:
    return TypeError(
        f"the chunked head does not compute the logits, so {what} cannot be applied to them: a "
        "loss under chunked_head passes the model's logits to bigbatch.token_cross_entropy "
        "unchanged (a model that transforms its logits, e.g. soft-capping, cannot use it)."
    )


def output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``model`` (or a model inside a wrapper) returns from ``get_output_embeddings``.

    Raises:
        TypeError: no module has one, or it is not a linear layer (a ``weight`` matrix).
    """
    owner: Any = next((m for m in model.modules() if hasattr(m, "get_output_embeddings")), None)
    head = owner.get_output_embeddings() if owner is not None else None
    if not isinstance(head, torch.nn.Module) or getattr(head, "weight", None) is None:
        raise TypeError(
            f"chunked_head needs the model's output layer: {type(model).__name__} has no "
            "get_output_embeddings() returning a linear layer (transformers' causal LMs have one; "
            "add the method to your model, or call bigbatch.head_cross_entropy in your loss)."
        )
    return head


@contextlib.contextmanager
def deferred_head(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, ``model``'s output layer returns ``HeadLogits`` (Note [deferred
    head]); yields that layer. Its own ``forward`` is given back afterwards."""
    head = output_layer(model)
    own = head.__dict__.get("forward")  # a hook library's wrapper, kept
    head.forward = lambda hidden, *args, **kwargs: HeadLogits(hidden, head)
    try:
        yield head
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def with_chunked_head(loss_fn: Any, model: torch.nn.Module) -> Any:
    """``loss_fn`` run with the model's output layer deferred (Note [deferred head]): the loss of
    ``--chunked-head``.

    Raises:
        TypeError: ``model`` has no output layer (``output_layer``).
    """
    output_layer(model)

    def chunked(model: torch.nn.Module, micro_batch: Any) -> Any:
        with deferred_head(model):
            return loss_fn(model, micro_batch)

    return chunked
