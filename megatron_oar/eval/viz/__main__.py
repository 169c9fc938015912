"""``python -m megatron_oar.eval.viz``: ``oar viz``."""

import sys

from megatron_oar.eval.viz.cli import main

sys.exit(main())
