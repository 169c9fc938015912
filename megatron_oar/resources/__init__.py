"""Files the code reads at run time, shipped inside the package (``package_data`` in setup.py).

They are found with :mod:`importlib.resources`, never through the repository's layout, so an
installed copy (``pip install .``, a wheel) finds them from any directory:

* ``tiny_cpu.yaml``: the CPU config of ``oar bench attribution`` (its default ``--config``);
* ``tiny_chain_cpu.yaml``: the chain-task CPU config of ``oar demo`` and ``oar repro``;
* ``tiny_credit_cpu.yaml``: the credit testbed's config (the chain task with filler sentences,
  ``oar repro --grid credit``);
* ``env.sh``: the launch environment's defaults, read by ``oar launch``
  (:func:`megatron_oar.commands.launch.parse_env_sh`) and sourced by the bash launch scripts.

These are the only copies: in a checkout, ``examples/tiny_cpu.yaml``,
``examples/tiny_chain_cpu.yaml``, ``examples/tiny_credit_cpu.yaml`` and ``launch_scripts/env.sh`` are symlinks to them
(``tests/test_install.py`` checks that they resolve here).
"""

from __future__ import annotations

import atexit
import contextlib
from importlib.resources import as_file, files
from pathlib import Path

NAMES = ("tiny_cpu.yaml", "tiny_chain_cpu.yaml", "tiny_credit_cpu.yaml", "env.sh")

_extracted = contextlib.ExitStack()  # temporary copies, for a package imported from a zip
atexit.register(_extracted.close)


def path(name: str) -> Path:
    """A file-system path of the shipped file ``name`` (one of :data:`NAMES`). In a checkout or a
    normal install that is the file itself; a package imported from a zip gets a temporary copy
    that lasts as long as the process (subprocesses can be handed the path either way)."""
    if name not in NAMES:
        raise ValueError(f"{name!r}: not a shipped resource (one of {', '.join(NAMES)})")
    resource = files(__name__) / name
    if not resource.is_file():
        raise FileNotFoundError(f"{resource}: missing from the installed package (setup.py's "
                                "package_data ships megatron_oar/resources/)")
    return _extracted.enter_context(as_file(resource))
