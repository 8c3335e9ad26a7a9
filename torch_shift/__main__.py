"""`python -m torch_shift`: the `torch-shift` command without depending on PATH."""

import sys

from torch_shift.cli import main

sys.exit(main())
