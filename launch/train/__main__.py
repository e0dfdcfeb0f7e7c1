"""``torchrun --nproc-per-node N -m hla_sp.launch.train <flags>``: the trainer (:mod:`.main`)."""

import os
import signal
import sys
from typing import Any


def _stop_while_starting(signum: int, frame: Any) -> None:
    """A signal before training starts (megatron's import takes seconds): leave at once,
    one line from rank 0, no traceback of half-finished imports from every rank."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"hla-sp train: stopped by {signal.Signals(signum).name} while starting; "
                    f"nothing was trained\n".encode())
    os._exit(128 + signum)


signal.signal(signal.SIGINT, _stop_while_starting)  # main.run() installs the training-time ones

from hla_sp.launch.train.main import main  # noqa: E402

sys.exit(main())
