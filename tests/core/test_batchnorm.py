"""BatchNorm policies, the momentum correction and the engine's one-time warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from models import mean_ce

import bigbatch
from bigbatch.core.batchnorm import corrected_momentum


def bn_model(momentum: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=momentum), nn.Linear(8, 3)
    ).double()


def test_invalid_policy_names_the_allowed_values():
    with pytest.raises(
        ValueError, match="policy='ghost' is not allowed: use one of 'micro', 'freeze', 'groupnorm'"
    ):
        bigbatch.batchnorm(bn_model(), "ghost")


def test_micro_warns_once_naming_layers():
    with pytest.warns(
        bigbatch.BigBatchWarning,
        match=r"BatchNorm layers '1' \(BatchNorm1d\) use statistics per micro-batch",
    ):
        bigbatch.batchnorm(bn_model(), "micro")


@pytest.mark.parametrize("sizes", [(4, 4, 2), (5, 5)])
def test_momentum_correction_moves_running_stats_like_one_big_batch(gen, sizes):
    """After one window the old running mean keeps weight exactly 1 - m, as in one big-batch update.

    With corrected momenta a_j = 1 - (1 - m)^(s_j / n) the result is
    (1 - m) r0 + Σ_j a_j Π_{i>j}(1 - a_i) μ_j, and Σ of the new weights is exactly m. When every
    micro-batch has the same statistics it equals the big-batch update to rounding.
    """
    n = sum(sizes)
    model = bn_model(momentum=0.1)
    with pytest.warns(bigbatch.BigBatchWarning):
        bigbatch.batchnorm(model, "micro")
    bn = model[1]
    bn.running_mean.copy_(torch.randn(8, generator=gen, dtype=torch.float64))
    r0 = bn.running_mean.clone()
    x = torch.randn(sizes[0], 6, generator=gen, dtype=torch.float64).repeat(n // sizes[0] + 1, 1)[
        :n
    ]
    y = torch.randint(0, 3, (n,), generator=gen)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.0), micro_batch_size=sizes[0]
    )
    acc.train_step((x, y), mean_ce)
    with torch.no_grad():
        mus = [
            model[0](x[a : a + s]).mean(0)
            for a, s in zip(
                [0, *list(torch.tensor(sizes).cumsum(0)[:-1].tolist())], sizes, strict=True
            )
        ]
        big_mu = model[0](x).mean(0)
    expected = r0.clone()
    for s, mu in zip(sizes, mus, strict=True):
        a = corrected_momentum(0.1, s, n)
        expected = (1 - a) * expected + a * mu
    torch.testing.assert_close(bn.running_mean, expected, rtol=1e-12, atol=1e-12)
    big = 0.9 * r0 + 0.1 * big_mu
    if all(s == sizes[0] for s in sizes) and n % sizes[0] == 0:  # identical micro-batches: equal
        torch.testing.assert_close(bn.running_mean, big, rtol=1e-12, atol=1e-12)
    uncorrected = r0.clone()
    for mu in mus:
        uncorrected = 0.9 * uncorrected + 0.1 * mu
    assert (bn.running_mean - big).norm() < (uncorrected - big).norm()
    assert bn.momentum == 0.1  # restored after the window


def test_freeze_keeps_running_stats_and_survives_train(gen):
    model = bn_model()
    bigbatch.batchnorm(model, "freeze")
    model.train()
    before = {k: v.clone() for k, v in model[1].named_buffers()}
    x, y = (
        torch.randn(10, 6, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (10,), generator=gen),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", bigbatch.BigBatchWarning)  # frozen: nothing to warn about
        bigbatch.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4
        ).train_step((x, y), mean_ce)
    for k, v in model[1].named_buffers():
        assert torch.equal(v, before[k]), k
    assert model[1].weight.requires_grad
    assert bigbatch.check(model, (x, y), mean_ce).exact


def test_groupnorm_replaces_and_copies_affine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48), nn.Flatten(), nn.BatchNorm1d(4))
    with torch.no_grad():
        model[1].weight.uniform_()
    w = model[1].weight.clone()
    assert bigbatch.batchnorm(model, "groupnorm") is model
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 16
    assert isinstance(model[3], nn.GroupNorm) and model[3].num_groups == 1
    assert torch.equal(model[1].weight, w)


def test_groupnorm_on_uninitialised_lazy_layer_raises():
    with pytest.raises(
        ValueError, match="lazy BatchNorm not initialised yet: run one forward pass"
    ):
        bigbatch.batchnorm(nn.Sequential(nn.LazyBatchNorm1d()), "groupnorm")


def test_engine_warns_once_at_first_step(gen):
    model = bn_model()
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4
    )
    x, y = (
        torch.randn(10, 6, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (10,), generator=gen),
    )
    with pytest.warns(
        bigbatch.BigBatchWarning,
        match=r"'1' \(BatchNorm1d\) normalise with batch statistics in training mode",
    ):
        acc.train_step((x, y), mean_ce)
    with warnings.catch_warnings():
        warnings.simplefilter("error", bigbatch.BigBatchWarning)
        acc.train_step((x, y), mean_ce)  # once only
        whole = bigbatch.Accumulator(
            (other := bn_model()), torch.optim.SGD(other.parameters(), lr=0.1), micro_batch_size=10
        )
        whole.train_step((x, y), mean_ce)  # one micro-batch is the full batch: exact, no warning
        model.eval()
        bigbatch.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4
        ).train_step((x, y), mean_ce)


def test_every_batchnorm_class_is_found_and_handled_ones_are_not():
    from bigbatch.core.batchnorm import unhandled_batch_coupled

    model = nn.Sequential(
        nn.BatchNorm3d(4), nn.SyncBatchNorm(4), nn.LazyBatchNorm1d(), nn.LayerNorm(4)
    )
    assert unhandled_batch_coupled(model) == [
        "'0' (BatchNorm3d)",
        "'1' (SyncBatchNorm)",
        "'2' (LazyBatchNorm1d)",
    ]
    bigbatch.batchnorm(model, "freeze")
    assert unhandled_batch_coupled(model) == []
    assert unhandled_batch_coupled(nn.BatchNorm2d(3).eval()) == []


@pytest.mark.filterwarnings("ignore::bigbatch.BigBatchWarning")
@pytest.mark.parametrize("policy", ["micro", "freeze", "groupnorm"])
def test_keep_undoes_a_policy_exactly(policy, gen):
    """A policy is a record of what it changed: "keep" gives back the model's behaviour and
    state_dict, and leaves nothing of bigbatch's on the layers (no attributes, no hooks)."""
    model, plain = bn_model(), bn_model()
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    bigbatch.batchnorm(model, policy)
    model(x)  # the policy acts once (GroupNorm learns nothing here; "micro" moves statistics)
    bigbatch.batchnorm(model, "keep")
    plain.load_state_dict(model.state_dict())  # same values, now compare behaviour and keys
    assert list(model.state_dict()) == list(plain.state_dict())
    for mode in ("train", "eval"):
        getattr(model, mode)()
        getattr(plain, mode)()
        assert torch.equal(model(x), plain(x))
    layer = model[1]
    assert type(layer) is torch.nn.BatchNorm1d
    assert not layer._forward_pre_hooks and not layer._forward_hooks
    assert not [k for k in vars(layer) if k.startswith("_bigbatch")]
    assert layer.momentum == 0.1


def test_a_new_policy_replaces_the_previous_one(gen):
    model = bn_model()
    bigbatch.batchnorm(model, "freeze")
    with pytest.warns(bigbatch.BigBatchWarning):
        bigbatch.batchnorm(model, "micro")
    assert len(model[1]._forward_pre_hooks) == 1  # one policy's hook, not two
