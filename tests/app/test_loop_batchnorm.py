"""The ``batchnorm`` setting: fit applies ``bigbatch.batchnorm(model, policy)`` before training.

Under ``"freeze"`` and ``"groupnorm"`` the accumulated run equals the full-batch run to float64
rounding; left as it is (``"keep"``) a BatchNorm model does not, and the engine says so.
"""

from __future__ import annotations

import pytest
import tasks
import torch

import bigbatch
from bigbatch.app.cli import main
from bigbatch.app.settings import make_config
from bigbatch.app.snapshot import RunMismatchError


def _train(tmp_path, name, **settings):
    torch.manual_seed(0)  # the same initial weights in every run
    task = tasks.bn_cnn()
    settings = {"batch_size": 12, "epochs": 2, "lr": 0.01, "quiet": True, **settings}
    bigbatch.fit(task, out=str(tmp_path / name), **settings)
    return task.model.state_dict()


def _max_relative_error(want, got):
    """Largest ``‖want - got‖ / ‖want‖`` over the state's tensors (as tests/reference.py)."""
    norm = torch.linalg.vector_norm
    floats = [k for k, v in want.items() if v.is_floating_point()]
    return max(float(norm(got[k] - want[k]) / norm(want[k]).clamp_min(1e-30)) for k in floats)


@pytest.mark.parametrize("policy", ["freeze", "groupnorm"])
def test_policy_makes_accumulation_equal_the_full_batch(tmp_path, policy):
    full = _train(tmp_path, "full", batchnorm=policy)  # one micro-batch of 12
    accumulated = _train(tmp_path, "acc", batchnorm=policy, micro_batch_size=5)  # 5 + 5 + 2
    assert _max_relative_error(full, accumulated) < 1e-10
    swapped = any("running_mean" in k for k in accumulated)
    assert swapped == (policy == "freeze")  # groupnorm replaced the layer


def test_keep_leaves_batchnorm_inexact_and_warns(tmp_path):
    full = _train(tmp_path, "full")
    with pytest.warns(bigbatch.BigBatchWarning, match="'1' \\(BatchNorm2d\\) normalise with batch"):
        accumulated = _train(tmp_path, "acc", micro_batch_size=5, batchnorm=None)
    assert _max_relative_error(full, accumulated) > 1e-6  # the test above can tell


def test_bad_value_names_the_allowed_ones():
    with pytest.raises(
        ValueError,
        match="batchnorm='sync' is not allowed: use one of 'keep', 'micro', 'freeze', 'groupnorm'.",
    ):
        make_config(batchnorm="sync")
    assert make_config(batchnorm=None).batchnorm == "keep"  # None is "keep"


def test_resume_refuses_another_batchnorm(tmp_path):
    _train(tmp_path, "run", batchnorm="groupnorm", steps=1, epochs=None, save_every=1)
    with pytest.raises(RunMismatchError, match="batchnorm: 'groupnorm' -> 'micro'"):
        with pytest.warns(bigbatch.BigBatchWarning):  # "micro" says it is ghost-batch
            _train(tmp_path, "run", batchnorm="micro", steps=2, epochs=None, resume=True)


def test_cli_flag_and_toml_key(tmp_path, capsys):
    task = f"{tasks.__file__}:bn_cnn"
    toml = tmp_path / "run.toml"
    toml.write_text('batchnorm = "groupnorm"\nsteps = 1\nquiet = true\nbatch_size = 12\n')
    assert main(["train", task, "--config", str(toml), "--out", str(tmp_path / "a")]) == 0
    assert not any("running_mean" in k for k in torch.load(tmp_path / "a" / "model.pt"))
    flag = ["--batchnorm", "freeze", "--out", str(tmp_path / "b")]
    assert main(["train", task, "--config", str(toml), *flag]) == 0  # the flag overrides
    assert any("running_mean" in k for k in torch.load(tmp_path / "b" / "model.pt"))
    toml.write_text('batchnorm = "batch"\n')
    assert main(["train", task, "--config", str(toml), "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.strip() == (
        "bigbatch train: error: batchnorm='batch' is not allowed: use one of 'keep', 'micro', "
        "'freeze', 'groupnorm'."
    )
