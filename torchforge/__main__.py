"""``python -m torchforge``: the ``torchforge`` command (:mod:`torchforge.cli`)."""
import sys

from torchforge.cli import main

sys.exit(main())
