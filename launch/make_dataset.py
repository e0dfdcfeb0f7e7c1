"""``python -m hla_sp.launch.make_dataset ...``, the documented command:
:mod:`hla_sp.launch.data.make_dataset`."""

import sys

from hla_sp.launch.data.make_dataset import main

if __name__ == "__main__":
    sys.exit(main())
