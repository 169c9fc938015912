"""OAR through the router: OAR-G and OAR-P on a tiny Qwen3-MoE equal the transformers reference.

OAR-G's input gradient flows through each MoE layer's gating (the routing probabilities of the
chosen experts) as well as the experts; OAR-P's masked copies route on their own (a masked token
changes which experts later tokens get: that is the counterfactual). The model is built with
``model.routing_replay=training``, and a recording pass and a pass replaying another routing run
first, so the test also shows that attribution does not replay unless asked (``training/routing_replay.py``
clears megatron's replay action and targets after every pass).

R3 (``model.routing_replay=rollout``): the teacher comes from the old-logprob pass replaying
"vLLM's" routing (here every recorded expert moved one on); the attribution passes, routed as the
trainer routes them (``training.routing_replay.attribution_route``), replay it too, so OAR-G with
vanishing noise and OAR-P copies that mask nothing (mask token = the token there) score ~0; the
same passes routing on their own score up to 0.039 (OAR-G) and 2.75 (OAR-P).

Tiny random Qwen3-MoE (2 layers, both MoE, 4 experts, top-2, ``norm_topk_prob``; weights std
0.3 as in tests/test_attribution.py, routers std 0.2), HF weights loaded into each rank's shard
(``tests/test_qwen3_moe._load_hf``). Slow: one pooled world of 2 gloo ranks runs EP1 (as DP2),
EP2 and CP2, both ranks scoring the same batch (megatron's allgather dispatcher gathers over the EP
ranks, which then hold equal shapes); measured 6 s on the shared 2 cores at load 4 (14 s at
load 8) in a warm world, plus the transformers reference (about 1 s); the R3 test 23 s at load 20
(four old-logprob passes and eight attribution runs over EP1 and EP2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import launch, save_gathered
from tests.tiny import make_tiny_qwen3_moe

ATTR_CASES = ("oar_g_answer_mean", "oar_p_answer_mean")
# (ep, cp) in the world of 2: EP1 (as DP2), EP2, and context parallelism CP2 (each rank runs two of
# the four chunks of every row; the routing recorded and replayed per CP rank's own tokens)
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def _worker(hf_dir: str, layouts: list[tuple[int, int]], out: str) -> None:
    from transformers import AutoTokenizer

    from megatron_oar.attribution import compute_importance
    from megatron_oar.models import ModelOptions, build_gpt_model, parse_arch
    from megatron_oar.models.forward import forward_logits
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.training.routing_replay import RoutingPass
    from tests.test_attribution import CASES, SEQ_ADV, make_batch
    from tests.test_qwen3_moe import _load_hf
    from tests.tiny import read_config

    tok = AutoTokenizer.from_pretrained(hf_dir)
    batch = make_batch(tok)
    arch = parse_arch(read_config(Path(hf_dir)))
    results = {}
    for ep, cp in layouts:
        init_runtime(ParallelConfig(ep=ep, cp=cp))
        model = build_gpt_model(arch, ModelOptions(spec="local", routing_replay="training"))
        _load_hf(model, arch, hf_dir, "local")
        # a recording pass first (as the trainer's old-logprob pass): attribution must not replay it
        rows = [[i] for i in range(batch.size)]
        with RoutingPass(model, rows, batch.lengths.tolist(), batch.tokens.shape[1], record=True) as rec:
            before = forward_logits(model, batch.tokens, micro_batch_size=1, vocab_size=arch.vocab_size)
        assert (rec.routed[0, :int(batch.lengths[0])] >= 0).all()
        # and a pass replaying another routing (every expert one on), which must take effect
        shifted = torch.where(rec.routed >= 0, (rec.routed + 1) % arch.num_experts, rec.routed)
        with RoutingPass(model, rows, batch.lengths.tolist(), batch.tokens.shape[1], replay=shifted):
            replayed = forward_logits(model, batch.tokens, micro_batch_size=1, vocab_size=arch.vocab_size)
        assert replayed is None or not torch.allclose(replayed, before, atol=1e-3)
        for p in model.parameters():  # a stale gradient from "training" that must survive
            p.grad = torch.full_like(p, 0.5)
        model.train()
        res = {}
        for name in ATTR_CASES:
            attr = compute_importance(model, batch, CASES[name], vocab_size=arch.vocab_size, seq_adv=SEQ_ADV,
                                      step=3, tokenizer=tok)
            res[name] = attr.importance
        after = forward_logits(model, batch.tokens, micro_batch_size=1, vocab_size=arch.vocab_size)
        res["grads_untouched"] = all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
        res["outputs_unchanged"] = before is None or torch.equal(before, after)
        results[f"ep{ep} cp{cp}"] = res
    save_gathered(results, out)


@pytest.fixture(scope="module")
def moe_attribution(tmp_path_factory):
    from tests.test_attribution import reference_importance

    root = tmp_path_factory.mktemp("qwen3_moe_oar")
    hf = make_tiny_qwen3_moe(root / "hf", seed=5, initializer_range=0.3)
    return root, hf, reference_importance(hf, ATTR_CASES)


@pytest.mark.slow
def test_oar_through_the_router_matches_reference(moe_attribution):
    from tests.test_attribution import REL_TOL, rel_error

    root, hf, refs = moe_attribution
    out = root / "attr.pt"
    launch(_worker, 2, str(hf), LAYOUTS, str(out))
    ranks = torch.load(out, weights_only=False)
    for rank, results in enumerate(ranks):
        for ep, res in results.items():
            assert res["grads_untouched"] and res["outputs_unchanged"], (ep, rank)
            for name, want in refs.items():
                assert want.abs().max() > 0, name
                err = rel_error(res[name], want)
                print(f"qwen3-moe ep={ep} rank={rank} {name}: rel err {err:.2e}")
                assert err <= REL_TOL, f"{name} at ep={ep} rank {rank}: {err:.2e}"


# ---------------------------------------------------------------------------------------------
# R3 (model.routing_replay=rollout): the students route as the teacher did

SIGMA_ZERO = 1e-30  # OAR-G's noise std: the noise vanishes in fp32 next to the embeddings


def _r3_worker(hf_dir: str, layouts: list[tuple[int, int]], out: str) -> None:
    """Per EP size: the teacher from the old-logprob pass replaying "vLLM's" routing (every
    recorded expert moved one on, so it differs from the model's own), then OAR-G with vanishing
    noise and OAR-P copies whose mask token is the token already there (nothing masked), routed as
    the trainer routes attribution (``attribution_route``) and, to show the test can fail, with
    the students routing on their own."""
    from transformers import AutoTokenizer

    from megatron_oar.attribution import AttributionConfig, compute_importance, locate_probes
    from megatron_oar.attribution.spans import SpanFinder
    from megatron_oar.models import ModelOptions, build_gpt_model, parse_arch
    from megatron_oar.models.forward import forward_logits
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy_passes import old_logprob_pass
    from megatron_oar.training.routing_replay import RoutingLog, RoutingPass, attribution_route
    from tests.test_attribution import SEQ_ADV, make_batch
    from tests.test_qwen3_moe import _load_hf
    from tests.tiny import read_config

    tok = AutoTokenizer.from_pretrained(hf_dir)
    seqs = make_batch(tok)
    arch = parse_arch(read_config(Path(hf_dir)))
    vocab = arch.vocab_size
    g_cfg = AttributionConfig(method="oar_g", sigma=SIGMA_ZERO, micro_batch_size=2)
    sites = locate_probes(seqs, g_cfg.probe, 3, SpanFinder(tok, g_cfg.probe.answer_pattern))
    scored = sites.score_mask & (SEQ_ADV != 0)[:, None]
    # OAR-P's mask token: the commonest scored token, so its copies change nothing
    same = int(torch.mode(seqs.tokens[scored]).values)
    unmasked = scored & (seqs.tokens == same)
    p_cfg = AttributionConfig(method="oar_p", pad_id=same, perturb_micro_batch_size=8, length_bucket=8)
    results = {"unmasked_positions": int(unmasked.sum())}
    for ep, cp in layouts:
        init_runtime(ParallelConfig(ep=ep, cp=cp))
        model = build_gpt_model(arch, ModelOptions(spec="local", routing_replay="rollout"))
        _load_hf(model, arch, hf_dir, "local")
        batch = TrainBatch(seqs.tokens, seqs.prompt_lens, seqs.lengths, seqs.sample_ids,
                           loss_mask=seqs.response_mask(), rollout_logprobs=torch.zeros(seqs.tokens.shape),
                           seq_adv=SEQ_ADV)
        rows = [[i] for i in range(batch.size)]
        with RoutingPass(model, rows, batch.lengths.tolist(), batch.tokens.shape[1], record=True) as rec:
            forward_logits(model, batch.tokens, micro_batch_size=1, vocab_size=vocab)
        batch.routed_experts = torch.where(rec.routed >= 0, (rec.routed + 1) % arch.num_experts, rec.routed)
        routing = RoutingLog("rollout")
        own, _, _ = old_logprob_pass(model, batch, vocab, 1, batching="padded")
        replayed, _, teacher = old_logprob_pass(model, batch, vocab, 1, sites=sites, batching="padded",
                                                routing=routing)
        res = {"logprob_gap": float(((own - replayed) * batch.loss_mask).abs().max())}
        for arm, route in (("replayed", attribution_route(model, batch, routing)), ("own", None)):
            for name, cfg, where in (("oar_g", g_cfg, scored), ("oar_p", p_cfg, unmasked)):
                attr = compute_importance(model, batch, cfg, vocab_size=vocab, seq_adv=SEQ_ADV, step=3,
                                          tokenizer=tok, sites=sites, teacher=teacher, external_teacher=True,
                                          teacher_fp8=False, route=route)
                res[f"{name}_{arm}"] = float(attr.importance[where].abs().max())
        results[f"ep{ep} cp{cp}"] = res
    save_gathered(results, out)


@pytest.mark.slow
def test_r3_attribution_routes_as_its_teacher(moe_attribution):
    """``model.routing_replay=rollout``: the trainer's teacher comes from the old-logprob pass,
    which replays vLLM's routing, so OAR-G with no noise and OAR-P with nothing masked must give
    zero importance: the attribution passes replay the same routing. Routing on their own, the
    students differ from the teacher without any perturbation."""
    root, hf, _ = moe_attribution
    out = root / "r3.pt"
    launch(_r3_worker, 2, str(hf), LAYOUTS, str(out))
    for rank, results in enumerate(torch.load(out, weights_only=False)):
        assert results.pop("unmasked_positions") >= 3
        for ep, res in results.items():
            print(f"R3 ep={ep} rank={rank}: {res}")
            assert res["logprob_gap"] > 1e-2, res  # vLLM's routing is not the model's own
            for name in ("oar_g", "oar_p"):
                assert res[f"{name}_own"] > 1e-3, (name, ep, rank, res)  # the defect, shown
                assert res[f"{name}_replayed"] < 1e-5, (name, ep, rank, res)
