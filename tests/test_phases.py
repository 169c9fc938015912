"""The loop's memory handover with vLLM, proved with a recording fake engine.

* over two steps with an evaluation after each (and the step-0 baseline), the engine's calls come
  in the colocated order: wake weights -> sync -> wake KV cache -> generate -> sleep, for the
  steps and for every evaluation;
* every Megatron pass (old log-probs, reference, attribution, update) runs while the engine sleeps,
  and every generation while it is fully awake;
* the trainer's phases are the phases ``oar plan`` budgets (``plan.trainer_phases``), so the plan
  cannot assume a sleeping vLLM where the loop keeps it awake;
* ``RolloutEngine.wake_up`` frees PyTorch's cached blocks before vLLM re-allocates;
* (issue 28, 6c) on an FP8 model under delayed scaling the forward-only passes enter FP8 autocast
  only where TE has set its scales: never the reference, the old-logprob pass after the first
  update (the same run: the model's ``config.fp8`` set once built, megatron's ``get_fp8_context``
  a recording fake, as there is no Transformer Engine on CPU).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron_oar.training.phases import CHECKPOINT, EVAL, NOTHING, STEP
from tests.distributed import launch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
TINY = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
            num_hidden_layers=2, max_position_embeddings=256)
MEGATRON_PASSES = ("old_logprob_pass", "reference_logprobs", "compute_importance", "update_step")


class RecordingEngine:
    """Stands in for ``RolloutEngine``: random completions, and a trace of every call with what
    the engine held on the GPU at that moment (sleep and wake_up as in vLLM: tags)."""

    def __init__(self, rollout_cfg, tokenizer, trace: list):
        self.config = rollout_cfg
        self.tokenizer = tokenizer
        self.trace = trace
        self.asleep: set[str] = set()  # a new engine is awake
        self.dp_size, self.dp_rank = 1, 0

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def _record(self, call: str) -> None:
        self.trace.append((call, sorted(self.asleep)))

    def sleep(self) -> None:
        self._record("sleep")
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None) -> None:
        self._record(f"wake_up({','.join(tags or ['all'])})")
        self.asleep -= set(tags or self.asleep)

    def sync_weights(self, model, *, step=None):
        from megatron_oar.rollout.engine import SyncStats

        self._record("sync_weights")
        return SyncStats(seconds=0.0, bytes=0, num_tensors=0, num_buckets=0, max_bucket_bytes=0)

    def generate(self, prompt_ids, *, n=None, seeds=None, temperature=None, **_):
        from megatron_oar.rollout.batch import RolloutBatch

        self._record("generate")
        n = n or self.config.n
        eos = self.tokenizer.eos_token_id
        vocab = [i for i in range(len(self.tokenizer)) if i != eos]
        ids, texts = [], []
        for p, seed in zip(prompt_ids, seeds):
            rng = random.Random(seed)
            resp = [[rng.choice(vocab) for _ in range(rng.randint(4, 9))] + [eos] for _ in range(n)]
            ids.append(resp)
            texts.append([self.tokenizer.decode(r[:-1]) for r in resp])
        k = len(prompt_ids)
        return RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], response_ids=ids,
                            logprobs=[[[-1.0] * len(r) for r in rs] for rs in ids],
                            finish_reasons=[["stop"] * n] * k, stop_reasons=[[None] * n] * k,
                            texts=texts, seeds=list(seeds), n=n, temperature=temperature or 1.0,
                            top_p=1.0, top_k=0, logprobs_mode="raw_logprobs")

    def gather(self, batch):
        return batch

    def shutdown(self) -> None:
        self._record("shutdown")


def _run_worker(hf_dir: str, run_dir: str, out: str) -> None:
    from contextlib import nullcontext

    import torch
    from megatron.core.transformer import transformer_block
    from transformers import AutoTokenizer

    import megatron_oar.training.trainer as trainer_mod
    from megatron_oar.commands.plan import trainer_phases
    from megatron_oar.config import load_config
    from megatron_oar.training.trainer import Trainer

    cfg = load_config(EXAMPLE, [
        f"model.path={hf_dir}", f"run_dir={run_dir}", "parallel.tp=1", "rollout.tp=1",
        "train.steps=2", "train.prompts_per_step=2", "train.group_size=4", "train.mini_batches=1",
        "train.max_tokens_per_micro_batch=112", "train.eval_interval=1", "train.eval_max_prompts=2",
        "train.dynamic_sampling=false", "credit=oar_g", "loss.kl_coef=0.01",
        "attribution.probe.warmup_steps=0", r"attribution.probe.answer_pattern=(\d+)",
        "rewards.format_weight=1.0", "rewards.accuracy_weight=0.0",
        "rewards.format_pattern=.*[0-9].*", "checkpoint.export_hf_at_end=false",
        "log.console=false",
        "rollout.max_logprob_mismatch=null"])  # the fake rollouts' log-probs are made up
    trace: list = []
    passes: list = []  # per Megatron pass: name, its fp8 / teacher_fp8 arguments, FP8 autocasts entered
    engine = RecordingEngine(cfg.rollout, AutoTokenizer.from_pretrained(hf_dir), trace)
    originals = {name: getattr(trainer_mod, name) for name in MEGATRON_PASSES}  # restored below
    for name in MEGATRON_PASSES:  # each pass records what the engine held while it ran
        def recorded(*args, _name=name, _fn=getattr(trainer_mod, name), **kwargs):
            trace.append((_name, sorted(engine.asleep)))
            passes.append({"name": _name, "fp8": kwargs.get("fp8"), "teacher_fp8": kwargs.get("teacher_fp8"),
                           "autocasts": []})
            return _fn(*args, **kwargs)
        setattr(trainer_mod, name, recorded)

    def fp8_context(config, layer_no=-1, is_init=False):  # megatron calls it where config.fp8 is set
        passes[-1]["autocasts"].append(torch.is_grad_enabled())
        return nullcontext()

    get_fp8_context = transformer_block.get_fp8_context
    transformer_block.get_fp8_context = fp8_context  # this pool rank's: restored below
    trainer = Trainer(cfg, engine=engine)
    for model in (trainer.policy.gpt, trainer.reference):  # FP8 (delayed scaling) from here on
        model.config.fp8 = "hybrid"
    phase = trainer.logger.phase

    def traced_phase(name):
        trace.append((f"phase:{name}", sorted(engine.asleep)))
        return phase(name)

    trainer.logger.phase = traced_phase
    try:
        trainer.run()
    finally:  # this pooled rank process runs later jobs
        transformer_block.get_fp8_context = get_fp8_context
        for name, fn in originals.items():
            setattr(trainer_mod, name, fn)
    Path(out).write_text(json.dumps({"trace": trace, "passes": passes,
                                     "plan": [p.name for p in trainer_phases(cfg)]}))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from megatron_oar.models.tiny import make_tiny_qwen2

    root = tmp_path_factory.mktemp("phases")
    hf = make_tiny_qwen2(root / "hf", seed=3, **TINY)
    out = root / "trace.json"
    launch(_run_worker, 1, str(hf), str(root / "run"), str(out))
    return json.loads(out.read_text())


@pytest.mark.slow
def test_engine_calls_follow_the_colocated_order(run):
    calls = [c for c, _ in run["trace"] if not c.startswith("phase:") and c not in MEGATRON_PASSES]
    wake = ["wake_up(weights)", "sync_weights", "wake_up(kv_cache)", "generate", "sleep"]
    # asleep once built, the step-0 evaluation, then per step: rollout, evaluation
    assert calls == ["sleep"] + wake * 5, calls


@pytest.mark.slow
def test_megatron_passes_run_while_vllm_sleeps(run):
    held = {}
    for call, asleep in run["trace"]:
        held.setdefault(call, set()).add(tuple(asleep))
    for name in ("old_logprob_pass", "reference_logprobs", "compute_importance", "update_step"):
        assert held[name] == {("kv_cache", "weights")}, (name, held.get(name))
    assert held["generate"] == {()}  # generation only with weights and KV cache awake
    assert held["sync_weights"] == {("kv_cache",)}  # weights awake, KV cache not yet
    for name, phase in [(p.name, p) for p in STEP + EVAL + CHECKPOINT]:
        if phase.vllm_holds == NOTHING:
            assert held[f"phase:{name}"] == {("kv_cache", "weights")}, name


@pytest.mark.slow
def test_trainer_phases_are_the_plans(run):
    phases = [c[len("phase:"):] for c, _ in run["trace"] if c.startswith("phase:")]
    evaluation = [p.name for p in EVAL]
    step = [p.name for p in STEP]
    # the step-0 evaluation, then step / evaluation / checkpoint (the last step's) x 2
    assert phases == evaluation + step + evaluation + step + evaluation + ["checkpoint"], phases
    assert sorted(set(phases)) == sorted(run["plan"])


@pytest.mark.slow
def test_forward_only_passes_enter_fp8_once_scales_are_set(run):
    """TE updates delayed-scaling FP8 scales only when an autocast exits with grad enabled, so
    the reference (never trained) runs in bf16, and so does the first old-logprob pass (before any
    update: TE's initial scales); the updates run in FP8 and set them, so the second step's
    old-logprob pass (and the probe teacher it hands attribution) is FP8."""
    by_name: dict[str, list] = {}
    for p in run["passes"]:
        by_name.setdefault(p["name"], []).append(p)
    logprob = by_name["old_logprob_pass"]
    assert [p["fp8"] for p in logprob] == [False, True]
    assert logprob[0]["autocasts"] == [] and logprob[1]["autocasts"] and not any(logprob[1]["autocasts"])
    assert all(p["autocasts"] == [] for p in by_name["reference_logprobs"])
    assert all(p["autocasts"] and all(p["autocasts"]) for p in by_name["update_step"])  # with grad
    attribution = by_name["compute_importance"]  # outside FP8 (attribution.allow_fp8 false)
    assert [p["teacher_fp8"] for p in attribution] == [False, True]
    assert all(p["autocasts"] == [] for p in attribution)


def test_plan_phases_follow_the_config():
    from megatron_oar.commands.plan import trainer_phases
    from megatron_oar.config import load_config

    cfg = load_config(EXAMPLE, ["credit=grpo", "train.eval_interval=0"])
    assert [p.name for p in trainer_phases(cfg)] == [
        "wake_weights", "sync", "wake_kv_cache", "generate", "sleep", "logprob", "update",
        "checkpoint"]
    cfg = load_config(EXAMPLE, ["credit=oar_p", "train.eval_interval=5"])
    assert [p.name for p in trainer_phases(cfg)] == [p.name for p in STEP] + ["eval", "checkpoint"]


def test_plan_budgets_every_phase_and_vllm_asleep_for_megatron():
    """The 7B example: every phase has a budget; Megatron's phases count vLLM asleep, and
    with vLLM never sleeping (sleep_level 0) the training phase needs its awake share too."""
    from megatron_oar.commands.plan import Hardware, make_plan, trainer_phases
    from megatron_oar.config import load_config
    from megatron_oar.models.presets import resolve_hf_config

    path = ROOT / "examples" / "qwen2.5-7b_oar_g.yaml"
    plans = {}
    for level in (2, 0):
        cfg = load_config(path, [f"rollout.sleep_level={level}"])
        hf, _ = resolve_hf_config(cfg.model.path, None)
        plans[level] = make_plan(cfg, hf, nodes=1, gpus_per_node=8, hw=Hardware())
        assert list(plans[level].phases_gib) == [p.name for p in trainer_phases(cfg)]
        assert set(plans[level].time_s) - {"total"} <= set(plans[level].phases_gib)
    asleep, awake = plans[2], plans[0]
    share = asleep.vllm["share_gib"]
    assert awake.phases_gib["update"] - asleep.phases_gib["update"] == pytest.approx(share - 1.0)
    assert awake.train_peak_gib > asleep.hardware["gpu_mem_gib"] > asleep.train_peak_gib


def test_wake_up_frees_torch_cache_first(monkeypatch):
    from megatron_oar.rollout import engine as engine_mod
    from megatron_oar.rollout.config import RolloutConfig

    calls = []

    class LLM:
        def sleep(self, level):
            calls.append(f"sleep({level})")

        def wake_up(self, tags):
            calls.append(f"wake_up({tags})")

    eng = engine_mod.RolloutEngine.__new__(engine_mod.RolloutEngine)
    eng.config, eng.sleep_supported, eng._asleep, eng._llm = RolloutConfig(), True, set(), LLM()
    eng._weights_loaded = True
    monkeypatch.setattr(engine_mod, "free_torch_cache", lambda: calls.append("free"))
    eng.sleep()
    assert not eng._weights_loaded  # the default level 2 discards them: a sync must come first
    eng.wake_up(["weights"])
    eng.wake_up(["kv_cache"])
    eng.wake_up(["kv_cache"])  # awake already: nothing
    assert calls == ["sleep(2)", "free", "wake_up(['weights'])", "free", "wake_up(['kv_cache'])"]


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("vllm_release", ["0.24", "0.32"])
def test_sleep_frees_what_a_partial_wake_left_awake(monkeypatch, vllm_release, level):
    """A sync wakes the weights and may fail before the KV cache wakes; sleep() must still free
    them. The fake follows vLLM: its allocator sleeps what is awake and skips what sleeps, and
    its executor ignores a sleep ("Executor is already sleeping") while anything sleeps (0.24,
    `abstract.py`: `if self.is_sleeping`; seen on an H100, where woken weights stayed awake) or
    while the weights sleep (0.32: `if "weights" in self.sleeping_tags`). After a level-2 sleep
    0.24's worker restores the buffers it saved on the first wake, whatever the tags (into
    unmapped weights when only the KV cache woke: CUDA "invalid argument" on an H200), 0.32's
    only with the weights: at level 2 the weights wake with the KV cache."""
    from megatron_oar.rollout import engine as engine_mod
    from megatron_oar.rollout.config import RolloutConfig

    class LLM:
        def __init__(self):
            self.asleep: set[str] = set()
            self.saved_buffers = False

        def sleep(self, level):
            ignored = bool(self.asleep) if vllm_release == "0.24" else "weights" in self.asleep
            if not ignored:
                self.asleep = {"weights", "kv_cache"}
                self.saved_buffers = level == 2

        def wake_up(self, tags):
            self.asleep -= set(tags)
            if self.saved_buffers and (vllm_release == "0.24" or "weights" in tags):
                if "weights" in self.asleep:
                    raise RuntimeError("CUDA error: invalid argument (buffers into asleep weights)")
                self.saved_buffers = False

    eng = engine_mod.RolloutEngine.__new__(engine_mod.RolloutEngine)
    eng.config, eng.sleep_supported, eng._asleep, eng._llm = RolloutConfig(sleep_level=level), True, set(), LLM()
    eng._weights_loaded = True
    monkeypatch.setattr(engine_mod, "free_torch_cache", lambda: None)
    for woken in (["weights"], ["kv_cache"], ["weights", "kv_cache"]):
        eng.sleep()
        eng.wake_up(woken)
        awake = set(woken) | ({"weights"} if level == 2 else set())
        assert eng.llm.asleep == eng._asleep == {"weights", "kv_cache"} - awake, woken
        eng.sleep()
        assert eng.llm.asleep == {"weights", "kv_cache"} and eng._asleep == {"weights", "kv_cache"}, woken
