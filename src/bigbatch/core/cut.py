"""``Cut``: how each window is cut into micro-batches, sized and counted, as one checked value.

The settings of how a window is cut travel together: by samples (``micro_batch_size``, each
micro-batch trimmed to its longest sample unless ``trim_padding=False``: Note [per-token tensors]
in ``bigbatch.core._tokens``) or by tokens (``micro_batch_tokens``, with ``pad_to_multiple_of``,
``lengths`` and a row cap), the pad values of a mapping batch's per-token keys, and the memory a
window may take (``memory_budget``, which ``"auto"`` sizes against). A ``Cut`` checks them
together once, when it is made, and builds a fresh sizing policy and cutter for each
``Accumulator`` (``build``). The ``Accumulator``, ``bigbatch.hf.exact``'s trainers and
``bigbatch train`` take these settings by their names, as before, and pass one ``Cut`` on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from bigbatch.core._pack import PackCut
from bigbatch.core._sizing import Sizing
from bigbatch.core._tokens import TokenCut, TrimmedSampleCut
from bigbatch.core._units import parse_bytes
from bigbatch.core._window import SampleCut

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Cut", "CutSettings"]

DEFAULT_MICRO_BATCH_SIZE = 32
"""Samples per micro-batch when neither ``micro_batch_size`` nor ``micro_batch_tokens`` is given."""


class CutSettings(TypedDict, total=False):
    """A ``Cut``'s fields as keyword arguments (the ``Accumulator``'s ``**cut``)."""

    micro_batch_size: int | str | None
    micro_batch_tokens: int | str | None
    pad_to_multiple_of: int | None
    lengths: Callable[[Any], Any] | None
    pad_values: Mapping[str, float | None] | None
    trim_padding: bool
    memory_budget: int | str | None
    pack: int | None
    count_group: Any


@dataclass(frozen=True)
class Cut:
    """How each window is cut into micro-batches and sized.

    Args:
        micro_batch_size: samples per micro-batch, or ``"auto"`` for the largest that fits (an
            out-of-memory error shrinks it and redoes the window). ``None``: 32, or no row cap
            with ``micro_batch_tokens``, where it caps the rows of a micro-batch.
        micro_batch_tokens: cut windows of variable-length text by tokens instead (Note [token
            windows] in ``bigbatch.core._tokens``): at most this many padded tokens per
            micro-batch, or ``"auto"`` (with ``memory_budget``: the largest budget that fits).
        pad_to_multiple_of: with ``micro_batch_tokens``: round each micro-batch's length up to a
            multiple of this and pad its rows to the bucket's row count, so a compiled model sees
            one shape per bucket (Note [compile buckets]).
        lengths: with ``micro_batch_tokens``: ``lengths(batch)`` -> each sample's tokens;
            default ``attention_mask.sum(-1)`` of a mapping batch.
        pad_values: the per-token keys of a mapping batch beyond transformers' and their pad
            value (``input_ids`` 0, ``attention_mask`` 0, ``labels`` -100, ...), ``None`` for a
            key that is not per-token (Note [per-token tensors]).
        trim_padding: cut by samples, trim each micro-batch of right-padded text (a mapping
            batch with an ``attention_mask``) to its longest sample; ``False`` keeps the batch's
            padded width, for a model or loss that reads the padding (mean pooling without the
            mask).
        memory_budget: cap on the memory a window may use above what was in use before it
            (``"6GiB"``, bytes): a window that goes over is redone smaller in auto mode, refused
            otherwise (``MemoryBudgetExceeded``).
        pack: pack each window's samples whole into rows of this many tokens, for a causal LM
            (Note [packed windows] in ``bigbatch.core._pack``): ``micro_batch_size`` rows per
            micro-batch (default 1), or as many as ``micro_batch_tokens`` holds.
        count_group: under context parallelism, the ``DeviceMesh`` of the ranks the gradients
            are reduced over, naming its ``"cp"`` dimension: each window's count is summed over
            the ranks' unique tokens once (Note [count groups] in ``bigbatch.core._sync``);
            ``None`` where every rank holds other samples.

    Raises:
        TypeError, ValueError: a bad or contradictory setting, named with what is allowed.

    Example:
        >>> Cut(micro_batch_tokens=4096).build()[0].name, Cut().build()[0].state.size
        ('micro_batch_tokens', 32)
    """

    micro_batch_size: int | str | None = None
    micro_batch_tokens: int | str | None = None
    pad_to_multiple_of: int | None = None
    lengths: Callable[[Any], Any] | None = None
    pad_values: Mapping[str, float | None] | None = None
    trim_padding: bool = True
    memory_budget: int | str | None = None
    pack: int | None = None
    count_group: Any = None

    def __post_init__(self) -> None:
        self.build()  # every check of the settings, together, once
        parse_bytes(self.memory_budget)

    @classmethod
    def of(cls, cut: Cut | int | str | None = None, **settings: Unpack[CutSettings]) -> Cut:
        """The ``Cut`` an ``Accumulator`` was given: a ``Cut``, a micro-batch size (``8``,
        ``"auto"``) standing for ``micro_batch_size``, and the settings by name.

        Raises:
            TypeError: a ``Cut`` together with settings by name, or settings it has no field for.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise TypeError(
                f"unexpected keyword argument {unknown[0]!r}: the settings of how a window is cut "
                f"are {', '.join(names)}."
            )
        if isinstance(cut, Cut):
            if settings:
                raise TypeError(
                    f"a Cut and {', '.join(settings)}= were both given: put every setting in the "
                    "Cut, or give them all by name."
                )
            return cut
        if cut is not None:
            if "micro_batch_size" in settings:
                raise TypeError("micro_batch_size was given twice: by position and by name.")
            settings["micro_batch_size"] = cut  # type: ignore[typeddict-item]
        return cls(**settings)

    def build(self) -> tuple[Sizing, SampleCut]:
        """A fresh sizing policy and cutter (each ``Accumulator`` holds its own: they keep state).

        Raises:
            TypeError, ValueError: a bad or contradictory setting, named with what is allowed.
        """
        if not isinstance(self.trim_padding, bool):
            raise TypeError(
                f"trim_padding={self.trim_padding!r} is not allowed: use True or False."
            )
        if self.pack is not None:
            return self._packed()
        if self.micro_batch_tokens is None:
            return self._by_samples()
        if self.micro_batch_size == "auto":
            raise ValueError(
                'micro_batch_size="auto" with micro_batch_tokens: the token budget is what auto '
                'sizes; use micro_batch_tokens="auto" and micro_batch_size=None or a row cap.'
            )
        if not self.trim_padding:
            raise ValueError(
                "trim_padding=False with micro_batch_tokens: token windows trim every micro-batch "
                "by design; cut by samples (micro_batch_size) to keep the batch's padded width."
            )
        sizing = Sizing(self.micro_batch_tokens, "micro_batch_tokens")
        rows = self.micro_batch_size
        cut = TokenCut(rows, self.pad_to_multiple_of, self.lengths, self.pad_values)  # type: ignore[arg-type]  # not "auto": refused above
        budget, multiple = self.micro_batch_tokens, cut.multiple or 0
        if isinstance(budget, int) and multiple > budget:
            raise ValueError(
                f"pad_to_multiple_of={multiple} is larger than micro_batch_tokens={budget}: every "
                f"micro-batch would be padded to at least {multiple} tokens, over the budget. Use "
                f"pad_to_multiple_of={min(64, budget)} (at most {budget}), or a larger "
                "micro_batch_tokens."
            )
        return sizing, cut

    def _packed(self) -> tuple[Sizing, SampleCut]:
        rows, budget, multiple = (
            self.micro_batch_size,
            self.micro_batch_tokens,
            self.pad_to_multiple_of,
        )
        wrong = {"micro_batch_size": rows == "auto", "trim_padding": not self.trim_padding}
        if name := next((k for k, v in wrong.items() if v), None):
            raise ValueError(
                f"{name}={getattr(self, name)!r} with pack: packed rows have one length already "
                f'and their token budget is what auto sizes: drop it (micro_batch_tokens="auto").'
            )
        cut = PackCut(self.pack, rows, self.lengths, self.pad_values)  # type: ignore[arg-type]
        if multiple is not None and (
            type(multiple) is not int or multiple < 1 or cut.length % multiple
        ):
            raise ValueError(
                f"pad_to_multiple_of={multiple!r} with pack={cut.length}: packed rows are the "
                "bucket already; give a divisor of pack (every micro-batch then padded to its "
                "full rows: one shape), or drop it."
            )
        cut.multiple = multiple  # Note [compile buckets]: the last micro-batch's rows padded
        if budget is None:
            budget = cut.length * (rows or 1)  # type: ignore[operator]
        elif isinstance(budget, int) and budget < cut.length:
            raise ValueError(
                f"micro_batch_tokens={budget} holds no packed row of pack={cut.length} tokens: "
                f"use micro_batch_tokens={cut.length} or more (a multiple), or a shorter pack."
            )
        cut.budget = budget if isinstance(budget, int) else None
        return Sizing(budget, "micro_batch_tokens"), cut

    def _by_samples(self) -> tuple[Sizing, SampleCut]:
        if self.pad_to_multiple_of is not None or self.lengths is not None:
            raise ValueError(
                "pad_to_multiple_of and lengths shape token windows: give micro_batch_tokens "
                "too (e.g. micro_batch_tokens=4096)."
            )
        size = DEFAULT_MICRO_BATCH_SIZE if self.micro_batch_size is None else self.micro_batch_size
        cut = TrimmedSampleCut(self.pad_values) if self.trim_padding else SampleCut()
        return Sizing(size), cut
