"""How a command's process ends (``oar`` itself, and the torchrun ranks of ``oar train``, ``oar
eval`` and ``oar analyze oracle``): with its exit status, without the interpreter's full-heap
garbage collections at shutdown. Only for a process's ``__main__``: ``main()`` called in a
longer-lived process (a test) must not freeze that process's heap.

A rank holds about 0.8 million objects tracked by Python's cyclic garbage collector (the modules
and caches of torch, megatron-core, transformers and vLLM). CPython's finalisation
(``Py_FinalizeEx`` in CPython 3.11's ``Python/pylifecycle.c``: one collection before
``finalize_modules``, which collects twice more while it tears the modules down) walks all of
them each time: about 0.35 s a pass on an idle core, 1 to 3 s on the 2 shared cores of the test
machine, and so seconds between a rank's last log line and its exit, for every rank of every run
and restart. vLLM freezes the heap for the same reason while its engine runs
(``freeze_gc_heap`` in ``vllm/v1/engine/core.py``, vLLM 0.32) and unfreezes it in its shutdown.

:func:`exit_after` freezes the heap (``gc.freeze()``: every live object moves to the permanent
generation, which collections skip) once ``main`` has returned or raised, i.e. after the command
closed what it opened (``Trainer.close``: the logger, the verifier pool, the vLLM engine;
``destroy_runtime``: the process groups). Nothing else changes: ``atexit`` handlers still run
(``logging.shutdown``, multiprocessing's finalizers), objects are still released by reference
counting as the modules are torn down, and the exit status is ``main``'s, or 1 with the
traceback for an exception. Only the reference cycles alive at exit are left to the operating
system (CPython does not promise their finalizers at exit either: a command closes what it
opened, as ``Trainer.close`` does), where ``os._exit`` would skip all of the above.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import NoReturn


def exit_after(main: Callable[[], int | None]) -> NoReturn:
    """``sys.exit(main())``, with the heap frozen once ``main`` is done (returned or raised)."""
    try:
        status = main()
    finally:
        gc.freeze()
    sys.exit(status)
