"""``python -m megatron_oar.commands.plan``: ``oar plan``."""

import sys

from megatron_oar.commands.plan.command import main

sys.exit(main())
