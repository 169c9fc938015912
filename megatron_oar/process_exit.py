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

One consequence is filtered out: nanobind (the bindings of ``triton._C.libtriton``, which
megatron-core imports) checks at the very end of the interpreter (its ``Py_AtExit`` handler,
``internals_cleanup`` in nanobind's ``src/nb_internals.cpp``) that every object it bound was
released, and prints "nanobind: leaked N instances! ... leaked type triton._C.libtriton.ir..." to
stderr for those still alive: with the heap frozen, triton's types and functions (reference cycles
through their modules) are, and ``oar plan --help`` ended with 27 such lines. Its switch
(``nanobind::set_leak_warnings``) is C++ only and triton does not expose it, so
:func:`exit_after` routes the process's stderr, from its last ``atexit`` handler on, through
``grep -v`` of exactly the lines of that report (:data:`NANOBIND_LEAK_REPORT`); every other line
still reaches stderr. Unfreezing instead costs the collections back: ``oar plan --help`` exits
0.3 s after ``main`` frozen, 2 to 5 s unfrozen on the 2 shared cores of the test machine.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
from collections.abc import Callable
from typing import NoReturn

# the lines of nanobind's leak report (``internals_cleanup``), and no others
NANOBIND_LEAK_REPORT = (r"^(nanobind: leaked [0-9]+ (instances|keep_alive records|types|functions)!"
                        r"|nanobind: this is likely caused by a reference counting issue"
                        r"| - leaked (instance|type|function) "
                        r"| - \.\.\. skipped remainder$"
                        r"|See https://nanobind\.readthedocs\.io/en/latest/refleaks\.html)")


def _filter_nanobind_leak_report() -> None:
    """Point file descriptor 2 at a ``grep -v`` that drops :data:`NANOBIND_LEAK_REPORT`'s lines and
    writes the rest to the stderr this process had. Registered first, so ``atexit`` runs it last;
    a system without ``grep`` keeps the report."""
    grep = shutil.which("grep")
    if grep is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    os.posix_spawn(grep, [grep, "-v", "-E", NANOBIND_LEAK_REPORT], os.environ, file_actions=[
        (os.POSIX_SPAWN_DUP2, read, 0), (os.POSIX_SPAWN_DUP2, 2, 1),
        (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)])
    os.close(read)
    os.dup2(write, 2)  # grep reads until this process, the pipe's last writer, has ended
    os.close(write)


def exit_after(main: Callable[[], int | None]) -> NoReturn:
    """``sys.exit(main())``, with the heap frozen once ``main`` is done (returned or raised) and
    nanobind's leak report filtered out of stderr."""
    atexit.register(_filter_nanobind_leak_report)
    try:
        status = main()
    finally:
        gc.freeze()
    sys.exit(status)
