"""``oar-convert`` with Qwen3-MoE: HF <-> megatron torch_dist checkpoints at any TP/PP/EP.

Tiny random models as in tests/test_qwen3_moe.py: "A" (2 layers, all MoE, ``norm_topk_prob``;
megatron stacks its layers on one checkpoint axis) and "B" (4 layers, dense / MoE alternating;
megatron writes each layer's keys on their own). The experts are stored as megatron's own experts
``sharded_state_dict`` writes them: ``mlp.experts.experts.linear_fc1/2.weight`` with an axis of
global expert ids, which a model at EP > 1 maps its local experts onto.

Fast (single process, about 6 s with imports): the converter's checkpoint layout equals the
sharded state dict of a real megatron model (both models); HF -> Megatron -> HF is bit-exact at
fp32 and bf16 (the bf16 source is a bf16 HF model); bad inputs fail naming the flag or file.
Slow (pooled gloo ranks): one world of 2 loads the converted checkpoint of A at EP2 and saves it
from there (megatron's save at EP2, experts renumbered to global ids), then at TP2 with sequence
parallelism and expert TP 1 loads both checkpoints (identical parameters; logits equal
transformers'), and runs ``verify`` at EP2; the checkpoint saved at EP2 exports back to the HF
tensors bit-exactly. One world of 4 does the same from TP2xEP2 (expert TP 2) to EP2xPP2 with
model B. Measured on the shared 2-core machine under a load average near 20 (other sessions'
jobs): 7 s (world 2) and 6 s (world 4) with the pool warm, plus about 40 s when this file starts
the pool; the fast tests about 10 s with imports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatron_oar.models import hf_mapping, parse_arch
from tests.distributed import launch
from tests.tiny import hf_logits, make_tiny_qwen3_moe, read_config

TOL = 1e-4
MODEL_B = dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False)


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from checkpoints_convert.hf_io import HFReader

    reader = HFReader(hf_dir)
    return {k: reader.get(k) for k in reader.names()}


def _assert_same_tensors(a_dir: Path, b_dir: Path) -> int:
    a, b = _hf_tensors(a_dir), _hf_tensors(b_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    return len(a)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe_convert")
    return {"A": make_tiny_qwen3_moe(root / "A", seed=7),
            "B": make_tiny_qwen3_moe(root / "B", seed=7, **MODEL_B),
            "A_bf16": make_tiny_qwen3_moe(root / "A_bf16", seed=7, dtype=torch.bfloat16),
            "B_bf16": make_tiny_qwen3_moe(root / "B_bf16", seed=7, dtype=torch.bfloat16, **MODEL_B)}


# ---------------------------------------------------------------------------------------------
# fast: layout, round trip, errors


@pytest.mark.parametrize("name", ["A", "B"])
def test_layout_equals_megatron_sharded_state_dict(models, name):
    """Keys and global shapes of the converter's layout == those of a real GPTModel's sharded
    state dict (megatron's factories applied), and ep/etp leave the checkpoint keys unchanged."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from checkpoints_convert.convert import _single_process_runtime, template

    arch = parse_arch(read_config(models[name]))
    with _single_process_runtime():
        sd = template(arch, "fp32")
    apply_factories(sd)
    got = {v.key: v.global_shape for v in nested_values(sd) if isinstance(v, ShardedTensor)}
    layout = hf_mapping.checkpoint_layout(arch, arch.padded_vocab_size())
    assert got == {k: t.shape for k, t in layout.items()}
    experts = [t for t in layout.values() if t.expert_fc]
    assert len(experts) == (2 if name == "A" else 4)  # fc1, fc2 (stacked) or per MoE layer
    assert all(t.shape[int(t.stacked)] == arch.num_experts for t in experts)
    assert hf_mapping.homogeneous_layers(arch) is (name == "A")


@pytest.mark.parametrize("name", ["A", "B"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_roundtrip_bit_exact(models, tmp_path, name, dtype):
    """HF -> Megatron (intended EP2) -> HF gives back every tensor bit for bit, with the experts
    read a few at a time (a small shard size) and split over several output shards."""
    from checkpoints_convert.convert import hf_to_megatron, megatron_to_hf
    from megatron_oar.models.model_checkpoint import CheckpointMeta

    src = models[name if dtype == "fp32" else f"{name}_bf16"]
    meta = hf_to_megatron(src, tmp_path / "ckpt", ep=2, etp=1, progress=False)
    assert meta.dtype == dtype and (meta.written_ep, meta.written_etp) == (2, 1)
    assert CheckpointMeta.read(tmp_path / "ckpt") == meta
    megatron_to_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=40_000, progress=False)
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    n = _assert_same_tensors(src, tmp_path / "hf")
    assert n == len(hf_mapping.hf_shapes(parse_arch(read_config(src))))


def test_bad_layouts_name_the_flag(models, tmp_path):
    from checkpoints_convert.cli import main
    from checkpoints_convert.convert import ConversionError, hf_to_megatron

    cases = [(dict(ep=3), r"--ep=3 does not divide num_experts=4"),
             (dict(ep=8), r"--ep=8 does not divide num_experts=4"),
             (dict(etp=3), r"--etp=3 does not divide moe_intermediate_size=32"),
             (dict(ep=0), r"--ep=0 must be a positive integer"),
             (dict(tp=3), r"--tp=3 \(the expert TP by default\) does not divide moe_intermediate_size"),
             (dict(tp=3, etp=1), r"--tp=3 does not divide num_attention_heads=4")]
    for kwargs, message in cases:
        with pytest.raises(ConversionError, match=message):
            hf_to_megatron(models["A"], tmp_path / "ckpt", progress=False, **kwargs)
        assert not (tmp_path / "ckpt").exists() and not list(tmp_path.iterdir())
    assert main(["verify", "--hf", str(models["A"]), "--ckpt", str(tmp_path / "x"), "--ep", "0"]) == 2


def test_checkpoint_and_config_disagree(models, tmp_path, capsys):
    """A checkpoint whose hf/config.json says more experts than it holds: refused before writing,
    naming the tensor, the shapes and the experts."""
    from checkpoints_convert.cli import main
    from checkpoints_convert.convert import hf_to_megatron

    ckpt = tmp_path / "ckpt"
    hf_to_megatron(models["A"], ckpt, progress=False)
    cfg = json.loads((ckpt / "hf" / "config.json").read_text())
    (ckpt / "hf" / "config.json").write_text(json.dumps({**cfg, "num_experts": 8}))
    assert main(["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"tensor 'decoder\.layers\.mlp\.router\.weight' has shape \[2, 4, 64\], but .*"
                     r"config\.json implies \[2, 8, 64\] .*num_experts=8", err), err
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------------
# slow: load, save and reload at other layouts on gloo ranks


def _layout_logits(hf_dir: str, converted: str, saved: str, layout: tuple, tokens, first: bool):
    """At ``layout`` (tp, pp, ep, etp): load the converted checkpoint and take the logits (None off
    the reporting rank); ``first``: then save the model to ``saved`` with megatron's own save at
    this layout; else load ``saved`` into the same model and check it brings back exactly the
    converted checkpoint's parameters."""
    from megatron.core import parallel_state as ps

    from megatron_oar.models import ModelOptions, build_gpt_model
    from megatron_oar.models.forward import forward_logits
    from megatron_oar.models.model_checkpoint import CheckpointMeta, load_model, save_model
    from megatron_oar.runtime import ParallelConfig, init_runtime

    tp, pp, ep, etp = layout
    init_runtime(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp))
    arch = parse_arch(read_config(Path(hf_dir)))
    model = build_gpt_model(arch, ModelOptions(spec="local", sequence_parallel=tp > 1),
                            perform_initialization=False)
    meta = load_model(model, converted)
    logits = forward_logits(model, tokens, micro_batch_size=1, vocab_size=arch.vocab_size)
    if first:
        meta = CheckpointMeta(**{**meta.__dict__, "written_tp": tp, "written_pp": pp,
                                 "written_ep": ep, "written_etp": etp})
        save_model(model, saved, meta, hf_files_from=hf_dir)
    else:
        before = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        load_model(model, saved)
        after = model.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in before.items()), layout
    reporter = logits is not None and ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    return logits if reporter else None


def _reshard_worker(hf_dir: str, converted: str, saved: str, first: tuple, others: list, tokens,
                    out: str, with_verify: bool) -> None:
    """``first`` layout: load the converted checkpoint, save it to ``saved``; each of ``others``:
    load both (equal parameters). Results (layout, logits) to ``out`` from the reporting ranks."""
    import torch.distributed as dist

    results = [(layout, _layout_logits(hf_dir, converted, saved, layout, tokens, layout == first))
               for layout in (first, *others)]
    if with_verify:
        from checkpoints_convert.verify import verify

        result = verify(hf_dir, converted, ep=2, tol=TOL)
        if result is not None:
            results.append(("verify", (result.max_abs_diff, result.top1_agreement)))
    torch.save([r for r in results if r[1] is not None], f"{out}.rank{dist.get_rank()}")


def _run(models, tmp_path, world: int, name: str, first, others, with_verify: bool):
    from checkpoints_convert.convert import hf_to_megatron, megatron_to_hf

    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    hf = models[name]
    converted, saved = tmp_path / "converted", tmp_path / "saved"
    hf_to_megatron(hf, converted, progress=False)
    out = str(tmp_path / "results")
    launch(_reshard_worker, world, str(hf), str(converted), str(saved), first, others, tokens, out,
           with_verify)
    results = [r for rank in range(world) for r in torch.load(f"{out}.rank{rank}", weights_only=False)]
    ref = hf_logits(hf, tokens)
    seen = set()
    for layout, got in results:
        if layout == "verify":
            print(f"verify ep=2: max|dlogit|={got[0]:.3e} top1={got[1]:.4f}")
            assert got[0] <= TOL and got[1] == 1.0
        else:
            diff = (got - ref).abs().max().item()
            print(f"qwen3-moe {name} (tp, pp, ep, etp)={layout}: max|dlogit|={diff:.3e}")
            assert diff <= TOL and torch.equal(got.argmax(-1), ref.argmax(-1)), (layout, diff)
        seen.add(layout)
    assert seen == {first, *others} | ({"verify"} if with_verify else set())
    meta = json.loads((saved / "oar_checkpoint.json").read_text())
    assert (meta["written_tp"], meta["written_pp"], meta["written_ep"]) == first[:3]
    megatron_to_hf(saved, tmp_path / "exported", progress=False)  # experts back at global ids
    _assert_same_tensors(hf, tmp_path / "exported")


@pytest.mark.slow
def test_reshard_world2(models, tmp_path):
    """A: converted -> EP2 (saved there) -> TP2 (SP) x EP1 with expert TP 1; verify at EP2."""
    _run(models, tmp_path, 2, "A", (1, 1, 2, None), [(2, 1, 1, 1)], with_verify=True)


@pytest.mark.slow
def test_reshard_world4(models, tmp_path):
    """B: converted -> TP2xEP2 (SP, expert TP 2; saved there) -> EP2xPP2 (expert TP 1)."""
    _run(models, tmp_path, 4, "B", (2, 1, 2, None), [(1, 2, 2, None)], with_verify=False)
