"""Routing replay for mixture-of-experts models (``model.routing_replay``), and the routing metrics.

A MoE policy's log-probs depend on which experts each token is routed to; if the update's
forward routes a token to other experts than the pass that produced ``old_logprobs`` (or than
vLLM did while sampling), the PPO ratio compares two different sub-networks. The modes:

* ``none``: every pass routes on its own weights (megatron's default).
* ``training``: the old-logprob pass records the top-k experts of every (token, MoE layer), and
  the update's forward replays them (the ratio compares the same experts). Without activation
  recompute megatron's backward never re-runs the router, so the backward uses the routing the
  forward used; with it (``model.recompute=full``) each recomputed router replays, first in first
  out, what its call's forward used (megatron's ``REPLAY_BACKWARD``, which we switch to when a
  model call returns: megatron 0.16 never sets it).
* ``rollout``: vLLM's routed experts (``enable_return_routed_experts``) of every sampled token are
  replayed in the old-logprob pass and in the update (R3-style: the three passes share one routing).

The mechanism is megatron-core's own: ``TransformerConfig.moe_enable_routing_replay`` gives every
``TopKRouter`` a ``RouterReplay``, whose ``RECORD`` action keeps the top-k indices the router
computed and whose ``REPLAY_FORWARD`` action uses given indices instead of its own top-k (the
routing probabilities are still the router's, gathered at the replayed experts, so gradients
reach the router). We drive each model's own instances (not the class-wide list, which holds
every model built in the process) and set their targets per micro-batch from a forward pre-hook.

Routing is stored per batch row and token column, ``routed [B, L, n, k]`` (``n``: this pipeline
stage's MoE layers, in order; ``-1``: not recorded), so the update may group its micro-batches
differently from the old-logprob pass (mini-batches, token budgets, packing); each micro-batch's
router tokens are mapped to (row, column) from the model call's own layout (padded ``[s, b]``
sequence-first, or THD packed), under context parallelism to this CP rank's two chunks of every
sequence (their global columns: each CP rank replays, and records, the routing of its own tokens),
and under sequence parallelism to this TP rank's contiguous share (a recording stays on the
device, one byte per value where the ids fit, until the pass ends; then the CP ranks and the TP
ranks all-gather their shares in bounded chunks, so every rank holds its batch's whole routing).
Tokens without a recorded routing (padding, and vLLM's last sampled token, never fed back to the
model) take experts round-robin among themselves (every expert, hence every EP rank, alike); no
loss, probe or earlier token reads them. Every other token must have one: a row vLLM returned no
routing for, or too little, is refused (:func:`rollout_routing`).

Metrics (:class:`RoutingLog`): the share of top-k choices a pass would make on its own that equal
the replayed ones (``routing/agree_*``, per (token, layer) the overlap of the two expert sets
divided by ``k``: slot order is not compared), and the per-layer expert load of the old-logprob
pass (tokens per expert, max over mean), accumulated on the device and read once per pass.

Attribution passes (OAR-G, OAR-P, a teacher pass of their own) route as the pass their teacher
came from (:func:`attribution_route`): the teacher and the students must route alike, or the
students diverge from the teacher with nothing perturbed. With ``rollout`` the teacher comes
from the old-logprob pass, which replays vLLM's routing, so they replay it too (a masked copy
or a noisy sequence sends each token to the experts vLLM chose for its row's token there, the
masked position's too): the importance is measured on the sub-network the rollout sampled from
and the update trains, which is what R3 is for. With ``training`` and ``none`` the teacher
routed on its own and so do the students: a masked copy may route later tokens elsewhere (that
counterfactual is then part of OAR-P's measure).

Bound: megatron-core 0.16.x, whose ``RouterReplay`` API this module uses (``router_replay.py``
appeared in 0.16; its methods are development API that may change).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_oar.models import context_parallel as cpx
from megatron_oar.models.builder import ROUTING_REPLAY_MODES, moe_layer_pattern
from megatron_oar.models.parallel import unwrap
from megatron_oar.models.recompute import recomputing
from megatron_oar.rollout.batch import RoutedExperts

# routed [B, L, n, k] on the CPU: 2 bytes per (token, MoE layer, slot), -1 where none (experts
# must number fewer than 2**15: RoutingPass checks)
ROUTED_DTYPE = torch.int16
# what a pass keeps on the device and the TP ranks exchange: one byte per (token, layer, slot)
# where the experts' ids fit, and at most this many bytes per rank in one all-gather
WIRE_CHUNK_BYTES = 64 << 20


def wire_dtype(experts: int) -> torch.dtype:
    """The smallest dtype that holds expert ids ``0 .. experts - 1``."""
    return torch.uint8 if experts <= 256 else ROUTED_DTYPE
# RouterReplay's API as read in 0.16.1 (router_replay.py: per-instance set_target_indices,
# get_recorded_indices, set_router_replay_action; TopKRouter.router_replay): development API
MEGATRON_CORE_RANGE = ((0, 16), (0, 17))


@functools.cache
def check_megatron_core() -> None:
    from importlib.metadata import version

    v = tuple(int(x) for x in version("megatron-core").split(".")[:2])
    lo, hi = MEGATRON_CORE_RANGE
    if not lo <= v < hi:
        raise RuntimeError(f"model.routing_replay drives megatron-core's RouterReplay as 0.16 ships it; "
                           f"megatron-core {version('megatron-core')} is outside the tested range "
                           f"[{'.'.join(map(str, lo))}, {'.'.join(map(str, hi))})")


def moe_routers(model) -> list:
    """This stage's ``TopKRouter`` modules in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]


def stage_moe_layers(model) -> tuple[list[int], list[int], int]:
    """``(decoder layers, MoE indices, MoE layers in all)`` of this stage's routers: each one's
    global decoder layer (0-based: what vLLM's routed experts are indexed by) and its index among
    the model's MoE layers (the metrics')."""
    pattern = moe_layer_pattern(unwrap(model).config)
    layers = [r.layer_number - 1 for r in moe_routers(model)]
    return layers, [sum(pattern[:i]) for i in layers], int(sum(pattern))


def router_tokens(args: tuple, kwargs: dict, rows: list[int], lengths: list[int],
                  tp_rank: int, tp_size: int, sequence_parallel: bool, *, cp_rank: int = 0,
                  cp_size: int = 1):
    """``(row, col, valid)`` of each token the routers of one model call see, in their order.

    ``args``/``kwargs``: the call (``input_ids [m, S / CP]``; ``packed_seq_params`` when packed);
    ``rows``: the batch rows of the micro-batch; ``lengths``: every batch row's real length.
    Under context parallelism (``cp_size`` > 1) the call holds CP rank ``cp_rank``'s two chunks
    of every sequence (``models.context_parallel``: of the padded rows, or of each packed row):
    their columns are those chunks' global ones.
    """
    ids = args[0] if args else kwargs["input_ids"]
    packed = kwargs.get("packed_seq_params")
    dev = torch.device("cpu")  # from shapes and lists: no device value is read (but THD offsets)
    m, s = ids.shape
    rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
    lens = torch.tensor(lengths, dtype=torch.long, device=dev)[rows_t]
    if packed is not None:  # THD: [1, T] -> tokens in order, row k at cu_seqlens_q_padded[k]
        cu = packed.cu_seqlens_q_padded.to(dev).long()
        t = (torch.arange(s, device=dev) if cp_size == 1 else
             cpx.thd_local_index(cu, cp_size, cp_rank))  # each local token's packed position
        k = torch.searchsorted(cu, t, right=True) - 1
        row, col = rows_t[k], t - cu[k]
        valid = col < lens[k]
    else:  # [m, S] -> [S, m] sequence-first, flattened
        cols = cpx.local_positions(s * cp_size, cp_size, cp_rank, dev)  # arange(s) at CP 1
        j = torch.arange(s * m, device=dev)
        b, col = j % m, cols[j // m]
        row, valid = rows_t[b], col < lens[b]
    return _tp_share((row, col, valid), tp_rank, tp_size, sequence_parallel)


def _overlap(a: torch.Tensor, b: torch.Tensor, experts: int) -> torch.Tensor:
    """Per token, how many of the top-k experts ``a [n, k]`` are also in ``b [n, k]``."""
    ma = torch.zeros(a.shape[0], experts, dtype=torch.bool, device=a.device).scatter(1, a.long(), True)
    mb = torch.zeros_like(ma).scatter(1, b.long(), True)
    return (ma & mb).sum(-1)


@dataclass
class RoutingLog:
    """One step's routing mode and metrics, filled by the passes (``policy_passes``).

    ``agree[name] = (equal choices, choices)`` and ``load [n_moe_layers, experts]`` are this
    rank's counts; :meth:`metrics` reduces them over the world (collective)."""

    mode: str = "none"
    agree: dict[str, list[float]] = field(default_factory=dict)
    load: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"model.routing_replay={self.mode!r}; expected one of {list(ROUTING_REPLAY_MODES)}")

    def count_agreement(self, name: str, equal: float, total: float) -> None:
        box = self.agree.setdefault(name, [0.0, 0.0])
        box[0] += equal
        box[1] += total

    def metrics(self, device) -> dict[str, float]:
        """``routing/agree_<a>_<b>`` (share of top-k choices equal) and ``routing/load_max_mean``
        (the worst layer) with ``routing/load_max_mean/layer<i>``. Collective over the world."""
        names = sorted(self.agree)
        box = [names, None if self.load is None else tuple(self.load.shape)]
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:  # pipeline stages without MoE layers hold no load
            boxes = [None] * world
            dist.all_gather_object(boxes, box)
            names = sorted({n for b in boxes for n in b[0]})
            shape = next((b[1] for b in boxes if b[1] is not None), None)
        else:
            shape = box[1]
        counts = torch.tensor([self.agree.get(n, [0.0, 0.0]) for n in names] or [[0.0, 0.0]],
                              dtype=torch.float64, device=device)
        load = torch.zeros(shape or (0,), dtype=torch.float64, device=device)
        if self.load is not None:
            load += self.load.to(device, torch.float64)
        if world > 1:
            dist.all_reduce(counts)
            dist.all_reduce(load)
        out = {f"routing/agree_{n}": float(counts[i, 0] / counts[i, 1].clamp_min(1)) for i, n in enumerate(names)}
        if load.numel():
            ratio = load.max(-1).values / load.mean(-1).clamp_min(1e-30)
            out.update({f"routing/load_max_mean/layer{i}": float(r) for i, r in enumerate(ratio)})
            out["routing/load_max_mean"] = float(ratio.max())
        return out


class RoutingPass:
    """One Megatron pass over a batch's micro-batches, routing as asked.

    ``rows``: the batch rows of each micro-batch, in the schedule's order (model calls past
    them are filler calls pairing other DP ranks' calls, ``models.equal_calls``: they route on
    their own and are neither recorded, replayed nor counted); ``lengths``: the
    batch rows' real lengths; ``width``: the batch's columns. ``record``: fill :attr:`routed`
    (``[B, width, n, k]``) with this pass's routing (megatron's ``RECORD``); ``replay``: a
    ``routed`` tensor to force (``REPLAY_FORWARD``); ``log``/``agree``: count how many of the
    pass's own top-k choices equal the replayed ones, as ``log.agree[agree]``; ``load``: count
    the experts' tokens into ``log.load``. Use as a context manager around the pass."""

    def __init__(self, model, rows: list[list[int]], lengths: list[int], width: int, *,
                 record: bool = False, replay: torch.Tensor | None = None,
                 log: RoutingLog | None = None, agree: str | None = None, load: bool = False):
        self.model, self.rows, self.lengths, self.width = model, rows, lengths, width
        self.routers = moe_routers(model)
        config = unwrap(model).config
        if self.routers and (record or replay is not None):
            check_megatron_core()
        if self.routers and any(r.router_replay is None for r in self.routers) and (record or replay is not None):
            raise RuntimeError("routing replay needs the model built with model.routing_replay set "
                               "(megatron's moe_enable_routing_replay)")
        if config.moe_router_fusion:
            raise RuntimeError("routing replay needs moe_router_fusion=False (TE's fused top-k bypasses it)")
        self.k, self.experts = config.moe_router_topk, config.num_moe_experts
        if self.routers and self.experts >= 2**15:
            raise ValueError(f"{self.experts} experts do not fit the routing's int16 storage")
        self.sp = bool(config.sequence_parallel)
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.cp_rank, self.cp = cpx.cp_rank(), cpx.cp_size()  # each CP rank routes its own chunks
        self.record, self.replay, self.log, self.agree_name, self.load = record, replay, log, agree, load
        self.routed = None  # after a recording pass: routed [B, width, n, k] on the CPU
        # recording: per micro-batch, this rank's router tokens' routing on the device
        # ([tokens, n, k], wire_dtype) and, per CP rank, every TP rank's (row, col, valid) on the CPU
        self._recorded: list[torch.Tensor] = []
        self._layouts: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        if replay is not None and replay.shape[2] != len(self.routers):
            raise ValueError(f"replayed routing has {replay.shape[2]} MoE layers, this stage has {len(self.routers)}")
        # the metrics accumulate on the device, read once when the pass ends (no host wait per
        # layer and call): tokens per expert, and (equal choices, choices) of the agreement
        self.device = next(unwrap(model).parameters()).device
        self.counts = torch.zeros(len(self.routers), self.experts or 1, dtype=torch.float64, device=self.device)
        self.agreement = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.slots = None  # the current call's real tokens (1.0) per top-k slot, on the device
        self.micro = -1  # calls past len(rows) are filler calls (models.equal_calls)
        self.action = None  # megatron's RouterReplayAction of the pass's own calls
        self.tokens = None  # (row, col, valid) of the current micro-batch
        self.targets = self.known = None  # its replayed top-k [n, layers, k], and where recorded
        # the model recomputes its routers in the backward (model.recompute=full): a grad-enabled
        # call's routing is then kept in megatron's replay_backward_list, and the routers switch
        # to REPLAY_BACKWARD when the call returns (see _post)
        self.recomputed = _routers_recomputed(config)
        self.keep = False  # the current call's routing is kept for its recompute
        self._handles = []

    # ------------------------------------------------------------------ hooks

    def _pre(self, module, args, kwargs):
        self.micro += 1
        # recomputed routers: train mode, or an eval-mode pass under recompute (OAR-G's, models.recompute)
        self.keep = (self.recomputed and (module.training or recomputing(module)) and torch.is_grad_enabled()
                     and self.action is not None)
        if self.micro >= len(self.rows):  # a filler call (models.equal_calls): routes on its own
            self.tokens = None
            for r in self.routers:
                if r.router_replay is None:
                    continue
                if self.keep:  # recorded, so that its recompute routes as it did
                    r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
                else:
                    r.router_replay.clear_router_replay_action()
            return
        if self.action is not None:  # the pass's own calls (before any filler)
            for r in self.routers:
                r.router_replay.set_router_replay_action(self.action)
        rows = self.rows[self.micro]
        def layout(cp_rank: int):  # the CP rank's router tokens, every TP rank's (on the CPU)
            return router_tokens(args, kwargs, rows, self.lengths, 0, 1, False, cp_rank=cp_rank,
                                 cp_size=self.cp)

        full = layout(self.cp_rank)
        self.tokens = _tp_share(full, self.tp_rank, self.tp_size, self.sp)
        valid = self.tokens[2]
        self.slots = valid.repeat_interleave(self.k).double().to(self.device, non_blocking=True)
        if self.record:
            self._layouts.append([full if c == self.cp_rank else layout(c) for c in range(self.cp)])
            self._recorded.append(torch.zeros(valid.numel(), len(self.routers), self.k,
                                              dtype=wire_dtype(self.experts), device=self.device))
        if self.replay is not None:  # one copy to the device per call, every layer's
            targets, known = self._targets(*self.tokens)
            self.targets = targets.to(self.device, non_blocking=True)
            self.known = known.to(self.device, non_blocking=True)
            for i, r in enumerate(self.routers):
                r.router_replay.set_target_indices(self.targets[:, i])

    def _targets(self, row, col, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """The replayed top-k ``[n, layers, k]`` of this micro-batch's router tokens and where
        one was recorded ``[n, layers]`` (on the CPU), gathered once for all layers. Tokens
        without one (padding; what vLLM did not return) take experts round-robin among
        themselves, per layer: ``m``-th such token ``(m k + j) mod E`` for slot ``j``, so they
        load every expert (every EP rank) alike, where experts ``0..k-1`` took them all."""
        n, layers = row.numel(), self.replay.shape[2]
        inside = valid & (col < self.replay.shape[1])
        got = self.replay[row[inside], col[inside]].long()  # [m, layers, k]
        known = torch.zeros(n, layers, dtype=torch.bool)
        known[inside] = (got >= 0).all(-1)
        rank = (~known).long().cumsum(0) - 1  # [n, layers]: each unrouted token's place among them
        out = (rank[:, :, None] * self.k + torch.arange(self.k)) % self.experts
        out[inside] = torch.where(known[inside, :, None], got, out[inside])
        return out, known

    def _post(self, module, args, output):
        """A model call returned: with recompute its routers' next calls are the recomputed
        forwards of earlier calls (megatron's 1F1B runs backwards in the calls' order), which
        pop what each call used from the front of the list."""
        if self.keep:
            for r in self.routers:
                r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def _router_post(self, layer: int):
        def hook(router, args, output):
            replay = router.router_replay
            action = getattr(replay, "router_replay_action", None)
            if action is RouterReplayAction.REPLAY_BACKWARD:  # recomputed: counted when it ran
                return
            if self.keep and action is RouterReplayAction.RECORD:  # what the recompute replays
                replay.replay_backward_list.append(replay.get_recorded_indices().detach())
            elif replay is not None and action is RouterReplayAction.REPLAY_FORWARD and not self.keep:
                _drop_backward_target(replay)
            if self.tokens is None:  # a filler call: neither recorded nor counted
                return
            # everything below stays on the device: nothing here waits for it
            with torch.no_grad():
                if self.record:  # copied to the CPU once, when the pass ends
                    idx = router.router_replay.get_recorded_indices().detach()
                    self._recorded[-1][:, layer] = idx  # same device; cast to the wire dtype
                if self.log is None:
                    return
                own = self._own_topk(router, args, output)
                if self.load:  # real tokens' slots per expert
                    self.counts[layer].index_add_(0, own.flatten(), self.slots)
                if self.replay is not None and self.agree_name:
                    known = self.known[:, layer]
                    equal = (_overlap(own, self.targets[:, layer], self.experts) * known).sum()
                    self.agreement += torch.stack([equal, known.sum() * self.k]).double()
        return hook

    def _own_topk(self, router, args, output) -> torch.Tensor:
        """The experts the router would choose itself: its routing map, or, when it replayed,
        the top-k of its gating logits (softmax is monotonic; Qwen3-MoE has no expert bias or
        groups, refused by the family otherwise)."""
        action = getattr(router.router_replay, "router_replay_action", None)
        if action is None or action.value == "record":
            routing_map = output[1]
            return routing_map.int().topk(self.k, dim=-1).indices
        logits = router.gating(args[0]).view(-1, self.experts)
        return logits.topk(self.k, dim=-1).indices

    # ------------------------------------------------------------------ context

    def __enter__(self) -> RoutingPass:
        if not self.routers:
            return self
        if self.record or self.replay is not None:
            self.action = RouterReplayAction.RECORD if self.record else RouterReplayAction.REPLAY_FORWARD
            for r in self.routers:
                r.router_replay.clear_indices()
                r.router_replay.set_router_replay_action(self.action)
        self._handles.append(unwrap(self.model).register_forward_pre_hook(self._pre, with_kwargs=True))
        self._handles.append(unwrap(self.model).register_forward_hook(self._post))
        for i, r in enumerate(self.routers):
            self._handles.append(r.register_forward_hook(self._router_post(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for r in self.routers:  # attribution passes and the next step route on their own
            if r.router_replay is not None:
                r.router_replay.clear_router_replay_action()
                r.router_replay.clear_indices()
        if exc[0] is not None:
            return
        if self.record:
            self.routed = self._assemble_recorded()
        # the metrics: read from the device once per pass; without SP every TP rank saw the same
        # tokens, so TP rank 0 counts them
        counted = self.sp or self.tp_rank == 0
        if self.log is not None and self.replay is not None and self.agree_name and self.routers and counted:
            equal, total = self.agreement.tolist()
            if total:
                self.log.count_agreement(self.agree_name, equal, total)
        if self.log is not None and self.load and self.routers and counted:
            _, numbers, total = stage_moe_layers(self.model)
            if self.log.load is None:
                self.log.load = torch.zeros(total, self.experts, dtype=torch.float64)
            counts = self.counts.cpu()
            for i, n in enumerate(numbers):
                self.log.load[n] += counts[i]


    def _assemble_recorded(self) -> torch.Tensor:
        """``routed [B, width, n, k]`` on the CPU from the micro-batches' recordings. Under
        sequence parallelism each TP rank recorded its own share of every micro-batch's tokens,
        under context parallelism each CP rank its two chunks of every sequence: the CP ranks,
        then the TP ranks all-gather their recordings (one byte per value where the ids fit, in
        chunks of at most :data:`WIRE_CHUNK_BYTES` per rank) and place each rank's at its tokens
        (every rank of a TP x CP group then holds the routing of all of its batch's tokens)."""
        routed = torch.full((len(self.lengths), self.width, len(self.routers), self.k), -1, dtype=ROUTED_DTYPE)
        if not self._recorded:
            return routed
        mine = torch.cat(self._recorded)
        shared = self.sp and self.tp_size > 1
        # [tokens, CP, n, k]: this TP rank's share of every CP rank's tokens (equally many: the
        # CP ranks run the same micro-batches, each a 1/CP of every sequence)
        values = mine.unsqueeze(1)
        if self.cp > 1:
            values = torch.stack(_all_gather_chunked(mine, ps.get_context_parallel_group(), self.cp), 1)
        parts = ([values.cpu()] if not shared else
                 _all_gather_chunked(values.to(self.device), ps.get_tensor_model_parallel_group(), self.tp_size))
        for rank, part in enumerate(parts):
            for c in range(self.cp):
                row, col, valid = (torch.cat(t) for t in zip(*(_tp_share(layout[c], rank, self.tp_size, shared)
                                                                for layout in self._layouts)))
                routed[row[valid], col[valid]] = part[:, c][valid].to(ROUTED_DTYPE)
        self._recorded, self._layouts = [], []
        return routed


def _tp_share(tokens: tuple, tp_rank: int, tp_size: int, sequence_parallel: bool) -> tuple:
    """The share of a model call's router tokens ``(row, col, valid)`` that TP rank ``tp_rank``
    routes: under sequence parallelism its contiguous slice of the sequence axis, else all."""
    if not sequence_parallel or tp_size == 1:
        return tokens
    n = tokens[0].numel() // tp_size
    return tuple(t[tp_rank * n:(tp_rank + 1) * n] for t in tokens)


def as_wire_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as bytes: NCCL has no ``int16`` (a ``Short`` collective raises), so
    ids wider than a byte travel as their bytes (a ``uint8`` view, the last dimension
    ``element_size`` times longer) and :func:`from_wire_bytes` restores them."""
    return t if t.dtype == torch.uint8 else t.contiguous().view(torch.uint8)


def from_wire_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b if dtype == torch.uint8 else b.view(dtype)


def _all_gather_chunked(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same shape on each) on the CPU, in rank order, all-gathered along
    dim 0 in chunks of at most :data:`WIRE_CHUNK_BYTES` per rank, as bytes (:func:`as_wire_bytes`)."""
    per_row = max(t[0].nbytes if t.shape[0] else 1, 1)
    step = max(WIRE_CHUNK_BYTES // per_row, 1)
    out = [torch.empty(t.shape, dtype=t.dtype) for _ in range(size)]
    for a in range(0, t.shape[0], step):
        chunk = as_wire_bytes(t[a:a + step].contiguous())
        parts = [torch.empty_like(chunk) for _ in range(size)]
        dist.all_gather(parts, chunk, group=group)
        for o, p in zip(out, parts):
            o[a:a + step] = from_wire_bytes(p.cpu(), t.dtype)
    return out


def _routers_recomputed(config) -> bool:
    """Whether megatron re-runs a MoE layer's router in the backward (in training mode with
    grad): full recompute (``TransformerBlock._checkpointed_forward``) or selective recompute of
    the MoE layer (``recompute_modules`` with ``moe``; the builder asks for ``core_attn`` only)."""
    granularity = getattr(config, "recompute_granularity", None)
    return granularity == "full" or (granularity == "selective"
                                     and "moe" in (getattr(config, "recompute_modules", None) or ()))


def _drop_backward_target(replay) -> None:
    """Forget the target a router has just replayed. megatron-core 0.16's
    ``RouterReplay.set_target_indices`` also appends the target to ``replay_backward_list``,
    which only a recomputed forward (``REPLAY_BACKWARD``) pops: without one, every micro-batch's
    int64 targets of every layer would stay on the device until the pass ends."""
    if replay.replay_backward_list:
        replay.replay_backward_list.pop()


def attribution_route(model, batch, routing: RoutingLog | None):
    """How the attribution passes of ``batch`` route (``compute_importance``'s ``route``): with
    ``model.routing_replay=rollout``, each schedule call replays ``batch.routed_experts`` (vLLM's
    routing, which the old-logprob pass replayed for the teacher) for its micro-batches' rows;
    otherwise None, every pass routing on its own as the teacher did (module docstring)."""
    if routing is None or routing.mode != "rollout":
        return None
    if batch.routed_experts is None:
        raise ValueError("model.routing_replay=rollout: the batch has no routed experts from vLLM")
    lengths, width, routed = batch.lengths.tolist(), batch.tokens.shape[1], batch.routed_experts
    return lambda rows: RoutingPass(model, rows, lengths, width, replay=routed)


def rollout_routing(per_sample: list, lengths: list[int], width: int, moe_layers: list[int],
                    topk: int) -> torch.Tensor:
    """vLLM's routed experts of each row (``[tokens, num_hidden_layers, k]`` arrays) as
    ``routed [B, width, n, k]`` for the MoE layers ``moe_layers`` (global layer indices; vLLM
    indexes every decoder layer). vLLM returns the prompt's tokens and every sampled token but
    the last (never fed back to the model): columns past what it returned stay ``-1``.

    Every row needs at least ``lengths[i] - 1`` tokens of routing (``ValueError`` naming the row
    otherwise): a real token without one would be replayed to experts ``0..k-1``, and the
    passes would compute the log-probs of a network vLLM never sampled from."""
    out = torch.full((len(per_sample), width, len(moe_layers), topk), -1, dtype=ROUTED_DTYPE)
    for i, ids in enumerate(per_sample):
        need = lengths[i] - 1
        if ids is None:
            raise ValueError(f"row {i}: vLLM returned no routed experts; its {lengths[i]} tokens need "
                             f"{need} (model.routing_replay=rollout replays them in every pass)")
        t = torch.as_tensor(ids)
        if t.dim() != 3 or t.shape[2] != topk or t.shape[1] <= max(moe_layers, default=0):
            raise ValueError(f"row {i}: vLLM's routed experts have shape {tuple(t.shape)}; expected "
                             f"[tokens, layers > {max(moe_layers, default=0)}, {topk}]")
        if t.shape[0] < need:
            raise ValueError(f"row {i}: vLLM's routed experts cover {t.shape[0]} tokens; its {lengths[i]} "
                             f"tokens need {need} (every token but the last sampled one; "
                             "model.routing_replay=rollout)")
        n = min(t.shape[0], lengths[i], width)
        out[i, :n] = t[:n, moe_layers].to(ROUTED_DTYPE)
    return out


def attach_rollout_routing(model, batch, samples: list, group=None) -> None:
    """``batch.routed_experts`` from the rollout's samples (``batch.sample_ids`` index them):
    vLLM's routing of this stage's MoE layers (``model.routing_replay=rollout``).

    Once the rollouts were gathered over rollout groups, each sample's array stays on the ranks
    of the group that generated it (:class:`~megatron_oar.rollout.batch.RoutedExperts`); then
    this is collective over ``group`` (default the world; a gloo group, e.g. the trainer's
    control group, keeps the exchange off the GPU): the ranks state their rows and MoE layers
    (one ``all_gather_object`` of indices) and one all-to-all sends each rank, from one of each
    sample's holders, exactly those rows' tokens at those layers, one byte per value where the
    expert ids fit. Samples holding plain arrays (no gather) are read where they are."""
    config = unwrap(model).config
    layers, _, _ = stage_moe_layers(model)
    rows = [int(i) for i in batch.sample_ids]
    if any(isinstance(s.routed_experts, RoutedExperts) for s in samples):
        _check_routed_shapes(samples, config.num_layers, config.moe_router_topk)
        per_row = _fetch_routing(samples, rows, layers, wire_dtype(config.num_moe_experts), group)
        picked = list(range(len(layers)))  # the fetched arrays hold this stage's layers only
    else:
        per_row, picked = [samples[i].routed_experts for i in rows], layers
    if all(r is None for r in per_row):
        raise ValueError("model.routing_replay=rollout: vLLM returned no routed experts "
                         "(rollout.return_routed_experts; vLLM's V2 GPU model runner)")
    batch.routed_experts = rollout_routing(per_row, batch.lengths.tolist(), batch.tokens.shape[1],
                                           picked, config.moe_router_topk)


def _check_routed_shapes(samples: list, num_layers: int, topk: int) -> None:
    """vLLM's routing shapes, checked alike on every rank (before any collective)."""
    for i, s in enumerate(samples):
        shape = None if s.routed_experts is None else tuple(s.routed_experts.shape)
        if shape is not None and (len(shape) != 3 or shape[1] != num_layers or shape[2] != topk):
            raise ValueError(f"sample {i}: vLLM's routed experts have shape {shape}; expected "
                             f"[tokens, {num_layers} layers, {topk}]")


def _fetch_routing(samples: list, rows: list[int], layers: list[int], wire: torch.dtype,
                   group) -> list[torch.Tensor | None]:
    """Per row of ``rows``, its sample's routing ``[tokens, len(layers), k]`` at ``layers``
    (``wire`` dtype), or None where vLLM returned none. Collective over ``group``."""
    group = group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    needs: list = [None] * len(ranks)
    dist.all_gather_object(needs, (rows, layers), group=group)

    def tokens(i: int) -> int:  # what vLLM returned, up to the sample's length
        s = samples[i]
        return min(s.routed_experts.shape[0], len(s.prompt_ids) + len(s.response_ids))

    def source(r: RoutedExperts, q: int) -> int | None:  # None: rank q holds it
        return None if ranks[q] in r.ranks else ranks.index(r.ranks[q % len(r.ranks)])

    send: list[list[torch.Tensor]] = [[] for _ in ranks]
    recv = [0] * len(ranks)
    for q, (q_rows, q_layers) in enumerate(needs):
        for i in q_rows:
            r = samples[i].routed_experts
            src = None if r is None else source(r, q)
            if src == me:
                send[q].append(torch.as_tensor(r.array[:tokens(i), q_layers]).to(wire).flatten())
            if src is not None and q == me:
                recv[src] += tokens(i) * len(q_layers) * r.shape[2]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    width = torch.empty((), dtype=wire).element_size()  # bytes per value on the wire (as_wire_bytes)
    out = torch.empty(sum(recv) * width, dtype=torch.uint8, device=device)
    inp = torch.cat([t for ts in send for t in ts]) if any(send) else torch.empty(0, dtype=wire)
    sizes = [sum(t.numel() for t in ts) * width for ts in send]
    dist.all_to_all_single(out, as_wire_bytes(inp).to(device), [n * width for n in recv], sizes, group=group)
    got = list(from_wire_bytes(out.cpu(), wire).split(recv))
    offsets = [0] * len(ranks)
    per_row = []
    for i in rows:
        r = samples[i].routed_experts
        if r is None:
            per_row.append(None)
            continue
        src = source(r, me)
        if src is None:
            per_row.append(torch.as_tensor(r.array[:tokens(i), layers]).to(wire))
            continue
        n = tokens(i) * len(layers) * r.shape[2]
        per_row.append(got[src][offsets[src]:offsets[src] + n].view(tokens(i), len(layers), r.shape[2]))
        offsets[src] += n
    return per_row
