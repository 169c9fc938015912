"""Routing replay (``model.routing_replay``) and the routing metrics on a tiny Qwen3-MoE.

Tiny random Qwen3-MoE "A" (2 layers, both MoE, 4 experts, top-2, ``norm_topk_prob``; fp32,
local spec), converted once and loaded by ``build_policy`` (megatron DDP and optimizer).

Fast (a few seconds): the metrics' arithmetic on hand-made routings, the token layout of padded
and packed micro-batches under sequence parallelism, vLLM's routed experts (recorded arrays, as
vLLM returns them) into ``routed [B, L, n, k]`` and through ``RolloutBatch`` -> ``Sample`` ->
the batch, and the config key's refusals.

Slow (one pooled world of 2 gloo ranks, one job running EP2 (as DP2 for the dense part), PP2,
TP2 with sequence parallelism, PP2 with full recompute, and under context parallelism CP2 and
CP2 x EP2 (each rank routes its two chunks of every row; packed THD micro-batches too); the whole
file 28 s at low load before the CP layouts, up to 70 s at load 6-12 on the shared 2 cores, the
world's start included; the CP layouts add 2 of the job's 6 policy builds; the conversion 1 s):
the old-logprob pass records the routing transformers computes (at TP2 the ranks exchange one
byte per value of their own tokens); the update on unchanged weights
reproduces the old log-probs exactly (ratio 1, agreement 1); after the
routers' weights change (expert rows rolled: every token's own routing moves), the update
replays the recorded routing exactly and its loss and router gradients equal transformers with
the routing forced by hand; without replay the update routes on its own (the rolled routing);
``rollout`` mode replays vLLM-style ids in the old-logprob pass (transformers' log-probs with
that routing forced). Under full recompute the recomputed routers replay what their forward
used; megatron's list of replayed targets never holds more than the calls in flight.
The rollout-routing exchange (2 ranks, no model, a few seconds): each rank receives only its rows
and its stage's layers of vLLM's routing.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_oar.training.routing_replay import RoutingLog, _overlap, rollout_routing, router_tokens
from tests.distributed import launch, launch_and_load, save_gathered
from tests.tiny import SMALL_QWEN3_MOE, make_tiny_qwen3_moe
from tests.tolerances import ModelShape, assert_close_to_rounding

# DP rank r takes rows r, r + 2, ...: equal lengths pairwise, since megatron's allgather dispatcher
# (the CPU one) gathers the routing over the EP ranks, which must then hold equally many tokens
LENGTHS = [14, 14, 9, 9, 17, 17]
PROMPT = 4
# fp32 rounding of the tiny MoE model on these rows (tests/tolerances.py): log-probs and the loss
# through the forward's reductions, router gradients through the backward's and the sum over tokens
_SHAPE = ModelShape.from_hf(SMALL_QWEN3_MOE)
LOGPROB_TOL = _SHAPE.logprob_tol(max(LENGTHS))
GRAD_TOL = _SHAPE.grad_tol(max(LENGTHS), sum(LENGTHS))

# ---------------------------------------------------------------------------------------------
# fast


def test_overlap_and_metrics_arithmetic():
    a = torch.tensor([[0, 1], [2, 3], [1, 3]])
    b = torch.tensor([[1, 0], [2, 0], [0, 2]])  # same set (order ignored), one of two, none
    assert _overlap(a, b, 4).tolist() == [2, 1, 0]
    log = RoutingLog("training")
    log.count_agreement("old_update", 3.0, 6.0)
    log.count_agreement("old_update", 1.0, 2.0)
    log.load = torch.tensor([[4.0, 0.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]])
    m = log.metrics(torch.device("cpu"))
    assert m["routing/agree_old_update"] == pytest.approx(0.5)
    assert m["routing/load_max_mean/layer0"] == pytest.approx(2.0)  # 4 / mean 2
    assert m["routing/load_max_mean/layer1"] == pytest.approx(1.0)
    assert m["routing/load_max_mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"model\.routing_replay='sometimes'"):
        RoutingLog("sometimes")


def test_router_token_layout():
    """Padded micro-batches: the routers see ``[s, b]`` flattened sequence-first; packed: the
    rows back to back at their padded offsets; SP: each TP rank its contiguous share; CP: each
    CP rank its two chunks of every row, at their global columns."""
    from megatron_oar.models.packing import pack, packed_seq_params

    lengths = [5, 3, 4]
    ids = torch.zeros(2, 6, dtype=torch.long)  # rows 2 and 0 of the batch, padded to 6
    row, col, valid = router_tokens((ids,), {}, [2, 0], lengths, 0, 1, False)
    assert row.tolist() == [2, 0] * 6 and col.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert valid.tolist() == [True] * 8 + [False, True, False, False]
    r1, c1, _ = router_tokens((ids,), {}, [2, 0], lengths, 1, 2, True)
    assert r1.tolist() == row[6:].tolist() and c1.tolist() == col[6:].tolist()
    packed = pack(torch.zeros(2, 5, dtype=torch.long), [3, 5], multiple=2)  # rows 1 and 0
    kw = {"packed_seq_params": packed_seq_params(packed)}
    row, col, valid = router_tokens((packed.tokens,), kw, [1, 0], lengths, 0, 1, False)
    assert row.tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert col.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert valid.tolist() == [True, True, True, False, True, True, True, True, True, False]
    # CP2, rank 1: its chunks 1 and 2 of 4 (columns 2..5 of 8), of every row; packed, of each row
    row, col, valid = router_tokens((torch.zeros(2, 4, dtype=torch.long),), {}, [2, 0], lengths, 0, 1, False,
                                    cp_rank=1, cp_size=2)
    assert row.tolist() == [2, 0] * 4 and col.tolist() == [2, 2, 3, 3, 4, 4, 5, 5]
    assert valid.tolist() == [True, True, True, True, False, True, False, False]
    packed = pack(torch.zeros(2, 5, dtype=torch.long), [3, 5], multiple=4)  # rows of 4 and 8
    kw = {"packed_seq_params": packed_seq_params(packed)}
    row, col, valid = router_tokens((packed.tokens[:, :6],), kw, [1, 0], lengths, 0, 1, False,
                                    cp_rank=0, cp_size=2)
    assert row.tolist() == [1, 1, 0, 0, 0, 0] and col.tolist() == [0, 3, 0, 1, 6, 7]
    assert valid.tolist() == [True, False, True, True, False, False]


def test_tokens_without_routing_spread_over_experts():
    """Replay: tokens without a recorded routing (padding; rows or columns vLLM returned none
    for) get experts round-robin among themselves, per layer: balanced over all experts (every
    EP rank takes its share), each token k distinct ones; recorded tokens keep theirs."""
    from megatron_oar.training.routing_replay import RoutingPass

    k, experts, layers = 2, 8, 2
    lengths = [3, 16, 11]
    table = torch.full((3, 16, layers, k), -1, dtype=torch.int16)
    table[0, :3] = torch.tensor([5, 6], dtype=torch.int16)
    table[2, :11, 1] = torch.tensor([1, 4], dtype=torch.int16)  # row 2: layer 0 never recorded
    ids = torch.zeros(3, 16, dtype=torch.long)  # the micro-batch, padded to 16
    row, col, valid = router_tokens((ids,), {}, [0, 1, 2], lengths, 0, 1, False)
    fake = SimpleNamespace(replay=table, k=k, experts=experts)
    targets, known = RoutingPass._targets(fake, row, col, valid)
    assert targets.shape == (48, layers, k) and known.shape == (48, layers)
    recorded = (row == 0) & (col < 3)
    assert (targets[recorded] == torch.tensor([5, 6])).all() and known[recorded].all()
    assert (targets[(row == 2) & (col < 11), 1] == torch.tensor([1, 4])).all()
    for layer in range(layers):
        fallback = targets[~known[:, layer], layer]  # [m, k]
        assert len(fallback) > 0 and (fallback[:, 0] != fallback[:, 1]).all()
        counts = torch.bincount(fallback.flatten(), minlength=experts)
        assert counts.max() - counts.min() <= 1, (layer, counts.tolist())


def test_rollout_routing_from_vllm_arrays():
    """vLLM's ``[prompt + response - 1, num_hidden_layers, k]`` per sequence -> this stage's MoE
    layers, ``-1`` past what vLLM returned; a wrong shape names the row."""
    g = np.random.default_rng(0)
    a = g.integers(0, 8, size=(6, 4, 2))  # 7 tokens: the last one's routing is never returned
    b = g.integers(0, 8, size=(3, 4, 2))
    out = rollout_routing([a, b], [7, 4], 8, [1, 3], 2)
    assert out.shape == (2, 8, 2, 2) and out.dtype == torch.int16
    assert torch.equal(out[0, :6], torch.as_tensor(a[:, [1, 3]], dtype=torch.int16))
    assert (out[0, 6:] == -1).all() and (out[1, 3:] == -1).all()
    with pytest.raises(ValueError, match=r"row 1: vLLM's routed experts have shape \(3, 2, 2\)"):
        rollout_routing([a, b[:, :2]], [7, 4], 8, [1, 3], 2)


def test_rollout_routing_refuses_missing_or_short_rows():
    """Every real token but the last needs vLLM's routing (issue 39, item 4): a row without any,
    or with fewer than ``length - 1`` tokens of it, is refused naming the row, instead of
    replaying experts ``0..k-1`` on real tokens."""
    g = np.random.default_rng(0)
    a = g.integers(0, 8, size=(6, 4, 2))
    with pytest.raises(ValueError, match=r"row 1: vLLM returned no routed experts; its 2 tokens need 1"):
        rollout_routing([a, None], [7, 2], 8, [1, 3], 2)
    with pytest.raises(ValueError, match=r"row 0: vLLM's routed experts cover 5 tokens; its 7 tokens need 6"):
        rollout_routing([a[:5]], [7], 8, [1, 3], 2)
    # more than needed (a row the trainer cut shorter than vLLM's sequence) is fine
    out = rollout_routing([a], [5], 8, [1, 3], 2)
    assert torch.equal(out[0, :5], torch.as_tensor(a[:5, [1, 3]], dtype=torch.int16))


def test_rollout_batch_carries_routed_experts():
    """engine output -> RolloutBatch (concat over rollout groups) -> Sample -> ``routed``."""
    from megatron_oar.rollout.batch import RolloutBatch
    from megatron_oar.rollout.engine import _completions

    g = np.random.default_rng(1)
    prompts = [[5, 6, 7], [8, 9]]
    outs, want = [], {}
    for i, p in enumerate(prompts):
        comps = []
        for j in range(2):
            resp = [1, 2, 3][: j + 2]
            ids = g.integers(0, 4, size=(len(p) + len(resp) - 1, 2, 2))
            want[(i, j)] = ids
            comps.append(SimpleNamespace(index=j, token_ids=resp, logprobs=[{t: SimpleNamespace(logprob=-1.0)}
                                                                             for t in resp],
                                         finish_reason="stop", stop_reason=None, text="", routed_experts=ids))
        outs.append(SimpleNamespace(prompt_token_ids=p, outputs=comps))
    fields = _completions(prompts, outs, 2)
    part = RolloutBatch(prompt_ids=prompts, seeds=[0, 1], n=2, temperature=1.0, top_p=1.0, top_k=0,
                        logprobs_mode="raw_logprobs", **fields)
    plain = RolloutBatch(prompt_ids=[[4]], response_ids=[[[1], [2]]], logprobs=[[[-1.0], [-1.0]]],
                         finish_reasons=[["stop"] * 2], stop_reasons=[[None] * 2], texts=[[""] * 2],
                         seeds=[2], n=2, temperature=1.0, top_p=1.0, top_k=0, logprobs_mode="raw_logprobs")
    joined = RolloutBatch.concat([part, plain])
    got = {(c.prompt_index, c.sample_index): c.routed_experts for c in joined.completions()}
    assert all(got[k] is want[k] for k in want) and got[(2, 0)] is None
    assert RolloutBatch.concat([plain]).routed_experts is None

    # the trainer's path: generate_samples -> Sample.routed_experts -> routed [B, L, n, k]
    from megatron_oar.data.readers import Example
    from megatron_oar.training.collect import generate_samples

    engine = SimpleNamespace(dp_size=1, dp_rank=0, generate=lambda ids, **_: part, gather=lambda b: b)
    tok = type("Tok", (), {"chat_template": None,
                           "__call__": lambda self, text, **_: {"input_ids": [1, 2]}})()
    examples = [Example("p0", "a0", "s", 0), Example("p1", "a1", "s", 1)]
    samples = generate_samples(engine, tok, examples, "answer_tag", [0, 1])
    assert [s.routed_experts is want[(s.group, j % 2)] for j, s in enumerate(samples)] == [True] * 4
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    routed = rollout_routing([s.routed_experts for s in samples], lengths, max(lengths), [0, 1], 2)
    for r, s in enumerate(samples):
        n = lengths[r] - 1  # vLLM's last token has no routing
        assert torch.equal(routed[r, :n], torch.as_tensor(s.routed_experts, dtype=torch.int16))
        assert (routed[r, n:] == -1).all()


def test_config_key_validated():
    from megatron_oar.config import ConfigError, validate
    from tests.test_config import CASES, HF, example
    from tests.test_qwen3_moe import QWEN3_30B_A3B

    def cfg(*overrides):
        return example("tiny_cpu.yaml", "parallel.tp=1", *overrides)

    c = cfg("model.routing_replay=rollout")
    validate(c, world_size=1, hf_config=QWEN3_30B_A3B)
    assert c.rollout.return_routed_experts  # derived: vLLM asked for its routing
    with pytest.raises(ConfigError, match=r"model\.routing_replay='always'"):
        validate(cfg("model.routing_replay=always"), world_size=1)
    # replay under full recompute: the recomputed routers replay what the forward used
    validate(cfg("model.routing_replay=training", "model.recompute=full"), world_size=1, hf_config=QWEN3_30B_A3B)
    for name in ("qwen3-30b-a3b_oar_g.yaml", "qwen3-235b-a22b_oar_g.yaml"):  # the MoE examples
        arch, world = CASES[name]
        for mode in ("training", "rollout"):
            c = example(name, f"model.routing_replay={mode}")
            assert c.model.recompute == "full"
            validate(c, world_size=world, hf_config=HF[arch])
    with pytest.raises(ConfigError, match=r"model\.routing_replay='training' needs a mixture-of-experts"):
        validate(cfg("model.routing_replay=training"), world_size=1,
                 hf_config={**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})


# ---------------------------------------------------------------------------------------------
# slow


def make_batch(vocab: int, rows: list[int]):
    from megatron_oar.training.inputs import TrainBatch

    g = torch.Generator().manual_seed(3)
    n, width = len(LENGTHS), max(LENGTHS)
    tokens = torch.randint(0, vocab, (n, width), generator=g)
    lengths = torch.tensor(LENGTHS)
    cols = torch.arange(width)
    tokens[cols >= lengths[:, None]] = 0
    mask = (cols >= PROMPT) & (cols < lengths[:, None])
    adv = torch.randn(n, width, generator=g) * mask
    seq_adv = torch.randn(n, generator=g)
    full = TrainBatch(tokens, torch.full((n,), PROMPT), lengths, torch.arange(n), torch.zeros(n, dtype=torch.bool),
                      loss_mask=mask, rollout_logprobs=torch.zeros(n, width), seq_adv=seq_adv)
    full.advantages = adv
    return full.select(rows) if rows is not None else full


def _policy(ckpt: str, mode: str, tp: int, recompute: str | None = None):
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import parse_arch
    from megatron_oar.training.policy import build_policy
    from tests.tiny import read_config

    hf = read_config(Path(ckpt) / "hf")
    # lr 1e-30: Adam's step is below fp32 resolution, so the weights change only where the test
    # changes them; no clipping, so the gradient buffers hold the loss's gradients
    policy = build_policy(hf, ModelConfig(path=ckpt, spec="local", routing_replay=mode, sequence_parallel=tp > 1,
                                          recompute=recompute),
                          OptimConfig(lr=1e-30, clip_grad=0.0, use_distributed_optimizer=False),
                          checkpoint=ckpt, total_optimizer_steps=10)
    return policy, parse_arch(hf)


class _Capture:
    """Every router call's chosen experts (sorted), per stage layer, in call order; and the most
    replayed targets megatron's ``RouterReplay`` held for the backward at any call (its
    ``replay_backward_list``, which ``set_target_indices`` appends to)."""

    def __init__(self, model):
        from megatron_oar.training.routing_replay import moe_routers

        self.calls = {i: [] for i in range(len(moe_routers(model)))}
        self.pending = 0
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(moe_routers(model))]

    def _hook(self, i):
        def hook(router, args, output):
            if torch._C._current_graph_task_id() != -1:  # recomputed in the backward: not a call
                return
            if router.router_replay is not None:
                self.pending = max(self.pending, len(router.router_replay.replay_backward_list))
            self.calls[i].append(output[1].int().topk(router.topk, dim=-1).indices.sort(-1).values.detach())
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def _layout(model, batch, groups):
    """``(row, col, valid)`` of the router tokens of each micro-batch of ``groups`` (token budget;
    this CP rank's chunks under CP, this TP rank's share under SP), built as the update builds
    its inputs."""
    from megatron.core import parallel_state as ps

    from megatron_oar.models.forward import MicroInput
    from megatron_oar.models.padding import sequence_multiple

    out = []
    for g in groups:
        width = int(batch.lengths[g].max())
        inp = MicroInput(batch.tokens[g, :width], sequence_multiple(model.config))
        out.append(router_tokens((inp.local_tokens,), {}, g, batch.lengths.tolist(),
                                 ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                                 model.config.sequence_parallel, cp_rank=ps.get_context_parallel_rank(),
                                 cp_size=ps.get_context_parallel_world_size()))
    return out


class _IntTraffic:
    """Bytes this rank receives in integer-dtype collectives over ``group`` (the routing's: the
    model's own collectives move floats), while active: an all-reduce counts its tensor, an
    all-gather the other ranks' parts."""

    def __init__(self, group):
        import torch.distributed as dist

        self.dist, self.group, self.bytes, self.saved = dist, group, 0, {}

    def _count(self, name, received):
        orig = self.saved[name]

        def wrapped(*args, **kwargs):
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            if group is self.group:
                self.bytes += received(*args)
            return orig(*args, **kwargs)
        return wrapped

    def __enter__(self):
        def ints(t):
            return t.nbytes if not t.is_floating_point() else 0

        world = self.dist.get_world_size(self.group)
        rules = {"all_reduce": lambda t, *_: ints(t),
                 "all_gather": lambda out, t, *_: (len(out) - 1) * ints(t),
                 "all_gather_into_tensor": lambda out, t, *_: (world - 1) * ints(t)}
        for name, received in rules.items():
            self.saved[name] = getattr(self.dist, name)
            setattr(self.dist, name, self._count(name, received))
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(self.dist, name, orig)


# what makes the host wait for a CUDA device: reading a device value, or a result whose shape
# depends on device values (boolean-mask indexing, nonzero, bincount's length)
HOST_WAITS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero",
              "bincount", "unique", "masked_select"}


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class _HostWaits:
    """Counts, while the routing's router hooks run (once per MoE layer and model call), the calls
    that would make the host wait for the GPU (on CPU the same calls run, and are counted)."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        from torch.overrides import TorchFunctionMode

        from megatron_oar.training.routing_replay import RoutingPass

        outer, orig = self, RoutingPass._router_post

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if (name in HOST_WAITS or (name in ("__getitem__", "__setitem__") and _bool_index(args[1]))
                        or (name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values())))):
                    outer.count += 1
                return func(*args, **kwargs)

        def counted(pass_, layer):
            hook = orig(pass_, layer)

            def wrapped(*args):
                with Mode():
                    return hook(*args)
            return wrapped

        self.saved = orig
        RoutingPass._router_post = counted
        return self

    def __exit__(self, *exc):
        from megatron_oar.training.routing_replay import RoutingPass

        RoutingPass._router_post = self.saved


def _oar_g_replayed(model, batch, vocab: int) -> torch.Tensor:
    """OAR-G importance of ``batch`` with every pass replaying ``batch.routed_experts`` (as
    ``attribution_route`` does under ``model.routing_replay=rollout``), one row per micro-batch:
    under full recompute (models/recompute.py) each router rerun in the backward must replay what
    its own micro-batch's forward did, though 1F1B at PP2 runs the next forward first."""
    from megatron_oar.attribution import AttributionConfig, ProbeConfig, compute_importance
    from megatron_oar.training.routing_replay import RoutingPass

    lengths, width, routed = batch.lengths.tolist(), batch.tokens.shape[1], batch.routed_experts
    cfg = AttributionConfig(method="oar_g", sigma=1e-2, probe=ProbeConfig(kind="last_token"),
                            batching="padded", micro_batch_size=1)
    return compute_importance(model, batch, cfg, vocab_size=vocab, seq_adv=batch.seq_adv, step=1,
                              route=lambda rows: RoutingPass(model, rows, lengths, width, replay=routed)).importance


def _replay_worker(ckpt: str, layouts: list, out: str) -> None:
    import megatron_oar.training.routing_replay as rr
    from megatron_oar.testing import nccl_rules

    chunk, rr.WIRE_CHUNK_BYTES = rr.WIRE_CHUNK_BYTES, 16  # the TP exchange 4 tokens at a time
    try:  # under the CPU check of NCCL's rules (docs/testing.md)
        with _HostWaits() as waits, nccl_rules.enabled():
            _replay_layouts(ckpt, layouts, out, waits)
    finally:  # the pool's processes run later jobs
        rr.WIRE_CHUNK_BYTES = chunk


def _replay_layouts(ckpt: str, layouts: list, out: str, waits: _HostWaits) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import megatron_oar.training.routing_replay as rr
    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.models.micro_batches import micro_batches
    from megatron_oar.models.padding import sequence_multiple
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.training.policy_passes import old_logprob_pass, update_step
    from megatron_oar.training.routing_replay import attach_rollout_routing, moe_routers, stage_moe_layers

    results = {}
    loss_cfg = PolicyLossConfig()
    for tp, pp, ep, recompute, cp in layouts:
        init_runtime(ParallelConfig(tp=tp, pp=pp, ep=ep, cp=cp, sequence_parallel=tp > 1))
        policy, arch = _policy(ckpt, "training", tp, recompute)
        model = policy.model
        dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        batch = make_batch(arch.vocab_size, list(range(r, len(LENGTHS), dp)))
        res = {"sample_ids": batch.sample_ids, "layers": stage_moe_layers(model)[0]}
        waits.count = 0
        # without replay: the old-logprob pass still counts the expert load, on the device
        none = RoutingLog("none")
        old_logprob_pass(model, batch, arch.vocab_size, 2, batching="token_budget", max_tokens=40, routing=none)
        res["load_none"] = none.metrics(torch.device("cpu"))

        # old-logprob pass: records the routing (token budget 40: other groups than the update's)
        log = RoutingLog("training")
        with _IntTraffic(ps.get_tensor_model_parallel_group()) as traffic:
            old, _, _ = old_logprob_pass(model, batch, arch.vocab_size, 2, batching="token_budget",
                                         max_tokens=40, routing=log)
        # what the TP ranks exchange: each the others' shares of the router tokens, one byte per
        # (token, MoE layer, slot) (4 experts fit uint8)
        groups = micro_batches(batch.lengths.tolist(), batching="token_budget", rows_per_micro=2, max_tokens=40,
                               multiple=sequence_multiple(policy.gpt.config))  # the passes' grouping
        share = sum(row.numel() for row, _, _ in _layout(policy.gpt, batch, groups))
        # (under CP each TP rank sends its share of every CP rank's tokens, gathered over CP first)
        res["routing_bytes"] = (traffic.bytes, (tp - 1) * cp * share * len(res["layers"]) * arch.moe_topk)
        if tp > 1:  # ids of a model with more than 256 experts (int16) over TP: as bytes (no NCCL int16)
            ids = [(torch.arange(24, device=torch.cuda.current_device()).view(4, 3, 2) * 37 + 300 * q)
                   .to(rr.ROUTED_DTYPE) for q in range(tp)]
            parts = rr._all_gather_chunked(ids[ps.get_tensor_model_parallel_rank()],
                                           ps.get_tensor_model_parallel_group(), tp)
            res["int16_gather"] = all(p.dtype == rr.ROUTED_DTYPE and torch.equal(p, w) for p, w in zip(parts, ids))
        batch.old_logprobs = old
        res["load_training"] = log.metrics(torch.device("cpu"))
        res["routed"] = batch.routed_experts.clone()
        res["old"] = old

        # unchanged weights, the same grouping: the update's first forward reproduces them
        log1 = RoutingLog("training")
        step = update_step(policy, batch, loss_cfg, arch.vocab_size, 2, batching="token_budget",
                           max_tokens=40, routing=log1)
        res["ratio"] = (step.stats["ratio_mean"], step.stats["ratio_max"])
        res["agree_unchanged"] = log1.metrics(torch.device("cpu"))
        if cp > 1:  # packed (THD) under CP, each row split on its own: the same routing recorded,
            # and the packed update replays it exactly
            packed = make_batch(arch.vocab_size, list(range(r, len(LENGTHS), dp)))
            packed.old_logprobs, _, _ = old_logprob_pass(model, packed, arch.vocab_size, 2, batching="packed",
                                                         max_tokens=40, routing=RoutingLog("training"))
            res["packed_routed"] = packed.routed_experts.clone()
            log_p = RoutingLog("training")
            step = update_step(policy, packed, loss_cfg, arch.vocab_size, 2, batching="packed", max_tokens=30,
                               routing=log_p)
            res["packed_ratio"] = (step.stats["ratio_mean"], step.stats["ratio_max"])
            res["packed_agree"] = log_p.metrics(torch.device("cpu"))

        # the routers' expert rows rolled by one: every token's own top-k moves to (e + 1) mod E
        with torch.no_grad():
            for router in moe_routers(model):
                router.weight.copy_(torch.roll(router.weight, 1, dims=0))
        groups = micro_batches(batch.lengths.tolist(), batching="token_budget", rows_per_micro=2, max_tokens=30,
                               multiple=sequence_multiple(policy.gpt.config))  # the passes' grouping
        layout = _layout(policy.gpt, batch, groups)
        # replayed: every layer routes as recorded; without replay, the first MoE layer routes
        # exactly one expert on from what was recorded
        for mode, shift in (("training", 0), ("none", 1)):
            log2 = RoutingLog(mode)
            cap = _Capture(model)
            step = update_step(policy, batch, loss_cfg, arch.vocab_size, 2, batching="token_budget",
                               max_tokens=30, routing=log2 if mode != "none" else None)
            cap.close()
            match = True
            for layer, calls in cap.calls.items():
                assert len(calls) == len(groups)
                if mode == "none" and res["layers"][layer] != 0:
                    continue  # deeper layers' inputs changed with the first layer's routing
                for got, (row, col, valid) in zip(calls, layout):
                    want = (batch.routed_experts[row[valid], col[valid], layer].long() + shift) % arch.num_experts
                    match &= torch.equal(got[valid], want.sort(-1).values)
            res[f"match_{mode}"] = match
            res[f"pending_{mode}"] = (cap.pending, len(groups))
            if mode == "training":
                res["agree_rolled"] = log2.metrics(torch.device("cpu"))
                res["loss"] = step.stats["loss"]
                res["router_grads"] = {layer: router.weight.main_grad.clone() for layer, router in
                                       zip(res["layers"], moe_routers(model))}
                # every gradient, experts by their global number (EP ranks hold E / EP of them)
                first = ps.get_expert_model_parallel_rank() * arch.num_experts // ep
                res["grads"] = {re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m[1]) + first}.", n):
                                p.main_grad.clone() for n, p in policy.gpt.named_parameters()}
        # rollout mode: vLLM-style ids ([len - 1, num_hidden_layers, k] per row: the recorded
        # routing of the original weights) replayed by the old-logprob pass
        gathered = [torch.full((len(LENGTHS), max(LENGTHS), 1, arch.moe_topk), -1, dtype=torch.int32,
                               device=torch.cuda.current_device()) for _ in range(arch.num_layers)]
        width = batch.routed_experts.shape[1]
        for j, layer in enumerate(res["layers"]):
            gathered[layer][batch.sample_ids, :width] = batch.routed_experts[:, :, j:j + 1].int()
        for t in gathered:  # every stage's layers on every rank, as vLLM returns them
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        full = torch.cat(gathered, dim=2)
        samples = [SimpleNamespace(routed_experts=full[i, :LENGTHS[i] - 1].numpy()) for i in range(len(LENGTHS))]
        rollout = make_batch(arch.vocab_size, list(range(r, len(LENGTHS), dp)))
        attach_rollout_routing(model, rollout, samples)
        log3 = RoutingLog("rollout")
        lp3, _, _ = old_logprob_pass(model, rollout, arch.vocab_size, 2, batching="token_budget",
                                     max_tokens=40, routing=log3)
        res["rollout_old"] = lp3
        res["rollout_metrics"] = log3.metrics(torch.device("cpu"))
        res["host_waits"] = waits.count  # in the router hooks of every pass above
        if pp > 1:  # OAR-G replaying the recorded routing, compared between PP2 with and without recompute
            res["oar_g_replayed"] = _oar_g_replayed(model, batch, arch.vocab_size)
        results[_name(tp, pp, ep, recompute, cp)] = res
    save_gathered(results, out)
    del dist


R3_LAYERS, R3_TOPK, R3_EXPERTS = 16, 4, 64  # vLLM's routing: every decoder layer, int32


def _r3_routing(prompt: int, j: int, tokens: int) -> np.ndarray:
    return np.random.default_rng(100 * prompt + j).integers(0, R3_EXPERTS, size=(tokens, R3_LAYERS, R3_TOPK),
                                                           dtype=np.int32)


class _Received:
    """Bytes this rank receives in the world's all-gathers (``all_gather_object``'s too) and
    all-to-alls while active: the other ranks' parts."""

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.spots = [(c10d, "all_gather"), (dist, "all_gather"), (c10d, "all_to_all_single"),
                      (dist, "all_to_all_single")]
        self.bytes = self.a2a = 0
        self.saved = [getattr(m, n) for m, n in self.spots]

    def __enter__(self):
        import torch.distributed as dist

        me = dist.get_rank()
        gather, a2a = self.saved[0], self.saved[2]
        inside = [False]  # the CPU backend's torch-function mode calls a collective again

        def counted(f, count):
            def wrapped(*args, **kwargs):
                if inside[0]:
                    return f(*args, **kwargs)
                inside[0] = True
                try:
                    count(*args, **kwargs)
                    return f(*args, **kwargs)
                finally:
                    inside[0] = False
            return wrapped

        def gathered(out, t, *_, **__):
            self.bytes += sum(o.nbytes for i, o in enumerate(out) if i != me)

        def exchanged(output, input, output_split_sizes=None, *_, **__):
            n = output.shape[0]
            mine = output_split_sizes[me] if output_split_sizes else n // dist.get_world_size()
            got = (n - mine) * output.element_size()
            self.bytes += got
            self.a2a += got

        all_gather, all_to_all_single = counted(gather, gathered), counted(a2a, exchanged)

        for (m, n), f in zip(self.spots, [all_gather, all_gather, all_to_all_single, all_to_all_single]):
            setattr(m, n, f)
        return self

    def __exit__(self, *exc):
        for (m, n), f in zip(self.spots, self.saved):
            setattr(m, n, f)


def _r3_worker(out: str) -> None:
    """Two rollout groups (rollout TP1) generate two prompts each (n=2); each rank then trains on
    six of the eight samples and holds its own half of the MoE layers (as two pipeline stages)."""
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.testing import nccl_rules

    with nccl_rules.enabled():  # the exchange as NCCL would take it (int16 ids travel as bytes)
        init_runtime(ParallelConfig())
        _r3_exchange(out)


def _r3_exchange(out: str) -> None:
    import torch.distributed as dist

    import megatron_oar.training.routing_replay as rr
    from megatron_oar.data.readers import Example
    from megatron_oar.rollout.batch import RolloutBatch
    from megatron_oar.rollout.engine import gather_rollouts
    from megatron_oar.training.collect import generate_samples

    rank = dist.get_rank()

    def generate(ids, seeds, with_routing):
        prompts = [[5, 6, 7]] * len(ids)
        first = 2 * rank  # this group's prompts (collect.group_share)
        responses = [[[1] * (60 + 10 * (first + i) + 5 * j) for j in range(2)] for i in range(len(ids))]
        routed = [[_r3_routing(first + i, j, len(p) + len(r) - 1) for j, r in enumerate(rs)]
                  for i, (p, rs) in enumerate(zip(prompts, responses))] if with_routing else None
        return RolloutBatch(prompt_ids=prompts, response_ids=responses,
                            logprobs=[[[-1.0] * len(r) for r in rs] for rs in responses],
                            finish_reasons=[["stop"] * 2] * len(ids), stop_reasons=[[None] * 2] * len(ids),
                            texts=[[""] * 2] * len(ids), seeds=list(seeds), n=2, temperature=1.0, top_p=1.0,
                            top_k=0, logprobs_mode="raw_logprobs", routed_experts=routed)

    tok = type("Tok", (), {"chat_template": None, "__call__": lambda self, text, **_: {"input_ids": [1, 2]}})()
    examples = [Example(f"p{i}", "a", "s", i) for i in range(4)]
    layers = list(range(rank * R3_LAYERS // 2, (rank + 1) * R3_LAYERS // 2))
    rows = list(range(2 * rank, 2 * rank + 6))
    saved = rr.stage_moe_layers
    rr.stage_moe_layers = lambda model: (layers, None, None)  # this rank's "stage"
    res = {}
    try:  # 300 experts: the ids travel as int16 (2 bytes each), as bytes on the wire
        for with_routing, experts in ((False, R3_EXPERTS), (True, R3_EXPERTS), (True, 300)):
            model = SimpleNamespace(config=SimpleNamespace(moe_router_topk=R3_TOPK, num_moe_experts=experts,
                                                           num_layers=R3_LAYERS))
            engine = SimpleNamespace(dp_size=2, dp_rank=rank, world_size=2, is_group_leader=True,
                                     group_ranks=[rank], tp=1, _world_gloo=dist.group.WORLD)
            engine.generate = lambda ids, seeds, **_: generate(ids, seeds, with_routing)
            engine.gather = lambda b: gather_rollouts(b, engine)
            with _Received() as received:
                samples = generate_samples(engine, tok, examples, "answer_tag", list(range(4)))
                lengths = [len(x.prompt_ids) + len(x.response_ids) for x in samples]
                batch = SimpleNamespace(sample_ids=torch.tensor(rows), lengths=torch.tensor([lengths[i] for i in rows]),
                                        tokens=torch.zeros(len(rows), max(lengths[i] for i in rows)))
                if with_routing:
                    rr.attach_rollout_routing(model, batch, samples)
            res[with_routing, experts] = (received.bytes, received.a2a)
            if with_routing:
                want = rr.rollout_routing([_r3_routing(i // 2, i % 2, lengths[i] - 1) for i in rows],
                                          batch.lengths.tolist(), batch.tokens.shape[1], layers, R3_TOPK)
                res["equal", experts] = torch.equal(batch.routed_experts, want)
        # what this rank needs from the other group: its rows' tokens x its layers x k, one byte each
        res["need"] = sum((lengths[i] - 1) * len(layers) * R3_TOPK for i in rows if i // 4 != rank)
    finally:
        rr.stage_moe_layers = saved
    save_gathered(res, out)


@pytest.mark.slow
def test_rollout_routing_reaches_only_its_ranks(tmp_path):
    """``model.routing_replay=rollout``: vLLM's routing of every completion stays on its rollout
    group's ranks when the rollouts are gathered; each rank then receives only its own rows and
    its own stage's MoE layers, one byte per value, and gets the same ``routed`` as from the
    whole arrays; with more than 256 experts two bytes per value, sent as bytes (NCCL has no
    int16), under the CPU check of NCCL's rules. 2 gloo ranks, no model: about 3 s in a warm pool."""
    ranks = launch_and_load(_r3_worker, 2, tmp_path / "r3.pt")
    for rank, res in enumerate(ranks):
        plain, _ = res[False, R3_EXPERTS]
        for experts, width in ((R3_EXPERTS, 1), (300, 2)):
            total, a2a = res[True, experts]
            need = width * res["need"]
            print(f"rank {rank}, {experts} experts: received {total - plain} bytes for the routing ({a2a} of "
                  f"them routing values; {need} needed)")
            assert res["equal", experts], (rank, experts)
            assert a2a == need, (rank, experts)
            assert total - plain <= need + 4096, f"rank {rank}: {total - plain} bytes for {need}"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from checkpoints_convert.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("routing_replay")
    hf = make_tiny_qwen3_moe(root / "A", seed=7)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    return root, hf


def _hf_forced(hf_dir, batch, routed: dict | None, roll: bool):
    """transformers' log-probs ``[B, L]`` (row by row), with each MoE layer's top-k forced to
    ``routed[layer][row]`` (``[len, k]``; None: its own), routers rolled as the worker rolled
    them; the model too, for gradients. Also each row's own top-k per layer."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mq

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    gates = [layer.mlp.gate for layer in model.model.layers]
    if roll:
        with torch.no_grad():
            for g in gates:
                g.weight.copy_(torch.roll(g.weight, 1, dims=0))
    own: dict[int, list] = {i: [] for i in range(len(gates))}

    def forced(self, hidden):
        hidden = hidden.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        idx = probs.topk(self.top_k, dim=-1).indices
        own[self._layer].append(idx)
        if self._forced is not None:
            idx = self._forced.long()
        top = probs.gather(1, idx)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    saved = mq.Qwen3MoeTopKRouter.forward
    mq.Qwen3MoeTopKRouter.forward = forced
    try:
        lps = torch.zeros(batch.tokens.shape)
        rows = []
        for i in range(batch.size):
            n = int(batch.lengths[i])
            for j, g in enumerate(gates):
                g._layer, g._forced = j, None if routed is None else routed[j][i][:n]
            logits = model(batch.tokens[i:i + 1, :n]).logits[0]
            lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, batch.tokens[i, 1:n, None])[:, 0]
            rows.append(torch.cat([lp.new_zeros(1), lp]))
        lps = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        lps = torch.nn.functional.pad(lps, (0, batch.tokens.shape[1] - lps.shape[1]))
    finally:
        mq.Qwen3MoeTopKRouter.forward = saved
    return lps, model, own


def _name(tp: int, pp: int, ep: int, recompute: str | None, cp: int = 1) -> str:
    return f"tp{tp}pp{pp}ep{ep}" + (f"cp{cp}" if cp > 1 else "") + (f"-recompute_{recompute}" if recompute else "")


@pytest.mark.slow
def test_training_replay_world2(tiny_moe):
    # (tp, pp, ep, model.recompute, cp): EP2 (its dense part DP2), PP2, TP2 + SP; PP2 with full
    # recompute (megatron's 1F1B holds two micro-batches' replayed targets on the first stage);
    # CP2 and CP2 x EP2 (both ranks on every row, each routing its two chunks of each: the
    # expert group is the CP group)
    _check_replay(tiny_moe, 2, [(1, 1, 2, None, 1), (1, 2, 1, None, 1), (2, 1, 1, None, 1),
                                (1, 2, 1, "full", 1), (1, 1, 1, None, 2), (1, 1, 2, None, 2)])


@pytest.mark.slow
def test_training_replay_sp_cp_world4(tiny_moe):
    """On the pooled world of 4: TP2 + SP x CP2 x EP2 (expert TP 2), where each TP rank routes its
    share of its CP rank's two chunks of every row and a recording is gathered over CP, then TP;
    and CP2 x DP2 x EP4, whose expert group spans the CP and the DP ranks (the DP ranks' calls
    paired, ``models/equal_calls.py``). Two policy builds and their passes: the first alone took
    15-32 s at load averages of 35-60 on the 2 shared cores, both 241 s with this test starting
    the pool of 4 at a load average of 60-110."""
    _check_replay(tiny_moe, 4, [(2, 1, 2, None, 2), (1, 1, 4, None, 2)])


def _check_replay(tiny_moe, world: int, layouts: list) -> None:
    """Runs ``_replay_worker`` over ``layouts`` in the pooled world of ``world`` ranks and checks
    each against transformers (and the layouts against each other where both are there)."""
    from megatron_oar.algorithms import PolicyLossConfig, policy_loss
    from megatron_oar.models import parse_arch
    from tests.tiny import read_config

    root, hf = tiny_moe
    out = str(root / f"replay{world}.pt")
    launch(_replay_worker, world, str(root / "ckpt"), layouts, out)
    ranks = torch.load(out, weights_only=False)
    arch = parse_arch(read_config(hf))
    full = make_batch(arch.vocab_size, None)
    # transformers' own routing of the original weights: what the old-logprob pass must record
    _, _, own = _hf_forced(hf, full, None, roll=False)
    # OAR-G with replayed routing under full recompute equals it without (1F1B at PP2: the rerun
    # routers replay their own micro-batch's experts, models/recompute.py + RoutingPass)
    from tests.test_attribution import recompute_tolerance

    widest = max(arch.hidden_size, arch.intermediate_size, arch.moe_intermediate_size)
    tol = recompute_tolerance(widest, arch.num_layers)
    names = {_name(*layout) for layout in layouts}
    for rank in ranks if {_name(1, 2, 1, None), _name(1, 2, 1, "full")} <= names else ():
        want, got = rank[_name(1, 2, 1, None)]["oar_g_replayed"], rank[_name(1, 2, 1, "full")]["oar_g_replayed"]
        assert want.abs().max() > 0
        err = float(((got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-30)).max())
        print(f"OAR-G replayed at PP2, full recompute against none: rel err {err:.2e} (tolerance {tol:.2e})")
        assert err <= tol, err
    ref, olds = None, {}
    for name in (_name(*layout) for layout in layouts):
        routed = torch.full((full.size, full.tokens.shape[1], arch.num_layers, arch.moe_topk), -1, dtype=torch.int16)
        old = torch.zeros(full.tokens.shape)
        for rank in ranks:
            res = rank[name]
            ids = res["sample_ids"]
            w = res["routed"].shape[1]
            for j, layer in enumerate(res["layers"]):
                routed[ids, :w, layer] = res["routed"][:, :, j]
            old[ids, :res["old"].shape[1]] = res["old"].float()
        olds[name] = old
        for rank in ranks:
            res = rank[name]
            assert res["match_training"], f"{name}: the update did not route as recorded"
            assert res["match_none"], f"{name}: without replay the update must route on its own"
            # without recompute nothing re-runs the router in the backward: the replayed targets
            # of earlier micro-batches must not pile up in megatron's list (the current one only)
            got, want = res["routing_bytes"]
            assert got == want, f"{name}: the TP ranks exchanged {got} bytes of routing, expected {want}"
            if name.startswith("tp2"):  # > 256 experts: int16 ids over TP, sent as bytes (NCCL rules on)
                assert res["int16_gather"], f"{name}: int16 ids changed over the TP all-gather"
            assert res["host_waits"] == 0, f"{name}: the router hooks made the host wait {res['host_waits']} times"
            # the same weights route alike with and without recording: the same expert load
            load = {k: v for k, v in res["load_training"].items() if k.startswith("routing/load")}
            assert load and res["load_none"] == load, (name, res["load_none"], load)
            pending, micros = res["pending_training"]
            # with full recompute the backward replays them: at most the micro-batches in flight
            most = 2 if name.endswith("full") else 1
            assert micros >= 2 and pending <= most, f"{name}: {pending} replayed targets held at once"
            mean, peak = res["ratio"]
            print(f"{name}: unchanged weights ratio mean {mean} max {peak}; agreement "
                  f"{res['agree_unchanged']} rolled {res['agree_rolled']}")
            # the old-logprob pass and the update's forward are not the same kernels on every CPU
            # (a 2-core AVX-512 EPYC gave a max of 1.0000004768): exp of a log-prob difference,
            # within the log-probs' rounding of 1
            assert mean == pytest.approx(1.0, abs=LOGPROB_TOL) and peak == pytest.approx(1.0, abs=LOGPROB_TOL), name
            # a count of equal expert ids over a count of tokens: exact
            assert res["agree_unchanged"]["routing/agree_old_update"] == 1.0
            if "packed_routed" in res:  # CP: packed records the token-budget routing, replays it exactly
                known = res["routed"] >= 0
                assert torch.equal(res["packed_routed"] >= 0, known), name
                assert torch.equal(res["packed_routed"][known], res["routed"][known]), name
                assert res["packed_agree"]["routing/agree_old_update"] == 1.0, name
                assert all(v == pytest.approx(1.0, abs=LOGPROB_TOL) for v in res["packed_ratio"]), name
            assert res["agree_rolled"]["routing/agree_old_update"] < 0.9
        for i in range(full.size):
            n = int(full.lengths[i])
            for layer in range(arch.num_layers):
                got = routed[i, :n, layer].long().sort(-1).values
                assert torch.equal(got, own[layer][i].sort(-1).values), (name, i, layer)
            assert (routed[i, n:] == -1).all()
        # rolled routers, routing forced to the recorded one: transformers' loss and gradients
        # (every layout recorded the same routing, checked above: one reference)
        if ref is None:
            forced = {layer: [routed[i, :, layer] for i in range(full.size)] for layer in range(arch.num_layers)}
            lp, model, _ = _hf_forced(hf, full, forced, roll=True)
            mask = full.loss_mask
            loss, _ = policy_loss(lp, old, full.advantages, mask, PolicyLossConfig(),
                                  num_tokens=int(mask.sum()), num_seqs=int(mask.any(-1).sum()))
            loss.backward()
            ref = lp.detach(), model, loss
        lp, model, loss = ref
        got_loss = ranks[0][name]["loss"]
        print(f"{name}: replayed update loss {got_loss:.6f}, transformers forced {float(loss):.6f}")
        assert abs(got_loss - float(loss)) <= LOGPROB_TOL * max(abs(float(loss)), 1e-3), name
        rollout_lp = torch.zeros(full.tokens.shape)
        for rank in ranks:
            res = rank[name]
            rollout_lp[res["sample_ids"], :res["rollout_old"].shape[1]] = res["rollout_old"].float()
            m = res["rollout_metrics"]
            print(f"{name}: rollout mode {m}")
            # the pass's own choices (rolled routers, replayed history) against vLLM's, whose last
            # token per row is missing (not counted); the update's replay is training mode's
            assert 0 < m["routing/agree_rollout_old"] < 0.9
            assert m["routing/load_max_mean"] >= 1.0
        # vLLM-style ids replayed: transformers with the same routing forced, to fp32 rounding
        err = float(((rollout_lp - lp) * full.loss_mask).abs().max())
        scale = float((lp * full.loss_mask).abs().max())
        print(f"{name}: rollout-replayed old log-probs vs transformers forced: max|d| {err:.2e} of {scale:.2f}")
        assert err <= LOGPROB_TOL * scale, name
        for rank in ranks:
            for layer, g in rank[name]["router_grads"].items():
                want = model.model.layers[layer].mlp.gate.weight.grad
                rel = float((g - want).abs().max() / want.abs().max())
                print(f"{name}: router gradient of layer {layer} vs transformers forced: rel {rel:.2e}")
                assert rel <= GRAD_TOL, (name, layer, rel)
    if {_name(1, 1, 2, None), _name(1, 1, 1, None, 2), _name(1, 1, 2, None, 2)} <= names:
        _assert_cp_equals_cp1(ranks, olds, full)


def _assert_cp_equals_cp1(ranks: list, olds: dict, full) -> None:
    """CP2 and CP2 x EP2 against DP2 x EP2 (CP1) in the job above: the old-logprob pass's
    log-probs (recorded routing), the replayed update's loss (rolled routers) and every gradient
    (experts by their global number; DDP reduced them over the data x context parallel ranks,
    the experts' over the expert data-parallel group), to fp32 rounding. The routing each
    recorded, and the replayed update's agreement of exactly 1.0, the loop above checks per
    layout."""
    want = _name(1, 1, 2, None)
    valid = torch.arange(full.tokens.shape[1]) < full.lengths[:, None]
    grads_want = {k: v for rank in ranks for k, v in rank[want]["grads"].items()}
    for got in (_name(1, 1, 1, None, 2), _name(1, 1, 2, None, 2)):
        scale = float(olds[want][valid].abs().max())
        err = float((olds[got] - olds[want])[valid].abs().max())
        print(f"{got} vs {want}: old log-probs max|d| {err:.2e} of {scale:.2f}")
        assert err <= LOGPROB_TOL * scale, got
        assert ranks[0][got]["loss"] == pytest.approx(ranks[0][want]["loss"], rel=LOGPROB_TOL), got
        grads = {k: v for rank in ranks for k, v in rank[got]["grads"].items()}
        assert grads.keys() == grads_want.keys(), got
        for k, w in grads_want.items():
            assert w.abs().max() > 0, k
            assert_close_to_rounding(grads[k], w, GRAD_TOL, f"{got}: grad {k}")
