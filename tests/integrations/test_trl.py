"""TRL's SFT, DPO, reward and GRPO trainers under gradient accumulation, stock and through
``bigbatch.hf.exact``, against the same trainer's one-batch run.

Tiny random models built from configs, a word-level tokenizer built here, in-memory data sets of
very different lengths: nothing is downloaded. The models are float64, but TRL's fused LM head
(SFT, DPO, GRPO) computes its log-probabilities in float32 and Llama's RMSNorm in float32, so those
runs agree to float32's rounding (``FLOAT32``); the reward model (GPT-2 with a scalar head) is
float64 end to end and agrees to 1e-10.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import transformers  # noqa: E402
from integrations.hf_models import VOCAB, distance, llama  # noqa: E402
from integrations.test_hf_pack import float64_norms  # noqa: E402

import bigbatch.hf  # noqa: E402
from bigbatch.core.loss import token_cross_entropy  # noqa: E402

FLOAT32 = 1e-5  # float32 islands (TRL's fused LM head, Llama's RMSNorm) in a float64 model
WORDS = [f"w{i}" for i in range(VOCAB - 3)]


def tokenizer():
    """A word-level tokenizer over ``WORDS`` (ids 3...), built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


def sentences(n: int, seed: int, low: int = 2, high: int = 14) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g)) for k in lengths]  # fmt: skip


def config(cls, tmp, batch: int, steps: int, **kwargs):
    """A TRL config for a deterministic CPU run: float64 (no bf16), SGD, constant LR, no clipping."""
    return cls(
        output_dir=str(tmp), per_device_train_batch_size=batch, gradient_accumulation_steps=steps,
        learning_rate=0.05, lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, optim="sgd", **{"max_steps": 2, "bf16": False, **kwargs},
    )  # fmt: skip


def reward_model():
    torch.manual_seed(0)
    settings = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, num_labels=1,
    )  # fmt: skip
    return transformers.GPT2ForSequenceClassification(settings).to(torch.float64)


def train(cls, base, batch, steps, tmp, data, **kwargs):
    """Train a copy of ``base`` with ``cls``, auditing its first step; the model and the result."""
    model = copy.deepcopy(base)
    arguments = config(CONFIGS[cls.__name__], tmp, batch, steps, **kwargs.pop("args", {}))
    trainer = cls(
        model=model, args=arguments, train_dataset=data, processing_class=tokenizer(), **kwargs
    )
    report = bigbatch.hf.audit(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return model, report.results[0]


CONFIGS = {
    "SFTTrainer": trl.SFTConfig,
    "DPOTrainer": trl.DPOConfig,
    "RewardTrainer": trl.RewardConfig,
    "GRPOTrainer": trl.GRPOConfig,
}


def test_sft_per_token(tmp_path):
    """12 texts of 2 to 13 words, 5 + 5 + 2 per window: SFT's loss is a token mean over the
    window's count (``num_items_in_batch``), so the stock trainer is right too (no false alarm)."""
    data, base = datasets.Dataset.from_dict({"text": sentences(12, 1)}), llama()
    one, _ = train(trl.SFTTrainer, base, 12, 1, tmp_path, data)
    stock, stock_audit = train(trl.SFTTrainer, base, 5, 3, tmp_path, data)
    ours, our_audit = train(bigbatch.hf.exact(trl.SFTTrainer), base, 5, 3, tmp_path, data)
    assert stock_audit.exact and our_audit.exact
    assert our_audit.loss_ratio == pytest.approx(1, abs=FLOAT32)
    assert distance(stock, one, base) < FLOAT32 and distance(ours, one, base) < FLOAT32


def test_sft_with_dropout(tmp_path):
    """Llama with attention dropout 0.1 under SFT: the audit replays the window with dropout off
    (Note [audit dropout]) and calls it exact, and the tokens SFT counts (its logged
    ``num_tokens``) are the plain run's: the audit's own calls of ``compute_loss`` are not
    counted."""
    data, counted = datasets.Dataset.from_dict({"text": sentences(12, 1)}), []
    for audit in (False, True):
        model = llama()
        model.config.attention_dropout = 0.1
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
        trainer = trl.SFTTrainer(
            model=model, args=config(trl.SFTConfig, tmp_path, 5, 3), train_dataset=data,
            processing_class=tokenizer(),
        )  # fmt: skip
        report = bigbatch.hf.audit(trainer, steps=(1, 2)) if audit else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        counted.append(trainer._total_train_tokens)
    assert [r.exact for r in report.results] == [True, True], report.results
    assert counted[0] == counted[1] > 0


def docstrings(n: int = 300, low: int = 6, high: int = 256) -> list[str]:
    """``n`` of Python's own docstrings of ``low`` to ``high`` words, each word mapped to one of
    ``WORDS``: a realistic spread of lengths, shipped with Python (nothing downloaded)."""
    import builtins
    import collections
    import inspect
    import zlib

    found: dict[str, str] = {}
    for module in (builtins, collections, inspect, torch, torch.nn.functional, torch.nn):
        for name in sorted(dir(module)):
            words = (inspect.getdoc(getattr(module, name, None)) or "").split()[:high]
            if len(words) >= low:
                found.setdefault(
                    " ".join(words),
                    " ".join(WORDS[zlib.crc32(w.encode()) % len(WORDS)] for w in words),
                )
    assert len(found) >= n
    return list(found.values())[:n]


def long_gpt2():
    torch.manual_seed(0)
    settings = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=260, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(settings).to(torch.float64)


@pytest.mark.parametrize(
    "name, bf16", [("gpt2", False), pytest.param("llama", True, marks=pytest.mark.slow)]
)
def test_sft_on_docstrings_equals_the_one_batch_run(tmp_path, name, bf16):
    """A newcomer's first hour: 300 docstrings of 6 to 256 tokens, a float64 model, SFTConfig's
    own default ``bf16=True`` or not; 3 steps of 4 × 4. ``exact(SFTTrainer)`` ends where stock SFT
    and the one-batch run end: its loss's form is read before the first window (``loss_form``):
    SFT's loss honours ``num_items_in_batch``, which gets what transformers counts (every label
    for GPT-2: 1.8% off before), and the first window runs at the one-batch run's scale too (in
    bf16 every scale rounds: 3e-3 off before)."""
    data, base = (
        datasets.Dataset.from_dict({"text": docstrings()}),
        long_gpt2() if name == "gpt2" else llama(),
    )
    runs = {
        key: train(cls, base, batch, steps, tmp_path, data, args={"bf16": bf16, "max_steps": 3})[0]
        for key, cls, batch, steps in [
            ("one", trl.SFTTrainer, 16, 1), ("stock", trl.SFTTrainer, 4, 4),
            ("ours", bigbatch.hf.exact(trl.SFTTrainer), 4, 4),
        ]
    }  # fmt: skip
    stock, ours = (
        distance(runs["stock"], runs["one"], base),
        distance(runs["ours"], runs["one"], base),
    )
    assert ours < 1e-6 and abs(ours - stock) < 1e-9, (stock, ours)


@pytest.mark.slow
def test_dpo_per_pair(tmp_path):
    """10 pairs, 4 + 4 + 2 per window: stock DPO averages the micro-batches' pair means (each of
    the last 2 pairs weighs twice as much); ``exact`` weighs every pair 1/10."""
    data = datasets.Dataset.from_dict(
        {"prompt": sentences(10, 1, 1, 6), "chosen": sentences(10, 2), "rejected": sentences(10, 3)}
    )
    base = llama()
    runs = {}
    for name, cls, batch, steps in [
        ("one", trl.DPOTrainer, 10, 1),
        ("stock", trl.DPOTrainer, 4, 3),
        ("exact", bigbatch.hf.exact(trl.DPOTrainer), 4, 3),
    ]:
        runs[name] = train(cls, base, batch, steps, tmp_path, data, ref_model=copy.deepcopy(base))
    (one, _), (stock, found), (ours, mine) = runs["one"], runs["stock"], runs["exact"]
    assert not found.exact and found.diagnosis == "per-micro-batch mean on padded data", found
    assert mine.exact and mine.loss_ratio == pytest.approx(1, abs=FLOAT32), mine
    assert distance(ours, one, base) < FLOAT32 < 0.05 < distance(stock, one, base)


@pytest.mark.slow  # 2-5 s on 2 cores
def test_reward_per_pair_float64(tmp_path):
    """The reward trainer's loss, ``-log σ(r_chosen − r_rejected)`` per pair, in float64."""
    data = datasets.Dataset.from_dict({"chosen": sentences(10, 2), "rejected": sentences(10, 3)})
    base = reward_model()
    one, _ = train(trl.RewardTrainer, base, 10, 1, tmp_path, data)
    stock, found = train(trl.RewardTrainer, base, 4, 3, tmp_path, data)
    ours, mine = train(bigbatch.hf.exact(trl.RewardTrainer), base, 4, 3, tmp_path, data)
    assert not found.exact and found.diagnosis == "per-micro-batch mean on padded data", found
    assert mine.exact
    assert distance(ours, one, base) < 1e-10 < 0.05 < distance(stock, one, base)


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_grpo_is_audited(tmp_path, loss_type):
    """Stock GRPO (8 prompts x 4 completions of up to 6 tokens, 4 sequences per micro-batch, 2
    micro-batches) is exact under accumulation for the per-sequence, constant-length and
    window-token units (Note [generating trainers]); bnpo's token mean per micro-batch is not."""
    data = datasets.Dataset.from_dict({"prompt": sentences(8, 1, 1, 6)})
    settings = dict(num_generations=4, max_completion_length=6, loss_type=loss_type, beta=0.0)
    _, found = train(
        trl.GRPOTrainer, llama(), 4, 2, tmp_path, data, reward_funcs=length, args=settings
    )
    if loss_type == "bnpo":
        assert not found.exact and found.diagnosis == "per-micro-batch mean on padded data", found
    else:
        assert found.exact, found  # (its loss is near 0: advantages are centred per prompt)


def test_exact_refuses_generating_trainers():
    for cls in (
        getattr(trl, name) for name in ("GRPOTrainer", "RLOOTrainer") if hasattr(trl, name)
    ):
        with pytest.raises(TypeError, match=f"exact\\(\\) does not take {cls.__name__}.*audit"):
            bigbatch.hf.exact(cls)


def float64_loss(outputs, labels, num_items_in_batch=None):
    """SFT's token loss in float64 (TRL's fused head and transformers' ``ForCausalLMLoss``
    compute it in float32), as a ``compute_loss_func``."""
    loss_sum, count = token_cross_entropy(outputs.logits, labels, shift=True)
    return loss_sum / (count if num_items_in_batch is None else num_items_in_batch)


FLAT = {  # TRL's flattened batches: one row of sequences, positions restarting
    "padding_free": {"padding_free": True, "max_length": None},
    "padding_free_pad8": {"padding_free": True, "max_length": None, "pad_to_multiple_of": 8},
    "bfd": {"packing": True, "max_length": 24},  # 12 texts in 5 rows: 2 + 2 + 1 per window
}
SIZES = {"padding_free": (12, 4), "padding_free_pad8": (12, 4), "bfd": (5, 2)}


@pytest.mark.parametrize(
    "layout, ours",
    [
        ("padding_free", {}),
        ("bfd", {}),
        pytest.param("padding_free", {"chunked_head": True}, marks=pytest.mark.slow),
        pytest.param("bfd", {"chunked_head": True}, marks=pytest.mark.slow),
        pytest.param("padding_free_pad8", {"micro_batch_tokens": 40}, marks=pytest.mark.slow),
        pytest.param("bfd", {"pack": 24}, marks=pytest.mark.slow),
    ],
)
def test_sft_flattened_batches_float64(tmp_path, layout, ours):
    """TRL's ``padding_free`` and ``packing`` (``bfd``) batches, cut by their sequences (Note
    [flattened batches]): ``exact(SFTTrainer)`` (by sequences, by tokens, packed again, the
    chunked head) equals the stock one-batch run at float64's rounding, as stock accumulation
    does; both audits say exact. Float64 end to end: Llama's RMSNorm in float64, the stock loss a
    float64 ``compute_loss_func`` (the chunked head is float64 itself)."""
    data, base = datasets.Dataset.from_dict({"text": sentences(12, 1)}), float64_norms(llama())
    (whole, batch), args = SIZES[layout], FLAT[layout]
    stock = {"compute_loss_func": float64_loss}
    mine = ours if ours.get("chunked_head") else {**stock, **ours}
    one, _ = train(trl.SFTTrainer, base, whole, 1, tmp_path, data, args=args, **stock)
    accumulated, found = train(trl.SFTTrainer, base, batch, 3, tmp_path, data, args=args, **stock)
    exact = bigbatch.hf.exact(trl.SFTTrainer)
    ours_model, mine_found = train(exact, base, batch, 3, tmp_path, data, args=args, **mine)
    assert found.exact and mine_found.exact, (found, mine_found)
    assert distance(accumulated, one, base) < 1e-10
    assert distance(ours_model, one, base) < 1e-10


@pytest.mark.parametrize("layout", ["padding_free_pad8", "bfd"])
def test_sft_flattened_batches_trl_loss(tmp_path, layout):
    """TRL's own loss (its fused head, float32) on its flattened batches: ``exact(SFTTrainer)``
    trains where the stock trainer does (it refused them before: "tensors disagree on the first
    (sample) dimension"), and ends where stock accumulation and the one-batch run end, at
    float32's rounding; under ``padding_free`` (by 4 texts, as stock) at float64's."""
    data, base = datasets.Dataset.from_dict({"text": sentences(12, 1)}), llama()
    (whole, batch), args = SIZES[layout], FLAT[layout]
    one, _ = train(trl.SFTTrainer, base, whole, 1, tmp_path, data, args=args)
    stock, _ = train(trl.SFTTrainer, base, batch, 3, tmp_path, data, args=args)
    ours, found = train(
        bigbatch.hf.exact(trl.SFTTrainer), base, batch, 3, tmp_path, data, args=args
    )
    assert found.exact, found
    assert distance(ours, one, base) < FLOAT32 and distance(stock, one, base) < FLOAT32
    if layout != "bfd":  # the same micro-batches as stock's (its padding dropped): its rounding
        assert distance(ours, stock, base) < 1e-12


@pytest.mark.parametrize("ours", [False, True])
def test_every_loss_sees_flattened_rows_as_trl_makes_them(tmp_path, ours):
    """Under ``padding_free`` every batch the SFT loss gets (the window's, bigbatch's
    micro-batches, the audit's one batch) is one row whose ``cu_seq_lens_q`` and ``seq_idx``
    describe it, as TRL's collator makes them, and the audit's one batch is the window's 12
    texts in one row (joined as rows before, its ``cu_seq_lens_q`` concatenated: what a varlen
    kernel would misread)."""
    seen = []

    class SFTTrainer(trl.SFTTrainer):  # (named so: train() finds its config by the name)
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append({k: inputs[k] for k in ("input_ids", "cu_seq_lens_q", "seq_idx")})
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    data = datasets.Dataset.from_dict({"text": sentences(12, 1)})
    cls = bigbatch.hf.exact(SFTTrainer) if ours else SFTTrainer
    _, found = train(cls, llama(), 4, 3, tmp_path, data, args=FLAT["padding_free"])
    assert found.exact, found
    for batch in seen:
        bounds, width = batch["cu_seq_lens_q"], batch["input_ids"].shape[1]
        assert batch["input_ids"].shape[0] == 1 and bounds[0] == 0 and bounds[-1] == width
        assert (bounds.diff() > 0).all() and batch["seq_idx"][0, -1] == len(bounds) - 2
    assert max(len(b["cu_seq_lens_q"]) for b in seen) == 13  # the audit's: 12 texts
