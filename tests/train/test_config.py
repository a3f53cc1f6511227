"""TrainConfig: one list of names for fit(), the CLI and TOML files; batch arithmetic; LR scaling."""

from __future__ import annotations

import pytest

from bigbatch.train.config import TrainConfig, load_toml, make_config, resolve_batch, scaled_lr


@pytest.mark.parametrize(
    "given, want",
    [
        ({}, (32, 32, 1)),
        ({"batch_size": 10, "micro_batch_size": 4}, (10, 4, 3)),
        ({"batch_size": 10, "gradient_accumulation_steps": 3}, (10, 4, 3)),
        ({"micro_batch_size": 4, "gradient_accumulation_steps": 3}, (12, 4, 3)),
        ({"batch_size": 12, "micro_batch_size": 4, "gradient_accumulation_steps": 3}, (12, 4, 3)),
        ({"micro_batch_size": 8}, (8, 8, 1)),
        ({"batch_size": 6, "micro_batch_size": 8}, (6, 6, 1)),
        ({"batch_size": 64, "micro_batch_size": "auto"}, (64, "auto", None)),
    ],
)
def test_any_two_batch_numbers_determine_the_third(given, want):
    assert resolve_batch(TrainConfig(**given)) == want


def test_contradicting_batch_numbers_name_the_values():
    with pytest.raises(
        ValueError,
        match=r"batch_size=10, micro_batch_size=4 and gradient_accumulation_steps=2 contradict",
    ):
        TrainConfig(batch_size=10, micro_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(
        ValueError, match=r"micro_batch_size='auto' chooses the accumulation steps itself"
    ):
        TrainConfig(micro_batch_size="auto", gradient_accumulation_steps=2)


@pytest.mark.parametrize(
    "settings, match",
    [
        (
            {"precision": "fp8"},
            r"precision='fp8' is not allowed: use one of 'fp32', 'bf16', 'fp16'",
        ),
        (
            {"micro_batch_size": 0},
            r"micro_batch_size=0 is not allowed: use a positive integer or \"auto\"",
        ),
        ({"batch_size": 2.5}, r"batch_size=2.5 is not allowed: use a positive integer"),
        ({"save_every": -1}, r"save_every=-1 is not allowed: use a non-negative integer"),
        ({"steps": 3, "epochs": 1}, r"steps=3 and epochs=1 are both given: choose one"),
        ({"lr": 0}, r"lr=0 is not allowed: use a positive number"),
        ({"lr_scaling": "linear"}, r"lr_scaling='linear' needs reference_batch_size"),
        ({"lr_schedule": "step"}, r"lr_schedule='step' is not allowed"),
    ],
)
def test_bad_settings_are_named(settings, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**settings)


def test_lr_scaling_rules():
    def lr(rule):
        return scaled_lr(TrainConfig(lr=0.1, lr_scaling=rule, reference_batch_size=256), 1024)

    assert lr("none") == 0.1
    assert lr("linear") == pytest.approx(0.4)
    assert lr("sqrt") == pytest.approx(0.2)


def test_make_config_overrides_and_lists_allowed_keys():
    config = make_config({"batch_size": 8, "lr": 0.1}, lr=0.2)
    assert (config.batch_size, config.lr) == (8, 0.2)
    assert make_config(config, seed=3).seed == 3
    with pytest.raises(
        ValueError,
        match=r"unknown setting\(s\) 'batchsize'; allowed: task, batch_size, micro_batch_size",
    ):
        make_config({"batchsize": 8})


def test_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('task = "tasks.py:classify"\nbatch_size = 16\nmicro_batch_size = "auto"\n')
    config = make_config(load_toml(str(path)))
    assert (config.task, config.batch_size, config.micro_batch_size) == (
        "tasks.py:classify",
        16,
        "auto",
    )
    path.write_text("batch_size = = 3\n")
    with pytest.raises(ValueError, match=r"run.toml' is not valid TOML: .*line 1"):
        load_toml(str(path))
    with pytest.raises(FileNotFoundError, match=r"config file '.*missing.toml' does not exist"):
        load_toml(str(tmp_path / "missing.toml"))
