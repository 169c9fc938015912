"""CUDA attribution: OAR-G and OAR-P on GPU (fp32, TP1) against the transformers reference.

The same comparison as tests/test_attribution.py, on one GPU; skipped without CUDA. Record runs
in docs/gpu-validation.md.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints_convert.convert import hf_to_megatron
from megatron_oar.attribution import locate_probes
from megatron_oar.attribution.spans import SpanFinder
from megatron_oar.models.tiny import make_tiny_qwen2
from tests import attribution_reference as ref
from tests.test_attribution import CASES, SEQ_ADV, make_batch, rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_oar.attribution import compute_importance
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime

    root = tmp_path_factory.mktemp("gpu_attr")
    hf = make_tiny_qwen2(root / "hf", seed=5, initializer_range=0.3)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    tok = AutoTokenizer.from_pretrained(str(hf))
    batch = make_batch(tok)
    init_runtime(ParallelConfig())
    try:
        model = build_gpt_model(read_hf_config(root / "ckpt" / "hf"), ModelOptions(spec="local"))
        model.cuda()
        meta = load_model(model, root / "ckpt")
        gpu_batch = type(batch)(batch.tokens.cuda(), batch.prompt_lens.cuda(), batch.lengths.cuda(),
                                batch.sample_ids)
        got = {name: compute_importance(model, gpu_batch, cfg, vocab_size=meta.vocab_size,
                                        seq_adv=SEQ_ADV.cuda(), step=3, tokenizer=tok).importance.cpu()
               for name, cfg in CASES.items()}
    finally:
        destroy_runtime()
    hf_model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    want = {}
    for name, cfg in CASES.items():
        sites = locate_probes(batch, cfg.probe, 3, SpanFinder(tok, cfg.probe.answer_pattern))
        rows = [i for i in range(batch.size) if sites.kinds[i] != "none" and SEQ_ADV[i] != 0]
        want[name] = (ref.oar_g(hf_model, batch, sites, rows, cfg.sigma, cfg.seed, 3, noise_device="cuda")
                      if cfg.method == "oar_g"
                      else ref.oar_p(hf_model, batch, sites, rows, tok.pad_token_id, cfg.probe.joint_importance))
    return got, want


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_importance_matches_reference(results, name):
    got, want = results
    err = rel_error(got[name], want[name])
    print(f"{name}: rel err {err:.2e}")
    # TF32 and cuBLAS reductions differ from the CPU reference more than CPU fp32 does
    assert err <= 1e-3
