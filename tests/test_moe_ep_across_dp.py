"""Expert parallelism across data-parallel ranks: every pass runs equally many model calls.

At TP1, EP2 over 2 ranks the EP group is the DP group (``models.equal_calls``), so every MoE
layer's dispatcher collective pairs the two DP ranks' model calls. The ranks hold different
numbers of rows (3 and 2, all of one length, one row per micro-batch): without the agreement
they would run 3 and 2 model calls in each pass and the third call's all-gather would wait
forever. Tiny random Qwen3-MoE "A" (2 layers, both MoE, 4 experts, top-2; fp32, local spec),
converted once and loaded by ``build_policy``, ``model.routing_replay=training``.

One pooled world of 2 gloo ranks runs the passes at EP1 (plain DP2: each rank's rows alone,
no fillers) and at EP2, and records megatron's schedule calls per pass: the old-logprob pass
(recording the routing), the update (replaying it), OAR-G, serial OAR-P (one schedule call per
masked copy: the number of schedule calls is agreed too), screened OAR-P with rank 1 scoring
no row at all (its teacher, OAR-G and OAR-P run filler calls only) and the rollout sync check
(3 sequences: 2 and 1 per rank; 1 sequence: rank 1 checks none). EP2 gives EP1's results
(log-probs, recorded routing, expert load, update loss and gradient norm, importance, the sync
check's differences) at fp32 rounding; at EP1 the ranks run different numbers of model calls,
at EP2 both the most.
Also: which layouts' expert groups span DP ranks (TP1 x EP2 yes; EP2 inside TP2 no).

Cost (the shared 2 cores): 11 s in a warm pool of 2-rank worlds at load 13-18 (the conversion
and both layouts' passes); 23-31 s run alone at load 19-21, the pool's start included.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import launch_and_load, save_gathered
from tests.tiny import make_tiny_qwen3_moe

LENGTH, PROMPT = 12, 9
ROWS = ([0, 1, 2], [3, 4])  # DP rank -> its rows: 3 and 2 micro-batches of one row
TOL = 1e-5
REL_TOL = 1e-4  # importance, as tests/test_attribution.py
SIGMA = 1e-2  # OAR-G: as tests/test_attribution.py (the fp32 rounding floor ~1e-5 relative)


def _batch(vocab: int, rows: list[int]):
    from megatron_oar.training.inputs import TrainBatch

    g = torch.Generator().manual_seed(11)
    n = 5
    tokens = torch.randint(1, vocab, (n, LENGTH), generator=g)
    mask = (torch.arange(LENGTH) >= PROMPT).expand(n, LENGTH)
    full = TrainBatch(tokens, torch.full((n,), PROMPT), torch.full((n,), LENGTH), torch.arange(n),
                      torch.zeros(n, dtype=torch.bool), loss_mask=mask.clone(),
                      rollout_logprobs=torch.zeros(n, LENGTH), seq_adv=torch.tensor([1.0, -0.5, 2.0, 1.5, -1.0]))
    full.advantages = torch.randn(n, LENGTH, generator=g) * mask
    return full.select(rows)


def _rollout(vocab: int, n: int):
    """The first ``n`` rows as a rollout batch (one completion per prompt) whose "vLLM"
    log-probs are 0: the sync check's difference is Megatron's own log-probs."""
    from megatron_oar.rollout.batch import RolloutBatch

    tokens = _batch(vocab, list(range(n))).tokens.tolist()
    return RolloutBatch(prompt_ids=[t[:PROMPT] for t in tokens], response_ids=[[t[PROMPT:]] for t in tokens],
                        logprobs=[[[0.0] * (LENGTH - PROMPT)] for _ in tokens], finish_reasons=[["stop"]] * n,
                        stop_reasons=[[None]] * n, texts=[[""]] * n, seeds=list(range(n)), n=1,
                        temperature=1.0, top_p=1.0, top_k=-1, logprobs_mode="raw_logprobs")


def _worker(ckpt: str, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.attribution import AttributionConfig, ProbeConfig, compute_importance
    from megatron_oar.models import equal_calls, forward
    from megatron_oar.rollout.sync_check import logprob_agreement
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.training.policy_passes import old_logprob_pass, update_step
    from megatron_oar.training.routing_replay import RoutingLog
    from tests.test_routing_replay import _policy

    real_schedule = forward.get_forward_backward_func
    calls: dict[str, list[int]] = {}
    key = [""]

    def recording():
        schedule = real_schedule()

        def run(**kw):
            calls.setdefault(key[0], []).append(kw["num_microbatches"])
            return schedule(**kw)
        return run

    last = ProbeConfig(kind="last_token")
    cases = {
        "oar_g": AttributionConfig(method="oar_g", sigma=SIGMA, probe=last, micro_batch_size=1),
        "oar_p_serial": AttributionConfig(method="oar_p", serial=True, probe=last, pad_id=0, micro_batch_size=1),
        "screened_idle": AttributionConfig(method="oar_p_screened", sigma=SIGMA, probe=last, pad_id=0,
                                           micro_batch_size=1, perturb_micro_batch_size=1, screen_fraction=0.5),
    }
    results = {}
    forward.get_forward_backward_func = recording
    try:
        for ep in (1, 2):
            calls.clear()
            init_runtime(ParallelConfig(ep=ep))
            policy, arch = _policy(ckpt, "training", 1)
            d = ps.get_data_parallel_rank()
            batch = _batch(arch.vocab_size, ROWS[d])
            grouping = {"batching": "token_budget", "max_tokens": LENGTH}  # one row per micro-batch
            res = {"spans": equal_calls.expert_groups_span_dp()}
            key[0] = "old_logprob"
            log = RoutingLog("training")
            batch.old_logprobs, batch.entropy, _ = old_logprob_pass(policy.model, batch, arch.vocab_size, 1,
                                                                    routing=log, **grouping)
            res.update(old=batch.old_logprobs, entropy=batch.entropy, routed=batch.routed_experts.clone())
            key[0] = "update"
            step = update_step(policy, batch, PolicyLossConfig(), arch.vocab_size, 1, routing=log, **grouping)
            res.update(applied=step.applied, loss=step.stats["loss"], grad_norm=step.grad_norm,
                       ratio=(step.stats["ratio_mean"], step.stats["ratio_max"]),
                       routing=log.metrics(torch.device("cpu")))
            for name, cfg in cases.items():
                key[0] = name
                seq_adv = batch.seq_adv * (0 if name == "screened_idle" and d == 1 else 1)
                res[name] = compute_importance(policy.model, batch, cfg, vocab_size=arch.vocab_size,
                                               seq_adv=seq_adv, step=2).importance
            for n in (3, 1):  # the sync check: rows 0, 2 and 1 (2 and 1 calls); row 0 and none
                key[0] = f"sync{n}"
                check = logprob_agreement(policy.model, _rollout(arch.vocab_size, n), arch.vocab_size)
                res[key[0]] = (check.mean_abs_diff, check.max_abs_diff, check.num_tokens)
            res["calls"] = dict(calls)
            results[ep] = res
        init_runtime(ParallelConfig(tp=2, ep=2, etp=1, sequence_parallel=True))  # EP inside TP
        results["ep_in_tp_spans"] = equal_calls.expert_groups_span_dp()
    finally:
        forward.get_forward_backward_func = real_schedule
    save_gathered(results, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from checkpoints_convert.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("moe_ep_across_dp")
    hf = make_tiny_qwen3_moe(root / "A", seed=7)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    return launch_and_load(_worker, 2, root / "out.pt", str(root / "ckpt"))


@pytest.mark.slow
def test_every_pass_runs_equal_model_calls_when_ep_spans_dp(runs):
    assert [r[1]["spans"] for r in runs] == [False, False]
    assert [r[2]["spans"] for r in runs] == [True, True]
    assert [r["ep_in_tp_spans"] for r in runs] == [False, False]
    plain = [r[1]["calls"] for r in runs]
    equal = [r[2]["calls"] for r in runs]
    for name in plain[0]:
        print(f"{name}: model calls per schedule, EP1 {plain[0][name]} / {plain[1].get(name)}, "
              f"EP2 {equal[0][name]} / {equal[1][name]}")
    # without the agreement the ranks' counts differ in every pass (rank 1 skips screened OAR-P)
    for name in ("old_logprob", "update", "oar_g", "oar_p_serial", "sync3"):
        assert plain[0][name] != plain[1][name], name
    assert "screened_idle" not in plain[1] and "sync1" not in plain[1]  # nothing to score / check
    assert len(plain[0]["oar_p_serial"]) > len(plain[1]["oar_p_serial"])  # schedule calls too
    for name in plain[0]:  # with it, both run the most of each pass
        assert equal[0][name] == equal[1][name], name
        assert sum(equal[0][name]) >= max(sum(plain[0][name]), sum(plain[1].get(name, [0]))), name


@pytest.mark.slow
def test_filler_calls_change_no_result(runs):
    for rank, res in enumerate(runs):
        plain, filled = res[1], res[2]
        assert plain["applied"] and filled["applied"]
        for name in ("old", "entropy"):
            assert torch.allclose(filled[name], plain[name], rtol=TOL, atol=TOL), f"rank {rank}: {name}"
        # the fillers route freely and are neither recorded nor counted: the same routing, the
        # same load, and the update replays the recording exactly (ratio 1, agreement 1)
        assert torch.equal(filled["routed"], plain["routed"]), f"rank {rank}: routing"
        assert (filled["routed"][:, :LENGTH] >= 0).all()
        assert filled["routing"] == pytest.approx(plain["routing"], rel=TOL)
        assert filled["routing"]["routing/agree_old_update"] == 1.0
        assert filled["ratio"] == (1.0, 1.0)
        assert filled["loss"] == pytest.approx(plain["loss"], rel=TOL)
        assert filled["grad_norm"] == pytest.approx(plain["grad_norm"], rel=TOL)
        for name in ("sync3", "sync1"):  # the same log-probs checked, over both ranks' rows
            assert filled[name][2] == plain[name][2] > 0
            assert filled[name][:2] == pytest.approx(plain[name][:2], rel=TOL), name
        for name in ("oar_g", "oar_p_serial", "screened_idle"):
            want, got = plain[name], filled[name]
            if rank == 1 and name == "screened_idle":
                assert got.abs().max() == 0 and want.abs().max() == 0  # nothing scored
                continue
            assert want.abs().max() > 0, name
            err = float((got - want).abs().max() / want.abs().max())
            print(f"rank {rank} {name}: rel err {err:.2e}")
            assert err <= REL_TOL, f"rank {rank} {name}: {err:.2e}"
