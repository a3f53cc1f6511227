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
      for the plain loss (class weights included) on float32 / float64 hidden states: it forms
      the gradient during its forward (three matrix products, as the plain head) and its
      backward only scales it.
    * ``_Chunked``, ours, for what torch's op does not do (label smoothing, the z-loss,
      soft-capping, half-precision hidden states, whose loss sum the op returns in their
      dtype: bf16 keeps 3 digits of a sum over thousands of tokens) and on torch < 2.13. It
      keeps each token's log-sum-exp and recomputes a chunk's logits in backward (four
      products), so the gradient is formed from the upstream one as autograd's is, fp16's loss
      scale included. Half-precision hidden states multiply in their dtype, as the plain head
      under autocast, and every sum and softmax is in float32. Soft-capping is per chunk
      (``cap · tanh(logits / cap)``, its gradient ``1 - tanh²`` in backward).

    Class weights (``weight=``) stay exact under accumulation: ``F.cross_entropy``'s weighted
    mean is ``Σ w_y · loss / Σ w_y`` (its label smoothing term ``ε / V · Σ_c w_c (log Z -
    logit_c)`` is divided by the same ``Σ w_y``), so the count is ``Σ w_y``.

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
    What a model does to its logits that keeps them computable is recorded: a scale by a finite
    number (Cohere's ``logit_scale``, Granite's ``logits_scaling``) goes onto the hidden states,
    exactly; ``s2 · tanh(s1 · logits)`` (Gemma 2's soft-capping ``/ cap``, ``tanh``, ``* cap``,
    and any other two scales) is ``softcap=|s2|`` of the logits scaled by ``s1 · s2``. Calls that
    change no value answer as the logits would: ``.contiguous()`` (OPT), ``.shape``, ``.size()``,
    ``.dim()``, ``.device`` (a logging hook), ``.dtype`` and ``.float()`` (accelerate's
    ``convert_to_fp32`` under mixed precision). Under autocast the layer's input is cast to
    autocast's dtype, as autocast's linear layer casts it, so the chunked loss rounds as the
    plain head's (logits in bf16, upcast for the loss); ``dtype`` is then autocast's, and
    ``.float()`` changes nothing computed. Anything else (an ``argmax``, ``+``, indexing, a
    second ``tanh``) is refused in one line rather than computed wrong. The trainer's
    ``--chunked-head`` and ``bigbatch.hf.Trainer(chunked_head=True)`` use it.

Note [head gradients]
    A second backward through the same loss (``retain_graph=True``, torch's ``gradcheck``)
    works on both paths: ``_Chunked`` recomputes from what it saved, and torch's op keeps its
    gradient buffers (``allow_retain_graph=True``), at the cost of one gradient-sized product
    per backward instead of scaling them in place (a 32K x 2,048 float32 head, 1,024 tokens:
    the added peak 528 -> 792 MiB, one weight gradient more). Higher-order gradients (a
    backward with ``create_graph=True``, e.g. a gradient penalty) are refused in one line when
    that backward reaches the head: neither path's backward is differentiable, and torch's op
    would return first-order gradients with no graph, leaving the penalty's second-order terms
    out silently.
"""

from __future__ import annotations

import contextlib
import functools
import math
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
    softcap: float | None = None,
    weight: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    chunk_memory: int | str | None = None,
) -> Any:
    """Token cross-entropy of a linear head on ``hidden``, in chunks, as ``(loss_sum, count)``.

    Equal to ``token_cross_entropy(head(hidden), labels, shift=shift)`` (with ``label_smoothing``
    and ``weight``: ``F.cross_entropy``'s) without ever holding the whole ``tokens × vocabulary``
    logits (Note [chunked head]). Use it in a ``loss_fn`` with the hidden states before a
    language model's head: the memory of a micro-batch is then bounded by the model, not its
    vocabulary.

    Args:
        hidden: ``[..., hidden_size]`` states the head maps to logits.
        head: the output layer: an ``nn.Linear`` (with or without bias; a tied embedding's
            weight works; under ZeRO 3 the layer, not its weight: Note [head under ZeRO 3]), a
            ``[vocab, hidden_size]`` weight, or a ``(weight, bias)`` pair.
        labels: ``[...]`` target ids; ``ignore_index`` marks tokens not counted.
        shift: ``True``: predict token ``t+1`` from position ``t`` (a causal LM with unshifted
            labels); ``False``: labels already aligned with ``hidden``.
        ignore_index: the label of tokens not counted.
        label_smoothing: in ``[0, 1]``, as ``F.cross_entropy``'s.
        z_loss: weight of the z-loss (PaLM: ``1e-4``), the mean squared log-partition
            ``log²Σexp(logits)`` per token, computed in the same pass.
        softcap: final-logit soft-capping (Gemma 2): the logits are ``softcap * tanh(logits /
            softcap)``; a positive number, or ``None``.
        weight: ``[vocab]`` class weights, as ``F.cross_entropy``'s ``weight=`` (constants):
            the count is then ``Σ weight[label]``, so ``loss_sum / count`` is its weighted mean.
        chunk_tokens: tokens per chunk (Note [chunk size]).
        chunk_memory: without ``chunk_tokens``: bytes one chunk's float32 logits may take
            (``"16MiB"``); default: 64 MiB, and at least 256 tokens (Note [chunk size]).

    Returns:
        ``(loss_sum, count)``: the summed loss over labelled tokens (float32 for half-precision
        states) and their number (a 0-dim tensor; with ``weight``, the sum of their weights);
        with ``z_loss`` the named terms ``{"ce": (loss_sum, count), "z": (z_sum, tokens,
        z_loss)}`` (Note [named terms]).

    Raises:
        ValueError: ``label_smoothing`` outside ``[0, 1]``, a negative ``z_loss``, a ``softcap``
            that is not positive, a ``weight`` not ``[vocab]``, a chunk size that is not
            positive, a label outside the vocabulary; shapes that do not match; ZeRO 3's empty
            partition of a weight.
        TypeError: ``head`` is none of the above; ``shift`` is not a bool; labels that are
            not integers.
        RuntimeError: in a backward with ``create_graph=True`` (Note [head gradients]).

    Example:
        >>> head, hidden = torch.nn.Linear(8, 50), torch.randn(2, 5, 8)
        >>> loss_sum, count = head_cross_entropy(hidden, head, torch.randint(0, 50, (2, 5)))
        >>> int(count)
        8
    """
    if isinstance(head, torch.nn.Module) and _partitioned(getattr(head, "weight", None)):
        options: dict[str, Any] = dict(shift=shift, ignore_index=ignore_index, weight=weight)
        options.update(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
        options.update(chunk_tokens=chunk_tokens, chunk_memory=chunk_memory)
        return _in_layer(head, hidden, labels, options)
    matrix, bias = _weights(head)
    _check(hidden, matrix, labels, label_smoothing, z_loss)
    _check_options(shift, softcap, weight, matrix.shape[0])
    if shift:
        hidden, labels = hidden[..., :-1, :], labels[..., 1:]
    flat = labels.reshape(-1)
    kept = flat != ignore_index
    rows = kept.nonzero().squeeze(1)  # ignored tokens never reach the head
    h = hidden.reshape(-1, hidden.shape[-1])[rows]  # (index_select's backward: 5-10x slower)
    y = _labels(flat[rows], matrix.shape[0], ignore_index)
    chunk = chunk_size(matrix.shape[0], chunk_tokens, chunk_memory)
    acc = torch.float32 if h.dtype in HALF else h.dtype  # the sums' dtype (Note [chunked head])
    cw = None if weight is None else weight.detach().to(acc)
    ce, z = _sums(h, (matrix, bias), y, cw, chunk, float(label_smoothing), softcap, bool(z_loss))
    count = kept.sum() if cw is None else cw[y].sum()
    if not z_loss:
        return ce, count
    return {"ce": (ce, count), "z": (z, kept.sum(), float(z_loss))}


def _sums(
    h: torch.Tensor,
    head: tuple[torch.Tensor, torch.Tensor | None],
    y: torch.Tensor,
    cw: torch.Tensor | None,
    chunk: int,
    smoothing: float,
    softcap: float | None,
    z_loss: bool,
) -> Any:
    """The loss sum and the ``log²Z`` sum over the kept tokens (Note [chunked head]); torch's
    op gives no ``log²Z`` sum (``None``)."""
    with torch.autocast(h.device.type, enabled=False):  # the dtypes are chosen here
        w, b = (None if t is None else t.to(h.dtype) for t in head)
        if LINEAR_CE is None or smoothing or z_loss or softcap or h.dtype in HALF:
            return _Chunked.apply(h, w, b, y, cw, chunk, smoothing, softcap)
        # Note [head gradients]: a second backward (retain_graph=True) is allowed
        options = torch.nn.LinearCrossEntropyOptions(  # type: ignore[attr-defined]
            batch_chunk_size=chunk, allow_retain_graph=True
        )
        ce = LINEAR_CE(h, w, y, linear_bias=b, weight=cw, reduction="sum", options=options)
        return _FirstOrder.apply(ce), None


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
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels of dtype {labels.dtype} are not allowed: use integer token ids.")
    if _partitioned(weight) and weight.numel() == 0:
        raise ValueError(
            "head: the weight is ZeRO 3's partition (empty outside its layer's call): pass the "
            "output layer itself (model.lm_head), whose call gathers it."
        )
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


def _check_options(shift: object, softcap: object, weight: object, vocab: int) -> None:
    if not isinstance(shift, bool):  # Cut Cross-Entropy's int shift is not ours
        raise TypeError(
            f"shift={shift!r} is not allowed: use True (predict token t+1 from position t) or "
            "False (labels already aligned)."
        )
    real = isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
    if softcap is not None and not (real and 0 < softcap < math.inf):  # type: ignore[operator]
        raise ValueError(f"softcap={softcap!r} is not allowed: use a number > 0 (Gemma 2: 30.0).")
    if weight is not None and not (
        isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.shape == (vocab,)
    ):
        what = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(
            f"weight={what} is not allowed: use a float tensor of one weight per class, [{vocab}]."
        )


def _labels(y: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    outside = y[(y < 0) | (y >= vocab)]  # torch's op would skip a -100, ours would fail
    if len(outside):
        raise ValueError(
            f"labels hold {int(outside[0])}, which is not allowed: use token ids in [0, {vocab}) "
            f"and ignore_index={ignore_index} for tokens not counted."
        )
    return y.long()


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
        cw: torch.Tensor | None,
        chunk: int,
        smoothing: float,
        cap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.float32 if h.dtype in HALF else h.dtype
        cw = torch.ones(w.shape[0], dtype=acc, device=h.device) if cw is None else cw
        lse = torch.empty(len(h), dtype=acc, device=h.device)
        ce, z = torch.zeros(2, dtype=acc, device=h.device).unbind()
        for s in range(0, len(h), chunk):
            logits, _ = _logits(h[s : s + chunk], w, b, acc, cap)
            top = lse[s : s + chunk] = torch.logsumexp(logits, 1)
            ys = y[s : s + chunk]
            nll = (top - logits.gather(1, ys[:, None]).squeeze(1)) * cw[ys]
            if smoothing:  # F.cross_entropy's: (1 - ε) w_y nll + ε / V Σ_c w_c (log Z - logit_c)
                spread = (top * cw.sum() - logits @ cw) / w.shape[0]
                nll = (1 - smoothing) * nll + smoothing * spread
            ce, z = ce + nll.sum(), z + top.square().sum()
        ctx.save_for_backward(h, w, b, y, cw, lse)
        ctx.chunk, ctx.smoothing, ctx.cap = chunk, smoothing, cap
        return ce, z

    @staticmethod
    def backward(ctx: Any, g_ce: torch.Tensor, g_z: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _first_order()
        h, w, b, y, cw, lse = ctx.saved_tensors
        want = ctx.needs_input_grad
        grad_h = torch.empty_like(h) if want[0] else None
        grad_w = torch.zeros_like(w, dtype=lse.dtype) if want[1] else None
        grad_b = torch.zeros_like(b, dtype=lse.dtype) if want[2] else None
        eps, step, vocab = ctx.smoothing, ctx.chunk, w.shape[0]
        rows = torch.arange(min(step, len(h)), device=h.device)
        with torch.autocast(h.device.type, enabled=False):  # a backward called under autocast
            for s in range(0, len(h), step):
                top, hs, ys = lse[s : s + step, None], h[s : s + step], y[s : s + step]
                d, tanh = _logits(hs, w, b, lse.dtype, ctx.cap)
                d.sub_(top).exp_()  # the softmax
                wy = g_ce * (1 - eps) * cw[ys]
                # d log²Z / d logits = 2 log Z · softmax; the loss's: ε-smoothed, class-weighted
                d.mul_((wy + g_ce * eps * cw.sum() / vocab)[:, None] + 2 * g_z * top)
                d[rows[: len(d)], ys] -= wy
                if eps:
                    d.sub_(g_ce * eps / vocab * cw)
                if tanh is not None:  # through cap · tanh(logits / cap)
                    d.mul_(1 - tanh.square_())
                if grad_h is not None:
                    grad_h[s : s + step] = d.to(w.dtype) @ w
                if grad_w is not None:
                    grad_w.addmm_(d.t(), hs.to(d.dtype))
                if grad_b is not None:
                    grad_b += d.sum(0)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grad_h, cast(grad_w, w), cast(grad_b, b), None, None, None, None, None


def _logits(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, acc: torch.dtype, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's logits in ``acc``, soft-capped; and the ``tanh`` of the cap (for its gradient)."""
    logits = F.linear(h, w, b).to(acc)
    if cap is None:
        return logits, None
    tanh = logits.div_(cap).tanh_()
    return tanh * cap, tanh


def _first_order() -> None:
    if torch.is_grad_enabled():  # a backward with create_graph=True
        raise RuntimeError(
            "head_cross_entropy has no higher-order gradients (a backward with create_graph=True, "
            "e.g. a gradient penalty): use F.cross_entropy(head(hidden), labels) for that loss, or "
            "backward without create_graph."
        )


class _FirstOrder(torch.autograd.Function):
    """torch's op's loss, passed through; refuses a backward that builds a graph (Note [head
    gradients]): torch's op would give gradients without one, silently."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _first_order()
        return grad


def _operator(symbol: str) -> Any:
    def refuse(self: HeadLogits, *other: object) -> Any:
        raise _refused(f"the operator {symbol}")

    return refuse


class HeadLogits:
    """The logits of an output layer, not computed: what it received (Note [deferred head]).

    ``token_cross_entropy`` computes them in chunks; multiplying or dividing by a number scales
    them exactly, ``torch.tanh`` between two scales soft-caps them; the calls that change no
    value (``.float()``, ``.contiguous()``, ``.shape``, ...) answer as the logits would; anything
    else raises, naming what was asked. ``dtype``: the logits' (under autocast, its dtype).
    """

    def __init__(
        self,
        hidden: torch.Tensor,
        head: torch.nn.Module,
        scale: float = 1.0,
        cap: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.hidden, self.head, self.scale, self.cap = hidden, head, scale, cap
        self.dtype = hidden.dtype if dtype is None else dtype

    def cross_entropy(self, labels: torch.Tensor, **kwargs: Any) -> Any:
        """``head_cross_entropy`` of these logits (its keyword arguments).

        Note [head under ZeRO 3]
            DeepSpeed's ZeRO 3 keeps each rank's partition of a parameter only, and gathers the
            whole weight in the hooks around its module's call: before its forward, and again
            before its backward, reducing the gradient after it. The output layer's forward
            returned these logits without reading its weight, so where the weight is ZeRO 3's
            (``ds_id``) the chunked loss runs as the layer's forward, inside a second call of
            the layer: its hooks gather the weight for the loss and for its backward, and the
            weight's gradient goes to ZeRO's partitions as the plain head's would.
        """
        if not _partitioned(_weights(self.head)[0]):
            return self._cross_entropy(self.hidden, labels, kwargs)
        compute = functools.partial(self._cross_entropy, labels=labels, kwargs=kwargs)
        return _in_call(self.head, compute, self.hidden)

    def _cross_entropy(self, hidden: torch.Tensor, labels: torch.Tensor, kwargs: Any) -> Any:
        weight, bias = _weights(self.head)
        scale = self.scale if self.cap is None else self.scale * self.cap  # cap·tanh(x / cap)
        cap = None if self.cap is None else abs(self.cap)
        if scale != 1.0:
            bias = None if bias is None else bias * scale
            hidden = hidden * scale
        return head_cross_entropy(hidden, (weight, bias), labels, softcap=cap, **kwargs)

    def _with(self, **change: Any) -> HeadLogits:
        return HeadLogits(**{**vars(self), **change})

    def __mul__(self, other: object) -> HeadLogits:
        factor = _real(other, "multiplying them by")
        if self.cap is None:
            return self._with(scale=self.scale * factor)
        return self._with(cap=self.cap * factor)

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> HeadLogits:
        return self * (1.0 / _real(other, "dividing them by", divisor=True))

    __add__ = __radd__ = _operator("+")
    __sub__ = __rsub__ = _operator("-")
    __neg__ = _operator("unary -")
    __rtruediv__ = _operator("/ (dividing by them)")
    __pow__ = __rpow__ = _operator("**")
    __matmul__ = __rmatmul__ = _operator("@")
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _operator("// or %")

    def tanh(self) -> HeadLogits:
        """Soft-capping's ``tanh`` (Note [deferred head])."""
        if self.cap is not None:
            raise _refused("a second tanh")
        return self._with(cap=1.0)

    def to(self, *args: Any, **kwargs: Any) -> HeadLogits:
        """The same logits, upcast (accelerate's ``convert_to_fp32``): computed as before."""
        dtype = (*args, *kwargs.values())
        upcast = torch.float32 if self.dtype in HALF else self.dtype
        if len(dtype) != 1 or dtype[0] not in (self.dtype, upcast):
            what = f".to({', '.join(map(str, dtype))}) of {self.dtype} logits"
            raise _refused(f"{what} (only half precision's upcast to float32 keeps the values)")
        return self._with(dtype=dtype[0])

    def float(self) -> HeadLogits:
        return self.to(torch.float32)

    def contiguous(self) -> HeadLogits:
        return self

    @property
    def shape(self) -> torch.Size:
        weight = _weights(self.head)[0]  # ZeRO 3's partition: its whole shape
        return torch.Size((*self.hidden.shape[:-1], getattr(weight, "ds_shape", weight.shape)[0]))

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.hidden.dim()

    ndim = property(dim)
    device = property(lambda self: self.hidden.device)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # a probe (copy, pickle): not there, as for any object
            raise AttributeError(name)
        raise _refused(f".{name}")

    def __getitem__(self, index: object) -> Any:
        raise _refused("indexing")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.tanh, torch.Tensor.tanh, F.tanh) and len(args) == 1 and not kwargs:
            return args[0].tanh()
        raise _refused(getattr(func, "__name__", str(func)))


def _real(value: object, what: str, divisor: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _refused(f"{what} a {type(value).__name__}")
    if not math.isfinite(value) or (divisor and not value):
        why = "a non-finite scale" if not math.isfinite(value) else "a division by 0"
        raise _refused(f"{what} {value!r} ({why})")
    return float(value)


def _refused(what: str) -> TypeError:
    return TypeError(
        f"the chunked head does not compute the logits, so {what} cannot be applied to them: a "
        "loss under chunked_head passes the model's logits to bigbatch.token_cross_entropy "
        "scaled by numbers and soft-capped (cap * tanh(logits / cap)) at most."
    )


def output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``model`` (or a model inside a wrapper) returns from ``get_output_embeddings``.

    Raises:
        TypeError: no module has one, or it is not an ``nn.Linear`` (a layer whose forward is
            ``nn.Linear``'s: a LoRA adapter or a quantised layer computes more than its weight).
    """
    owner: Any = next((m for m in model.modules() if hasattr(m, "get_output_embeddings")), None)
    head = owner.get_output_embeddings() if owner is not None else None
    if not isinstance(head, torch.nn.Module) or getattr(head, "weight", None) is None:
        raise TypeError(
            f"chunked_head needs the model's output layer: {type(model).__name__} has no "
            "get_output_embeddings() returning a linear layer (transformers' causal LMs have one; "
            "add the method to your model, or call bigbatch.head_cross_entropy in your loss)."
        )
    if type(head).forward is not torch.nn.Linear.forward:  # its weight is not all it computes
        raise TypeError(
            f"chunked_head computes a linear layer's logits: {type(model).__name__}'s output "
            f"layer is a {type(head).__name__} with its own forward (a LoRA adapter, a quantised "
            "weight), which it would leave out: merge it into an nn.Linear, or call "
            "bigbatch.head_cross_entropy in your loss."
        )
    return head


@contextlib.contextmanager
def deferred_head(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, ``model``'s output layer returns ``HeadLogits`` (Note [deferred
    head]); yields that layer. Its own ``forward`` is given back afterwards."""
    head = output_layer(model)
    with _forward(head, lambda hidden, *args, **kwargs: HeadLogits(_autocast(hidden), head)):
        yield head


def _partitioned(weight: Any) -> bool:
    """Whether ``weight`` is a ZeRO 3 parameter (Note [head under ZeRO 3])."""
    return hasattr(weight, "ds_id")


def _in_layer(head: torch.nn.Module, hidden: torch.Tensor, labels: Any, options: Any) -> Any:
    """``head_cross_entropy`` with ``options`` on a ZeRO 3 output layer: inside its call, where
    its weight is whole (Note [head under ZeRO 3])."""
    pair = (head.weight, head.bias)
    compute = functools.partial(head_cross_entropy, head=pair, labels=labels, **options)
    return _in_call(head, compute, hidden)


def _in_call(head: torch.nn.Module, compute: Any, hidden: torch.Tensor) -> Any:
    """``compute(hidden)`` run as ``head``'s forward, inside its call and its hooks (Note [head
    under ZeRO 3])."""
    with _forward(head, compute):
        return head(hidden)


@contextlib.contextmanager
def _forward(module: torch.nn.Module, forward: Any) -> Iterator[None]:
    """Within the block ``module.forward`` is ``forward``; then its own (a hook library's
    wrapper set on the instance kept)."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _autocast(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` in the dtype autocast gives a linear layer here (torch >= 2.4): the chunked
    loss then rounds as the plain head's would."""
    device = hidden.device.type
    if not hasattr(torch, "get_autocast_dtype") or not torch.is_autocast_enabled(device):
        return hidden
    return hidden if hidden.dtype == torch.float64 else hidden.to(torch.get_autocast_dtype(device))


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
