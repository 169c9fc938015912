"""Megatron logits equal transformers' at TP1, TP2, PP2, TP2xPP2, through megatron's schedule;
a checkpoint written at TP2 reloads at TP1 and PP2 with identical logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints_convert.convert import hf_to_megatron, megatron_to_hf
from tests.distributed import launch
from tests.tiny import hf_logits, make_tiny_qwen2

pytestmark = pytest.mark.slow

TOL = 1e-4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _logits_worker(ckpt: str, tp: int, pp: int, tokens: torch.Tensor, out: str,
                   save_to: str | None = None) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.forward import forward_logits
    from megatron_oar.models.model_checkpoint import load_model, save_model
    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=tp, pp=pp))
    model = build_gpt_model(read_hf_config(Path(ckpt) / "hf"), ModelOptions())
    meta = load_model(model, ckpt)
    logits = forward_logits(model, tokens, micro_batch_size=1, vocab_size=meta.vocab_size)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
        torch.save(logits, out)
    if save_to is not None:
        meta.written_tp, meta.written_pp = tp, pp
        save_model(model, save_to, meta, hf_files_from=Path(ckpt) / "hf")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("tied" if request.param else "untied")
    # vocab 1000 is not a multiple of 128: exercises padding (1024) and trimming.
    hf = make_tiny_qwen2(root / "hf", tied=request.param, seed=3)
    ckpt = root / "ckpt"
    hf_to_megatron(hf, ckpt, progress=False)
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    return root, hf, ckpt, tokens, hf_logits(hf, tokens)


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_logits_match_transformers(converted, tp, pp):
    root, _, ckpt, tokens, ref = converted
    out = root / f"logits_tp{tp}pp{pp}.pt"
    launch(_logits_worker, tp * pp, str(ckpt), tp, pp, tokens, str(out))
    got = torch.load(out)
    diff = (got - ref).abs().max().item()
    print(f"tp={tp} pp={pp} max|dlogit|={diff:.3e}")
    assert got.shape == ref.shape
    assert diff <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_checkpoint_written_at_tp2_reloads_at_tp1_and_pp2(converted):
    root, hf, ckpt, tokens, ref = converted
    tp2_ckpt = root / "ckpt_tp2"
    launch(_logits_worker, 2, str(ckpt), 2, 1, tokens, str(root / "w_tp2.pt"), str(tp2_ckpt))
    for tp, pp in [(1, 1), (1, 2)]:
        a, b = root / f"orig_{tp}{pp}.pt", root / f"re_{tp}{pp}.pt"
        launch(_logits_worker, tp * pp, str(ckpt), tp, pp, tokens, str(a))
        launch(_logits_worker, tp * pp, str(tp2_ckpt), tp, pp, tokens, str(b))
        assert torch.equal(torch.load(a), torch.load(b)), f"tp={tp} pp={pp}"
    # And the TP2-written checkpoint exports back to the original HF weights, bit for bit.
    from safetensors.torch import load_file

    back = megatron_to_hf(tp2_ckpt, root / "hf_from_tp2", progress=False)
    src, dst = load_file(str(hf / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert src.keys() == dst.keys()
    assert all(torch.equal(src[k], dst[k]) for k in src)
