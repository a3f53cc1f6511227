"""Nothing bigbatch writes in a run folder follows a symbolic link planted there (Note [no links]
in bigbatch.app.folder): real links to a file outside the folder, whose content must survive.

Planted before the run, under each kind of name bigbatch writes (the lock, the log, the
summary, the model, snapshots, temporary files, TensorBoard's folder, a log file), the run is
refused in one line before it writes anything. Planted during the run (``tasks.faulty`` plants
it at a chosen micro-batch), a new temporary file refuses it (``O_NOFOLLOW | O_EXCL``) and a
file replaced by ``os.replace`` (``model.pt``, ``snapshot.pt``, ``summary.json``) replaces the
link, never its target.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bigbatch.app.cli import main

TASKS = Path(__file__).resolve().parent / "tasks.py"
RUN = ["--batch-size", "10", "--micro-batch-size", "4", "--epochs", "2", "--save-every", "3",
       "--seed", "3", "--quiet"]  # fmt: skip
PRECIOUS = "the user's own file\n"


def train(capsys, out, *extra):
    code = main(["train", f"{TASKS}:faulty", *RUN, "--out", str(out), *extra])
    return code, capsys.readouterr().err


def one_line(err):
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0].removeprefix("bigbatch train: error: ")


@pytest.fixture
def target(tmp_path):
    """A file outside the run folder that a link will point at."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text(PRECIOUS)
    return path


NAMES = ["metrics.csv", "metrics.csv.tmp", "summary.json", "model.pt", "snapshot.pt",
         "snapshot-00000003.pt", ".snapshot.pt.tmp.4242", "report.png", "tensorboard",
         "train.log"]  # fmt: skip


CASES = [(name, []) for name in NAMES] + [
    (name, ["--resume"]) for name in ("metrics.csv.tmp", "snapshot.pt", "tensorboard")
]  # resuming truncates metrics.csv through its .tmp and reads the newest snapshot


@pytest.mark.parametrize(("name", "resume"), CASES, ids=[f"{n}{' '.join(r)}" for n, r in CASES])
def test_a_link_planted_before_the_run_is_refused(name, resume, capsys, tmp_path, target):
    out = tmp_path / "run"
    if resume:  # a folder that already holds a run, resumed
        assert train(capsys, out)[0] == 0
    link = out / name
    out.mkdir(exist_ok=True)
    if link.is_dir():
        shutil.rmtree(link)
    link.unlink(missing_ok=True)
    link.symlink_to(target.parent if name == "tensorboard" else target)
    before = sorted(os.listdir(out))
    code, err = train(capsys, out, *resume)
    assert code == 2
    assert one_line(err) == (
        f"{out}: holds symbolic links where bigbatch writes ({name}), and bigbatch never writes "
        "through one: remove them, or choose another --out"
    )
    assert target.read_text() == PRECIOUS
    assert os.listdir(target.parent) == ["precious.txt"]
    assert sorted(os.listdir(out)) == before  # nothing written, not even the lock


def test_a_lock_that_is_a_link_is_refused_and_its_target_kept(capsys, tmp_path, target):
    """Refused with the other names; opened with O_NOFOLLOW all the same (``no_follow``). Before,
    O_CREAT followed the link and the run's PID truncated the target."""
    from bigbatch.app.folder import no_follow

    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(target)
    code, err = train(capsys, out)
    assert code == 2
    assert one_line(err) == (
        f"{out}: holds symbolic links where bigbatch writes (.lock), and bigbatch never writes "
        "through one: remove them, or choose another --out"
    )
    with pytest.raises(OSError, match="is a symbolic link, and bigbatch never writes through"):
        no_follow(str(out / ".lock"), os.O_RDWR | os.O_CREAT)
    assert target.read_text() == PRECIOUS and os.listdir(out) == [".lock"]


# During the run: 10 steps of 3 micro-batches (calls 1-30), then the final evaluation (31-40).
# Call 14 is in step 5, before the snapshot of step 5; call 31 is after the last snapshot.
def test_a_link_planted_during_the_run_is_not_written_through(
    capsys, tmp_path, target, monkeypatch
):
    """At the temporary file the snapshot of step 5 is about to be written to."""
    at, name = 14, f".snapshot.pt.tmp.{os.getpid()}"
    out = tmp_path / "run"
    monkeypatch.setenv("LINK_AT", str(at))
    monkeypatch.setenv("LINK", str(out / name))
    monkeypatch.setenv("LINK_TO", str(target))
    code, err = train(capsys, out)
    assert code == 2
    assert one_line(err) == (
        f"{out / name}: is a symbolic link, and bigbatch never writes through one in a run "
        "folder: remove the link, or choose another --out"
    )
    assert target.read_text() == PRECIOUS


@pytest.mark.parametrize(
    ("name", "at"), [("model.pt", 31), ("snapshot.pt", 14), ("summary.json", 31)]
)
def test_a_file_replaced_over_a_planted_link_leaves_its_target(
    name, at, capsys, tmp_path, target, monkeypatch
):
    """``os.replace`` puts the new file where the link was: the link goes, the target stays."""
    out = tmp_path / "run"
    monkeypatch.setenv("LINK_AT", str(at))
    monkeypatch.setenv("LINK", str(out / name))
    monkeypatch.setenv("LINK_TO", str(target))
    code, err = train(capsys, out)
    assert code == 0, err
    assert target.read_text() == PRECIOUS
    assert not (out / name).is_symlink() and (out / name).read_text(errors="replace") != PRECIOUS
    assert not [p for p in out.iterdir() if p.is_symlink()]
