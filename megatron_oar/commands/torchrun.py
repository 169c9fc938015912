"""torchrun for ``oar train --nproc-per-node N``: ``torch.distributed.run``, except that a worker
group in which a rank exited on a config error is never restarted.

    python -m megatron_oar.commands.torchrun [torchrun's arguments] -m megatron_oar.commands.train ...

``oar train`` validates the config against the world it is about to launch before it starts
torchrun (``megatron_oar/cli.py``), so a config error normally costs one line and exit status 2
with nothing started. A config error only a rank can see (a file that vanished, a config the rank
reads differently) still exits that rank with :data:`EXIT_CONFIG`; plain torchrun would then
restart the workers up to ``--max-restarts`` times (the same error each time) and end with its
~40-line ``ChildFailedError`` report. Here the elastic agent's restart budget is set to zero as
soon as a failed rank's exit status is :data:`EXIT_CONFIG`, and the launcher exits 2 after one line
(the ranks printed the error itself). Any other failure goes through torchrun unchanged (restarts,
report, exit status 1).

torchrun has no switch for this: its agent (``SimpleElasticAgent._invoke_run`` in
``torch/distributed/elastic/agent/server/api.py``, torch 2.13) restarts a failed group while
``_remaining_restarts > 0`` whatever the exit status, so :func:`no_restart_on_config_error` wraps
``LocalElasticAgent._monitor_workers``, which reports each failed rank's exit status, and
``SubprocessContext._close`` (in ``torch/distributed/elastic/multiprocessing/api.py``), whose
"closing signal" records for the other ranks it drops after a config error.
"""

from __future__ import annotations

import logging
import sys

EXIT_CONFIG = 2  # megatron_oar.commands.train's exit status for a ConfigError


def config_error_ranks(failures: dict) -> list[int]:
    """The global ranks of ``failures`` (rank -> ``ProcessFailure``) that exited on a config error."""
    return sorted(rank for rank, f in failures.items() if f.exitcode == EXIT_CONFIG)


class _ConfigErrorExit(logging.Filter):
    """Drops torchrun's "failed (exitcode: 2) local_rank: ..." record (the rank printed its config
    error and the launcher says it stopped on it) and, once a rank exited on a config error, its
    "Sending process ... closing signal SIGTERM" records for the ranks still running (a rank that
    was slower to read the config); every other exit status and shutdown is still logged."""

    seen = False  # a rank exited on a config error (set by no_restart_on_config_error's _close)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("failed (exitcode: %s)") and record.args and record.args[0] == EXIT_CONFIG:
            return False
        return not (_ConfigErrorExit.seen and msg.startswith("Sending process %s closing signal"))


def no_restart_on_config_error() -> None:
    """Makes torchrun's local agent give up, rather than restart the group, when a rank exited
    with :data:`EXIT_CONFIG`; idempotent."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    failures = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _ConfigErrorExit) for f in failures.filters):
        failures.addFilter(_ConfigErrorExit())

    monitor = LocalElasticAgent._monitor_workers
    if getattr(monitor, "_oar_config_errors", False):
        return

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and config_error_ranks(result.failures):
            self._remaining_restarts = 0
        return result

    _monitor_workers._oar_config_errors = True
    LocalElasticAgent._monitor_workers = _monitor_workers

    # the workers' context stops the ranks still running once one failed (``_close``, logging
    # "Sending process ... closing signal"): the failed rank has exited by then, so its status
    # says whether that was a config error
    close = SubprocessContext._close

    def _close(self, *args, **kwargs):
        if any(h.proc.poll() == EXIT_CONFIG for h in self.subprocess_handlers.values()):
            _ConfigErrorExit.seen = True
        return close(self, *args, **kwargs)

    SubprocessContext._close = _close


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import parse_args, run

    no_restart_on_config_error()

    @record  # torchrun's own error report, for every other failure
    def _run(args) -> None:
        try:
            run(args)
        except ChildFailedError as e:
            ranks = config_error_ranks(e.failures)
            if not ranks:
                raise
            print(f"oar train: stopped on the config error above (rank {', '.join(map(str, ranks))} "
                  f"exited {EXIT_CONFIG}); not restarted", file=sys.stderr)
            raise SystemExit(EXIT_CONFIG) from None

    _run(parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
