"""Lightning's DDP strategy on 2 real gloo ranks (torchrun's variables, the process group
``run_ranks`` opened), float64: ``accumulate_grad_batches=3`` over 12 padded samples of very
different lengths, 2 per batch, so each optimizer step is the whole data set split unevenly in
tokens between ranks and micro-batches.

Lightning's own accumulation (÷ k of each rank's micro-batch mean, Lightning #20350) is flagged;
``bigbatch.lightning.Exact`` equals two plain full-batch steps on the union. (Before ``Exact``
agreed its loss scale across ranks, each rank's scale differed, DDP averaged differently scaled
gradients and the audit said "ranks did not synchronise".)
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
from integrations.hf_models import distance, gpt2
from ranks import run_ranks

# real gloo ranks, Lightning imported in each (not at collection: ~5 s in every test worker)
pytestmark = [pytest.mark.slow, pytest.mark.needs("lightning", "transformers")]


def _rank(rank: int, world: int, settings: tuple[bool, bool]) -> tuple:
    import lightning.pytorch as L
    import torch
    from integrations.hf_models import collate, texts
    from integrations.lightning_cases import LM, sgd

    import bigbatch.lightning

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="t")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    warnings.simplefilter("ignore")
    exact, dropout = settings
    loader = torch.utils.data.DataLoader(texts(12), batch_size=2, collate_fn=collate)
    trainer = L.Trainer(
        max_epochs=2, accumulate_grad_batches=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=world,
        strategy="ddp", callbacks=[bigbatch.lightning.Exact()] if exact else [],
    )  # fmt: skip
    report = bigbatch.lightning.audit(trainer, steps=(1, 2))
    model = gpt2(dropout=dropout)
    trainer.fit(LM(model, exact, sgd), loader)
    return trainer.world_size, model.state_dict(), report.results


@pytest.mark.parametrize("exact", [False, True])
def test_lightning_ddp(exact):
    from integrations.hf_models import texts
    from integrations.lightning_cases import full, sgd

    base = gpt2()
    reference = full(base, sgd, [texts(12)] * 2)
    for world, state, results in run_ranks(_rank, (exact, False), timeout_s=300):
        model = copy.deepcopy(base)
        model.load_state_dict(state)
        assert world == 2
        if exact:
            assert [r.exact for r in results] == [True, True], results
            assert distance(model, reference, base) < 1e-10
        else:
            assert all(r.diagnosis == "per-micro-batch mean on padded data" for r in results)
            assert distance(model, reference, base) > 1e-3


def test_dropout_on_ranks():
    """GPT-2's default dropout under DDP with ``Exact``: each rank replays its window through the
    strategy (DDP synchronises it) with dropout off (Note [audit dropout]): exact on every rank."""
    for world, _, results in run_ranks(_rank, (True, True), timeout_s=300):
        assert world == 2 and [r.exact for r in results] == [True, True], results
