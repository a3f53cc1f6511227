"""Tiny transformers models built from configs (no weights, no download), padded data, trainers.

Everything is float64 with dropout off (unless asked for), so an accumulated step and the one-batch step differ
only by rounding; data are variable-length and right-padded (the case where averaging
micro-batch means goes wrong).
"""

from __future__ import annotations

import torch

VOCAB = 64


def llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(torch.float64)


def gpt2(seed: int = 0, dropout: bool = False) -> torch.nn.Module:
    """A tiny GPT-2; ``dropout``: its config's default dropout (0.1 on embeddings, attention and
    residuals), else none."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    off = {} if dropout else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64, pad_token_id=0, **off
    )
    return GPT2LMHeadModel(config).to(torch.float64)


class Wrapper(torch.nn.Module):
    """A model whose forward takes no loss kwargs (as many users write, and some VLMs): its
    loss is the token mean over the micro-batch (in float64, shifted as a causal LM's)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, labels=None):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        return {"loss": loss, "logits": logits}


def wrapper_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """A ``Wrapper``'s loss on a batch, as the full-batch reference reads it."""
    return model(**batch)["loss"]


def loaded(make, state: dict) -> torch.nn.Module:
    """``make()`` with ``state`` loaded: a model that a rank sent back as its state dict."""
    model = make()
    model.load_state_dict(state)
    return model


def texts(n: int = 12, seed: int = 1, low: int = 3, high: int = 20) -> list[dict[str, list[int]]]:
    """``n`` samples of very different lengths (the padding is what the bugs feed on)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (k,), generator=g).tolist()} for k in lengths]


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding: ``input_ids`` 0, ``attention_mask`` 0, ``labels`` -100."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[i, : len(s["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def arguments(tmp, batch: int, steps: int, **kwargs):
    """``TrainingArguments`` for a deterministic CPU run: constant LR, no clipping, no logging."""
    from transformers import TrainingArguments

    settings = dict(
        output_dir=str(tmp), per_device_train_batch_size=batch, gradient_accumulation_steps=steps,
        learning_rate=0.05, lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, max_steps=2,
        dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False,
    )  # fmt: skip
    settings.update(kwargs)
    return TrainingArguments(**settings)


def sgd(model: torch.nn.Module, lr: float = 0.05):
    return (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), None)


def adamw(model: torch.nn.Module, lr: float = 0.01):
    return (torch.optim.AdamW(model.parameters(), lr=lr), None)


def distance(a: torch.nn.Module, b: torch.nn.Module, start: torch.nn.Module) -> float:
    """How far ``a`` is from ``b``, relative to how far training moved ``b`` from ``start``."""
    pa, pb, p0 = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (a, b, start))
    return float((pa - pb).norm() / (pb - p0).norm())


def tagger(seed: int = 0, shift: bool = False) -> torch.nn.Module:
    """A token model of one's own (a ``PreTrainedModel`` whose ``loss_type`` transformers does
    not know, and that does not generate): a tagger, its loss the mean over every label (5 tags),
    or (``shift``) a causal LM's, the mean over the labels but each row's first."""
    from transformers import PretrainedConfig, PreTrainedModel

    class TaggerConfig(PretrainedConfig):
        model_type = "bigbatch-tagger"

    class Tagger(PreTrainedModel):
        config_class = TaggerConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed, self.mix = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, VOCAB if shift else 5)
            self.post_init()

        def forward(self, input_ids, attention_mask=None, labels=None):
            logits = self.head(torch.tanh(self.mix(self.embed(input_ids))))
            if labels is None:
                return {"logits": logits}
            flat, tags = logits.flatten(0, 1), labels.flatten()
            if shift:
                flat, tags = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
            loss = torch.nn.functional.cross_entropy(flat, tags, ignore_index=-100)
            return {"loss": loss, "logits": logits}

    torch.manual_seed(seed)
    return Tagger(TaggerConfig()).to(torch.float64)


def tags(samples: list[dict]) -> dict[str, torch.Tensor]:
    """``collate``, each labelled token's label its tag (its id modulo 5)."""
    batch = collate(samples)
    return {**batch, "labels": torch.where(batch["labels"] == -100, -100, batch["labels"] % 5)}
