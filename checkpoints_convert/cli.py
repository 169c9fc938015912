"""``oar-convert``: Qwen2/Qwen2.5, Qwen3 and Qwen3-MoE checkpoints between Hugging Face and
megatron-core.

    oar-convert hf-to-megatron --hf DIR --out DIR [--tp N --pp M --ep E --etp T] [--dtype bf16|fp32]
    oar-convert megatron-to-hf --ckpt DIR --out DIR [--max-shard-size 2GB]
    oar-convert verify --hf DIR --ckpt DIR [--tp N --pp M --ep E --etp T] [--tol 1e-4]
"""

from __future__ import annotations

import argparse
import logging
import re
import resource
import sys
import time
from pathlib import Path

from checkpoints_convert.verify import DEFAULT_PROMPT


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: expected e.g. 500MB or 2GB")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def hf_to_megatron_command(hf: str | Path, out: str | Path, dtype: str) -> list[str]:
    """``oar-convert hf-to-megatron`` as a command for a process of its own (a one-process megatron
    world: not inside a torchrun rank): how the trainer and ``oar repro`` convert an HF start."""
    return [sys.executable, "-m", "checkpoints_convert.cli", "hf-to-megatron", "--hf", str(hf),
            "--out", str(out), "--dtype", dtype, "--no-progress"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oar-convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    h = sub.add_parser("hf-to-megatron", help="HF safetensors -> megatron torch_dist checkpoint")
    h.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    h.add_argument("--out", required=True, help="new checkpoint directory (must not exist)")
    h.add_argument("--tp", type=int, default=1, help="intended TP (validated; loads at any TP)")
    h.add_argument("--pp", type=int, default=1, help="intended PP (validated; loads at any PP)")
    h.add_argument("--ep", type=int, default=1,
                   help="intended expert parallelism, MoE models (validated; loads at any EP)")
    h.add_argument("--etp", type=int, default=None,
                   help="intended expert tensor parallelism, MoE models (default: --tp)")
    h.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="parameter dtype (default: the HF config's torch_dtype)")
    h.add_argument("--vocab-multiple", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (default 128)")

    m = sub.add_parser("megatron-to-hf", help="megatron checkpoint -> HF safetensors")
    m.add_argument("--ckpt", required=True, help="checkpoint directory written by oar")
    m.add_argument("--out", required=True, help="new HF model directory (must not exist)")
    m.add_argument("--max-shard-size", type=_size, default=_size("2GB"),
                   help="safetensors shard size (default 2GB)")

    v = sub.add_parser("verify", help="compare logits of the HF model and the checkpoint")
    v.add_argument("--hf", required=True)
    v.add_argument("--ckpt", required=True)
    v.add_argument("--tp", type=int, default=1)
    v.add_argument("--pp", type=int, default=1)
    v.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE models)")
    v.add_argument("--etp", type=int, default=None, help="expert tensor parallelism (default: --tp)")
    v.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default="fp32",
                   help="compute dtype for both models (default fp32)")
    v.add_argument("--tol", type=float, default=1e-4, help="max abs logit difference allowed")
    v.add_argument("--prompt", default=DEFAULT_PROMPT)
    v.add_argument("--wait-minutes", type=float, default=180.0,
                   help="how long the other ranks wait for the reporting rank's HF reference (default 180)")
    v.add_argument("--result-file", default=None, help=argparse.SUPPRESS)

    for sp in (h, m):
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_oar.log_setup import quiet_backend_notices

    quiet_backend_notices()  # megatron-core's TE/Apex fallbacks, DCP's single-process notice
    from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

    from checkpoints_convert.convert import ConversionError
    from checkpoints_convert.hf_io import HFCheckpointError
    from megatron_oar.models import ModelConfigError
    from megatron_oar.models.model_checkpoint import CheckpointError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    start = time.perf_counter()
    try:
        if args.command == "hf-to-megatron":
            from checkpoints_convert.convert import hf_to_megatron

            meta = hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                                  etp=args.etp, dtype=args.dtype,
                                  vocab_multiple=args.vocab_multiple,
                                  progress=not args.no_progress)
            print(f"wrote {args.out} (dtype {meta.dtype}, vocab {meta.vocab_size} padded to "
                  f"{meta.padded_vocab_size}; loads at any TP/PP/EP)")
        elif args.command == "megatron-to-hf":
            from checkpoints_convert.convert import megatron_to_hf

            megatron_to_hf(args.ckpt, args.out, max_shard_bytes=args.max_shard_size,
                           progress=not args.no_progress)
            print(f"wrote {args.out}")
        else:
            from checkpoints_convert.verify import verify_cli

            return verify_cli(args)
    except (ConversionError, HFCheckpointError, CheckpointError, ModelConfigError) as e:
        print(f"oar-convert: error: {e}", file=sys.stderr)
        return 2
    except DCPCheckpointException as e:  # a BaseException: raised by DCP for write failures
        print(f"oar-convert: error: writing the checkpoint failed: {e}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"done in {time.perf_counter() - start:.1f}s, peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
