"""A token-local language model and text windows whose ranks count different numbers of tokens,
with what the DeepSpeed and count-group tests (and benchmarks/deepspeed_windows.py) share: a rank's
DeepSpeed environment, an engine, the one-process float64 reference.

DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) runs over the gloo group that ``run_ranks``
opened; it needs ``LOCAL_RANK`` and friends, and JIT-builds its shared-memory op once (about 30 s,
cached in ``~/.cache/torch_extensions``; only its inference all-reduce uses it).
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

VOCAB, WIDTH, LENGTH = 11, 8, 9
SAMPLES = (10, 6, 8)  # per rank, window by window: 3, 2 and 2 micro-batches of 4
MICRO = 4


class TokenLM(torch.nn.Module):
    """Embedding + MLP language model: each position's logits read only its own token, so a
    sequence cut into shards gives each shard's tokens the logits of the whole sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, hidden_only: bool = False) -> torch.Tensor:
        """The logits, or the hidden states the head reads (``hidden_only``)."""
        hidden = self.mlp(self.embed(input_ids))
        return hidden if hidden_only else self.head(hidden)


def model(seed: int = 0, dtype: torch.dtype = torch.float32) -> TokenLM:
    torch.manual_seed(seed)
    return TokenLM().to(dtype)


def text(n: int, gen: torch.Generator, length: int = LENGTH) -> dict:
    """``n`` right-padded sequences of 2..length tokens; about a third of the labels masked."""
    lengths = torch.randint(2, length + 1, (n,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = torch.randint(0, VOCAB, (n, length), generator=gen) * mask
    labels = torch.randint(0, VOCAB, (n, length), generator=gen)
    kept = mask.bool() & (torch.rand(n, length, generator=gen) > 0.35)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(~kept, -100)}


def windows(seed: int, world: int, samples: tuple[int, ...] = SAMPLES) -> list[list[dict]]:
    """One batch per rank for each window: as many samples on every rank, other token counts."""
    gen = torch.Generator().manual_seed(seed)
    return [[text(n, gen) for _ in range(world)] for n in samples]


def token_loss(m, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits = m(mb["input_ids"]).double()  # the loss in float64 (the model is DeepSpeed's float32)
    labels = mb["labels"].reshape(-1)
    loss_sum = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels, ignore_index=-100, reduction="sum"
    )
    return loss_sum, (labels != -100).sum()


def head_loss(m, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_loss`` by the chunked head: ``bigbatch.head_cross_entropy`` on the hidden states
    and the output layer (under ZeRO 3 it gathers the weight in the layer's call)."""
    import bigbatch

    hidden = m(mb["input_ids"], hidden_only=True)
    head = getattr(m, "module", m).head  # the engine's module's
    return bigbatch.head_cross_entropy(hidden, head, mb["labels"], shift=False)


def sample_mean(m, mb: dict) -> torch.Tensor:
    """Each sequence's mean token loss, averaged over the sequences: a mean over samples."""
    logits = m(mb["input_ids"]).double()
    per_token = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), mb["labels"].clamp_min(0), reduction="none"
    )
    kept = (mb["labels"] != -100).double()
    return ((per_token * kept).sum(1) / kept.sum(1).clamp_min(1)).mean()


def counts(mb: dict) -> torch.Tensor:
    return (mb["labels"] != -100).sum()


def environment(rank: int, world: int, port: int | None = None) -> None:
    """What DeepSpeed reads in a rank that ``run_ranks`` started (the group is already open);
    with ``port``, the rendezvous accelerate reads too (a trainer's ranks)."""
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    warnings.filterwarnings("ignore", module="deepspeed")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def engine(
    m: torch.nn.Module, optimizer: torch.optim.Optimizer, stage: int, scheduler=None, **config
):
    """``deepspeed.initialize`` with caller-owned windows and no clipping unless asked; the
    ``scheduler`` is the engine's (``engine.step()`` steps it)."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        # every parameter partitioned under ZeRO 3 (its default keeps those under 1e5 whole)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **config,
    }
    eng, opt, _, _ = deepspeed.initialize(
        model=m, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    return eng, opt


def gathered(eng) -> dict[str, torch.Tensor]:
    """The engine's full parameters (ZeRO 3 gathers them)."""
    import deepspeed

    params = list(eng.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def reference(windows_: list[list[dict]], make_optimizer, clip: float | None = None) -> dict:
    """One process, float64, each window's ranks' batches as one batch: one plain step each."""
    m = model(dtype=torch.float64)
    optimizer = make_optimizer(m.parameters())
    norms, losses = [], []
    for per_rank in windows_:
        batch = {k: torch.cat([b[k] for b in per_rank]) for k in per_rank[0]}
        loss_sum, count = token_loss(m, batch)
        optimizer.zero_grad(set_to_none=True)
        (loss_sum / count).backward()
        grads = [p.grad for p in m.parameters()]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        optimizer.step()
        losses.append(float(loss_sum.detach() / count))
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    return {"params": params, "norms": norms, "losses": losses}


def relative_error(got: dict, want: dict) -> float:
    """Largest ``‖got - want‖ / ‖want‖`` over the parameter tensors."""
    return max(
        float(torch.linalg.vector_norm(got[k].double() - w) / torch.linalg.vector_norm(w))
        for k, w in want.items()
    )
