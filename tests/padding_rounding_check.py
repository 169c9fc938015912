"""Is the padded run's gradient difference at TP2 summation order? A measurement, not a test.

Runs one training step's update (tests/test_padding.py's ``_passes``: same checkpoint, batch and
step) at TP2 on gloo, unpadded and padded to 16, with one and two OpenMP threads per rank, and
unpadded with micro-batches of 1 row and one of all 5 rows, and prints each pair's largest gradient difference
as a fraction of the tensor's largest gradient (the measure of ``assert_same_update``). If the
padded-vs-unpadded difference at one thread is of the size of the differences between two
unpadded runs that only sum in another order (threads, micro-batch split), it is rounding.

    python -m tests.padding_rounding_check      # about 1 min on 2 cores
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path


def _worker(ckpt: str, attention: str, out: str) -> None:
    import torch

    from megatron_oar.models.padding import force_multiple
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from tests.distributed import save_gathered
    from tests.test_padding import _passes

    init_runtime(ParallelConfig(tp=2, pp=1))
    results = {}
    for threads, multiple, micro in ((1, 1, 1), (1, 16, 1), (2, 1, 1), (2, 16, 1), (1, 1, 5), (2, 1, 5)):
        torch.set_num_threads(threads)
        with force_multiple(multiple):
            run = _passes(ckpt, update=True, micro_batch_size=micro, attention=attention)
        assert torch.get_num_threads() == threads
        results[(threads, multiple, micro)] = {k: run[k] for k in ("loss", "grads")}
    save_gathered(results, out)


def _grad_diff(a: dict, b: dict) -> float:
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(a["grads"], b["grads"])
               if w.abs().max() > 0)


def main() -> None:
    from checkpoints_convert.convert import hf_to_megatron
    from tests.distributed import launch_and_load
    from tests.tiny import make_tiny_qwen2

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf = make_tiny_qwen2(root / "hf", seed=5, initializer_range=0.3)  # conftest's scaled_checkpoint
        hf_to_megatron(hf, root / "ckpt", progress=False)
        runs = {attention: launch_and_load(_worker, 2, root / f"{attention}.pt", str(root / "ckpt"), attention)
                for attention in ("sdpa", "unfused")}
    names = {(1, 1, 1): "unpadded, 1 thread", (1, 16, 1): "padded, 1 thread",
             (2, 1, 1): "unpadded, 2 threads", (2, 16, 1): "padded, 2 threads",
             (1, 1, 5): "unpadded, 1 thread, one 5-row micro-batch",
             (2, 1, 5): "unpadded, 2 threads, one 5-row micro-batch"}
    print("| run A | run B | SDPA attention (rank 0, rank 1) | unfused attention (rank 0, rank 1) |")
    print("|---|---|---|---|")
    for a, b in itertools.combinations(names, 2):
        diffs = [", ".join(f"{_grad_diff(r[a], r[b]):.1e}" for r in ranks) for ranks in runs.values()]
        print(f"| {names[a]} | {names[b]} | {' | '.join(diffs)} |")


if __name__ == "__main__":
    main()
