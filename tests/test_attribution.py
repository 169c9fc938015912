"""Attribution inside Megatron's schedule equals a plain transformers reference at every layout.

OAR-G and OAR-P importance at TP1, TP2, PP2 and TP2xPP2 against single-process autograd /
brute force (tests/attribution_reference.py) on tiny random Qwen2 models, tied and untied;
batched OAR-P equals serial; micro-batch sizes, token budgets and the padded path do not change
scores; parameter gradients and model outputs are untouched by attribution; OAR-G under full and
selective activation recompute (models/recompute.py) equals it without, and really reruns the
layers (or core attentions) in its backward.

Cost (2 cores): 8 jobs of the warm world pool (one per layout and model, 1 to 4 ranks) and the
reference once per model in the pytest process: 110-140 s of wall time on a busy machine, about
125 s of CPU. One job per layout running both models was tried: the same CPU time (the pool's
per-job cost is well under a second; each job's first use of a rank's imports is most of it).
OAR-G under full and selective recompute (the untied model at TP1, TP2 and PP2) adds two model
builds and four OAR-G runs to each of those jobs: 17-32 s for one job at TP1 in one process at
a load average of 23-60 on the 2 shared cores (measured on 2026-11-28; idle, a fraction of that).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints_convert.convert import hf_to_megatron
from megatron_oar.attribution import AttributionConfig, ProbeConfig, SequenceBatch, locate_probes
from megatron_oar.attribution.spans import SpanFinder
from tests import attribution_reference as ref
from tests.distributed import launch, save_gathered
from tests.tiny import make_tiny_qwen2
from tests.tolerances import tiny_grad_tol

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
REL_TOL = 1e-4
# two of our own passes that differ only in order (a reused teacher, serial vs batched, another
# micro-batch size): scores through the tiny model's backward chain (tests/tolerances.py)
ROUNDING_TOL = tiny_grad_tol()
SEQ_ADV = torch.tensor([1.0, -0.5, 0.0, 2.0, 1.5])

# (prompt, response): answers, a long reasoning, a zero-advantage row, and no answer at all
TEXTS = [
    ("12 + 3 = ", "12 + 3 is 15. <answer>15</answer>"),
    ("7 + 5 = ", "7 + 5 = 12 so <answer>12</answer><|endoftext|>"),
    ("4 + 4 = ", "8. <answer>8</answer>"),
    ("30 + 6 = ", "30 + 6 = 36. 36 - 6 = 30."),
    ("21 + 2 = ", "21 + 2 = 23. <answer>23</answer> 23"),
]


def make_batch(tokenizer) -> SequenceBatch:
    rows = [(tokenizer.encode(p), tokenizer.encode(r)) for p, r in TEXTS]
    length = max(len(p) + len(r) for p, r in rows)
    tokens = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        tokens[i, :len(p) + len(r)] = torch.tensor(p + r)
    return SequenceBatch(tokens, torch.tensor([len(p) for p, _ in rows]),
                         torch.tensor([len(p) + len(r) for p, r in rows]),
                         sample_ids=torch.tensor([11, 12, 13, 14, 15]))


# OAR-G uses sigma = 1e-2 here: the fp32 rounding floor of q - p0 (the gradient of the KL) grows
# like eps / sigma, and at the default 1e-3 two correct fp32 implementations differ by up to ~7e-4
# relative (measured); at 1e-2 the floor is ~1e-5, so 1e-4 tests the implementation, not rounding.
SIGMA = 1e-2
CASES = {
    "oar_g_answer_mean": AttributionConfig(method="oar_g", micro_batch_size=2, sigma=SIGMA),
    "oar_g_last_token": AttributionConfig(method="oar_g", sigma=SIGMA, probe=ProbeConfig(kind="last_token")),
    "oar_g_answer_joint": AttributionConfig(method="oar_g", sigma=SIGMA, probe=ProbeConfig(kind="answer_joint")),
    "oar_g_mbs1": AttributionConfig(method="oar_g", sigma=SIGMA, micro_batch_size=1),
    "oar_p_answer_mean": AttributionConfig(method="oar_p", perturb_micro_batch_size=8, length_bucket=8),
    "oar_p_answer_joint": AttributionConfig(method="oar_p", probe=ProbeConfig(kind="answer_joint",
                                                                              joint_importance="abs")),
    "oar_p_serial": AttributionConfig(method="oar_p", serial=True),
    "oar_p_mbs3": AttributionConfig(method="oar_p", perturb_micro_batch_size=3, length_bucket=64),
    # the default batching is token_budget; the padded path, and budgets small enough that the
    # micro-batches differ in rows and length (scored rows of 26-29 tokens; PP exchanges shapes)
    "oar_g_padded": AttributionConfig(method="oar_g", sigma=SIGMA, micro_batch_size=2, batching="padded"),
    "oar_g_budget90": AttributionConfig(method="oar_g", sigma=SIGMA, max_tokens_per_micro_batch=90),
    "oar_p_padded": AttributionConfig(method="oar_p", perturb_micro_batch_size=8, length_bucket=8,
                                      batching="padded"),
    "oar_p_budget100": AttributionConfig(method="oar_p", max_tokens_per_copy_micro_batch=100),
}


# OAR-G under model.recompute (models/recompute.py): the padded path and a token budget whose
# micro-batches differ in rows and length
RECOMPUTE_CASES = ("oar_g_budget90", "oar_g_padded")


def _count_backward_calls(model) -> dict:
    """Forward calls of the model's transformer layers and of their core attention made inside a
    backward (a recompute), counted from now on (``counts["layer"]``, ``counts["core_attn"]``)."""
    counts = {"layer": 0, "core_attn": 0}

    def hook(key):
        def count(*_):
            if torch._C._current_graph_task_id() != -1:  # inside autograd's backward
                counts[key] += 1
        return count

    for layer in model.decoder.layers:
        layer.register_forward_hook(hook("layer"))
        layer.self_attention.core_attention.register_forward_hook(hook("core_attn"))
    return counts


def _recompute_results(ckpt: str, batch, tok) -> dict:
    """``RECOMPUTE_CASES``' importance of the model built with full and with selective recompute
    (``model.recompute``), the layer and core-attention calls each reran in its backwards, and
    whether each left every module in train mode as it found it."""
    from megatron_oar.attribution import compute_importance
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model

    out = {}
    for recompute in ("full", "selective"):
        model = build_gpt_model(read_hf_config(Path(ckpt) / "hf"), ModelOptions(recompute=recompute))
        meta = load_model(model, ckpt)
        model.train()
        counts = _count_backward_calls(model)
        out[recompute] = {name: compute_importance(model, batch, CASES[name], vocab_size=meta.vocab_size,
                                                   seq_adv=SEQ_ADV, step=3, tokenizer=tok).importance
                          for name in RECOMPUTE_CASES}
        out[recompute]["calls"] = dict(counts)
        out[recompute]["modes_restored"] = all(m.training for m in model.modules())
    return out


def _worker(ckpt: str, tp: int, pp: int, out: str, names: tuple[str, ...] | None = None,
            recompute: bool = False) -> None:
    """The ``CASES`` ``names`` (all by default) at TP x PP, with the checks of the test below;
    ``recompute``: also :func:`_recompute_results`."""
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from megatron_oar.attribution import ProbeOutput, compute_importance
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.forward import forward_logits
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=tp, pp=pp))
    model = build_gpt_model(read_hf_config(Path(ckpt) / "hf"), ModelOptions())
    meta = load_model(model, ckpt)
    tok = AutoTokenizer.from_pretrained(str(Path(ckpt) / "hf"))
    batch = make_batch(tok)
    for p in model.parameters():  # a stale gradient from "training" that must survive
        p.grad = torch.full_like(p, 0.5)
    before = forward_logits(model, batch.tokens, vocab_size=meta.vocab_size)
    model.train()
    rerun = _count_backward_calls(model)  # without recompute no layer reruns in a backward
    results = {}
    for name in CASES if names is None else names:
        attr = compute_importance(model, batch, CASES[name], vocab_size=meta.vocab_size, seq_adv=SEQ_ADV,
                                  step=3, tokenizer=tok)
        results[name] = (attr.importance, attr.score_mask, attr.kinds, attr.stats)
    after = forward_logits(model, batch.tokens, vocab_size=meta.vocab_size)
    if tp == 1 and pp == 1:
        # the trainer's path: the teacher from an old-logprob forward's logits, no extra pass
        cfg = CASES["oar_g_answer_mean"]
        sites = locate_probes(batch, cfg.probe, 3, SpanFinder(tok, cfg.probe.answer_pattern))
        local = torch.nn.functional.pad(after, (0, meta.padded_vocab_size - meta.vocab_size))  # the TP1 slice
        teacher = ProbeOutput.from_position_logits(local[sites.row, sites.pos], sites, meta.vocab_size)
        reused = compute_importance(model, batch, cfg, vocab_size=meta.vocab_size, seq_adv=SEQ_ADV,
                                    step=3, sites=sites, teacher=teacher)
        results["teacher_reused"] = reused.importance
    results["grads_untouched"] = all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    results["requires_grad_restored"] = all(p.requires_grad for p in model.parameters())
    results["outputs_unchanged"] = before is None or torch.equal(before, after)
    if recompute:
        results["recompute"] = _recompute_results(ckpt, batch, tok)
        results["recompute"][None] = {**{name: results[name][0] for name in RECOMPUTE_CASES},
                                      "calls": dict(rerun), "modes_restored": True}
    save_gathered(results, out)
    del ps


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def setup(request, tmp_path_factory):

    root = tmp_path_factory.mktemp("attr_tied" if request.param else "attr_untied")
    # larger weights than HF's default init, so that masking a token moves the probe well above
    # fp32 rounding (with std 0.02 the KLs are ~1e-5 and HF-vs-Megatron rounding dominates)
    hf = make_tiny_qwen2(root / "hf", tied=request.param, seed=5, initializer_range=0.3)
    ckpt = root / "ckpt"
    hf_to_megatron(hf, ckpt, progress=False)
    return root, ckpt, reference_importance(hf, CASES)


def reference_importance(hf, names) -> dict:
    """The transformers reference's importance (``tests/attribution_reference.py``) of the
    ``CASES`` ``names`` on :func:`make_batch`, for the HF model at ``hf`` (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_oar.attribution import locate_probes
    from megatron_oar.attribution.spans import SpanFinder

    tok = AutoTokenizer.from_pretrained(str(hf))
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    batch = make_batch(tok)
    refs = {}
    for name in names:
        cfg = CASES[name]
        sites = locate_probes(batch, cfg.probe, 3, SpanFinder(tok, cfg.probe.answer_pattern))
        rows = [i for i in range(batch.size) if sites.kinds[i] != "none" and SEQ_ADV[i] != 0
                and sites.score_mask[i].any()]
        if cfg.method == "oar_g":
            refs[name] = ref.oar_g(model, batch, sites, rows, cfg.sigma, cfg.seed, 3)
        else:
            refs[name] = ref.oar_p(model, batch, sites, rows, tok.pad_token_id, cfg.probe.joint_importance)
    return refs


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max over rows of max|got - want| / max|want| (rows with no scores are compared exactly)."""
    worst = 0.0
    for g, w in zip(got, want):
        scale = w.abs().max()
        if scale == 0:
            assert g.abs().max() == 0
            continue
        worst = max(worst, float((g - w).abs().max() / scale))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_importance_matches_reference(setup, tp, pp):
    root, ckpt, refs = setup
    out = root / f"attr_tp{tp}pp{pp}.pt"
    # OAR-G under recompute: on one of the two models, at TP1, TP2 and PP2
    recompute = "untied" in root.name and (tp, pp) != (2, 2)
    launch(_worker, tp * pp, str(ckpt), tp, pp, str(out), None, recompute)
    ranks = torch.load(out, weights_only=False)
    if recompute:
        for rank, results in enumerate(ranks):
            check_recompute(results["recompute"], rank)
    for rank, results in enumerate(ranks):
        assert results["grads_untouched"], f"rank {rank}: attribution touched parameter gradients"
        assert results["requires_grad_restored"], f"rank {rank}"
        assert results["outputs_unchanged"], f"rank {rank}: model outputs changed"
        for name, want in refs.items():
            got = results[name][0]
            err = rel_error(got, want)
            print(f"tp={tp} pp={pp} rank={rank} {name}: rel err {err:.2e}")
            assert err <= REL_TOL, f"{name} at tp={tp} pp={pp} rank {rank}: {err:.2e}"
    first = ranks[0]
    if "teacher_reused" in first:
        # the same scores from another pass's teacher: rounding apart (tests/tolerances.py; 1e-5
        # failed under ATEN_CPU_CAPABILITY=default with MKL_CBWR=COMPATIBLE: 1.4e-5, issue 53)
        assert rel_error(first["teacher_reused"], first["oar_g_answer_mean"][0]) <= ROUNDING_TOL
    kinds = first["oar_g_answer_mean"][2]
    # row 3 has no answer: falls back to last_token; row 2 has A = 0: not scored
    assert kinds == ["answer_mean", "answer_mean", "answer_mean", "last_token", "answer_mean"]
    mask = first["oar_g_answer_mean"][1]
    assert not mask[2].any() and mask[3].any()
    # batched and serial OAR-P agree; micro-batch sizes change nothing
    # (only fp32 rounding differs: other padded lengths and micro-batch shapes change GEMM blocking;
    # OAR-G's floor is ~1e-5 of the largest score, and since the <answer> tag, whose scores dwarfed
    # the reasoning's, is no longer scored, up to 3.6e-5 of a row's largest reasoning score)
    # (measured 2e-5 and 6e-5 on the developers' CPU; the bound: tests/tolerances.py)
    for a, b in [("oar_p_answer_mean", "oar_p_serial"), ("oar_p_answer_mean", "oar_p_mbs3"),
                 ("oar_g_answer_mean", "oar_g_mbs1")]:
        assert rel_error(first[a][0], first[b][0]) <= ROUNDING_TOL, (a, b)
    assert first["oar_p_answer_mean"][3]["masked_forwards"] == float(mask.sum())


def recompute_tolerance(reduction: int, layers: int) -> float:
    """Relative bound on how far recomputed OAR-G scores may sit from the stored-activation ones.
    The recomputed forward runs the same operations on the same inputs, so on one machine they
    are equal; a kernel that blocks its sums differently on the rerun could at most change each
    reduction by its length x fp32 eps (the worst-case bound of a sum of ``reduction`` terms, the
    model's longest: FC2's), once per layer of the forward and of the backward."""
    return 2 * layers * reduction * torch.finfo(torch.float32).eps


def check_recompute(res: dict, rank: int) -> None:
    """OAR-G under full and selective recompute equals OAR-G without (to :func:`recompute_tolerance`),
    and really recomputed: under full recompute layers reran in the backward (each with its core
    attention), under selective only core attention, as many as full reran layers (the OAR-G
    forwards' layer calls); without recompute nothing reran; train mode is restored."""
    from tests.tiny import SMALL

    tol = recompute_tolerance(max(SMALL["hidden_size"], SMALL["intermediate_size"]), SMALL["num_hidden_layers"])
    none, full, sel = res[None], res["full"], res["selective"]
    for name in RECOMPUTE_CASES:
        assert none[name].abs().max() > 0, name
        for mode in ("full", "selective"):
            err = rel_error(res[mode][name], none[name])
            print(f"rank {rank} {name} under {mode} recompute: rel err {err:.2e} (tolerance {tol:.2e})")
            assert err <= tol, f"rank {rank}: {name} under {mode} recompute: rel err {err:.2e} > {tol:.2e}"
    for mode in ("full", "selective"):
        assert res[mode]["modes_restored"], f"rank {rank}: {mode} recompute left a module in eval mode"
    assert none["calls"] == {"layer": 0, "core_attn": 0}, f"rank {rank}: {none['calls']} reran without recompute"
    reran = full["calls"]["layer"]
    assert reran > 0, f"rank {rank}: full recompute reran no layer in OAR-G's backward"
    assert full["calls"]["core_attn"] == reran, f"rank {rank}: {full['calls']}"
    assert sel["calls"] == {"layer": 0, "core_attn": reran}, \
        f"rank {rank}: selective recompute reran {sel['calls']}, expected {reran} core attentions only"
