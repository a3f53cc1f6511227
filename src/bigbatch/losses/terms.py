"""Ready-made loss terms, each ``{name: (loss_sum, count, weight)}`` in the unit its paper names.

A ``loss_fn`` returns the union of the terms it needs (``{**token_nll(...), **z_loss(...)}``) and
the engine gives every term its own global count (Note [named terms] in ``bigbatch.core.loss``):
an auxiliary term is not inflated by the number of micro-batches, a per-pair or per-sequence
term is not normalised per micro-batch. The units:

==================  ====================================================  ==================
term                loss                                                  count
==================  ====================================================  ==================
``token_nll``       cross-entropy (label smoothing optional) per token    labelled tokens
``z_loss``          ``logsumexp(logits)²`` per token (PaLM)                labelled tokens
``dpo``             ``-log σ(β (Δ chosen − Δ rejected))`` per pair          pairs
``policy_gradient`` clipped ratio × advantage per token, then             ``"token"``: tokens
                    (DAPO) per token, (GRPO) each sequence's token mean,   ``"sequence"``:
                    (Dr. GRPO) summed over a constant length               sequences;
                                                                          ``"constant"``:
                                                                          sequences × length
``load_balance``    ``E Σ_e f_e P_e`` over the global batch (Switch, Qwen  tokens
                    MoE): ``f`` from ``load_balance_stats`` in a
                    statistics pass, ``P`` differentiated
``kto``             ``1 − σ(±β (r − z_ref))`` per sample, ``z_ref`` the     samples
                    batch's mean log-ratio (``kto_stats``)
==================  ====================================================  ==================

Whole-batch statistics come from a statistics pass (``train_step(..., stats_fn=...)``): the
routed fractions (``load_balance_stats``), KTO's reference point (``kto_stats``), and rewards
normalised over the batch (``reward_stats`` + ``normalised_advantages``), each exact under any
cut because the pass totals them over the window and the ranks first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bigbatch.core.loss import Term, flat_tokens

Terms = dict[str, Term]


def token_nll(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    name: str = "nll",
    weight: float = 1.0,
    shift: bool = True,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> Terms:
    """Cross-entropy per labelled token (``labels != ignore_index``), summed; counted in tokens."""
    flat, target, kept = flat_tokens(logits, labels, shift, ignore_index)
    total = F.cross_entropy(
        flat, target, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing
    )
    return {name: Term(total, kept.sum(), weight)}


def z_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    weight: float = 1e-4,
    name: str = "z_loss",
    shift: bool = True,
    ignore_index: int = -100,
) -> Terms:
    """``logsumexp(logits)²`` per labelled token (keeps the softmax normaliser near 1)."""
    flat, _, kept = flat_tokens(logits, labels, shift, ignore_index)
    return {name: Term((flat.logsumexp(-1)[kept] ** 2).sum(), kept.sum(), weight)}


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, shift: bool = True, ignore_index: int = -100
) -> torch.Tensor:
    """Each sequence's log-probability of its labelled tokens, ``[n]`` (a DPO policy score;
    half-precision logits are upcast, as for ``token_nll``)."""
    flat, target, kept = flat_tokens(logits, labels, shift, ignore_index)
    picked = flat.log_softmax(-1).gather(-1, target.clamp_min(0)[:, None]).squeeze(-1)
    return (picked * kept).reshape(*labels.shape[:-1], -1).sum(-1)


def dpo(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    name: str = "dpo",
    weight: float = 1.0,
) -> Terms:
    """DPO per pair: ``-log σ(β ((π_c − ref_c) − (π_r − ref_r)))`` from sequence log-probs."""
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    losses = -F.logsigmoid(beta * margin)
    return {name: Term(losses.sum(), float(losses.numel()), weight)}


def policy_gradient(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    unit: str = "token",
    clip: float = 0.2,
    max_len: int | None = None,
    name: str = "pg",
    weight: float = 1.0,
) -> Terms:
    """Clipped policy gradient (PPO / GRPO) per token, normalised in ``unit``.

    Args:
        logps, old_logps: ``[n, t]`` per-token log-probabilities now and when sampled.
        advantages: ``[n]`` per sequence (or ``[n, t]`` per token).
        mask: ``[n, t]`` the tokens that count (the completion).
        unit: ``"token"`` (DAPO), ``"sequence"`` (GRPO: each sequence's token mean, averaged
            over sequences) or ``"constant"`` (Dr. GRPO: summed over ``max_len`` per sequence).

    Raises:
        ValueError: an unknown ``unit``, or ``"constant"`` without ``max_len``.
    """
    if unit not in ("token", "sequence", "constant") or (unit == "constant" and not max_len):
        raise ValueError(
            f"unit={unit!r}, max_len={max_len!r} is not allowed: use unit='token', 'sequence', "
            "or 'constant' with max_len, the fixed length (not a micro-batch's, which varies)."
        )
    a = advantages if advantages.dim() == logps.dim() else advantages[:, None]
    ratio = (logps - old_logps).exp()
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a) * mask
    if unit == "sequence":
        per_sequence = per_token.sum(-1) / mask.sum(-1).clamp_min(1)
        return {name: Term(per_sequence.sum(), float(len(mask)), weight)}
    count = mask.sum() if unit == "token" else float(len(mask) * max_len)  # type: ignore[operator]
    return {name: Term(per_token.sum(), count, weight)}


def load_balance_stats(router_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """A statistics pass's share of the routing: tokens routed to each expert (top-1), and tokens."""
    kept = mask[..., None].to(router_probs.dtype)
    picked = F.one_hot(router_probs.argmax(-1), router_probs.shape[-1]).to(router_probs.dtype)
    return {"routed": (picked * kept).flatten(0, -2).sum(0), "tokens": kept.sum()}


def load_balance(
    router_probs: torch.Tensor,
    mask: torch.Tensor,
    stats: dict[str, Any],
    *,
    weight: float = 0.01,
    name: str = "balance",
) -> Terms:
    """The global-batch balance ``E Σ_e f_e P_e``: ``f`` (held constant) from the window's totals
    of ``load_balance_stats``, ``P`` the mean router probability, differentiated."""
    kept = mask[..., None].to(router_probs.dtype)
    f = stats["routed"] / stats["tokens"]
    p_sum = (router_probs * kept).flatten(0, -2).sum(0)
    return {name: Term(router_probs.shape[-1] * (f * p_sum).sum(), kept.sum(), weight)}


def kto_stats(logratios: torch.Tensor) -> dict[str, Any]:
    """A statistics pass's share of KTO's reference point: ``Σ (log π − log π_ref)`` and n."""
    return {"sum": logratios.detach().sum(), "n": torch.tensor(float(logratios.numel()))}


def kto(
    logratios: torch.Tensor,
    desirable: torch.Tensor,
    stats: dict[str, Any],
    *,
    beta: float = 0.1,
    name: str = "kto",
    weight: float = 1.0,
) -> Terms:
    """KTO per sample: ``1 − σ(β (r − z))`` desirable, ``1 − σ(β (z − r))`` undesirable, with
    ``r`` the sample's log-ratio and ``z = max(0, batch mean of r)`` from ``kto_stats``."""
    z = (stats["sum"] / stats["n"]).clamp_min(0)
    sign = desirable.to(logratios.dtype) * 2 - 1
    losses = 1 - torch.sigmoid(beta * sign * (logratios - z))
    return {name: Term(losses.sum(), float(losses.numel()), weight)}


def reward_stats(rewards: torch.Tensor) -> dict[str, Any]:
    """A statistics pass's share of the batch's reward mean and spread: Σr, Σr², n."""
    r = rewards.detach().to(torch.float64)
    return {"sum": r.sum(), "squares": (r * r).sum(), "n": torch.tensor(float(r.numel()))}


def normalised_advantages(
    rewards: torch.Tensor, stats: dict[str, Any], eps: float = 1e-6
) -> torch.Tensor:
    """``(r − mean) / (std + eps)`` with the mean and (population) std of the whole batch."""
    mean = stats["sum"] / stats["n"]
    std = (stats["squares"] / stats["n"] - mean**2).clamp_min(0).sqrt()
    return ((rewards - mean) / (std + eps)).to(rewards.dtype)
