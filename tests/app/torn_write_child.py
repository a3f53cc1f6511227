"""``bigbatch train`` whose $STOP_IN_WRITE-th ``torch.save`` stops half-way through the file.

The test SIGKILLs the stopped process: the temporary file holds half a snapshot, the rename
never happened. With $FINISH_WRITE=1 a SIGCONT lets it write the other half and go on (the
test races another process against the write); with $STOP_TWICE=1 as well it stops again
after the third quarter (the test signals it twice during one write). Only the writing is changed (``torch.save`` is
wrapped); the loop is the CLI's.
"""

import io
import os
import signal
import sys

import torch

from bigbatch.app.cli import main

_real_save = torch.save
_stop_at = int(os.environ["STOP_IN_WRITE"])
_writes = [0]


def _torn_save(obj, f, *args, **kwargs):
    _writes[0] += 1
    if _writes[0] != _stop_at or not hasattr(f, "write"):
        return _real_save(obj, f, *args, **kwargs)
    whole = io.BytesIO()
    _real_save(obj, whole, *args, **kwargs)
    data = whole.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGSTOP)  # the test kills the process here, or continues it
    if os.environ.get("FINISH_WRITE") != "1":
        raise AssertionError("not killed")
    if os.environ.get("STOP_TWICE") == "1":
        f.write(data[len(data) // 2 : 3 * len(data) // 4])
        os.kill(os.getpid(), signal.SIGSTOP)
        f.write(data[3 * len(data) // 4 :])
        return
    f.write(data[len(data) // 2 :])


torch.save = _torn_save
sys.exit(main(sys.argv[1:]))
