"""``python -m hla_sp.launch.torchrun ...``, the documented command:
:mod:`hla_sp.launch.distributed.torchrun`."""

import sys

from hla_sp.launch.distributed.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
