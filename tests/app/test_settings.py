"""TrainConfig: one list of names for fit(), the CLI and TOML files; batch arithmetic; LR scaling."""

from __future__ import annotations

import pytest

from bigbatch.app.run import scaled_lr
from bigbatch.app.settings import TrainConfig, load_toml, make_config, resolve_batch


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


@pytest.mark.parametrize(
    "settings, error, match",
    [
        ({"max_grad_norm": "1.0"}, TypeError, r"^max_grad_norm='1\.0' is a str: max_grad_norm "
         r"takes a number \(or is left out\)\.$"),
        ({"max_grad_norm": float("inf")}, ValueError, r"^max_grad_norm=inf is not allowed: use a "
         r"positive number \(finite, e\.g\. 1\.0\), or leave it out for no clipping\.$"),
        ({"memory_budget": float("nan")}, ValueError, r"^memory_budget=nan is not a positive finite size"),
        ({"memory_budget": "inf"}, ValueError, r"^memory_budget='inf' is not a size"),
        ({"lr": float("inf")}, ValueError, r"^lr=inf is not allowed: use a positive number"),
        ({"lr": float("nan")}, ValueError, r"^lr=nan is not allowed: use a positive number"),
        ({"seed": 2**63}, ValueError, r"^seed=9223372036854775808 is not allowed: use an integer "
         r"from 0 to 2\*\*63 - 1\.$"),
        ({"seed": -1}, ValueError, r"^seed=-1 is not allowed: use a non-negative integer\.$"),
        ({"lr_scaling": "linear", "reference_batch_size": 0}, ValueError,
         r"^reference_batch_size=0 is not allowed: use a positive integer\.$"),
        ({"lr_scaling": "sqrt", "reference_batch_size": -4}, ValueError,
         r"^reference_batch_size=-4 is not allowed: use a positive integer\.$"),
        ({"keep_snapshots": 0}, ValueError, r"^keep_snapshots=0 is not allowed: use a positive"),
        ({"nonfinite": "ignore"}, ValueError, r"^nonfinite='ignore' is not allowed: use one of "
         r"'raise', 'skip', 'apply'\.$"),
        ({"resume": "no"}, ValueError, r"^resume='no' is not allowed: use one of False, True, "
         r"'auto'\.$"),
    ],
)  # fmt: skip
def test_every_setting_is_checked_when_the_config_is_made(settings, error, match):
    with pytest.raises(error, match=match):
        TrainConfig(**settings)


@pytest.mark.parametrize(
    "line, match",
    [
        ('shuffle = "false"', r"^shuffle='false' is a str: shuffle takes true or false\.$"),
        ('gradient_checkpointing = "false"', r"^gradient_checkpointing='false' is a str"),
        ("quiet = 1", r"^quiet=1 is an int: quiet takes true or false\.$"),
        ("task = 5", r"^task=5 is an int: task takes a string \(or is left out\)\.$"),
        ("lr = true", r"^lr=True is a bool: lr takes a number\.$"),
    ],
)
def test_toml_values_of_the_wrong_type_name_the_key(tmp_path, line, match):
    """A string where a bool belongs was read as true (resume = "no" resumed a finished run)."""
    path = tmp_path / "run.toml"
    path.write_text(line + "\n")
    with pytest.raises(TypeError, match=match):
        make_config(load_toml(str(path)))


def test_two_of_three_batch_numbers_never_say_give_only_two():
    with pytest.raises(ValueError) as given_two:
        TrainConfig(batch_size=10, gradient_accumulation_steps=6)
    assert "Give only two" not in str(given_two.value)
    assert str(given_two.value).endswith(
        "Use gradient_accumulation_steps=5, or give micro_batch_size instead."
    )
    with pytest.raises(ValueError, match=r"Give only two of the three\.$"):  # three given: right
        TrainConfig(batch_size=10, micro_batch_size=4, gradient_accumulation_steps=2)


def test_words_are_read_in_any_case_on_every_surface(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('micro_batch_size = "Auto"\nprecision = "BF16"\nresume = "AUTO"\n')
    config = make_config(load_toml(str(path)), lr_schedule="Cosine", device="CPU")
    assert (config.micro_batch_size, config.precision, config.resume) == ("auto", "bf16", "auto")
    assert (config.lr_schedule, config.device) == ("cosine", "cpu")


@pytest.mark.parametrize(
    "key, closest",
    [("learning_rate", "lr"), ("max_steps", "steps"), ("per_device_train_batch_size",
     "micro_batch_size"), ("micro_batch", "micro_batch_size"), ("num_train_epochs", "epochs")],
)  # fmt: skip
def test_an_unknown_key_names_the_closest_setting(key, closest):
    with pytest.raises(ValueError, match=rf"unknown setting\(s\) '{key}'; allowed: task, .* Did "
                       rf"you mean '{closest}'\?$"):  # fmt: skip
        make_config({key: 1})
