"""transformers' Trainer under accelerate's FSDP2 (``fully_shard``) on 2 real gloo ranks, float64.

The same 12 variable-length samples as ``test_hf_ranks.py`` (2 per micro-batch, 3 micro-batches
per window on each rank, every step the whole data set split unevenly in tokens), with
``TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})``: every GPT-2 block, the
embeddings and the head are ``fully_shard``-ed units; each rank holds half of every parameter
and of every gradient. ``bigbatch.hf.Trainer`` (the model's own loss, and a wrapper whose forward
takes no loss kwargs) equals one process on the union, and ``bigbatch.hf.audit`` (which gathers
the sharded gradients) finds both exact; the audit flags the stock Trainer on the wrapper (a mean
of micro-batch means on each rank) and raises no false alarm on the stock Trainer's own loss.

accelerate 1.15 runs FSDP on accelerators only: on the CPU it leaves its FSDP plugin unset and
the Trainer runs DDP (``MULTI_CPU``). ``_fsdp2_on_cpu`` puts back the state a GPU run gets (the
plugin built from the Trainer's own ``fsdp_plugin_args``), so the run below goes through
accelerate's FSDP2 preparation (``fsdp2_prepare_model``) exactly as on GPUs.
"""

from __future__ import annotations

import copy

import pytest
from ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_ranks import trainer_runs  # noqa: E402
from integrations.hf_models import (  # noqa: E402
    Wrapper,
    distance,
    gpt2,
    loaded,
    sgd,
    wrapper_loss,
)
from integrations.test_hf import counted, plain  # noqa: E402

pytestmark = pytest.mark.slow  # real gloo ranks, transformers imported in each

FSDP = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}


def _fsdp2_on_cpu(trainer) -> None:
    """The accelerator state a GPU run gets: distributed type FSDP, the Trainer's FSDP2 plugin."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def _sharded(trainer) -> None:
    from torch.distributed.tensor import DTensor

    assert type(trainer.model).__name__.startswith("FSDP")  # sharded by fully_shard
    shards = [p for p in trainer.model.parameters() if isinstance(p, DTensor)]
    assert shards and all(p.to_local().numel() < p.numel() for p in shards[:3])


def _rank(rank: int, world: int, tmp: str) -> dict:
    import transformers

    import bigbatch.hf

    runs = {
        "stock": (transformers.Trainer, gpt2),
        "stock wrapper": (transformers.Trainer, lambda: Wrapper(gpt2())),
        "stock wrapper, not audited": (transformers.Trainer, lambda: Wrapper(gpt2())),
        "bigbatch": (bigbatch.hf.Trainer, gpt2),
        "bigbatch wrapper": (bigbatch.hf.Trainer, lambda: Wrapper(gpt2())),
    }
    return trainer_runs(rank, world, tmp, runs, 29501, _fsdp2_on_cpu, _sharded, **FSDP)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_rank, str(tmp_path_factory.mktemp("fsdp")), timeout_s=600)


@pytest.mark.parametrize(
    "name, make", [("bigbatch", gpt2), ("bigbatch wrapper", lambda: Wrapper(gpt2()))]
)
def test_bigbatch_under_fsdp2_equals_one_process_on_the_union(ranks, name, make):
    base = make()
    reference = plain(copy.deepcopy(base), counted if name == "bigbatch" else wrapper_loss, sgd)
    for rank in ranks:
        state, results = rank[name]
        assert [r.exact for r in results] == [True, True], results
        assert distance(loaded(make, state), reference, base) < 1e-10


def test_the_audit_under_fsdp2_flags_a_mean_of_micro_batch_means(ranks):
    for rank in ranks:
        for result in rank["stock wrapper"][1]:
            assert not result.exact, result
            assert result.diagnosis == "per-micro-batch mean on padded data", result


def test_the_audit_under_fsdp2_leaves_training_unchanged(ranks):
    """Its diagnosis runs forwards without gradients, after which FSDP2 keeps some units
    unsharded: the audit shards them again, or the next step would use stale parameters."""
    for rank in ranks:
        audited, alone = rank["stock wrapper"][0], rank["stock wrapper, not audited"][0]
        make = lambda: Wrapper(gpt2())  # noqa: E731
        assert distance(loaded(make, audited), loaded(make, alone), make()) < 1e-12


def test_the_audit_under_fsdp2_raises_no_false_alarm(ranks):
    for rank in ranks:
        assert [r.exact for r in rank["stock"][1]] == [True, True], rank["stock"][1]
