"""``python -m hla_sp.launch.ray_sweep ...``, the documented command:
:mod:`hla_sp.launch.sweep.ray_sweep`."""

import sys

from hla_sp.launch.sweep.ray_sweep import main

if __name__ == "__main__":
    sys.exit(main())
