"""``oar-convert verify``: same prompt through transformers and the megatron checkpoint.

Runs megatron at the requested TP/PP (and for a MoE model EP / expert TP) through megatron's own
pipeline schedule (relaunching itself under torchrun when more than one rank is needed) and
reports the max absolute logit difference and the top-1 agreement against
``transformers.AutoModelForCausalLM``. A MoE model at TP > 1 runs with sequence parallelism
(megatron's MoE layer requires it).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DEFAULT_PROMPT = "Question: what is 12 + 30? Think step by step. <answer>42</answer>"


@dataclass
class VerifyResult:
    tp: int
    pp: int
    ep: int
    dtype: str
    tokens: int
    max_abs_diff: float
    top1_agreement: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tol

    def line(self) -> str:
        verdict = "OK" if self.ok else "FAIL"
        return (f"verify tp={self.tp} pp={self.pp} ep={self.ep} dtype={self.dtype} tokens={self.tokens}: "
                f"max|dlogit|={self.max_abs_diff:.3e} top1={self.top1_agreement:.4f} "
                f"(tol {self.tol:g}) {verdict}")


def _tokens(hf_dir: Path, prompt: str, vocab_size: int) -> torch.Tensor:
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(hf_dir))(prompt)["input_ids"]
    except (OSError, ValueError):  # no tokenizer files: a fixed pseudo-random prompt
        ids = torch.randint(0, vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    return torch.tensor([ids], dtype=torch.long)


def model_device(model) -> torch.device:
    """Where ``model``'s parameters are (every TP/PP shard has some)."""
    return next(model.parameters()).device


def world_size(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """The ranks ``verify`` runs on: the smallest world both the TP*PP layout and the experts'
    ETP*EP*PP layout divide (megatron's rule; the rest is data parallel)."""
    return math.lcm(tp * pp, (tp if etp is None else etp) * ep * pp)


def verify(hf_dir: str | Path, ckpt: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
           etp: int | None = None, dtype: str = "fp32", tol: float = 1e-4,
           prompt: str = DEFAULT_PROMPT, result_file: str | None = None,
           wait_minutes: float = 180.0) -> VerifyResult | None:
    """Collective over the :func:`world_size` ranks; returns the result on the reporting rank.
    ``wait_minutes``: how long the other ranks wait for it to build and run the HF reference."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from checkpoints_convert.convert import ConversionError
    from megatron_oar.models import DTYPES, ModelOptions, build_gpt_model, parse_arch, read_hf_config
    from megatron_oar.models.forward import forward_logits
    from megatron_oar.models.model_checkpoint import HF_DIR, load_model
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.runtime.distributed import on_one_rank

    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    hf_dir, ckpt = Path(hf_dir), Path(ckpt)
    config_path = ckpt / HF_DIR / "config.json"
    arch = parse_arch(read_hf_config(config_path), source=str(config_path))
    from checkpoints_convert.convert import check_convert_layout

    check_convert_layout(arch, tp, pp, 128, ep, etp)
    init_runtime(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp))
    model = build_gpt_model(arch, ModelOptions(dtype=dtype, sequence_parallel=arch.is_moe and tp > 1))
    meta = load_model(model, ckpt)
    tokens = _tokens(hf_dir, prompt, meta.vocab_size)  # on CPU, for the transformers reference
    # megatron's shard lives on this rank's GPU when there is one: its inputs go there, and the
    # comparison happens on CPU, where the reference runs.
    got = forward_logits(model, tokens.to(model_device(model)), vocab_size=meta.vocab_size)
    reporter = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0)

    def report() -> VerifyResult:
        ref_model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=DTYPES[dtype]).eval()
        with torch.no_grad():
            ref = ref_model(tokens).logits.float()
        mine = got.float().cpu()
        result = VerifyResult(tp=tp, pp=pp, ep=ep, dtype=dtype, tokens=tokens.numel(),
                              max_abs_diff=(mine - ref).abs().max().item(),
                              top1_agreement=(mine.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                              tol=tol)
        print(result.line(), flush=True)
        if result_file:
            Path(result_file).write_text(json.dumps(asdict(result)))
        return result

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return report()
    # the reporting rank loads and runs the HF reference (minutes for a large model) while the
    # others wait on a gloo group sized for it, not in a barrier of the default group (NCCL's
    # collective timeout would end them)
    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, reporter)
    return on_one_rank(report, src=flags.index(True), timeout_minutes=wait_minutes,
                       setting="oar-convert verify --wait-minutes", what="the HF reference")


def verify_cli(args) -> int:
    """Entry from the CLI: relaunches under torchrun when more than one rank is needed
    (:func:`world_size`) and not already launched."""
    from checkpoints_convert.convert import ConversionError

    for flag, value in (("--tp", args.tp), ("--pp", args.pp), ("--ep", args.ep), ("--etp", args.etp)):
        if value is not None and value < 1:
            raise ConversionError(f"{flag}={value} must be a positive integer")
    if not args.wait_minutes > 0:
        raise ConversionError(f"--wait-minutes={args.wait_minutes} must be > 0")
    world = world_size(args.tp, args.pp, args.ep, args.etp)
    if world > 1 and "WORLD_SIZE" not in os.environ:
        result_file = Path(args.ckpt).resolve().parent / f".verify-{os.getpid()}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}", "-m", "checkpoints_convert.cli", "verify",
               "--hf", str(args.hf), "--ckpt", str(args.ckpt), "--tp", str(args.tp),
               "--pp", str(args.pp), "--ep", str(args.ep),
               *(["--etp", str(args.etp)] if args.etp is not None else []),
               "--dtype", args.dtype, "--tol", str(args.tol),
               "--prompt", args.prompt, "--wait-minutes", str(args.wait_minutes),
               "--result-file", str(result_file)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        rc = subprocess.call(cmd, env=env)
        try:
            result = json.loads(result_file.read_text()) if result_file.exists() else None
        finally:
            result_file.unlink(missing_ok=True)
        if rc != 0 or result is None:
            return rc or 1
        return 0 if result["max_abs_diff"] <= result["tol"] else 1
    from megatron_oar.runtime import destroy_runtime

    try:
        result = verify(args.hf, args.ckpt, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                        dtype=args.dtype, tol=args.tol,
                        prompt=args.prompt, result_file=args.result_file, wait_minutes=args.wait_minutes)
    finally:
        destroy_runtime()
    return 0 if result is None or result.ok else 1
