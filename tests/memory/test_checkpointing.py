"""enable_checkpointing: same gradients (dropout too), same BatchNorm statistics, same state dict.

Every policy: "full" and "selective" here on the CPU, "offload" on CUDA (tests marked gpu).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from models import causal_lm, lm_token_loss, mlp, padded_lm_batch
from reference import full_batch_step, max_relative_error
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import bigbatch
from bigbatch.memory.checkpointing import checkpointed_blocks, find_blocks, selective_policy

RECOMPUTING = ["full", "selective"]  # the policies that run on the CPU
EXPENSIVE = {"mm", "addmm", "bmm", "baddbmm", "convolution"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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


class _OpCounts(TorchDispatchMode):
    """Counts the aten ops that run (by name without overload), e.g. ``counts["addmm"]``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(model: nn.Module, run) -> collections.Counter[str]:
    """The aten ops of a backward (recompute included): ``run(model)`` returns the loss."""
    loss = run(model)
    with _OpCounts() as counting:
        loss.backward()
    return counting.counts


@pytest.mark.parametrize("policy", RECOMPUTING)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_gradients_identical_dropout_included(policy, dropout, fraction, gen):
    plain = _net(dropout=dropout).train()
    ckpt = bigbatch.enable_checkpointing(copy.deepcopy(plain), fraction=fraction, policy=policy)
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


@pytest.mark.parametrize("policy", RECOMPUTING)
def test_idempotent_disable_restores_and_state_dict_unchanged(policy, gen):
    model = _net(norm=True)
    before = copy.deepcopy(model.state_dict())
    keys = list(before)
    bigbatch.enable_checkpointing(model, policy="full" if policy == "selective" else "selective")
    bigbatch.enable_checkpointing(model, policy=policy)  # replaces the first call
    for block in model.blocks:
        assert block.forward.previous is None  # not wrapped twice
        assert block.forward.policy == policy
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


@pytest.mark.parametrize("policy", RECOMPUTING)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_running_stats_updated_once(policy, momentum, gen):
    plain = _net(norm=True, momentum=momentum, dropout=0.2).train()
    ckpt = bigbatch.enable_checkpointing(copy.deepcopy(plain), policy=policy)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_c = torch.optim.SGD(ckpt.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _data(gen)
        for model, opt in [(plain, opt_p), (ckpt, opt_c)]:
            opt.zero_grad()
            torch.manual_seed(step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert int(ckpt.blocks[0].norm.num_batches_tracked) == 3


@pytest.mark.parametrize("policy", RECOMPUTING)
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_accumulator_with_checkpointing_equals_full_batch(policy, opt_name, gen):
    make_opt = {
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    }[opt_name]
    ref = causal_lm(torch.float64)
    eng = bigbatch.enable_checkpointing(copy.deepcopy(ref), policy=policy)
    assert checkpointed_blocks(eng) == ["blocks.0", "blocks.1"]
    opt_ref, opt_eng = make_opt(ref.parameters()), make_opt(eng.parameters())
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=4)
    for _ in range(3):
        batch = padded_lm_batch(10, gen)  # 4 + 4 + 2
        ref_loss = full_batch_step(ref, opt_ref, lm_token_loss, batch)
        assert acc.train_step(batch, lm_token_loss).loss == pytest.approx(ref_loss, rel=1e-10)
    assert max_relative_error(ref, eng) < 1e-10


# ------------------------------------------------------------------------- selective, in detail


class ConvBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.drop = nn.Dropout2d(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.norm(self.conv(x))))


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Sequential(*[ConvBlock(4) for _ in range(3)]),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 3),
    ).double().train()  # fmt: skip


def _conv_loss(x, y):
    def run(model):
        torch.manual_seed(11)
        return F.cross_entropy(model(x), y)

    return run


def test_selective_saves_expensive_outputs_and_recomputes_the_rest(gen):
    """In backward, "selective" runs no matmul/convolution more than no checkpointing does."""
    x, y = _data(gen)
    images = torch.randn(6, 2, 6, 6, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 3, (6,), generator=gen)
    for make, run in [
        (lambda: _net(dropout=0.3, norm=True).train(), _conv_loss(x, y)),
        (_conv_net, _conv_loss(images, labels)),
    ]:
        counts = {}
        for policy in [None, "full", "selective"]:
            model = make()
            if policy:
                bigbatch.enable_checkpointing(model, policy=policy)
            counts[policy] = _backward_ops(model, run)
        expensive = {p: sum(c[op] for op in EXPENSIVE) for p, c in counts.items()}
        assert expensive["selective"] == expensive[None] < expensive["full"], expensive
        cheap = {p: c["gelu"] + c["tanh"] for p, c in counts.items()}  # recomputed by both
        assert cheap[None] < cheap["selective"] == cheap["full"], cheap


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_selective_cnn_gradients_and_statistics_identical(fraction, gen):
    plain = _conv_net()
    ckpt = bigbatch.enable_checkpointing(
        copy.deepcopy(plain), fraction=fraction, policy="selective"
    )
    for _ in range(2):
        images = torch.randn(6, 2, 6, 6, generator=gen, dtype=torch.float64)
        labels = torch.randint(0, 3, (6,), generator=gen)
        grads = []
        for model in (plain, ckpt):
            model.zero_grad()
            _conv_loss(images, labels)(model).backward()
            grads.append([p.grad for p in model.parameters()])
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b)
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # BatchNorm statistics updated once per forward


def test_selective_policy_decisions():
    """What is saved: expensive ops, except an attention kernel that draws dropout numbers."""
    t = torch.ones(1, 1, 2, 2)
    save, recompute = (torch_checkpoint.CheckpointPolicy.MUST_SAVE,
                       torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)  # fmt: skip
    aten = torch.ops.aten
    assert selective_policy(None, aten.mm.default, t[0, 0], t[0, 0]) == save
    assert selective_policy(None, aten.convolution.default, t, t, None) == save
    assert selective_policy(None, aten.tanh.default, t) == recompute
    assert selective_policy(None, aten.native_dropout.default, t, 0.5, True) == recompute
    for kernel in [aten._scaled_dot_product_efficient_attention.default,
                   aten._scaled_dot_product_flash_attention.default]:  # fmt: skip
        positional = 5 if "efficient" in str(kernel) else 3  # dropout_p's position
        args = [t, t, t, None, True][:positional]
        assert selective_policy(None, kernel, *args) == save  # dropout_p defaults to 0
        assert selective_policy(None, kernel, *args, dropout_p=0.0) == save
        assert selective_policy(None, kernel, *args, 0.1) == recompute
        assert selective_policy(None, kernel, *args, dropout_p=0.1) == recompute


def test_selective_names_an_output_changed_in_place():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)) for _ in range(2)])
    bigbatch.enable_checkpointing(net, policy="selective")
    with pytest.raises(
        ValueError,
        match=r"policy='selective': the output of aten\.addmm\.default in a checkpointed "
        r"Sequential is changed in place .* use inplace=False, h = h \+ x, or policy='full'",
    ):
        net(torch.randn(3, 4))
    bigbatch.enable_checkpointing(net, policy="full")  # full recompute has no such limit
    net(torch.randn(3, 4)).sum().backward()


def test_selective_needs_torch_2_4(monkeypatch):
    monkeypatch.delattr(torch_checkpoint, "create_selective_checkpoint_contexts")
    model = _net()
    with pytest.raises(
        ValueError,
        match=r"policy='selective' needs torch >= 2\.4 .*this is torch .*pip install "
        r"'torch>=2\.4', or use policy='full'",
    ):
        bigbatch.enable_checkpointing(model, policy="selective")
    assert checkpointed_blocks(model) == []


# ------------------------------------------------------------------------------------ offload


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_offload_is_refused_without_cuda():
    model = _net()
    with pytest.raises(
        ValueError,
        match=r"policy='offload' moves activations from GPU memory to host memory, and CUDA is "
        r"not available here .*use policy='selective' or 'full'",
    ):
        bigbatch.enable_checkpointing(model, policy="offload")
    assert checkpointed_blocks(model) == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offload_gradients_and_statistics_identical_on_cuda(fraction, gen):
    plain = _net(dropout=0.3, norm=True).cuda().train()
    ckpt = bigbatch.enable_checkpointing(copy.deepcopy(plain), fraction=fraction, policy="offload")
    assert ckpt.blocks[0].forward.policy == "offload"
    for step in range(2):
        x, y = (t.cuda() for t in _data(gen))
        grads = []
        for model in (plain, ckpt):
            model.zero_grad()
            torch.manual_seed(step)
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad for p in model.parameters()])
        for a, b in zip(*grads, strict=True):  # same kernels; CUDA reductions may reorder
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for a, b in zip(plain.state_dict().values(), ckpt.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)  # statistics updated once
    with pytest.raises(ValueError, match=r"policy='offload': the input of Block is on cpu"):
        ckpt.cpu()(_data(gen)[0])
    bigbatch.disable_checkpointing(ckpt)
    assert checkpointed_blocks(ckpt) == []


@pytest.mark.gpu
@needs_cuda
def test_selective_never_saves_a_random_attention_kernel_on_cuda(gen):
    """A fused attention kernel with dropout, then more dropout: same gradients as no checkpoint."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
            a = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                               dropout_p=0.3)  # fmt: skip
            return x + F.dropout(self.out(a.transpose(1, 2).flatten(2)), 0.3)

    torch.manual_seed(0)
    plain = nn.Sequential(*[Attention() for _ in range(2)]).cuda()
    ckpt = bigbatch.enable_checkpointing(copy.deepcopy(plain), policy="selective")
    x = torch.randn(4, 32, 16, generator=gen).cuda()
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(5)
        model(x).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ transformers


def _gpt2(attn_implementation: str = "sdpa") -> nn.Module:
    """A stock GPT-2 from a config: default settings (use_cache on, dropout 0.1)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0,
        eos_token_id=0, attn_implementation=attn_implementation,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double().train()


def _llama(attn_implementation: str = "sdpa") -> nn.Module:
    """A Llama-style model from a config (grouped-query attention, SiLU MLP, RMSNorm, RoPE)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, attention_dropout=0.1,
        attn_implementation=attn_implementation,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().train()


MODELS = {
    "gpt2-eager": lambda: _gpt2("eager"),  # the reported crash: "tensor a (96) ... b (48)"
    "gpt2-sdpa": lambda: _gpt2("sdpa"),  # silently a cache of twice the length before the fix
    "llama-sdpa": lambda: _llama("sdpa"),
}


def _lm_run(ids, **call):
    def run(model):
        torch.manual_seed(3)
        return model(input_ids=ids, labels=ids, **call).loss

    return run


def _lm_grads(model, ids, **call):
    model.zero_grad(set_to_none=True)
    _lm_run(ids, **call)(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", RECOMPUTING)
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_models_with_default_settings(name, fraction, policy, gen):
    plain = MODELS[name]()
    model = bigbatch.enable_checkpointing(copy.deepcopy(plain), fraction=fraction, policy=policy)
    layers = model.model.layers if "llama" in name else model.transformer.h
    if fraction == 1.0:  # transformers' own switch, non-reentrant, with our policy
        assert all(layer.gradient_checkpointing for layer in layers)
        keywords = layers[0]._gradient_checkpointing_func.keywords
        assert keywords["use_reentrant"] is False
        assert ("context_fn" in keywords) == (policy == "selective")
        assert checkpointed_blocks(model) == []
    else:
        assert not layers[0].gradient_checkpointing
        assert checkpointed_blocks(model)[0].endswith("layers.0" if "llama" in name else "h.0")
    ids = torch.randint(0, 50, (3, 16), generator=gen)
    expected = _lm_grads(plain, ids)
    model.zero_grad(set_to_none=True)
    output = model(input_ids=ids, labels=ids)  # use_cache from the config: on
    cache = output.past_key_values
    assert cache is None or all(layer.get_seq_length() in (0, 16) for layer in cache.layers)
    model.zero_grad(set_to_none=True)
    for key, grad in _lm_grads(model, ids).items():
        torch.testing.assert_close(grad, expected[key], rtol=1e-12, atol=1e-14)
    if cache is not None:  # backward recomputed the blocks: the cache did not grow
        assert all(layer.get_seq_length() in (0, 16) for layer in cache.layers)
    if fraction == 1.0:
        ops = {p: _backward_ops(m, _lm_run(ids)) for p, m in [("plain", plain), (policy, model)]}
        more = sum(ops[policy][op] - ops["plain"][op] for op in EXPENSIVE)
        assert more == 0 if policy == "selective" else more > 0, ops  # the policy was applied
    bigbatch.disable_checkpointing(model)
    assert not any(layer.gradient_checkpointing for layer in layers)
    assert checkpointed_blocks(model) == []


def test_transformers_prefix_cache_is_refused():
    transformers = pytest.importorskip("transformers")
    model = bigbatch.enable_checkpointing(_llama(), fraction=0.5)
    ids = torch.randint(0, 50, (2, 6))
    with torch.no_grad():  # a prefix computed without gradients, as prompt tuning would
        prefix = model(input_ids=ids[:, :3], use_cache=True).past_key_values
    assert isinstance(prefix, transformers.Cache) and prefix.get_seq_length() == 3
    with pytest.raises(
        ValueError,
        match=r"a checkpointed LlamaDecoderLayer got a key/value cache that already holds 3 "
        r"positions.*use_cache=False and no past_key_values, or disable_checkpointing",
    ):
        model(input_ids=ids[:, 3:], past_key_values=prefix)


def test_transformers_old_checkpointing_format_is_wrapped_here():
    """transformers < 4.35's format drops checkpoint arguments: the policy is applied by us."""
    transformers = pytest.importorskip("transformers")

    class OldFormatGPT2(transformers.GPT2LMHeadModel):
        def _set_gradient_checkpointing(self, module, value=False):
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = value

    torch.manual_seed(0)
    model = OldFormatGPT2(_gpt2().config)
    bigbatch.enable_checkpointing(model, policy="selective")
    assert checkpointed_blocks(model) == ["transformer.h.0", "transformer.h.1"]
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


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
    for bad in ["Selective", "none", None]:
        with pytest.raises(
            ValueError,
            match=rf"policy={bad!r} is not allowed: use 'full' \(recompute whole blocks\), "
            r"'selective' .* or 'offload'",
        ):
            bigbatch.enable_checkpointing(model, policy=bad)
    assert checkpointed_blocks(model) == ["blocks.0", "blocks.1"]  # a failed call changes nothing
