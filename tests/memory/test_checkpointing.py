"""enable_checkpointing: same gradients (dropout too), same BatchNorm statistics, same state dict."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import causal_lm, lm_token_loss, mlp, padded_lm_batch
from reference import full_batch_step, max_relative_error
from torch import nn

import bigbatch
from bigbatch.memory.checkpointing import checkpointed_blocks, find_blocks


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float, norm: bool, momentum: float | None) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim, momentum=momentum) if norm else nn.Identity()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.dropout(torch.tanh(self.norm(self.linear(x))))


class Net(nn.Module):
    def __init__(self, blocks=4, dropout=0.0, norm=False, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.blocks = nn.ModuleList(Block(8, dropout, norm, momentum) for _ in range(blocks))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, scale=0.5)  # a keyword argument travels through the checkpoint
        return self.out(h)


def _net(seed=0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw).double()


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int = 7) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for both models
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _saved_tensors(model: nn.Module, x: torch.Tensor) -> int:
    """Tensors autograd keeps for backward outside checkpointed regions."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return count


def _data(gen, n=10):
    return torch.randn(n, 5, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=gen
    )


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_gradients_identical_dropout_included(dropout, fraction, gen):
    plain = _net(dropout=dropout).train()
    ckpt = bigbatch.enable_checkpointing(copy.deepcopy(plain), fraction=fraction)
    x, y = _data(gen)
    for a, b in zip(_grads(plain, x, y), _grads(ckpt, x, y), strict=True):
        assert torch.equal(a, b)
    if dropout:  # the masks were really random: another seed gives other gradients
        assert not torch.equal(_grads(plain, x, y, seed=8)[0], _grads(plain, x, y)[0])


def test_default_blocks_fraction_and_less_saved(gen):
    model = _net(blocks=4)
    x, _ = _data(gen)
    saved = [_saved_tensors(model, x)]
    for fraction, names in [(0.25, ["blocks.0"]), (0.5, ["blocks.0", "blocks.1"]), (1.0, None)]:
        bigbatch.enable_checkpointing(model, fraction=fraction)
        assert checkpointed_blocks(model) == (names or [f"blocks.{i}" for i in range(4)])
        saved.append(_saved_tensors(model, x))
    assert all(a > b for a, b in zip(saved[:-1], saved[1:], strict=True)), (
        saved
    )  # each block more saves less
    bigbatch.enable_checkpointing(model, fraction=0.01)  # at least one block
    assert checkpointed_blocks(model) == ["blocks.0"]


def test_blocks_by_class_and_by_name():
    model = _net()
    assert checkpointed_blocks(bigbatch.enable_checkpointing(model, [nn.Linear])) == [
        "inp",
        *[f"blocks.{i}.linear" for i in range(4)],
        "out",
    ]
    assert checkpointed_blocks(bigbatch.enable_checkpointing(model, ["blocks.2", "out"])) == [
        "blocks.2",
        "out",
    ]
    # a block inside a chosen block is recomputed with it, not wrapped twice
    assert [n for n, _ in find_blocks(model, [Block, nn.Linear])][:3] == [
        "inp",
        "blocks.0",
        "blocks.1",
    ]


def test_idempotent_disable_restores_and_state_dict_unchanged(gen):
    model = _net(norm=True)
    before = copy.deepcopy(model.state_dict())
    keys = list(before)
    bigbatch.enable_checkpointing(model)
    bigbatch.enable_checkpointing(model)
    for block in model.blocks:
        assert block.forward.previous is None  # not wrapped twice
    assert list(model.state_dict()) == keys
    model.load_state_dict(before)  # saved before, loads after
    after = _net(seed=1, norm=True)
    after.load_state_dict(model.state_dict())  # saved after, loads into a plain model
    assert all(torch.equal(after.state_dict()[k], before[k]) for k in keys)
    copy.deepcopy(model)  # a checkpointed model can be copied
    assert bigbatch.disable_checkpointing(model) is model
    assert checkpointed_blocks(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_forward_set_on_the_instance_is_kept(gen):
    model = _net()
    calls = []
    original = model.blocks[0].forward

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.blocks[0].forward = spy
    bigbatch.enable_checkpointing(model)
    x, y = _data(gen)
    _grads(model, x, y)
    assert len(calls) == 2  # forward and recompute
    bigbatch.disable_checkpointing(model)
    assert model.blocks[0].forward is spy


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_running_stats_updated_once(momentum, gen):
    plain = _net(norm=True, momentum=momentum).train()
    ckpt = bigbatch.enable_checkpointing(copy.deepcopy(plain))
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_c = torch.optim.SGD(ckpt.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x, y = _data(gen)
        for model, opt in [(plain, opt_p), (ckpt, opt_c)]:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert int(ckpt.blocks[0].norm.num_batches_tracked) == 3


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_accumulator_with_checkpointing_equals_full_batch(opt_name, gen):
    make_opt = {
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    }[opt_name]
    ref = causal_lm(torch.float64)
    eng = bigbatch.enable_checkpointing(copy.deepcopy(ref))
    assert checkpointed_blocks(eng) == ["blocks.0", "blocks.1"]
    opt_ref, opt_eng = make_opt(ref.parameters()), make_opt(eng.parameters())
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=4)
    for _ in range(3):
        batch = padded_lm_batch(10, gen)  # 4 + 4 + 2
        ref_loss = full_batch_step(ref, opt_ref, lm_token_loss, batch)
        assert acc.train_step(batch, lm_token_loss).loss == pytest.approx(ref_loss, rel=1e-10)
    assert max_relative_error(ref, eng) < 1e-10


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double().train()


def _lm_grads(model, ids):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_transformers_model(fraction, gen):
    plain = _tiny_gpt2()
    model = bigbatch.enable_checkpointing(copy.deepcopy(plain), fraction=fraction)
    layers = model.transformer.h
    if fraction == 1.0:  # transformers' own switch, non-reentrant
        assert all(layer.gradient_checkpointing for layer in layers)
        assert layers[0]._gradient_checkpointing_func.keywords["use_reentrant"] is False
        assert checkpointed_blocks(model) == []
    else:
        assert not layers[0].gradient_checkpointing
        assert checkpointed_blocks(model) == ["transformer.h.0"]
    ids = torch.randint(0, 50, (3, 16), generator=gen)
    expected = _lm_grads(plain, ids)
    for name, grad in _lm_grads(model, ids).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-12, atol=1e-14)
    bigbatch.disable_checkpointing(model)
    assert not any(layer.gradient_checkpointing for layer in layers)
    assert checkpointed_blocks(model) == []


def test_errors():
    with pytest.raises(
        ValueError, match=r"blocks=None: found no repeated blocks in Sequential.*blocks=\[MyBlock\]"
    ):
        bigbatch.enable_checkpointing(mlp())
    model = bigbatch.enable_checkpointing(_net(), fraction=0.5)
    with pytest.raises(ValueError, match=r"no module named 'blocks\.9' in the model.*e\.g\. 'inp'"):
        bigbatch.enable_checkpointing(model, ["blocks.0", "blocks.9"])
    with pytest.raises(ValueError, match=r"no module of class Conv2d in the model"):
        bigbatch.enable_checkpointing(model, [nn.Conv2d])
    with pytest.raises(ValueError, match=r"blocks='blocks\.0' is not allowed: use None, a list"):
        bigbatch.enable_checkpointing(model, "blocks.0")
    for bad in [0, 1.5, -0.5, "half"]:
        with pytest.raises(
            ValueError, match=rf"fraction={bad!r} is not allowed: use a number in \(0, 1\]"
        ):
            bigbatch.enable_checkpointing(model, fraction=bad)
    assert checkpointed_blocks(model) == ["blocks.0", "blocks.1"]  # a failed call changes nothing
