"""The trainer's config: schema, YAML + overrides, validation, the example configs."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from megatron_oar.algorithms import PolicyLossConfig, ShapingConfig
from megatron_oar.attribution import AttributionConfig, ProbeConfig
from megatron_oar.config import (
    DERIVED,
    Config,
    ConfigError,
    credit_scheme,
    load_config,
    save_config,
    validate,
)
from megatron_oar.methods import CREDIT_METHODS
from megatron_oar.models import ModelOptions, parse_arch
from megatron_oar.rewards import RewardConfig
from megatron_oar.rollout.config import RolloutConfig
from megatron_oar.runtime.distributed import ParallelConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def qwen(**kw) -> dict:
    """A Qwen2 config.json as a dict (no weights needed for validation)."""
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "use_sliding_window": False, "rope_scaling": None, **kw}


# The real architectures' shapes (their config.json values).
HF = {
    "math-1.5b": qwen(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=True),
    "7b": qwen(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
               rope_theta=1e6, tie_word_embeddings=False),
    "math-7b": qwen(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096,
                    rope_theta=10000.0, tie_word_embeddings=False),
    "14b": qwen(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
                rope_theta=1e6, tie_word_embeddings=False),
    "32b": qwen(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
                rope_theta=1e6, tie_word_embeddings=False),
    "72b": qwen(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                rope_theta=1e6, tie_word_embeddings=False),
    # Qwen/Qwen3-8B and Qwen3-32B config.json: q/k norms, no q/k/v bias, head_dim 128
    "qwen3-8b": dict(qwen(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=40960,
                          rope_theta=1e6, tie_word_embeddings=False),
                     architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128, attention_bias=False),
    "qwen3-32b": dict(qwen(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                           num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=40960,
                           rope_theta=1e6, tie_word_embeddings=False),
                      architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128, attention_bias=False),
    # Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json (April 2025 releases): 128 experts, top-8
    "qwen3-30b-a3b": dict(qwen(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=40960,
                               rope_theta=1e6, tie_word_embeddings=False),
                          architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=128,
                          attention_bias=False, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3-235b-a22b": dict(qwen(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                 num_attention_heads=64, num_key_value_heads=4, max_position_embeddings=40960,
                                 rope_theta=1e6, tie_word_embeddings=False),
                            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=128,
                            attention_bias=False, moe_intermediate_size=1536, num_experts=128,
                            num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "tiny": qwen(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 rope_theta=1e6, tie_word_embeddings=False),
}
# example -> (architecture, world size of the cluster it is written for)
CASES = {
    "qwen2.5-math-1.5b_oar_g.yaml": ("math-1.5b", 8),
    "qwen2.5-7b_oar_g.yaml": ("7b", 8),
    "qwen2.5-7b_oar_p.yaml": ("7b", 8),
    "qwen2.5-7b_oar_g_separate.yaml": ("7b", 16),
    "qwen2.5-math-7b_oar_g.yaml": ("math-7b", 8),
    "qwen2.5-14b_oar_g.yaml": ("14b", 16),
    "qwen2.5-32b_oar_g.yaml": ("32b", 32),
    "qwen2.5-72b_oar_g.yaml": ("72b", 64),
    "qwen3-8b_oar_g.yaml": ("qwen3-8b", 8),
    "qwen3-8b_oar_g_long.yaml": ("qwen3-8b", 8),
    "qwen3-32b_oar_g.yaml": ("qwen3-32b", 32),
    "qwen3-30b-a3b_oar_g.yaml": ("qwen3-30b-a3b", 8),
    "qwen3-235b-a22b_oar_g.yaml": ("qwen3-235b-a22b", 128),
    "tiny_cpu.yaml": ("tiny", 2),
    "tiny_chain_cpu.yaml": ("tiny", 2),
    "tiny_credit_cpu.yaml": ("tiny", 2),
}


def example(name: str, *overrides: str) -> Config:
    return load_config(EXAMPLES / name, list(overrides))


def raises(match: str):
    return pytest.raises(ConfigError, match=match)


# ------------------------------------------------------------------------------------ examples

def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(CASES)
    for name, (_, world) in CASES.items():  # each names the cluster it is written for
        assert example(name).launch.world_size == world, name


def test_presets_match_the_published_configs():
    """models/presets.py (used by oar plan / oar launch) against the values written out here."""
    from megatron_oar.models.presets import PRESETS

    for arch, preset in (("math-1.5b", "qwen2.5-math-1.5b"), ("7b", "qwen2.5-7b"),
                         ("math-7b", "qwen2.5-math-7b"), ("14b", "qwen2.5-14b"),
                         ("32b", "qwen2.5-32b"), ("72b", "qwen2.5-72b"), ("qwen3-8b", "qwen3-8b"),
                         ("qwen3-32b", "qwen3-32b"), ("qwen3-30b-a3b", "qwen3-30b-a3b"),
                         ("qwen3-235b-a22b", "qwen3-235b-a22b")):
        assert parse_arch(PRESETS[preset]) == parse_arch(HF[arch]), preset


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_loads_and_validates(name):
    arch, world = CASES[name]
    cfg = example(name)
    validate(cfg, world_size=world, hf_config=HF[arch])
    header = (EXAMPLES / name).read_text().splitlines()[:6]
    assert header[0].startswith("# ") and any(f"--config examples/{name}" in line for line in header)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("qwen")])
def test_real_examples_use_the_paper_settings(name):
    cfg = example(name)
    # the long-reasoning example leaves the paper's 1,024-token limit for 32k-token responses and
    # halves the prompts per step, whose generation dominates its step (its header says so)
    prompts = 32 if name.endswith("_long.yaml") else 64
    assert (cfg.train.group_size, cfg.train.prompts_per_step, cfg.rollout.n) == (8, prompts, 8)
    assert cfg.optim.lr == 1e-6 and cfg.optim.use_distributed_optimizer
    new_tokens = 32768 if name.endswith("_long.yaml") else 1024
    assert (cfg.rollout.temperature, cfg.rollout.max_new_tokens) == (1.0, new_tokens)
    assert (cfg.shaping.scheme, cfg.shaping.tau, cfg.shaping.beta) == ("oar", 0.4, 2.0)
    assert (cfg.loss.clip_low, cfg.loss.clip_high, cfg.loss.agg) == (0.2, 0.28, "token_mean")
    assert cfg.model.dtype == "bf16" and cfg.rollout.dtype == "bf16"
    assert cfg.data.train_files == ["data/dapo-math-17k.parquet"] and cfg.data.fields == "dapo"
    assert cfg.attribution.method == cfg.credit


def test_tiny_example_is_cpu_sized():
    cfg = example("tiny_cpu.yaml")
    assert (cfg.parallel.tp, cfg.model.dtype, cfg.model.spec, cfg.train.group_size) == (2, "fp32", "local", 8)
    assert cfg.data.synthetic is not None and not cfg.data.train_files
    assert cfg.rollout.max_new_tokens == 24 and cfg.rollout.cpu_kv_cache_gib <= 0.5


def test_sections_are_component_dataclasses():
    cfg = example("qwen2.5-7b_oar_g.yaml")
    for value, cls in ((cfg.model, ModelOptions), (cfg.parallel, ParallelConfig),
                       (cfg.rollout, RolloutConfig), (cfg.rewards, RewardConfig),
                       (cfg.shaping, ShapingConfig), (cfg.loss, PolicyLossConfig),
                       (cfg.attribution, AttributionConfig), (cfg.attribution.probe, ProbeConfig)):
        assert isinstance(value, cls), (value, cls)
    assert not OmegaConf.is_config(cfg.data.train_files) and isinstance(cfg.data.train_files, list)
    assert cfg.checkpoint.dir == "runs/qwen2.5-7b_oar_g/checkpoints"


def test_model_paths(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path}", "checkpoint.resume=null"])
    assert cfg.model.hf_dir() == tmp_path and cfg.model.tokenizer_dir() == tmp_path
    (tmp_path / "oar_checkpoint.json").write_text("{}")  # an oar-convert checkpoint dir
    assert cfg.model.hf_dir() == tmp_path / "hf" and cfg.model.tokenizer_dir() == tmp_path / "hf"
    assert load_config(None, ["model.tokenizer=tok"]).model.tokenizer_dir() == Path("tok")
    assert cfg.checkpoint.resume == "none" and cfg.log.dir == "runs/default/logs"


# ----------------------------------------------------------------------------------- overrides

def test_overrides():
    cfg = example("qwen2.5-7b_oar_g.yaml", "train.steps=10", "credit=oar_p", "attribution.sigma=0.01",
                  "data.train_files=[a.jsonl,b.parquet]", "rollout.stop=[</answer>]", "model.tokenizer=tok")
    assert cfg.train.steps == 10 and cfg.attribution.sigma == 0.01
    assert (cfg.credit, cfg.attribution.method, cfg.shaping.scheme) == ("oar_p", "oar_p", "oar")
    assert cfg.data.train_files == ["a.jsonl", "b.parquet"] and cfg.rollout.stop == ["</answer>"]
    assert cfg.model.tokenizer == "tok"


def test_overrides_apply_in_order_and_fill_optional_sections():
    cfg = load_config(None, ["model.path=m", "train.steps=3", "train.steps=5", "data.synthetic.n=100",
                             "data.field_map={prompt: q, answer: a}"])
    assert cfg.train.steps == 5 and cfg.data.synthetic.n == 100 and cfg.data.synthetic.operators == "+-*"
    assert (cfg.data.field_map.prompt, cfg.data.field_map.answer) == ("q", "a")


# ------------------------------------------------------------------------------- load errors

def test_unknown_key_in_file_names_key_and_file(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("model: {path: m}\ntrain:\n  stepz: 3\n")
    with raises(rf"{bad}: unknown key 'train.stepz' \(did you mean 'steps'\?\)"):
        load_config(bad, [])


def test_unknown_key_override():
    with raises(r"override 'train.stepz=1': unknown key 'train.stepz'"):
        example("tiny_cpu.yaml", "train.stepz=1")
    with raises(r"unknown key 'nosuchsection'"):
        example("tiny_cpu.yaml", "nosuchsection=1")


def test_wrong_type_names_key(tmp_path):
    with raises(r"override 'train.steps=ten': bad value for 'train.steps'"):
        example("tiny_cpu.yaml", "train.steps=ten")
    bad = tmp_path / "t.yaml"
    bad.write_text("optim:\n  lr: fast\n")
    with raises(rf"{bad}: bad value for 'optim.lr'"):
        load_config(bad, [])


@pytest.mark.parametrize("item", ["train.steps", "=3"])
def test_override_syntax(item):
    with raises("expected key=value"):
        load_config(None, [item])


def test_file_errors(tmp_path):
    with raises("no such config file"):
        load_config(tmp_path / "missing.yaml", [])
    (tmp_path / "bad.yaml").write_text("train: [unclosed\n")
    with raises("bad.yaml: not valid YAML"):
        load_config(tmp_path / "bad.yaml", [])
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with raises("list.yaml: expected a mapping"):
        load_config(tmp_path / "list.yaml", [])


def test_component_post_init_errors_name_the_section():
    with raises(r"shaping: tau must be in \[0, 1\]"):
        example("tiny_cpu.yaml", "shaping.tau=2")
    with raises(r"attribution.sigma must be > 0"):
        example("tiny_cpu.yaml", "attribution.sigma=-1")
    with raises(r"probe.kind must be one of"):
        example("tiny_cpu.yaml", "attribution.probe.kind=nope")
    with raises(r"'data.field_map.answer' needs a value"):
        example("tiny_cpu.yaml", "data.field_map.prompt=q")


# ------------------------------------------------------------------------------------- credit

def test_credit_mapping():
    assert credit_scheme("grpo") == ("grpo", None)
    assert credit_scheme("random") == ("random", None)
    assert credit_scheme("entropy") == ("entropy", None)
    assert credit_scheme("oar_g") == ("oar", "oar_g")
    assert credit_scheme("oar_p") == ("oar", "oar_p")
    for credit in CREDIT_METHODS:
        scheme, method = credit_scheme(credit)
        cfg = example("tiny_cpu.yaml", f"credit={credit}")
        assert cfg.shaping.scheme == scheme and cfg.uses_attribution == (method is not None)
        if method:
            assert cfg.attribution.method == method
        validate(cfg, world_size=2, hf_config=HF["tiny"])


def test_bad_credit():
    cfg = example("tiny_cpu.yaml", "credit=oar_p_screened", "attribution.screen_fraction=0.5")
    assert credit_scheme("oar_p_screened") == ("oar", "oar_p_screened")
    assert (cfg.attribution.method, cfg.attribution.screen_fraction) == ("oar_p_screened", 0.5)
    validate(cfg, world_size=2, hf_config=HF["tiny"])
    for bad in ("0", "1.5"):
        with pytest.raises(ValueError, match="screen_fraction"):
            example("tiny_cpu.yaml", "credit=oar_p_screened", f"attribution.screen_fraction={bad}")
    with raises(r"credit='ppo': expected one of"):
        example("tiny_cpu.yaml", "credit=ppo")


# --------------------------------------------------------------------------- one key, two places

def test_sequence_parallel_is_one_key(tmp_path):
    cfg = example("qwen2.5-7b_oar_g.yaml", "parallel.sequence_parallel=true", "model.spec=te")
    assert cfg.parallel.sequence_parallel is True and cfg.model.sequence_parallel is True
    validate(cfg, world_size=8, hf_config=HF["7b"])
    with raises(r"'model.sequence_parallel' is set from 'parallel.sequence_parallel'"):
        example("qwen2.5-7b_oar_g.yaml", "model.sequence_parallel=true")
    bad = tmp_path / "sp.yaml"
    bad.write_text("model:\n  path: m\n  sequence_parallel: false\n")
    with raises(rf"{bad}: 'model.sequence_parallel' is set from 'parallel.sequence_parallel'"):
        load_config(bad, [])
    with raises(r"parallel.sequence_parallel needs parallel.tp > 1"):
        validate(example("qwen2.5-math-1.5b_oar_g.yaml", "parallel.sequence_parallel=true"), world_size=8)


@pytest.mark.parametrize("key", sorted(DERIVED))
def test_derived_keys_are_rejected(key):
    with raises(f"'{key}' is set from '{DERIVED[key]}'"):
        example("tiny_cpu.yaml", f"{key}=1")


def test_group_size_feeds_rollout_n():
    cfg = example("tiny_cpu.yaml", "train.group_size=8")
    assert cfg.rollout.n == 8


# --------------------------------------------------------------------------------- validation

def test_tp_must_divide_heads_and_kv_groups():
    with raises(r"parallel.tp=8 does not divide num_attention_heads=28"):
        validate(example("qwen2.5-7b_oar_g.yaml", "parallel.tp=8"), world_size=8, hf_config=HF["7b"])
    small = "qwen2.5-math-1.5b_oar_g.yaml"
    with raises(r"parallel.tp=4 does not divide num_key_value_heads=2"):
        validate(example(small, "parallel.tp=4"), world_size=8, hf_config=HF["math-1.5b"])
    # vLLM's rule for rollout.tp: beyond the KV heads it replicates them (a whole number of times)
    validate(example(small, "rollout.tp=4"), world_size=8, hf_config=HF["math-1.5b"])
    with raises(r"rollout.tp=3 is not a multiple of num_key_value_heads=2"):
        validate(example(small, "rollout.tp=3"), hf_config=HF["math-1.5b"])
    with raises(r"rollout.tp=8 does not divide num_attention_heads=12"):
        validate(example(small, "rollout.tp=8"), world_size=8, hf_config=HF["math-1.5b"])
    with raises(r"parallel.pp=3 does not divide num_hidden_layers=4"):
        validate(example("tiny_cpu.yaml", "parallel.tp=1", "parallel.pp=3"), world_size=3,
                 hf_config=HF["tiny"])


def test_world_size_layout():
    with raises(r"parallel.tp\*parallel.pp = 4\*1 does not divide the world size 6"):
        validate(example("qwen2.5-7b_oar_g.yaml", "parallel.tp=4"), world_size=6)
    with raises(r"rollout.tp=3.*does not divide the world size 8"):
        validate(example("qwen2.5-7b_oar_g.yaml", "rollout.tp=3"), world_size=8)


def test_context_parallel_layout_and_refusals():
    """parallel.cp: tp*pp*cp divides the world, DP is what is left (the batch checks use it), and
    what CP does not run yet is refused naming the key."""
    grpo = ("credit=grpo", "parallel.tp=2", "parallel.cp=2")
    validate(example("qwen2.5-7b_oar_g.yaml", *grpo, "model.spec=local"), world_size=8)
    with raises(r"parallel.tp\*parallel.pp\*parallel.cp = 2\*1\*2 does not divide the world size 6"):
        validate(example("qwen2.5-7b_oar_g.yaml", *grpo, "model.spec=local"), world_size=6)
    with raises(r"parallel.cp=0: must be >= 1"):
        validate(example("qwen2.5-7b_oar_g.yaml", "parallel.cp=0"), world_size=8)
    # DP = 8 / (2*2) = 2: 512 samples in micro-batches of 3 rows per DP rank do not divide
    with raises(r"train.micro_batch_size\*DP = 3\*2"):
        validate(example("qwen2.5-7b_oar_g.yaml", *grpo, "model.spec=local", "train.batching=padded",
                         "train.micro_batch_size=3"), world_size=8)
    # the attribution credits run under CP (every pass splits each row over the CP ranks)
    for credit in ("oar_g", "oar_p", "oar_p_screened"):
        validate(example("qwen2.5-7b_oar_g.yaml", *grpo, "model.spec=local", f"credit={credit}"), world_size=8)
    with raises(r"parallel.cp=2 > 1 is not yet supported with model.attention=unfused"):
        validate(example("qwen2.5-7b_oar_g.yaml", *grpo, "model.spec=local", "model.attention=unfused"),
                 world_size=8)
    # packed (THD) batching runs under CP: each row split on its own (tests/test_context_parallel.py)
    validate(example("qwen2.5-7b_oar_g.yaml", *grpo, "model.spec=local", "train.batching=packed"), world_size=8)
    # mixture-of-experts models run under CP, with and without routing replay (each CP rank
    # replays its own chunks' routing: tests/test_routing_replay.py)
    for replay in ("none", "training", "rollout"):
        validate(example("qwen3-30b-a3b_oar_g.yaml", "credit=grpo", "parallel.cp=2",
                         f"model.routing_replay={replay}"), hf_config=HF["qwen3-30b-a3b"])


def test_batch_must_divide():
    # rows per micro-batch divide each DP rank's rows under padded only; token budgets take any
    cfg = example("qwen2.5-7b_oar_g.yaml", "train.batching=padded", "train.micro_batch_size=3")
    with raises(r"train.prompts_per_step\*train.group_size = 512 .* train.micro_batch_size\*DP = 3\*4 "
                r"\(train.batching=padded\)"):
        validate(cfg, world_size=8)
    validate(example("qwen2.5-7b_oar_g.yaml", "train.micro_batch_size=3"), world_size=8)  # ignored
    with raises(r"train.prompts_per_step\*train.group_size = 315 samples per step is not divisible by "
                r"the data-parallel size 4"):
        validate(example("qwen2.5-7b_oar_g.yaml", "train.prompts_per_step=63", "train.group_size=5"), world_size=8)
    with raises(r"train.mini_batches=3 does not divide"):
        validate(example("qwen2.5-7b_oar_g.yaml", "train.mini_batches=3"), world_size=8)
    # 512 samples in 8 mini-batches of 64; micro 4 * DP 8 = 32 divides, micro 16 * DP 8 does not
    small = ("qwen2.5-math-1.5b_oar_g.yaml", "train.batching=padded", "train.mini_batches=8")
    validate(example(*small, "train.micro_batch_size=4"), world_size=8)
    with raises("in 8 mini-batches of 64"):
        validate(example(*small, "train.micro_batch_size=16"), world_size=8)


def test_batching_keys_mean_one_thing(tmp_path, caplog):
    """micro_batch_size: rows (padded); max_tokens_per_micro_batch: tokens (token_budget, packed),
    null = 4 full-length rows whatever micro_batch_size is; the attribution keys' null = the
    training ones (packed -> token_budget); a key its batching ignores is named in a warning."""
    cfg = load_config(None, ["data.max_prompt_tokens=100", "rollout.max_new_tokens=28",
                             "train.micro_batch_size=2"])
    assert cfg.micro_batch_tokens == 4 * 128  # not 2 x 128: micro_batch_size is rows, padded only
    a = cfg.attribution_config()
    assert (a.batching, a.micro_batch_size, a.max_tokens_per_micro_batch, a.max_tokens_per_copy_micro_batch,
            a.perturb_micro_batch_size) == ("token_budget", 2, 512, 512, 16)
    assert cfg.attribution.batching is None and cfg.attribution.max_tokens_per_micro_batch is None  # as set
    cfg = load_config(None, ["train.batching=packed", "train.max_tokens_per_micro_batch=300",
                             "attribution.max_tokens_per_copy_micro_batch=900"])
    a = cfg.attribution_config()
    assert (cfg.micro_batch_tokens, a.batching, a.max_tokens_per_micro_batch,
            a.max_tokens_per_copy_micro_batch) == (300, "token_budget", 300, 900)
    a = load_config(None, ["train.batching=padded", "train.micro_batch_size=3"]).attribution_config()
    assert (a.batching, a.micro_batch_size) == ("padded", 3)
    a = load_config(None, ["train.batching=padded", "attribution.batching=token_budget"]).attribution_config()
    assert a.batching == "token_budget"
    # the nulls survive a save: a later train.* override still reaches the attribution passes
    path = save_config(load_config(None, []), tmp_path / "config.yaml")
    again = load_config(path, ["train.max_tokens_per_micro_batch=999"])
    assert again.attribution.max_tokens_per_micro_batch is None
    assert again.attribution_config().max_tokens_per_micro_batch == 999

    def ignored(*overrides: str) -> str:
        caplog.clear()
        with caplog.at_level("WARNING", logger="megatron_oar.config"):
            validate(example("qwen2.5-7b_oar_g.yaml", *overrides), world_size=8)
        return caplog.text

    assert "is ignored" not in ignored()  # the examples set only the keys their batching reads
    assert "train.micro_batch_size=8 (rows; train.batching=token_budget" in ignored("train.micro_batch_size=8")
    assert "train.max_tokens_per_micro_batch=8192 (tokens; train.batching=padded" in ignored("train.batching=padded")
    text = ignored("attribution.micro_batch_size=2")
    assert "attribution.micro_batch_size=2 (rows; attribution.batching=token_budget, from train.batching" in text
    with raises("attribution.batching must be one of"):
        load_config(None, ["attribution.batching=packed"])


def test_lengths():
    with raises(r"data.max_prompt_tokens \+ rollout.max_new_tokens = 1024\+2048 exceeds "
                r"rollout.max_model_len=2048"):
        validate(example("qwen2.5-7b_oar_g.yaml", "rollout.max_new_tokens=2048"))
    with raises(r"rollout.max_model_len=8192 exceeds the model's max_position_embeddings=4096"):
        validate(example("qwen2.5-math-7b_oar_g.yaml", "rollout.max_model_len=8192"), world_size=8,
                 hf_config=HF["math-7b"])


@pytest.mark.parametrize("overrides, match", [
    (["model.fp8=hybrid"], r"model.fp8='hybrid' needs model.spec=te"),
    (["model.dtype=fp64"], r"model.dtype='fp64'"),
    (["model.path=''"], r"model.path: not set"),
    (["train.group_size=1"], r"train.group_size=1: must be >= 2"),
    (["data.train_files=[x.jsonl]"], r"data.train_files and data.synthetic: set exactly one"),
    (["data.synthetic=null"], r"data.train_files and data.synthetic: set exactly one"),
    (["data.synthetic.n=2"], r"data.synthetic.n=2: fewer problems than train.prompts_per_step=16"),
    (["data.synthetic.operators=^"], r"data.synthetic.operators"),
    (["data.template=nope"], r"data.template='nope'"),
    (["data.fields=nope"], r"data.fields='nope'"),
    (["rollout.temperature=-1"], r"rollout.temperature"),
    (["shaping.entropy_kappa=1.0", "credit=entropy"], r"shaping.entropy_kappa=1.0: must be > 1"),
    (["shaping.variant=signs"], r"shaping.variant='signs': must be one of \['paper', 'sign_aware'\]"),
    (["rewards.extractors=[nope]"], r"rewards.extractors"),
    (["loss.agg=seq_mean_token_sum_norm"], r"loss.norm_len"),
    (["loss.policy_loss=gspo"], r"loss.policy_loss=gspo with credit=oar_g: .* Use loss.policy_loss=gspo_token"),
    (["loss.policy_loss=gspo", "credit=entropy"], r"loss.policy_loss=gspo with credit=entropy"),
    # the trainer's log-probs are at rollout.temperature (issue 39, item 5): vLLM's must be too
    (["loss.rollout_correction=tis", "rollout.temperature=0.7", "rollout.max_logprob_mismatch=null"],
     r"loss.rollout_correction=tis .* rollout.temperature=0.7 .* use rollout.logprobs_mode=processed_logprobs"),
    (["rollout.temperature=0.7"],
     r"rollout.logprobs_mode='raw_logprobs' at rollout.temperature=0.7: .* rollout.max_logprob_mismatch=0.5"),
    (["rollout.temperature=0"], r"rollout.temperature=0.0: training samples"),
    (["rollout.top_p=0.9", "rollout.logprobs_mode=processed_logprobs"], r"rollout.top_p=0.9: .* set rollout.top_p=1"),
    (["rollout.top_k=20"], r"rollout.top_k=20: .* set rollout.top_k=0"),
    (["optim.lr_schedule=step"], r"optim.lr_schedule='step'"),
    (["optim.min_lr=1"], r"optim.min_lr=1.0"),
    (["optim.adam_beta2=1.0"], r"optim.adam_beta2=1.0"),
    (["checkpoint.keep_last=-1"], r"checkpoint.keep_last=-1"),
    (["checkpoint.optim_sharding=dp_zero"], r"checkpoint.optim_sharding='dp_zero'"),
    (["checkpoint.convert_timeout_minutes=0"], r"checkpoint.convert_timeout_minutes=0.0: must be > 0"),
    (["data.synthetic.eval_n=0"], r"train.eval_interval=10 needs an eval set"),
    (["train.eval_n=4"], r"train.eval_n=4 with train.eval_temperature=0"),
    (["train.eval_temperature=-1"], r"train.eval_temperature=-1"),
    (["train.eval_max_prompts=0"], r"train.eval_max_prompts=0"),
])
def test_validation_names_the_key(overrides, match):
    with raises(match):
        validate(example("tiny_cpu.yaml", *overrides), world_size=2, hf_config=HF["tiny"])


def test_rollout_temperature_with_processed_logprobs_trains():
    """At a rollout temperature other than 1, vLLM's processed log-probs are the trainer's
    policy's (both log_softmax(logits / T)): the mismatch check and every correction accept it."""
    for correction in ("none", "tis", "mis", "icepop"):
        validate(example("tiny_cpu.yaml", "rollout.temperature=0.7", "rollout.logprobs_mode=processed_logprobs",
                         f"loss.rollout_correction={correction}"), world_size=2, hf_config=HF["tiny"])
    validate(example("tiny_cpu.yaml", "rollout.top_k=-1", "loss.rollout_correction=tis"), world_size=2,
             hf_config=HF["tiny"])  # -1: off, as 0
    validate(example("tiny_cpu.yaml", "rollout.temperature=0.7", "rollout.max_logprob_mismatch=null"),
             world_size=2, hf_config=HF["tiny"])  # nothing compares vLLM's numbers


@pytest.mark.parametrize("credit", ["grpo", "oar_g", "oar_p"])
@pytest.mark.parametrize("loss", ["ppo_clip", "gspo_token", "cispo"])
def test_token_advantage_losses_compose_with_every_credit(credit, loss):
    validate(example("tiny_cpu.yaml", f"credit={credit}", f"loss.policy_loss={loss}",
                     "loss.rollout_correction=icepop"), world_size=2, hf_config=HF["tiny"])


def test_gspo_with_grpo_credit(caplog):
    cfg = example("tiny_cpu.yaml", "credit=grpo", "loss.policy_loss=gspo", "loss.agg=token_mean")
    validate(cfg, world_size=2, hf_config=HF["tiny"])
    assert "loss.agg=seq_mean_token_mean" in caplog.text  # the paper's aggregation, a warning


def test_fp8_with_te_spec_is_allowed():
    cfg = example("qwen2.5-7b_oar_g.yaml", "model.fp8=hybrid", "model.spec=te")
    validate(cfg, world_size=8, hf_config=HF["7b"])


# ------------------------------------------------- combinations megatron / TE cannot build (issue 15)

def test_fp8_needs_the_te_spec(monkeypatch):
    """FP8 autocast covers only TE modules: refused at validation, naming the keys, with ``auto``
    resolved for this machine first (local without CUDA/TE). Sequence parallelism runs under
    either spec (the local spec's norm supports it)."""
    import megatron_oar.config as config_module

    sp = ("qwen2.5-7b_oar_g.yaml", "parallel.sequence_parallel=true")
    validate(example(*sp, "model.spec=local"), world_size=8, hf_config=HF["7b"])
    monkeypatch.setattr(config_module, "resolve_spec", lambda opts: "local")  # a machine without TE
    validate(example(*sp), world_size=8, hf_config=HF["7b"])
    with raises(r"model.fp8='hybrid' needs model.spec=te .*model.spec='auto', which resolves to 'local'"):
        validate(example("qwen2.5-7b_oar_g.yaml", "model.fp8=hybrid"), world_size=8, hf_config=HF["7b"])
    with raises(r"model.fp8='hybrid' needs model.spec=te .*got model.spec='local'"):
        validate(example("qwen2.5-7b_oar_g.yaml", "model.fp8=hybrid", "model.spec=local"), world_size=8,
                 hf_config=HF["7b"])
    validate(example(*sp, "model.spec=te"), world_size=8, hf_config=HF["7b"])  # written for a cluster
    monkeypatch.setattr(config_module, "resolve_spec", lambda opts: "te")  # a machine with TE
    validate(example(*sp), world_size=8, hf_config=HF["7b"])
    validate(example("qwen2.5-7b_oar_g.yaml", "model.fp8=hybrid"), world_size=8, hf_config=HF["7b"])


def _fake_gpu(monkeypatch, capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_mxfp8_needs_blackwell(monkeypatch, caplog):
    """mxfp8 is refused on a pre-Blackwell GPU; where no GPU is visible it cannot be checked, so
    it is a warning (the model build on the GPU checks it again)."""
    cfg = ("qwen2.5-72b_oar_g.yaml", "model.fp8_recipe=mxfp8")
    with caplog.at_level("WARNING", logger="megatron_oar.config"):
        validate(example(*cfg), world_size=64, hf_config=HF["72b"])  # no GPU here
    assert "model.fp8_recipe=mxfp8 needs a Blackwell GPU" in caplog.text
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    with raises(r"model.fp8_recipe='mxfp8' needs a Blackwell GPU \(compute capability >= 10.0\); "
                r"this machine's NVIDIA H100 80GB HBM3 is sm_90"):
        validate(example(*cfg), world_size=64, hf_config=HF["72b"])
    validate(example("qwen2.5-72b_oar_g.yaml"), world_size=64, hf_config=HF["72b"])  # delayed
    validate(example(*cfg, "model.fp8=null"), world_size=64, hf_config=HF["72b"])  # FP8 off
    _fake_gpu(monkeypatch, (10, 0), "NVIDIA B200")
    validate(example(*cfg), world_size=64, hf_config=HF["72b"])


def test_attribution_fp8_with_data_parallel_is_refused():
    """TE's amax reduction spans TP x DP at each FP8 autocast exit, and DP ranks score different
    numbers of sequences: allow_fp8 with DP > 1 could hang, so it is refused naming both."""
    fp8 = ("qwen2.5-7b_oar_g.yaml", "model.spec=te", "model.fp8=hybrid", "attribution.allow_fp8=true")
    with raises(r"attribution.allow_fp8=true with model.fp8='hybrid' and data-parallel size 4 "
                r"\(world size 8 / parallel.tp\*parallel.pp = 2\*1\) can deadlock"):
        validate(example(*fp8), world_size=8, hf_config=HF["7b"])
    with raises(r"attribution.allow_fp8=true .* data-parallel size 2"):
        validate(example("qwen2.5-72b_oar_g.yaml", "attribution.allow_fp8=true"), world_size=64,
                 hf_config=HF["72b"])
    validate(example(*fp8), world_size=2, hf_config=HF["7b"])  # DP 1
    validate(example(*fp8, "model.fp8=null"), world_size=8, hf_config=HF["7b"])  # nothing in FP8
    validate(example(*fp8, "credit=grpo"), world_size=8, hf_config=HF["7b"])  # no attribution
    validate(example(fp8[0], *fp8[1:3]), world_size=8, hf_config=HF["7b"])  # attribution in bf16


# ------------------------------------------------------------------------------ save and load

@pytest.mark.parametrize("name", sorted(CASES))
def test_save_load_round_trip(tmp_path, name):
    cfg = example(name, "credit=oar_p", "parallel.sequence_parallel=true", "data.limit=10")
    out = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert out.read_text().startswith("# ")
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no temp file left
    again = load_config(out, [])
    assert again == cfg
    for f in fields(Config):
        assert type(getattr(again, f.name)) is type(getattr(cfg, f.name))
    assert "sequence_parallel" not in OmegaConf.load(out).model  # one key: parallel.sequence_parallel


def test_save_overwrites_atomically(tmp_path):
    path = tmp_path / "config.yaml"
    save_config(example("tiny_cpu.yaml"), path)
    save_config(example("tiny_cpu.yaml", "train.steps=7"), path)
    assert load_config(path, []).train.steps == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


# ------------------------------------------------- rollout placement (issue 43), milliseconds

@pytest.mark.parametrize("overrides, world, match", [
    (["rollout.placement=apart"], 3, r"rollout.placement='apart': expected one of \['colocated', 'separate'\]"),
    (["rollout.placement=separate"], 3, r"rollout.ranks=0: rollout.placement=separate needs >= 1"),
    (["rollout.placement=separate", "rollout.ranks=3"], 3,
     r"rollout.ranks=3: leaves 0 training ranks of the world size 3"),
    (["rollout.placement=separate", "rollout.ranks=1", "rollout.tp=2"], 3,
     r"rollout.tp=2 does not divide rollout.ranks=1"),
    # TP2 training over the 3 - 1 = 2 training ranks fits; over 3 - 2 = 1 it does not
    (["rollout.placement=separate", "rollout.ranks=2"], 3,
     r"parallel.tp\*parallel.pp = 2\*1 does not divide the training ranks 1 \(world size 3 - rollout.ranks=2\)"),
    (["rollout.ranks=1"], 3, r"rollout.ranks=1: needs rollout.placement=separate"),
    (["rollout.max_staleness=1"], 2, r"rollout.max_staleness=1: needs rollout.placement=separate"),
    (["rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=-1"], 3,
     r"rollout.max_staleness=-1: must be an integer >= 0"),
    (["rollout.partial_tokens=4"], 2, r"rollout.partial_tokens=4: needs rollout.placement=separate"),
    (["rollout.placement=separate", "rollout.ranks=1", "rollout.partial_tokens=0"], 3,
     r"rollout.partial_tokens=0: must be an integer >= 1"),
    (["rollout.placement=separate", "rollout.ranks=2", "parallel.tp=1", "rollout.partial_tokens=4"], 3,
     r"rollout.partial_tokens=4 with rollout.ranks=2 and rollout.tp=1: partial rollouts need one engine"),
])
def test_rollout_placement_is_validated(overrides, world, match):
    with raises(match):
        validate(example("tiny_cpu.yaml", *overrides), world_size=world, hf_config=HF["tiny"])


def test_separate_placement_splits_the_world():
    cfg = example("tiny_cpu.yaml", "rollout.placement=separate", "rollout.ranks=1",
                  "rollout.max_staleness=1")
    validate(cfg, world_size=3, hf_config=HF["tiny"])  # 2 training ranks (TP2) + 1 rollout rank
    assert cfg.rollout.training_world_size(3) == 2
    assert RolloutConfig().training_world_size(3) == 3  # colocated: every rank trains
