"""The commands: what ``oar`` (``megatron_oar.cli``) and torchrun start; library code lives in
the subpackages beside this one.

- :mod:`.train`   ``oar train`` / ``torchrun -m megatron_oar.commands.train``: one training run
- :mod:`.plan`    ``oar plan``: memory per GPU, FLOPs and step time of a config on its cluster
- :mod:`.launch`  ``oar launch``: validate a config for its cluster, start it via nemo-run
- :mod:`.plot`    ``oar plot``: training curves from a run's metrics
- :mod:`.demo`    ``oar demo``: the tiny end-to-end demo (SFT warm-up, then OAR-G GRPO)

``oar eval`` / ``oar analyze`` / ``oar viz`` are :mod:`megatron_oar.eval`'s entry points,
``oar repro`` is :mod:`megatron_oar.repro`'s and ``oar bench`` runs ``benchmarks/``. How every
entry point's process ends is :mod:`megatron_oar.process_exit` (below all of them).
"""
