"""`oar plan`: parameter counts equal megatron-core's GPTModel, every example fits its cluster,
the memory terms follow their documented formulas, and bad layouts are refused.

Mixture of experts (Qwen3-MoE): per-rank parameter counts equal a meta-device GPTModel with MoE
layers (a tiny model, one with dense and MoE layers, and a 30B-A3B-wide one cut to 2 layers) at
TP1 and per rank at TP2 x EP2 x PP2 (ETP1); the presets' total and active parameters equal
transformers' model on the meta device and the model cards; expert memory, the optimizer's
expert-DP sharding, the dispatcher's and the weight sync's bytes by hand. Long responses: the
longest-response search against the FITS line, chosen token budgets at their boundary (the same
in `oar train`'s start), exact OAR-P's cost warning at its threshold (about 5 s together, no
processes). Context parallelism: per-rank activations, the K/V traffic by hand, DP and the
optimizer's shards with CP, the CP knob and advice only where the credit runs under CP, and
`oar train`'s budget under CP (about 10 s together, no processes). Cost: the fast tests about
30 s on 2 cores (the meta-device builds about 2 s); the slow one runs in one pooled world of 4 gloo ranks (about 10 s).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_oar.commands import plan as P
from megatron_oar.commands.plan import activations
from megatron_oar.config import ConfigError, load_config, validate
from megatron_oar.models import ModelConfigError, parse_arch
from megatron_oar.models.presets import PRESETS, preset_name, resolve_hf_config
from megatron_oar.repro.demo_model import DEMO_ARCH
from tests.distributed import launch
from tests.tiny import SMALL_QWEN3_MOE

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GPU_EXAMPLES = [p for p in EXAMPLES if not p.stem.startswith("tiny")]
TINY = {**DEMO_ARCH, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": 300, "tie_word_embeddings": False}
# a 7B-wide model cut to 2 layers (1.56B parameters) and a tied 1.5B-wide one: mid-sized shapes
MID = dict(PRESETS["qwen2.5-7b"], num_hidden_layers=2)
MID_TIED = dict(PRESETS["qwen2.5-1.5b"], num_hidden_layers=2)
# Qwen3: head_dim 128 != hidden / heads, q/k norms, no q/k/v bias; tied (0.6B) and untied (8B)
QWEN3_TIED = dict(PRESETS["qwen3-0.6b"], num_hidden_layers=2)
QWEN3 = dict(PRESETS["qwen3-8b"], num_hidden_layers=2)
# Qwen3-MoE: tiny (4 experts, top-2, every layer MoE), tiny with dense layers 0 and 2
# (decoder_sparse_step 2), and 30B-A3B's widths (128 experts of 768, top-8) cut to 2 layers
MOE_TINY = {**SMALL_QWEN3_MOE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "tie_word_embeddings": False}
MOE_MIXED = dict(MOE_TINY, num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False)
MOE_30B = dict(PRESETS["qwen3-30b-a3b"], num_hidden_layers=2)


def _gpt_params(hf: dict) -> int:
    from megatron_oar.models import ModelOptions, build_gpt_model

    with torch.device("meta"):
        model = build_gpt_model(hf, ModelOptions(dtype="bf16"), perform_initialization=False,
                                use_cpu_initialization=True)  # meta alone would not keep CUDA off
    return sum(p.numel() for p in model.parameters())


def _gpt_params_moe_tp(hf: dict) -> int:
    """:func:`_gpt_params` of a MoE model at TP > 1, which megatron builds only with sequence
    parallelism, and megatron's torch norm (the local spec, CPU) refuses that. Parameter shapes
    do not depend on it: the TransformerConfig is made with SP on (megatron's MoE check passes)
    and the layers are built with it off (the norms build)."""
    from megatron_oar.models import builder

    make_config, check_spec = builder.transformer_config, builder.check_spec_features

    def config_without_sp(*args, **kwargs):
        config = make_config(*args, **kwargs)
        config.sequence_parallel = False
        return config

    builder.transformer_config, builder.check_spec_features = config_without_sp, lambda *a: None
    try:
        with torch.device("meta"):
            model = builder.build_gpt_model(
                hf, builder.ModelOptions(dtype="bf16", sequence_parallel=True),
                perform_initialization=False, use_cpu_initialization=True)
    finally:  # the pooled worker runs other tests next
        builder.transformer_config, builder.check_spec_features = make_config, check_spec
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("hf", [TINY, MID, MID_TIED, QWEN3, QWEN3_TIED, MOE_TINY, MOE_MIXED, MOE_30B],
                         ids=["tiny", "7b-wide", "1.5b-wide-tied", "qwen3-8b-wide", "qwen3-0.6b-wide-tied",
                              "moe-tiny", "moe-dense-and-moe-layers", "qwen3-30b-a3b-wide"])
def test_param_count_equals_gptmodel(hf):
    from megatron_oar.runtime import destroy_runtime, init_runtime

    init_runtime()
    try:
        assert P.stage_params(parse_arch(hf), 1, 1, 0) == _gpt_params(hf)
    finally:
        destroy_runtime()


def _rank_count_worker(hfs: list[dict], tp: int, pp: int, ep: int, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=1))
    rows = [[ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
             _gpt_params_moe_tp(hf) if "num_experts" in hf else _gpt_params(hf)] for hf in hfs]
    Path(out, f"{torch.distributed.get_rank()}.json").write_text(json.dumps(rows))


@pytest.mark.slow
def test_param_count_per_rank_tp2_pp2(tmp_path):
    """Per-rank counts of a real TP2xPP2 GPTModel (first stage: embedding; last stage: final norm,
    output layer, and for tied embeddings the embedding's copy), and of MoE models at TP2 x EP2 x
    PP2 with ETP1 (each rank: half the experts of its stage's MoE layers, whole; the router whole;
    the attention split by TP). One world of 4 ranks for all of them."""
    hfs = [dict(TINY, num_hidden_layers=4), dict(MID_TIED, num_hidden_layers=4), MID,
           dict(QWEN3_TIED, num_hidden_layers=4), dict(MOE_TINY, num_hidden_layers=4), MOE_MIXED,
           dict(MOE_30B, num_hidden_layers=4)]
    launch(_rank_count_worker, 4, hfs, 2, 2, 2, str(tmp_path))
    seen = set()
    for f in tmp_path.glob("*.json"):
        for hf, (stage, ep_rank, count) in zip(hfs, json.loads(f.read_text())):
            a = parse_arch(hf)
            assert P.stage_params(a, 2, 2, stage, ep=2 if a.is_moe else 1, etp=1) == count, (hf, stage)
            seen.add((stage, ep_rank))
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_total_params_match_model_cards():
    billions = {k: P.total_params(parse_arch(v)) / 1e9 for k, v in PRESETS.items()}
    # the model cards' "Number of Parameters"
    for key, card in {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09,
                      "qwen2.5-7b": 7.61, "qwen2.5-14b": 14.7, "qwen2.5-72b": 72.7}.items():
        assert billions[key] == pytest.approx(card, rel=0.01), key
    # Qwen3's cards give the total and the non-embedding count, to the digits compared here
    for key, (total, body, digits) in {"qwen3-0.6b": (0.6, 0.44, 2), "qwen3-1.7b": (1.7, 1.4, 1),
                                       "qwen3-4b": (4.0, 3.6, 1), "qwen3-8b": (8.2, 6.95, 2),
                                       "qwen3-14b": (14.8, 13.2, 1), "qwen3-32b": (32.8, 31.2, 1)}.items():
        a = parse_arch(PRESETS[key])
        assert round(billions[key], 1) == total, key
        assert round(a.num_layers * P.layer_params(a) / 1e9, digits) == body, key


def _tiny_model_dir(tmp_path: Path, positions: int = 0) -> Path:
    """A stand-in tiny model's config.json, with at least ``positions`` positions."""
    d = tmp_path / "tiny"
    d.mkdir()
    config = {**TINY, "max_position_embeddings": max(TINY["max_position_embeddings"], positions)}
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_validates_for_its_cluster(path, tmp_path):
    overrides = []
    if path.stem.startswith("tiny"):  # the tiny model each runs with: `oar repro` sizes its
        # position table to the config's prompt + response budget
        from megatron_oar.repro.runner import positions_for

        overrides = [f"model.path={_tiny_model_dir(tmp_path, positions_for(load_config(path)))}"]
    cfg = load_config(path, overrides)
    hf, _ = resolve_hf_config(cfg.model.path)
    validate(cfg, world_size=cfg.launch.world_size, hf_config=hf)


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=[p.stem for p in GPU_EXAMPLES])
def test_every_gpu_example_fits_its_cluster(path, capsys):
    assert P.main(["--config", str(path)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "FITS: peak" in out and "| **step** |" in out


def test_summary_table_and_json(capsys):
    paths = [str(ROOT / f"examples/qwen2.5-{s}_oar_g.yaml") for s in ("7b", "32b", "72b")]
    assert P.main(["--config", *paths]) == 0
    out = capsys.readouterr().out
    assert out.startswith(P.SUMMARY_HEADER.splitlines()[0])
    assert out.count("| fits |") == 3
    assert P.main(["--config", paths[2], "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["qwen2.5-72b_oar_g"]
    assert data["layout"] == {**data["layout"], "tp": 8, "pp": 4, "dp": 2, "gpus": 64}
    assert data["fits"] and data["params_b"] == pytest.approx(72.7, rel=0.01)


def _plan(example: str, *overrides: str, nodes=None, gpus_per_node=None, **hw):
    cfg = load_config(ROOT / f"examples/{example}.yaml", list(overrides))
    hf, source = resolve_hf_config(cfg.model.path)
    return P.make_plan(cfg, hf, nodes=nodes or cfg.launch.nodes,
                       gpus_per_node=gpus_per_node or cfg.launch.gpus_per_node,
                       hw=P.Hardware(**hw), source=source)


def test_resident_state_bytes_per_parameter():
    """bf16 weights 2 + fp32 grads 4 + Adam 12/DP (Megatron-LM's distributed optimizer notes)."""
    pl = _plan("qwen2.5-7b_oar_g")  # TP2, DP4
    a = parse_arch(PRESETS["qwen2.5-7b"])
    n = P.stage_params(a, 2, 1, 0) / P.GIB
    assert pl.memory_gib["weights"] == pytest.approx(2 * n)
    assert pl.memory_gib["gradients"] == pytest.approx(4 * n)
    assert pl.memory_gib["optimizer"] == pytest.approx(12 / 4 * n)
    plain = _plan("qwen2.5-7b_oar_g", "optim.use_distributed_optimizer=false")
    assert plain.memory_gib["optimizer"] == pytest.approx(12 * n)
    kl = _plan("qwen2.5-7b_oar_g", "loss.kl_coef=0.001")
    assert kl.memory_gib["reference model"] == pytest.approx(2 * n)


def test_layer_activation_formula_by_hand():
    a = parse_arch(TINY)  # h 128, f 256, heads 2 x d 64, KV groups 2
    h, f = 128, 256
    s, b = 10, 3
    sharded = (2 + 2 * 2) * 64 + 2 * 64 + 3 * f
    flash = 2 * (4 * h + sharded) * s * b
    assert activations._layer_act_bytes(a, s, b, 1, False, True) == flash
    assert activations._layer_act_bytes(a, s, b, 1, False, False) == flash + 6 * 2 * s * s * b
    assert activations._layer_act_bytes(a, s, b, 2, False, True) == 2 * (4 * h + sharded / 2) * s * b
    assert activations._layer_act_bytes(a, s, b, 2, True, True) == 2 * (4 * h + sharded) / 2 * s * b


def test_activation_levers_reduce_memory():
    a = parse_arch(PRESETS["qwen2.5-32b"])
    kw = dict(s=2048, b=2, tp=8, pp=2, flash=True, microbatches=64)
    none = P.update_activation_bytes(a, sp=False, recompute=None, **kw)
    sp = P.update_activation_bytes(a, sp=True, recompute=None, **kw)
    full = P.update_activation_bytes(a, sp=True, recompute="full", **kw)
    assert full < sp < none
    # 1F1B: the first stage holds pp micro-batches, never more than there are
    one = P.update_activation_bytes(a, sp=True, recompute=None, **{**kw, "microbatches": 1})
    assert sp == pytest.approx(2 * one)
    # local spec without selective recompute stores the attention matrix
    local = P.update_activation_bytes(a, sp=True, recompute=None, **{**kw, "flash": False})
    selective = P.update_activation_bytes(a, sp=True, recompute="selective", **{**kw, "flash": False})
    assert selective == sp < local


def test_only_unfused_attention_keeps_the_attention_matrix():
    """SDPA (the local spec's default) and TE's attention keep no s x s matrix; the plan counts one
    only for ``model.attention=unfused``."""
    path = EXAMPLES[0]
    for spec, attention, flash in (("te", "auto", True), ("local", "auto", True), ("local", "sdpa", True),
                                   ("local", "unfused", False), ("te", "unfused", False)):
        cfg = load_config(path, [f"model.spec={spec}", f"model.attention={attention}"])
        assert activations._act_setup(cfg)[3] is flash, (spec, attention)


def test_vllm_kv_cache_by_hand():
    pl = _plan("qwen2.5-7b_oar_g")  # rollout TP1, 0.5 of 80 GiB, 28 layers x 4 KV heads x 128
    weights = P.total_params(parse_arch(PRESETS["qwen2.5-7b"])) * 2
    kv = 40 * P.GIB - weights - P.VLLM_OVERHEAD_GIB * P.GIB
    assert pl.vllm["kv_tokens"] == int(kv // (2 * 28 * 4 * 128 * 2))
    assert pl.vllm["sequences_per_engine"] == 64  # 512 completions over 8 engines


def test_verdicts_name_the_reason():
    small = _plan("qwen2.5-7b_oar_g", gpu_mem_gib=40.0)
    assert not small.fits and any(r.startswith("phases ") and "generate" in r and "> 40 GiB" in r
                                  for r in small.reasons)
    one_node = _plan("qwen2.5-72b_oar_g", "parallel.pp=1", "rollout.tp=8", nodes=1)
    assert not one_node.fits and one_node.advice
    no_kv = _plan("qwen2.5-72b_oar_g", "rollout.tp=2", "rollout.gpu_memory_utilization=0.3")
    assert not no_kv.fits and any("leave no KV cache" in r for r in no_kv.reasons)
    text = P.render(no_kv, "x")
    assert "DOES NOT FIT" in text and "try:" in text


def test_weight_sync_bytes_per_rank_by_hand():
    """72B at TP8 x PP4 with vLLM TP8, bf16: the worst rank is a middle stage. Full tensors: it
    all-gathers 7/8 of its 20 layers' sharded tensors and receives the other 3 stages whole
    (60 layers, embedding, lm_head, final norm); as shards, only 1/8 of theirs (vLLM's 64-row
    vocabulary padding, 19008 rows per rank, matches Megatron's 128: the vocabulary goes as
    shards too) plus the replicated norms."""
    a = parse_arch(PRESETS["qwen2.5-72b"])
    h, d, f, V = 8192, 128, 29568, 152064
    qkv = (64 + 2 * 8) * d
    sharded, norms = qkv * h + h * 64 * d + 3 * f * h + qkv, 2 * h
    full_gather, full_bcast = 20 * sharded * 7 // 8, 60 * (sharded + norms) + 2 * V * h + h
    shard_bcast = 60 * (sharded // 8 + norms) + 2 * V * h // 8 + h
    pl = _plan("qwen2.5-72b_oar_g")
    full = _plan("qwen2.5-72b_oar_g", "rollout.sync_shards=false")
    assert (a.num_heads, a.num_kv_heads, a.intermediate_size, a.vocab_size) == (64, 8, f, V)
    assert pl.sync["shards"] and not full.sync["shards"]
    assert full.sync["tp_gather"] == pytest.approx(2 * full_gather / P.GIB)
    assert full.sync["pp_broadcast"] == pytest.approx(2 * full_bcast / P.GIB)
    assert pl.sync["tp_gather"] == 0 and pl.sync["pp_broadcast"] == pytest.approx(2 * shard_bcast / P.GIB)
    assert pl.sync["full_tensors_gib"] == full.sync["total"] > 10 * pl.sync["total"]
    assert (f"weight sync: {pl.sync['total']:.2f} GiB received per rank per step (of which TP gather "
            f"0.00, PP broadcast {pl.sync['total']:.2f}), as shards; full tensors would be "
            f"{full.sync['total']:.2f} GiB") in P.render(pl, "x")
    assert not _plan("qwen2.5-7b_oar_g").sync["shards"]  # TP2 training, vLLM TP1


def test_oar_p_costs_a_forward_per_scored_token():
    g, p = _plan("qwen2.5-7b_oar_g", "model.recompute=null"), _plan("qwen2.5-7b_oar_p")
    assert p.flops["attribution"] == pytest.approx(g.flops["attribution"] / 2 * 1024)
    # full recompute: one more forward in OAR-G's input-gradient backward, as in the update's
    full = _plan("qwen2.5-7b_oar_g", "model.recompute=full")
    assert full.flops["attribution"] == pytest.approx(g.flops["attribution"] * 3 / 2)
    assert full.flops["update"] == pytest.approx(g.flops["update"] * 4 / 3)
    grpo = _plan("qwen2.5-7b_oar_g", "credit=grpo")
    assert "attribution" not in grpo.time_s and grpo.flops["update"] == full.flops["update"]


def test_cli_refuses_bad_layouts(capsys):
    cfg = str(ROOT / "examples/qwen2.5-7b_oar_g.yaml")
    assert P.main(["--config", cfg, "parallel.tp=8"]) == 2
    assert "parallel.tp=8 does not divide num_attention_heads=28" in capsys.readouterr().err
    big = str(ROOT / "examples/qwen2.5-72b_oar_g.yaml")  # 64 heads, 8 KV groups
    assert P.main(["--config", big, "parallel.tp=16"]) == 2
    assert "parallel.tp=16 does not divide num_key_value_heads=8" in capsys.readouterr().err
    assert P.main(["--config", cfg, "--gpus-per-node", "10", "parallel.pp=5"]) == 2
    assert "parallel.pp=5 does not divide num_hidden_layers=28" in capsys.readouterr().err
    assert P.main(["--config", cfg, "--nodes", "1", "--gpus-per-node", "3"]) == 2
    assert "does not divide the world size 3" in capsys.readouterr().err
    assert P.main(["--config", cfg, "--nodes", "3", "--gpus-per-node", "2"]) == 2  # DP 3
    assert "512 samples per step is not divisible by the data-parallel size 3" in capsys.readouterr().err
    assert P.main(["--config", cfg, "--nodes", "3", "--gpus-per-node", "2", "train.batching=padded"]) == 2
    assert "is not divisible by train.micro_batch_size*DP = 4*3" in capsys.readouterr().err
    assert P.main(["--config", cfg, "model.path=/nowhere/custom"]) == 2
    assert "pass --arch" in capsys.readouterr().err


def test_presets_and_names(tmp_path):
    assert preset_name("models/Qwen2.5-Math-7B-Instruct") == "qwen2.5-math-7b"
    assert preset_name("x/llama") is None
    d = _tiny_model_dir(tmp_path)
    hf, source = resolve_hf_config(d)
    assert hf["hidden_size"] == 128 and source.endswith("config.json")
    assert resolve_hf_config("anything", "Qwen2.5-32B")[0]["num_hidden_layers"] == 64
    with pytest.raises(ModelConfigError, match="--arch 'qwen9'"):
        resolve_hf_config("anything", "qwen9")


def test_launch_section_validation():
    cfg = load_config(ROOT / "examples/qwen2.5-72b_oar_g.yaml")
    assert cfg.launch.world_size == 64 and cfg.launch.executor == "slurm"
    for bad, key in (("launch.nodes=0", "launch.nodes"), ("launch.executor=k8s", "launch.executor"),
                     ("launch.slurm.time=3h", "launch.slurm.time")):
        with pytest.raises(ConfigError, match=key):
            validate(load_config(ROOT / "examples/qwen2.5-72b_oar_g.yaml", [bad]))
    assert replace(P.Hardware(), gpu_mem_gib=141).gpu_mem_gib == 141


LONG_TABLE = ["qwen2.5-7b_oar_g", "qwen2.5-7b_oar_p", "qwen2.5-14b_oar_g", "qwen2.5-32b_oar_g",
              "qwen2.5-72b_oar_g", "qwen3-8b_oar_g_long", "qwen3-30b-a3b_oar_g", "qwen3-235b-a22b_oar_g"]


def test_scaling_doc_tables_are_current(capsys):
    """docs/scaling.md pastes `oar plan` outputs (dense and MoE), each under the command that prints it;
    regenerate them with those commands when the plan changes."""
    doc = (ROOT / "docs" / "scaling.md").read_text()
    names = ["qwen2.5-7b_oar_g", "qwen2.5-14b_oar_g", "qwen2.5-32b_oar_g", "qwen2.5-72b_oar_g"]
    moe = ["qwen3-30b-a3b_oar_g", "qwen3-235b-a22b_oar_g"]
    for configs in (names, ["qwen2.5-72b_oar_g"], moe, ["qwen3-30b-a3b_oar_g"], ["qwen3-235b-a22b_oar_g"]):
        assert P.main(["--config", *(str(ROOT / f"examples/{n}.yaml") for n in configs)]) == 0
        out = capsys.readouterr().out.strip()
        command = "oar plan --config " + " ".join(f"examples/{n}.yaml" for n in configs)
        assert command in doc, f"docs/scaling.md no longer shows `{command}`"
        assert out in doc, f"docs/scaling.md is stale: paste the output of `{command}`"
    table = [f"examples/{n}.yaml" for n in LONG_TABLE]
    assert P.main(["--table", "--config", *(str(ROOT / t) for t in table)]) == 0
    out, command = capsys.readouterr().out.strip(), "oar plan --table --config " + " ".join(table)
    assert command in doc and out in doc, f"docs/scaling.md is stale: paste the output of `{command}`"


def test_time_and_memory_follow_the_batching():
    """Padded micro-batches run every sequence at the longest length, token budgets at its own:
    with responses shorter than the maximum the Megatron passes cost less by exactly the FLOPs
    ratio; a smaller attribution budget holds fewer rows, so less activation memory."""
    from megatron_oar.models.flops import forward_flops

    def plan(*overrides):
        cfg = load_config(ROOT / "examples/qwen2.5-7b_oar_g.yaml", list(overrides))
        hf, source = resolve_hf_config(cfg.model.path)
        return cfg, P.make_plan(cfg, hf, nodes=cfg.launch.nodes, gpus_per_node=cfg.launch.gpus_per_node,
                                hw=P.Hardware(), source=source, response_tokens=256)

    cfg, budget = plan()
    _, padded = plan("train.batching=padded", "attribution.batching=padded")
    a = parse_arch(PRESETS["qwen2.5-7b"])
    short, longest = cfg.data.max_prompt_tokens + 256, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    for phase in ("logprob", "update", "attribution"):
        assert padded.flops[phase] / budget.flops[phase] == pytest.approx(
            forward_flops(a, [longest]) / forward_flops(a, [short]))
    assert budget.flops["generate"] == padded.flops["generate"]
    # more short rows fit a token budget: fewer micro-batches per rank
    assert budget.layout["micro_batches_per_rank"] < padded.layout["micro_batches_per_rank"]
    _, small = plan(f"attribution.max_tokens_per_micro_batch={short}")
    assert small.memory_gib["activations: attribution"] < budget.memory_gib["activations: attribution"]


# ------------------------------------------------------------------------------ mixture of experts

def test_moe_presets_equal_transformers_and_model_cards():
    """Total parameters equal transformers' Qwen3MoeForCausalLM on the meta device; total,
    activated and non-embedding counts equal the model cards (30.5B / 3.3B / 29.9B and
    235B / 22B / 234B)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    for key, (total, active, body, digits) in {"qwen3-30b-a3b": (30.5, 3.3, 29.9, 1),
                                               "qwen3-235b-a22b": (235, 22, 234, 0)}.items():
        hf = PRESETS[key]
        a = parse_arch(hf)
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in hf.items()
                                                          if k != "architectures"}))
        assert P.total_params(a) == sum(p.numel() for p in model.parameters()), key
        embeddings = 2 * a.vocab_size * a.hidden_size
        tol = 0.6 * 10 ** -digits  # the cards truncate (3.35B active: "3.3B") or round
        assert P.total_params(a) / 1e9 == pytest.approx(total, abs=tol), key
        assert P.active_params(a) / 1e9 == pytest.approx(active, abs=tol), key
        assert (P.total_params(a) - embeddings) / 1e9 == pytest.approx(body, abs=tol), key
    dense = parse_arch(PRESETS["qwen3-8b"])
    assert P.active_params(dense) == P.total_params(dense)


def test_moe_resident_state_shards_experts_over_expert_dp():
    """30B-A3B at TP4 x EP8 on 8 GPUs: the dense parameters' Adam state is split over DP 2, the
    experts' over expert-DP 1 (each rank owns 16 whole experts); at EP4 expert-DP is 2."""
    a = parse_arch(PRESETS["qwen3-30b-a3b"])
    pl = _plan("qwen3-30b-a3b_oar_g")
    dense, experts = P.stage_param_split(a, 4, 1, 0, ep=8, etp=1)
    assert (dense, experts) == (48 * ((2048 * 5120 + 4096 * 2048) // 4 + 2 * 2048 + 2 * 128 + 128 * 2048)
                                + 2 * 151936 * 2048 // 4 + 2048, 48 * 16 * 3 * 2048 * 768)
    assert pl.layout == {**pl.layout, "tp": 4, "dp": 2, "ep": 8, "etp": 1, "edp": 1}
    assert pl.memory_gib["weights"] == pytest.approx(2 * (dense + experts) / P.GIB)
    assert pl.memory_gib["gradients"] == pytest.approx(4 * (dense + experts) / P.GIB)
    assert pl.memory_gib["optimizer"] == pytest.approx((12 * dense / 2 + 12 * experts) / P.GIB)
    assert pl.moe["expert_state_gib_per_rank"] == pytest.approx(18 * experts / P.GIB)
    ep4 = _plan("qwen3-30b-a3b_oar_g", "parallel.ep=4")
    assert ep4.layout["edp"] == 2 and ep4.moe["experts_per_rank"] == 32
    assert ep4.memory_gib["optimizer"] == pytest.approx((12 * dense / 2 + 12 * 2 * experts / 2) / P.GIB)
    plain = _plan("qwen3-30b-a3b_oar_g", "optim.use_distributed_optimizer=false")
    assert plain.memory_gib["optimizer"] == pytest.approx(12 * (dense + experts) / P.GIB)


def test_moe_dispatcher_and_weight_sync_bytes_by_hand():
    from megatron_oar.commands.plan import moe as plan_moe

    a = parse_arch(PRESETS["qwen3-30b-a3b"])
    row = 8 * 2048 * 2  # top-8 copies of a bf16 token
    pl = _plan("qwen3-30b-a3b_oar_g")
    assert pl.moe["dispatcher_kib_per_token_layer"] == {"all_to_all": 2 * row * 7 / 8 / 1024,
                                                        "etp_gather": 0.0, "total": 2 * row * 7 / 8 / 1024}
    assert plan_moe.dispatcher_bytes_per_token(a, 4, 2, 2) == {
        "all_to_all": 2 * row * 3 / 4, "etp_gather": 2 * row, "total": 2 * row * 3 / 4 + 2 * row}
    # full tensors (vLLM TP8 != TP4), one stage: TP4 all-gathers 3/4 of the attention linears and
    # of the embedding and output layer; the experts travel as vLLM TP8 slices, each rank
    # receiving over EP8 its slice (1/8) of the other 7/8 of them
    attention = (40 * 128 * 2048) * 3 // 4 + (2048 * 4096) * 3 // 4
    tp_gather = 48 * attention + 2 * (151936 * 2048 * 3 // 4)
    ep_gather = 48 * (128 * 3 * 2048 * 768 * 7 // 8) // 8
    assert not pl.sync["shards"] and pl.sync["pp_broadcast"] == 0 and pl.sync["expert_tp"] == 8
    assert pl.sync["tp_gather"] == pytest.approx(2 * tp_gather / P.GIB)
    assert pl.sync["ep_gather"] == pytest.approx(2 * ep_gather / P.GIB)
    assert "EP gather 5.91), experts as 1/8 slices; full tensors would be 49.39 GiB" in P.render(pl, "x")
    # vLLM's reload holds one MoE layer's experts: 128 x (gate, up, down) compact frames of
    # (2048 + 8 - 1) x 768 / 8 elements, 1/8 of the whole 1.125 GiB
    assert pl.sync["moe_layer_reload_gib"] == pytest.approx(2 * 128 * 3 * (2048 + 7) * 96 / P.GIB)
    whole = _plan("qwen3-30b-a3b_oar_g", "rollout.sync_shards=false")
    assert whole.sync["expert_tp"] == 1 and whole.sync["ep_gather"] == pytest.approx(47.25, abs=0.01)
    assert whole.sync["moe_layer_reload_gib"] == pytest.approx(2 * 128 * 3 * 2048 * 768 / P.GIB)
    # 235B at PP2 (vLLM TP16: full tensors but the experts' 1/16 slices; the 64 ranks of a stage
    # hold every vLLM TP rank alike), the worst rank on stage 0: it receives stage 1's 47 layers
    # (attention, its 2 norms and the q/k norms, the router whole, the 128 experts' slices), the
    # final norm and the output layer
    experts = 128 * 3 * 4096 * 1536
    layer = (72 * 128) * 4096 + 4096 * (64 * 128) + 2 * 4096 + 2 * 128 + 128 * 4096 + experts // 16
    big = _plan("qwen3-235b-a22b_oar_g")
    assert big.sync["ep_gather"] == pytest.approx(2 * 47 * (experts * 63 // 64) // 16 / P.GIB)
    assert big.sync["pp_broadcast"] == pytest.approx(2 * (47 * layer + 4096 + 151936 * 4096) / P.GIB)


def test_moe_plan_flops_by_active_parameters_and_render():
    from megatron_oar.models.flops import matmul_params

    a = parse_arch(PRESETS["qwen3-30b-a3b"])
    pl = _plan("qwen3-30b-a3b_oar_g")
    # the MFU denominator: a token's matmuls use attention, router and 8 of 128 experts
    assert matmul_params(a) == 48 * (2048 * 5120 + 4096 * 2048 + 128 * 2048 + 8 * 3 * 2048 * 768) \
        + 151936 * 2048
    assert matmul_params(a) < P.active_params(a) < P.total_params(a) / 9
    assert pl.params_b == pytest.approx(30.53, abs=0.01) and pl.active_params_b == pytest.approx(3.35, abs=0.01)
    text = P.render(pl, "qwen3-30b-a3b_oar_g")
    assert "30.53B parameters, 3.35B active" in text and "EP 8 x ETP 1 (expert DP 1)" in text
    assert "(16 experts per MoE layer per EP rank)" in text and "56.0 KiB received per rank" in text
    # one node is the edge: a smaller vLLM share leaves no room for a KV cache
    tiny_kv = _plan("qwen3-30b-a3b_oar_g", "rollout.gpu_memory_utilization=0.1")
    assert not tiny_kv.fits
    # a second node doubles DP and expert-DP: the Adam state per GPU shrinks
    two = _plan("qwen3-30b-a3b_oar_g", nodes=2)
    assert two.fits and two.layout["edp"] == 2 and two.peak_gib < pl.peak_gib - 20


# ------------------------------------------------------------------------------ long responses

def _cfg_hf(example: str, *overrides: str):
    cfg = load_config(ROOT / f"examples/{example}.yaml", list(overrides))
    hf, source = resolve_hf_config(cfg.model.path)
    return cfg, hf, dict(nodes=cfg.launch.nodes, gpus_per_node=cfg.launch.gpus_per_node,
                         hw=P.Hardware(gpu_mem_gib=cfg.launch.gpu_mem_gib), source=source)


def test_longest_response_is_monotone_and_matches_the_fits_line(capsys):
    """The longest response that fits (searched in LENGTH_STEP steps) fits, one step more does
    not, shorter ones fit and longer ones do not; `oar plan --response-tokens` says the same."""
    from megatron_oar.commands.plan.budget_search import LENGTH_STEP

    # without recompute, so that memory (not the model's positions) bounds the length
    cfg, hf, kw = _cfg_hf("qwen2.5-7b_oar_g", "model.recompute=null")
    longest = P.longest_response(cfg, hf, **kw)
    assert 2048 < longest < 32768 and longest % LENGTH_STEP == 0
    fits = {n: P.make_plan(P.at_length(cfg, n), hf, **kw).fits
            for n in (1024, longest // 2, longest - LENGTH_STEP, longest, longest + LENGTH_STEP, 2 * longest)}
    assert fits == {**{n: True for n in fits if n <= longest}, **{n: False for n in fits if n > longest}}
    path = str(ROOT / "examples/qwen2.5-7b_oar_g.yaml")
    assert P.main(["--config", path, "--response-tokens", str(longest), "model.recompute=null"]) == 0
    out = capsys.readouterr().out
    assert "FITS: peak" in out and f"longest response that fits: {longest:,} tokens" in out
    assert f"sequences of {1024 + longest} tokens" in out
    assert P.main(["--config", path, "--response-tokens", str(longest + LENGTH_STEP), "--json",
                   "model.recompute=null"]) == 1
    data = json.loads(capsys.readouterr().out)["qwen2.5-7b_oar_g"]
    assert not data["fits"] and data["longest_response_tokens"] == longest


LONG_RESPONSE = 32768  # issue 50: every dense example trains 32k-token responses on its cluster
MOE_RESPONSE = 8192    # and the MoE examples 8k


def _arch(cfg):
    hf, source = resolve_hf_config(cfg.model.path)
    return parse_arch(hf, source=source)


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=[p.stem for p in GPU_EXAMPLES])
def test_examples_fit_long_responses_as_shipped(path):
    """By the plan, with the knobs each example names in its own file: a dense example fits
    32k-token responses on its cluster, a MoE example 8k; an example whose model has fewer
    positions than its prompt and that (the Qwen2.5-Math models' 4,096) cannot run it at all, and
    the plan's longest response stops at its positions."""
    cfg, hf, kw = _cfg_hf(path.stem)
    a = _arch(cfg)
    n = MOE_RESPONSE if a.is_moe else LONG_RESPONSE
    if cfg.data.max_prompt_tokens + n > a.max_position_embeddings:
        assert P.longest_response(cfg, hf, **kw) <= a.max_position_embeddings - cfg.data.max_prompt_tokens
        return
    plan = P.make_plan(P.at_length(cfg, n), hf, **kw)
    assert plan.fits, f"{path.name} at {n}-token responses: {plan.reasons}"


@pytest.mark.parametrize("example", ["qwen2.5-7b_oar_g", "qwen2.5-72b_oar_g", "qwen3-30b-a3b_oar_g"])
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_oar_g_activations_no_larger_than_the_update(example, recompute):
    """OAR-G's input-gradient backward runs under the update's recompute (models/recompute.py),
    so at the same token budget and micro-batches in flight its activations are at most the
    update's (they share the layers' terms; OAR-G's fp32 embedding gradient is below the update's
    logits). Before, OAR-G was sized without recompute: 2-30x the update's under full recompute."""
    cfg = load_config(ROOT / f"examples/{example}.yaml", [f"model.recompute={recompute or 'null'}"])
    a = _arch(cfg)
    s = cfg.data.max_prompt_tokens + LONG_RESPONSE
    for budget in (s, 2 * s, 4 * s):
        rows = activations.budget_rows(budget, s)
        for microbatches in (1, 64):
            update, _ = activations._train_activations(cfg, a, s=s, mbs=rows, microbatches=microbatches)
            oar_g = activations._oar_g_activations(cfg, a, s=s, seqs=rows, samples=int(microbatches * rows), dp=1)
            assert 0 < oar_g <= update, (budget, microbatches, oar_g / update)
    if recompute == "full":  # keeps only each layer's input: far below the layers' activations
        none = load_config(ROOT / f"examples/{example}.yaml", ["model.recompute=null"])
        assert (activations._oar_g_activations(cfg, a, s=s, seqs=1, samples=64, dp=1)
                < activations._oar_g_activations(none, a, s=s, seqs=1, samples=64, dp=1) / 2)


def test_chosen_budgets_are_the_largest_that_fit():
    """Unset token budgets become the largest multiple of BUDGET_STEP whose phase fits
    BUDGET_FILL of the GPU: the plan at that budget is under it, one step more is over it; a set
    budget past the whole GPU is warned about, naming the one that would be chosen; set budgets
    are kept. Covers the training budget, OAR-G's and OAR-P's copies (screened)."""
    from megatron_oar.commands.plan.budget_search import BUDGET_FILL, BUDGET_STEP, largest_fitting, with_budgets

    cfg, hf, kw = _cfg_hf("qwen2.5-7b_oar_g", "credit=oar_p_screened", "train.max_tokens_per_micro_batch=null",
                          "rollout.max_new_tokens=7168", "rollout.max_model_len=8192")
    cap = kw["hw"].gpu_mem_gib
    pl = P.make_plan(cfg, hf, **kw)
    chosen = pl.budgets["tokens"]
    assert set(pl.budgets["chosen"]) == set(chosen) == {P.TRAIN_BUDGET, P.ATTRIBUTION_BUDGET, P.COPY_BUDGET}
    assert pl.fits and not pl.warnings and max(pl.budgets["phase_gib"].values()) <= BUDGET_FILL * cap
    specs = {sp.key: sp for sp in P.budget_specs(cfg, parse_arch(hf), world=8, hw=kw["hw"])[0]}
    for key, tokens in chosen.items():
        assert tokens % BUDGET_STEP == 0 and tokens > 8192 and tokens < specs[key].hi
        phase = "update" if key == P.TRAIN_BUDGET else "attribution"
        at = P.make_plan(with_budgets(cfg, {key: tokens}), hf, **kw).phases_gib[phase]
        above = P.make_plan(with_budgets(cfg, {key: tokens + BUDGET_STEP}), hf, **kw).phases_gib[phase]
        assert at <= BUDGET_FILL * cap < above
        # past the whole GPU: a set budget does not fit, and the warning names the chosen one
        whole = largest_fitting(lambda b, sp=specs[key]: sp.phase_bytes(b) <= cap * P.GIB, tokens, specs[key].hi)
        over = P.make_plan(with_budgets(cfg, {key: whole + BUDGET_STEP}), hf, **kw)
        assert over.phases_gib[phase] > cap and not over.fits
        assert any(w.startswith(f"{key}={whole + BUDGET_STEP} does not fit") and f"{tokens} tokens would fit" in w
                   for w in over.warnings)
    kept = P.make_plan(with_budgets(cfg, {P.TRAIN_BUDGET: 8192}), hf, **kw)
    assert kept.budgets["tokens"][P.TRAIN_BUDGET] == 8192 and P.TRAIN_BUDGET not in kept.budgets["chosen"]


def test_trainer_and_plan_choose_the_same_budgets(tmp_path, caplog):
    """`oar train` chooses the unset budgets at its start with the plan's function, for the
    same GPUs (launch.gpu_mem_gib) and world, logs them and runs with them."""
    import logging

    from megatron_oar.commands.train import choose_run_budgets

    model = tmp_path / "Qwen2.5-7B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PRESETS["qwen2.5-7b"]))
    cfg, hf, kw = _cfg_hf("qwen2.5-7b_oar_g", f"model.path={model}", "train.max_tokens_per_micro_batch=null")
    plan = P.plan_config(cfg, hf, **kw, longest=False)
    with caplog.at_level(logging.INFO, logger="megatron_oar.train"):
        run_cfg, choice = choose_run_budgets(cfg, world=8)
    assert choice.tokens == plan.budgets["tokens"] and choice.chosen == plan.budgets["chosen"]
    assert run_cfg.train.max_tokens_per_micro_batch == choice.tokens[P.TRAIN_BUDGET]
    assert run_cfg.attribution.max_tokens_per_micro_batch == choice.tokens[P.ATTRIBUTION_BUDGET]
    assert cfg.train.max_tokens_per_micro_batch is None  # the caller's config is not changed
    assert f"{P.TRAIN_BUDGET}={choice.tokens[P.TRAIN_BUDGET]} (chosen" in caplog.text
    # a set budget that does not fit is kept and warned about
    big, choice = choose_run_budgets(load_config(ROOT / "examples/qwen2.5-7b_oar_g.yaml", [
        f"model.path={model}", "train.max_tokens_per_micro_batch=1000000"]), world=8)
    assert big.train.max_tokens_per_micro_batch == 1000000 and "1000000 does not fit" in caplog.text


def test_oar_p_cost_warning_at_its_threshold(capsys):
    """Exact OAR-P warns when its step costs more than --oar-p-max-cost GRPO steps, naming
    screened OAR-P and its cost; just above the ratio it does not; OAR-G never does."""
    cfg, hf, kw = _cfg_hf("qwen2.5-7b_oar_p")
    plan = P.make_plan(cfg, hf, **kw)
    grpo = P.make_plan(P.with_credit(cfg, "grpo"), hf, **kw)
    screened = P.make_plan(P.with_credit(cfg, "oar_p_screened"), hf, **kw)
    ratio = plan.time_s["total"] / grpo.time_s["total"]
    below = P.oar_p_cost_warning(cfg, hf, plan, max_cost=ratio * 0.999, **kw)
    assert "credit=oar_p_screened" in below and f"{screened.time_s['total']:,.0f} s per step" in below
    assert f"{ratio:.1f}x GRPO's step" in below
    assert P.oar_p_cost_warning(cfg, hf, plan, max_cost=ratio * 1.001, **kw) is None
    g, hf_g, kw_g = _cfg_hf("qwen2.5-7b_oar_g")
    assert P.oar_p_cost_warning(g, hf_g, P.make_plan(g, hf_g, **kw_g), max_cost=0.0, **kw_g) is None
    path = str(ROOT / "examples/qwen2.5-7b_oar_p.yaml")
    P.main(["--config", path, "--oar-p-max-cost", f"{ratio * 0.999}"])
    assert "warning: exact OAR-P costs" in capsys.readouterr().out
    P.main(["--config", path, "--oar-p-max-cost", f"{ratio * 1.001}"])
    assert "warning: exact OAR-P" not in capsys.readouterr().out


def test_separate_placement_plans_each_role():
    """rollout.placement=separate (issue 43), 2 nodes of 8: training GPUs hold no vLLM (the same
    Megatron state as colocated at the same layout, the sleeping engine's GiB free), a rollout
    GPU holds the engine's share, a bucket and the reserve; the step is the slower of
    generation and training plus the broadcast from staleness 1 on, their sum at 0; a rollout
    share past the GPU is refused, naming the key. Milliseconds."""
    from megatron_oar.commands.plan.memory import VLLM_ASLEEP_GIB
    from megatron_oar.training.phases import NOTHING

    path = ROOT / "examples" / "qwen2.5-7b_oar_g.yaml"
    sep = ["rollout.placement=separate", "rollout.ranks=8", "rollout.gpu_memory_utilization=0.85"]
    hf, _ = resolve_hf_config(load_config(path).model.path, None)
    make_plan, Hardware, render = P.make_plan, P.Hardware, P.render
    colocated = make_plan(load_config(path), hf, nodes=1, gpus_per_node=8, hw=Hardware())
    plans = {k: make_plan(load_config(path, [*sep, f"rollout.max_staleness={k}"]), hf, nodes=2,
                          gpus_per_node=8, hw=Hardware()) for k in (0, 1)}
    one = plans[1]
    assert one.layout["dp"] == colocated.layout["dp"] and one.layout["training_gpus"] == 8
    assert set(one.phase_vllm_holds.values()) == {NOTHING}
    # the Megatron state is the colocated one; the sleeping engine's GiB go to larger token budgets
    for key in ("weights", "gradients", "optimizer"):
        assert one.memory_gib[key] == pytest.approx(colocated.memory_gib[key])
    assert all(one.budgets["tokens"][k] >= n for k, n in colocated.budgets["tokens"].items())
    assert one.train_peak_gib <= colocated.train_peak_gib + VLLM_ASLEEP_GIB
    cfg = load_config(path, sep)
    # a received bucket: the embedding (152064 x 3584 bf16, 1.02 GiB) goes alone, past bucket_mb
    embedding = 152064 * 3584 * 2 / P.GIB
    assert cfg.rollout.bucket_mb / 1024 < embedding == pytest.approx(one.sync["bucket_gib"])
    assert one.rollout_gpu_gib == pytest.approx(0.85 * 80 + embedding + 4.0)
    assert one.fits and one.vllm["kv_tokens"] > colocated.vllm["kv_tokens"]
    t0, t1 = plans[0].time_s, one.time_s
    train = sum(v for k, v in t1.items() if k not in ("generate", "sync", "total"))
    assert t1["sync"] > 0
    assert t1["total"] == pytest.approx(max(t1["generate"], train) + t1["sync"])
    assert t0["total"] == pytest.approx(t1["generate"] + train + t1["sync"])
    assert "separate placement: 8 training GPUs, 8 rollout GPUs" in render(one, "x")
    too_much = make_plan(load_config(path, [*sep, "rollout.gpu_memory_utilization=1.0"]), hf, nodes=2,
                         gpus_per_node=8, hw=Hardware())
    assert not too_much.fits and "lower rollout.gpu_memory_utilization" in " ".join(too_much.reasons)


def test_separate_placement_sync_by_hand():
    """The separate placement's weight sync (issue 51): the stage senders gather their own stage
    (TP all-gather's share, no PP broadcast, no other training rank), each rollout rank receives
    the whole model; a rollout GPU holds the largest tensor's bucket past rollout.bucket_mb (72B:
    the 152064 x 8192 embedding) and, for a MoE model, one whole MoE layer as vLLM's reload
    holds it (the experts travel whole here); a training GPU's sync phase holds no vLLM reload.
    Milliseconds."""
    sep = ["rollout.placement=separate", "rollout.ranks=32"]  # 72B: 32 training GPUs, TP8 PP4
    pl = _plan("qwen2.5-72b_oar_g", *sep, "rollout.tp=8")
    a = parse_arch(PRESETS["qwen2.5-72b"])
    tp, pp = pl.layout["tp"], pl.layout["pp"]
    h, layers = 8192, 80 // pp
    qkv = (64 + 2 * 8) * 128
    per_layer = [qkv * h, h * 64 * 128, qkv, 2 * 29568 * h, h * 29568]  # TP-split tensors of a layer
    vocab = a.padded_vocab_size(128) * h
    stage0 = layers * sum(per_layer) + vocab  # the first stage: its layers and the embedding
    assert pl.sync["placement"] == "separate" and pl.sync["pp_broadcast"] == 0
    assert pl.sync["tp_gather"] == pytest.approx(2 * (tp - 1) * stage0 // tp / P.GIB, rel=1e-6)
    model = 80 * (sum(per_layer) + 2 * h) + 2 * vocab + h  # untied: embedding and output layer
    assert pl.sync["rollout_rank_gib"] == pytest.approx(2 * model / P.GIB, rel=1e-9)
    assert pl.sync["bucket_gib"] == pytest.approx(2 * vocab / P.GIB) and pl.sync["moe_layer_reload_gib"] == 0
    assert pl.rollout_gpu_gib == pytest.approx(pl.vllm["share_gib"] + 2 * vocab / P.GIB + 4.0)
    col = _plan("qwen2.5-72b_oar_g")
    assert "each rollout rank receives" in P.render(pl, "x") and col.sync.get("placement") is None
    # MoE: whole experts (vLLM TP 8 would cut them colocated); the training GPUs hold no reload
    moe = _plan("qwen3-30b-a3b_oar_g", *sep)
    reload = 2 * 128 * 3 * 2048 * 768 / P.GIB
    assert moe.sync["expert_tp"] == 1 and moe.sync["moe_layer_reload_gib"] == pytest.approx(reload)
    assert moe.rollout_gpu_gib == pytest.approx(moe.vllm["share_gib"] + moe.sync["bucket_gib"] + reload + 4.0)
    resident = sum(v for k, v in moe.memory_gib.items() if not k.startswith("activations"))
    assert moe.phases_gib["sync"] == pytest.approx(resident + 2 * moe.sync["bucket_gib"] + 4.0)


def test_longest_response_of_a_model_shorter_than_one_search_step(tmp_path, capsys):
    """The tiny configs' models hold fewer positions after the prompt than one search step
    (LENGTH_STEP): `oar plan` said "longest response that fits: 0 tokens" while the config fit.
    The search goes token by token there and reaches the model's last position."""
    model = _tiny_model_dir(tmp_path)
    path = str(ROOT / "examples/tiny_cpu.yaml")
    assert P.main(["--config", path, f"model.path={model}", "parallel.tp=1", "launch.gpus_per_node=1"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(path, [f"model.path={model}"])
    positions = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    assert "FITS: peak" in out
    assert f"longest response that fits: {positions - cfg.data.max_prompt_tokens:,} tokens" in out, out[-600:]


# -- context parallelism (parallel.cp): the plan's layout, activations, K/V traffic, knobs, budgets

def test_cp_splits_a_rows_activations_over_its_ranks():
    """Per rank, CP 2 runs half of a row: the update's activations of a long row, less the K/V
    term (:func:`activations.cp_kv_bytes`), are half of CP 1's, with and without recompute; the
    K/V term is the whole row's K/V (and its gradient) under the local spec, two blocks of
    s / CP tokens' under TE's ring; the local spec without recompute also keeps every layer's
    gathered K/V."""
    a = parse_arch(PRESETS["qwen2.5-7b"])
    s, tp, kv_token = 33792, 2, 2 * (a.num_kv_heads // 2) * a.head_dim * 2
    for recompute in (None, "selective", "full"):
        for ring in (True, False):
            kw = dict(s=s, b=1.0, tp=tp, pp=1, sp=False, flash=True, recompute=recompute, microbatches=4)
            one = activations.update_activation_bytes(a, **kw)
            two = activations.update_activation_bytes(a, **kw, cp=2, ring=ring)
            kv = activations.cp_kv_bytes(a, s=s, b=1.0, tp=tp, cp=2, ring=ring, backward=True)
            assert kv == kv_token * (2 * s / 2 if ring else s) * 2  # K/V and their gradients
            saved = kv_token * (s - s / 2) * a.num_layers if not ring and recompute is None else 0.0
            assert two - kv - saved == pytest.approx(one / 2, rel=1e-12)
    # a row that does not divide into 2 x CP chunks is padded: 4 chunks of 8449 tokens at CP 2
    assert activations.cp_local_tokens(33793, 2) == 2 * 8449 and activations.cp_local_tokens(33793, 1) == 33793


def test_cp_kv_traffic_by_hand():
    """The K/V all-gather for Qwen2.5-7B (4 KV heads of 128, bf16) at a 32k-token row: at TP 1
    each rank receives (CP - 1)/CP of the row's 2 x 4 x 128 x 2 bytes per token per layer; the
    step's traffic is that per layer, row and pass (forward, backward, a recomputed forward); the
    local spec adds its seconds to the passes, TE's ring does not."""
    from megatron_oar.commands.plan.step_time import cp_kv_row_layer_bytes

    a = parse_arch(PRESETS["qwen2.5-7b"])
    per_token = 2 * 4 * 128 * 2
    assert cp_kv_row_layer_bytes(a, s=32768, tp=1, cp=2) == 32768 / 2 * per_token == 32 * 2 ** 20
    assert cp_kv_row_layer_bytes(a, s=32768, tp=2, cp=4) == 32768 * 3 / 4 * per_token / 2
    cfg, hf, kw = _cfg_hf("qwen2.5-7b_oar_g", "credit=grpo", "parallel.cp=2", "rollout.max_new_tokens=31744",
                          "rollout.max_model_len=32768")  # 1,024 prompt tokens: rows of 32,768
    validate(cfg, world_size=8, hf_config=hf)
    ring = P.make_plan(cfg, hf, **kw)
    local = P.make_plan(load_config(ROOT / "examples/qwen2.5-7b_oar_g.yaml", [
        "credit=grpo", "parallel.cp=2", "rollout.max_new_tokens=31744", "rollout.max_model_len=32768",
        "model.spec=local"]), hf, **kw)
    t, samples = cfg.train, cfg.train.prompts_per_step * cfg.train.group_size
    rows = samples / (8 // (cfg.parallel.tp * 2))
    row_layer = 32768 / 2 * per_token / cfg.parallel.tp
    units = {"logprob": 1 + (cfg.loss.kl_coef > 0), "update": t.ppo_epochs * (2 + (cfg.model.recompute == "full"))}
    for plan in (ring, local):
        assert plan.layout["dp"] == 2 and plan.cp["row_layer_mib"] * 2 ** 20 == row_layer
        for k, u in units.items():
            assert plan.cp["step_gib"][k] * 2 ** 30 == pytest.approx(u * rows * a.num_layers * row_layer, rel=1e-12)
            nvlink = P.Hardware().intra_node_gb_s * 1e9
            assert plan.cp["seconds"][k] == pytest.approx(plan.cp["step_gib"][k] * 2 ** 30 / nvlink, rel=1e-12)
    assert not ring.cp["exposed"] and local.cp["exposed"]
    for k in units:
        assert local.time_s[k] - ring.time_s[k] == pytest.approx(local.cp["seconds"][k], rel=1e-9)
    assert "x CP 2 x DP 2" in P.render(ring, "cp") and "context parallelism: CP 2" in P.render(ring, "cp")


def test_cp_layout_dp_and_optimizer_shards():
    """DP = world / (TP x PP x CP); the CP ranks hold the same weights and gradients, and the
    distributed optimizer shards its state over DP x CP (so TP 2 x CP 2 x DP 2 holds what
    TP 2 x DP 4 holds)."""
    cfg, hf, kw = _cfg_hf("qwen2.5-7b_oar_g", "credit=grpo", "train.max_tokens_per_micro_batch=2048")
    cp2 = P.make_plan(load_config(ROOT / "examples/qwen2.5-7b_oar_g.yaml", [
        "credit=grpo", "train.max_tokens_per_micro_batch=2048", "parallel.cp=2"]), hf, **kw)
    cp1 = P.make_plan(cfg, hf, **kw)
    assert (cp1.layout["dp"], cp2.layout["dp"], cp2.layout["cp"]) == (8 // 2, 8 // 4, 2)
    for k in ("weights", "gradients", "optimizer"):
        assert cp2.memory_gib[k] == cp1.memory_gib[k]
    assert cp2.layout["micro_batches_per_rank"] == 2 * cp1.layout["micro_batches_per_rank"]  # half the DP ranks
    assert not cp1.cp and "CP" not in P.render(cp1, "cp1").split("\n")[1]


def test_cp_knob_order_for_every_credit(monkeypatch):
    """--table's knobs: parallel.cp=2 and 4 come after recompute and before more nodes, for GRPO,
    OAR-G (attribution runs under CP), packed batching and a MoE model alike."""
    from megatron_oar.commands.plan import report

    monkeypatch.setattr(report, "make_plan", lambda c, hf, **kw: c)  # the labels, not the plans
    labels = {}
    for credit, extra in (("grpo", ()), ("oar_g", ()), ("packed", ("train.batching=packed",))):
        cfg, hf, kw = _cfg_hf("qwen2.5-7b_oar_g", f"credit={'grpo' if credit == 'packed' else credit}",
                              "model.recompute=null", *extra)
        labels[credit] = [k for k, _ in report._knob_plans(cfg, hf, **kw)]
    grpo = labels["grpo"]
    assert "parallel.cp=2" in grpo and "parallel.cp=4" in grpo
    assert "parallel.sequence_parallel=true and model.recompute=full and parallel.cp=2" in grpo
    first_cp = grpo.index("parallel.cp=2")
    assert grpo.index("model.recompute=full") < first_cp < grpo.index("2x nodes (16 GPUs)")
    assert labels["oar_g"] == grpo
    assert labels["packed"] == grpo
    # a mixture-of-experts model runs under CP: its knobs include it
    cfg, hf, kw = _cfg_hf("qwen3-30b-a3b_oar_g", "credit=grpo", "model.recompute=null",
                          "model.routing_replay=training")
    assert "parallel.cp=2" in [k for k, _ in report._knob_plans(cfg, hf, **kw)]
    # the advice of a plan that does not fit names CP, for GRPO, OAR-G and packed batching alike
    from megatron_oar.commands.plan.budget_search import at_length

    for credit, extra, tip in (("grpo", (), "parallel.cp=2 or 4"), ("oar_g", (), "parallel.cp=2 or 4"),
                               ("grpo", ("train.batching=packed",), "parallel.cp=2 or 4")):
        cfg, hf, kw = _cfg_hf("qwen2.5-7b_oar_g", f"credit={credit}", "model.recompute=null", *extra)
        plan = P.make_plan(at_length(cfg, 65536), hf, **kw)
        assert not plan.fits and any(tip in a for a in plan.advice), (credit, extra, plan.advice)


def test_oar_g_and_oar_p_planned_per_cp_rank():
    """Under CP the attribution passes are sized per CP rank as the update is: OAR-G's layers at
    ``padded row / CP`` tokens (with the update's gathered K/V), its fp32 input gradient of the
    rank's tokens, and the whole rows' hidden states the probes read, gathered (bf16, and their
    gradient); OAR-P's one layer at a time likewise, forward only. Their K/V exchange is
    counted per forward, backward and recomputed forward, as the update's."""
    from megatron_oar.commands.plan.activations import (
        _oar_g_activations,
        _oar_p_activations,
        cp_kv_bytes,
        cp_local_tokens,
        update_activation_bytes,
    )
    from megatron_oar.commands.plan.activations import _one_layer_act_bytes as one_layer

    over = ("rollout.max_new_tokens=31744", "rollout.max_model_len=32768")  # rows of 32,768
    a = parse_arch(PRESETS["qwen2.5-7b"])
    h, s, sl = a.hidden_size, 32768, 16384
    assert cp_local_tokens(s, 2) == sl
    for credit in ("oar_g", "oar_p"):
        cfg1 = _cfg_hf("qwen2.5-7b_oar_g", f"credit={credit}", *over)[0]
        cfg2, hf, kw = _cfg_hf("qwen2.5-7b_oar_g", f"credit={credit}", *over, "parallel.cp=2")
        validate(cfg2, world_size=8, hf_config=hf)
        tp, pp, sp = cfg2.parallel.tp, cfg2.parallel.pp, cfg2.parallel.sequence_parallel
        if credit == "oar_g":
            g1 = _oar_g_activations(cfg1, a, s=s, seqs=1, samples=512, dp=4)
            g2 = _oar_g_activations(cfg2, a, s=s, seqs=1, samples=512, dp=2)
            layers = update_activation_bytes(a, s=s, b=1, tp=tp, pp=pp, sp=sp, flash=True,
                                             recompute=cfg2.model.recompute, microbatches=256, cp=2, ring=True)
            assert g2 == layers + 4.0 * sl * h + 2 * 2.0 * s * h
            assert g2 < 0.6 * g1  # about half: each rank runs half of the row
        else:
            p2 = _oar_p_activations(cfg2, a, s=s, copies=2)
            assert p2 == (one_layer(a, sl, 2, tp, sp, True)
                          + cp_kv_bytes(a, s=s, b=2, tp=tp, cp=2, ring=True, backward=False) + 2.0 * s * 2 * h)
            assert p2 < 0.6 * _oar_p_activations(cfg1, a, s=s, copies=2)
        plan = P.make_plan(cfg2, hf, **kw)
        fwd = 2 + (cfg2.model.recompute == "full") if credit == "oar_g" else 31744  # OAR-P: a copy per token
        ratio = plan.cp["step_gib"]["attribution"] / plan.cp["step_gib"]["update"]
        assert ratio == pytest.approx(fwd / (cfg2.train.ppo_epochs * (2 + (cfg2.model.recompute == "full"))),
                                      rel=1e-12), credit


def test_trainer_chooses_cp_budgets_by_the_whole_rows(tmp_path):
    """Under CP a token budget counts the whole padded rows, of which each rank runs 1/CP:
    `oar train` chooses the plan's budget, at its boundary (the update at the budget within
    BUDGET_FILL of the GPU, one step more over it), larger than CP 1's for the same rows."""
    from megatron_oar.commands.plan.budget_search import BUDGET_FILL, BUDGET_STEP, with_budgets
    from megatron_oar.commands.train import choose_run_budgets

    model = tmp_path / "Qwen2.5-7B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PRESETS["qwen2.5-7b"]))
    over = [f"model.path={model}", "credit=grpo", "model.recompute=null", "train.max_tokens_per_micro_batch=null",
            "rollout.max_new_tokens=15360", "rollout.max_model_len=16384"]
    cfg, hf, kw = _cfg_hf("qwen2.5-7b_oar_g", *over, "parallel.cp=2")
    _, choice = choose_run_budgets(cfg, world=8)
    plan = P.make_plan(cfg, hf, **kw)
    tokens = choice.tokens[P.TRAIN_BUDGET]
    assert plan.budgets["tokens"] == choice.tokens and tokens % BUDGET_STEP == 0
    at = P.make_plan(with_budgets(cfg, {P.TRAIN_BUDGET: tokens}), hf, **kw).phases_gib["update"]
    above = P.make_plan(with_budgets(cfg, {P.TRAIN_BUDGET: tokens + BUDGET_STEP}), hf, **kw).phases_gib["update"]
    assert at <= BUDGET_FILL * cfg.launch.gpu_mem_gib < above
    _, one = choose_run_budgets(_cfg_hf("qwen2.5-7b_oar_g", *over)[0], world=8)
    assert tokens > one.tokens[P.TRAIN_BUDGET]
