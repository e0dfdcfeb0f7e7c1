"""``python -m hla_sp.launch.cli``: the ``hla-sp`` console script."""

import sys

from hla_sp.launch.cli.commands import main

sys.exit(main())
