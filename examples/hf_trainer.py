"""bigbatch.hf.Trainer: transformers' Trainer with exact accumulation, and the audit on both.

A tiny Llama built from a config (no download), float64, on right-padded text of very different
lengths, with a model wrapper whose forward takes no loss kwargs (as many users write): the stock
Trainer averages micro-batch means; bigbatch's equals the one-batch step. ``bigbatch.hf.audit``
says which is which.
"""

import logging
import tempfile

import torch
import transformers

import bigbatch.hf

logging.basicConfig(level=logging.INFO, format="%(message)s")
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
)  # fmt: skip
lengths = torch.randint(3, 20, (16,)).tolist()
data = [{"input_ids": torch.randint(1, 64, (n,)).tolist()} for n in lengths]


def collate(samples):
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Wrapper(torch.nn.Module):  # its forward takes no num_items_in_batch
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, labels=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


base = transformers.LlamaForCausalLM(config).to(torch.float64)
for trainer_class in (transformers.Trainer, bigbatch.hf.Trainer):
    model = Wrapper(transformers.LlamaForCausalLM(config).to(torch.float64))
    model.load_state_dict(Wrapper(base).state_dict())
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            out, per_device_train_batch_size=4, gradient_accumulation_steps=4, max_steps=1,
            report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
        )  # fmt: skip
        trainer = trainer_class(model=model, args=args, train_dataset=data, data_collator=collate)
        report = bigbatch.hf.audit(trainer)
        trainer.train()
    result = report.results[0]
    print(f"{trainer_class.__module__}.Trainer: exact={result.exact} {result.diagnosis}")
    assert result.exact == (trainer_class is bigbatch.hf.Trainer)
