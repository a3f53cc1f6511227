"""Packed windows of transformers models built from configs (float64): Llama and GPT-2 equal the
unpacked full batch; the traps of Note [packing traps] are real, and refused.

Packed through ``Accumulator(..., pack=...)``, and ``bigbatch.hf.Trainer(pack=...)``.
Llama's RMSNorm computes in float32 (Note [float32 islands]): scaling its backward by ``1/count``
before or after changes the step by float32's rounding (5e-8 measured), so the 1e-12 tests run
it in float64 (``float64_norms``), as the rest of the model.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

pytest.importorskip("transformers")

from cases import OPTIMIZERS  # noqa: E402
from integrations.hf_models import VOCAB, distance, gpt2, llama  # noqa: E402
from reference import full_batch_step, max_relative_error  # noqa: E402

import bigbatch  # noqa: E402
import bigbatch.hf  # noqa: E402
from bigbatch.core._pack import PackCut, check_forward, check_model, pack  # noqa: E402
from bigbatch.core.loss import token_cross_entropy  # noqa: E402

LENGTH = 24  # the packed rows' length
TOLERANCE = {"sgd_momentum": 1e-12, "adamw": 1e-10}  # AdamW: see tests/test_pack.py


def rms_float64(self, hidden: torch.Tensor) -> torch.Tensor:
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * hidden * torch.rsqrt(variance + self.variance_epsilon)


def float64_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Llama with its RMSNorm in the model's dtype (its float32 island removed)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(rms_float64, module)
    return model


def exact_llama(seed: int = 0, attention: str = "sdpa") -> torch.nn.Module:
    model = float64_norms(llama(seed))
    model.config._attn_implementation = attention
    return model


MODELS = {"llama": exact_llama, "gpt2": gpt2, "llama_eager": lambda: exact_llama(0, "eager")}


def text(n: int, gen: torch.Generator, left: bool, sft: bool, width: int = 20) -> dict:
    """``n`` samples of 2 to ``width`` tokens, right- or left-padded (labels: Note [packed
    labels]: a left-padded sample's first label -100); ``sft``: a prompt masked."""
    lengths = torch.randint(2, width + 1, (n,), generator=gen)
    column = torch.arange(width)[None, :]
    first = width - lengths[:, None] if left else torch.zeros(n, 1, dtype=torch.long)
    inside = (column >= first) & (column < first + lengths[:, None])
    ids = torch.randint(1, VOCAB, (n, width), generator=gen) * inside
    prompt = (torch.rand(n, 1, generator=gen) * lengths[:, None]).long() if sft else 0
    keep = inside & (column >= first + prompt) & ((column > first) if left else True)
    labels = torch.where(keep, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": inside.long(), "labels": labels}


def unpacked_loss(model: torch.nn.Module, batch: dict):
    """The full batch as a user runs it: the mask, and positions counted from each sample's
    first token (what ``generate`` does for left padding; GPT-2's positions are absolute)."""
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(
        input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, use_cache=False
    ).logits
    return token_cross_entropy(logits, batch["labels"], shift=True)


def packed_loss(model: torch.nn.Module, batch: dict):
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return token_cross_entropy(logits, batch["labels"], shift=True)


def packable(model: torch.nn.Module) -> torch.nn.Module:
    """The model as a packed run needs it: no cache, and the traps checked at every forward."""
    model.config.use_cache = False
    check_model(model, varlen=False)
    model.register_forward_pre_hook(check_forward, with_kwargs=True)
    return model


CASES = [  # (model, left padding, SFT labels, token budget: 24 = 1 row per micro-batch, ...)
    ("llama", False, False, 48),
    ("llama", True, True, 72),
    ("llama", False, True, 24),
    ("gpt2", False, False, 48),
    ("gpt2", True, True, 72),
    ("gpt2", True, False, 10_000),
    ("llama_eager", True, False, 48),
]  # fmt: skip  (a table)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name, left, sft, budget", CASES)
def test_a_packed_window_equals_the_full_batch(name, left, sft, budget, optimizer, gen):
    init = MODELS[name]()
    ref, model = copy.deepcopy(init), packable(copy.deepcopy(init))
    ref_opt, opt = (
        OPTIMIZERS[optimizer](ref.parameters()),
        OPTIMIZERS[optimizer](model.parameters()),
    )
    acc = bigbatch.Accumulator(model, opt, micro_batch_tokens=budget, pack=LENGTH)
    for _ in range(2):
        batch = text(11, gen, left, sft)
        full_batch_step(ref, ref_opt, unpacked_loss, batch)
        result = acc.train_step(batch, packed_loss)
        assert result.count == int((batch["labels"][:, 1:] != -100).sum())
        assert result.tokens == int(batch["attention_mask"].sum())
        rows = pack(batch["attention_mask"].sum(-1).tolist(), LENGTH)
        assert result.padded_tokens == LENGTH * len(rows)
    assert max_relative_error(ref, model) < TOLERANCE[optimizer]


def gradient(model: torch.nn.Module, loss_fn, batches: list[dict]) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    count = 0
    for batch in batches:
        loss_sum, n = loss_fn(model, batch)
        loss_sum.backward()
        count += int(n)
    return torch.cat([p.grad.flatten() for p in model.parameters()]) / count


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_packed_gradient_is_the_full_batch(name, gen):
    model, batch = MODELS[name](), text(11, gen, left=False, sft=True)
    model.config.use_cache = False
    full = gradient(model, unpacked_loss, [batch])
    packed = gradient(model, packed_loss, [p.batch for p in PackCut(LENGTH)(batch, 48)])
    assert float((packed - full).norm() / full.norm()) < 1e-12


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_traps_are_real_and_refused(name, gen):
    """Note [packing traps]: a cache (the config's default) or a 2-D mask lets the packed samples
    attend each other, silently; ``check_forward`` refuses both, and a forward without positions."""
    model, batch = MODELS[name](), text(11, gen, left=False, sft=False)
    assert model.config.use_cache  # transformers' default, also in training
    model.config.use_cache = False
    full = gradient(model, unpacked_loss, [batch])
    pieces = [p.batch for p in PackCut(LENGTH)(batch, 48)]
    model.config.use_cache = True
    cached = gradient(model, packed_loss, pieces)
    model.config.use_cache = False

    def masked(m, b):
        ones = torch.ones_like(b["input_ids"])
        logits = m(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=ones)
        return token_cross_entropy(logits.logits, b["labels"], shift=True)

    two_d = gradient(model, masked, pieces)
    for wrong in (cached, two_d):
        assert float((wrong - full).norm() / full.norm()) > 1e-3  # silently wrong
    model.register_forward_pre_hook(check_forward, with_kwargs=True)
    model.config.use_cache = True
    with pytest.raises(
        ValueError,
        match=r"a forward of packed rows: use_cache is on, .* model.config.use_cache = False",
    ):
        packed_loss(model, pieces[0])
    model.config.use_cache = False
    with pytest.raises(
        ValueError, match=r"a forward of packed rows: a 2-D attention_mask was given, .* pass none"
    ):
        masked(model, pieces[0])
    with pytest.raises(
        ValueError, match=r"no position_ids were given, .* pass the batch's position_ids"
    ):
        model(input_ids=pieces[0]["input_ids"])


@pytest.mark.parametrize("attention", ["flash_attention_2", "paged|sdpa"])
def test_attention_that_cannot_keep_rows_apart_is_refused(attention):
    model = llama()
    model.config._attn_implementation = attention  # (set on the config only: no kernel needed)
    fix = "varlen=True" if attention.startswith("flash") else "one of sdpa, eager"
    with pytest.raises(ValueError, match=rf"attention implementation '{attention}' .* use {fix}"):
        check_model(model, varlen=False)
    if attention.startswith("flash"):
        check_model(model, varlen=True)  # cu_seq_lens_q/k keep the flattened rows apart


@pytest.mark.slow
def test_linear_attention_leaks_across_packed_samples_and_is_refused():
    """Qwen3-Next's GatedDeltaNet ignores position_ids: packed, the second sample's logits
    change (float32: its experts take no float64 on CPU); ``check_model`` refuses it."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"],
        use_cache=False,
    )  # fmt: skip  (a config)
    model = Qwen3NextForCausalLM(config)
    first, second = torch.randint(1, VOCAB, (1, 6)), torch.randint(1, VOCAB, (1, 5))
    alone = model(input_ids=second).logits
    positions = torch.cat([torch.arange(6), torch.arange(5)])[None]
    packed = model(input_ids=torch.cat([first, second], 1), position_ids=positions).logits
    assert (packed[:, 6:] - alone).abs().max() > 1e-4  # the first sample's state leaked in
    with pytest.raises(
        ValueError, match=r"layer '.*linear_attn' \(Qwen3NextGatedDeltaNet\) carries"
    ):
        check_model(model, varlen=False)


def trainer_run(cls, base, batch, steps, tmp, **kwargs):
    """Two optimizer steps of a copy of ``base`` with ``cls`` on 12 right-padded texts."""
    from integrations.hf_models import arguments, collate, sgd, texts

    model = copy.deepcopy(base)
    trainer = cls(
        model=model, args=arguments(tmp, batch, steps), train_dataset=texts(12),
        data_collator=collate, optimizers=sgd(model), **kwargs,
    )  # fmt: skip
    trainer.train()
    return model


def gpt2_shifted() -> torch.nn.Module:
    """GPT-2 whose labels transformers counts shifted, as Llama's (its ``loss_type`` is None:
    the Trainer counts every label, each sample's first too, which packing masks)."""
    model = gpt2()
    model.loss_type = "ForCausalLM"
    return model


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("cut", [{}, {"micro_batch_tokens": 48}])
def test_the_packed_trainer_equals_the_one_batch_run(tmp_path, name, cut):
    """``bigbatch.hf.Trainer(pack=24)``: the Trainer's padded batches packed by the engine (5
    rows of 24 per micro-batch, or 2) end where transformers' one-batch run ends, in float64 (the
    packing audit passes on the way: transformers' loss computes in float32, which it allows)."""
    import transformers

    base = {"llama": exact_llama, "gpt2": gpt2_shifted}[name]()
    one = trainer_run(transformers.Trainer, base, 12, 1, tmp_path)
    ours = trainer_run(bigbatch.hf.Trainer, base, 5, 3, tmp_path, pack=LENGTH, **cut)
    assert distance(ours, one, base) < 1e-10


def test_the_packed_trainer_refuses_what_packing_would_change(tmp_path):
    """``use_cache=True`` when the trainer is made; transformers' count of every label (GPT-2's
    ``loss_type`` None) at the packing audit, before the first step."""
    from integrations.hf_models import arguments

    with pytest.raises(ValueError, match=r"use_cache=True with pack: .*\(use_cache=False\)"):
        bigbatch.hf.Trainer(
            model=gpt2(), args=arguments(tmp_path, 4, 2, use_cache=True), pack=LENGTH
        )
    model = gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"its count is .* model.loss_type = 'ForCausalLM'"):
        trainer_run(bigbatch.hf.Trainer, model, 5, 3, tmp_path, pack=LENGTH)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
