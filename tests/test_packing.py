"""Packed (THD) micro-batches (``models/packing.py``, ``train.batching=packed``).

The bookkeeping on plain tensors; the padding accounting; the config check. Then the trainer's
Megatron passes (old-logprob with the probe teacher, reference log-probs, one ``update_step``)
with ``packed`` against ``token_budget`` on the same rows at TP1, TP2 and PP2, at sequence
multiples 1, 4 and 8, on the real megatron local-spec GPTModel, whose core attention is PyTorch
SDPA (``models/sdpa_attention.py``: each THD row attends within itself). The same passes with
megatron's unfused ``DotProductAttention`` (``model.attention=unfused``, token budgets) are the
reference for SDPA, token-budget and packed alike, and OAR-G / OAR-P importance under both
attentions agree too. A wrong pack, wrong cu_seqlens or a wrong unpack changes the results.
(Checked by hand once, with an emulation of TE's THD attention in SDPA's place: an ``unpack``
that reads each token's right neighbour fails ``test_packed_equals_token_budget`` at every
multiple, one that finds the rows at their real offsets ``cu_seqlens`` instead of
``cu_seqlens_padded`` fails it at multiple 4.) TE's own numerics are tests/gpu/test_gpu_packed.py's.

Cost (2 cores): 3 jobs of the warm world pool (1, 2, 2 ranks), about 60-90 s of wall time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_oar.models.micro_batches import micro_batches, padding_fraction, token_slots
from megatron_oar.models.packing import pack, packed_seq_params, unpack
from megatron_oar.models.padding import padded_length
from tests.distributed import launch_and_load, save_gathered
from tests.test_config import HF, example, raises
from tests.test_micro_batches import BUDGET, _passes, assert_same_passes

# rows of lengths 27, 26, 15, 29, 28 in budgets of 60 tokens: at multiple 1 three micro-batches of
# 2, 2, 1 rows; at 4 of 1, 2, 2 rows, with pads inside the packed sequences; at 8 one row each
MULTIPLES = (1, 4, 8)


# ----------------------------------------------------------------------------- the bookkeeping

def test_pack_layout():
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 11, 0]])
    p = pack(tokens, [5, 2, 4], multiple=4)
    assert p.tokens.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 0, 0, 8, 9, 10, 11]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3]]  # per row
    assert p.cu_seqlens.tolist() == [0, 5, 7, 11] and p.cu_seqlens.dtype == torch.int32
    assert p.cu_seqlens_padded.tolist() == [0, 8, 12, 16] and p.cu_seqlens_padded.dtype == torch.int32
    assert p.max_seqlen == 8 and p.total == 16 and p.size == 3
    q = packed_seq_params(p)
    assert q.qkv_format == "thd" and q.max_seqlen_q == q.max_seqlen_kv == 8
    for cu in (q.cu_seqlens_q, q.cu_seqlens_kv, q.cu_seqlens_q_padded, q.cu_seqlens_kv_padded):
        assert cu.tolist() == [0, 8, 12, 16]  # attention over each padded row (packing.py's doc)
    # multiple 1: no padding at all, T = the real tokens
    p1 = pack(tokens, [5, 2, 4])
    assert p1.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert p1.cu_seqlens.tolist() == p1.cu_seqlens_padded.tolist() == [0, 5, 7, 11]
    with pytest.raises(ValueError, match="do not fit"):
        pack(tokens, [6, 2, 4])


@pytest.mark.parametrize("multiple", [1, 3, 16])
def test_pack_unpack_round_trip(multiple):
    g = torch.Generator().manual_seed(multiple)
    lengths = [17, 3, 1, 9, 17]
    tokens = torch.randint(1, 100, (5, 17), generator=g)
    p = pack(tokens, lengths, multiple)
    assert p.total % multiple == 0 and p.total == sum(padded_length(n, multiple) for n in lengths)
    offsets = p.cu_seqlens_padded.tolist()
    assert all((b - a) % multiple == 0 for a, b in zip(offsets, offsets[1:]))
    valid = torch.arange(17)[None] < torch.tensor(lengths)[:, None]
    # the tokens, as [1, T] and [T], and per-token vectors [1, T, V]
    for values in (p.tokens, p.tokens[0]):
        back = unpack(values, p, 20)
        assert back.shape == (5, 20)
        assert torch.equal(back[:, :17][valid], tokens[valid]) and not back[:, :17][~valid].any()
        assert not back[:, 17:].any()
    vectors = torch.randn(1, p.total, 6, generator=g, requires_grad=True)
    back = unpack(vectors, p, 17)
    assert back.shape == (5, 17, 6)
    start = p.cu_seqlens_padded[3].item()
    assert torch.equal(back[3, :9], vectors[0, start:start + 9])  # row 3 from its own segment
    back.sum().backward()  # differentiable; the pads get no gradient
    pad = torch.ones(p.total, dtype=torch.bool)
    pad[p.index] = False
    assert (vectors.grad[0, ~pad] == 1).all() and not vectors.grad[0, pad].any()
    with pytest.raises(ValueError, match="not per token"):
        unpack(torch.zeros(p.total + 1), p, 17)


def test_packed_slots():
    """A packed micro-batch processes each row's length rounded up to the multiple; grouped as
    token budgets."""
    lengths = [10, 40, 12, 38, 11, 9, 25]
    kw = {"rows_per_micro": 2, "max_tokens": 80}
    groups = micro_batches(lengths, batching="packed", **kw)
    assert groups == micro_batches(lengths, batching="token_budget", **kw) == [[1, 3], [6, 2, 4], [0, 5]]
    assert token_slots(lengths, groups, packed=True) == (145, 145)  # multiple 1: no padding
    assert token_slots(lengths, groups, 16, packed=True) == (16 + 48 + 16 + 48 + 16 + 16 + 32, 145)
    assert token_slots(lengths, groups) == (40 * 2 + 25 * 3 + 10 * 2, 145)  # token_budget
    assert padding_fraction(lengths, groups, packed=True) == 0.0
    assert padding_fraction(lengths, groups, 16, packed=True) == pytest.approx(1 - 145 / 192)
    with pytest.raises(ValueError, match="packed batching needs max_tokens"):
        micro_batches(lengths, batching="packed", rows_per_micro=2)


def test_packed_needs_a_thd_attention(monkeypatch):
    import megatron_oar.config as config_module

    cfg = ("qwen2.5-7b_oar_g.yaml", "train.batching=packed")
    with raises(r"train.batching=packed needs model.attention=auto, sdpa or te .*unfused"):
        config_module.validate(example(*cfg, "model.spec=local", "model.attention=unfused"), world_size=8,
                               hf_config=HF["7b"])
    for spec in ("te", "local"):
        config_module.validate(example(*cfg, f"model.spec={spec}"), world_size=8, hf_config=HF["7b"])
    monkeypatch.setattr(config_module, "resolve_spec", lambda opts: "local")  # a machine without TE
    config_module.validate(example(*cfg, "model.spec=auto"), world_size=8, hf_config=HF["7b"])
    with raises(r"model.attention='te' needs model.spec=te"):
        config_module.validate(example(*cfg, "model.spec=auto", "model.attention=te"), world_size=8,
                               hf_config=HF["7b"])


# ----------------------------------------------------------------------------- the passes

def _count_thd_calls(log: list):
    """Records the row segments of every packed call of SDPA's core attention in ``log``, after
    checking the ``PackedSeqParams`` as TE's THD attention would take them."""
    from megatron_oar.models.sdpa_attention import SDPAttention

    packed = SDPAttention._packed

    def counted(self, query, key, value, p, causal, dropout):
        assert p.qkv_format == "thd" and query.dim() == 3 and causal
        for a, b in ((p.cu_seqlens_q, p.cu_seqlens_kv), (p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded)):
            assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)
        offsets = p.cu_seqlens_q_padded.tolist()
        segments = [b - a for a, b in zip(offsets, offsets[1:])]
        assert offsets[0] == 0 and offsets[-1] == query.shape[0] == key.shape[0]
        assert all(0 < s <= p.max_seqlen_q for s in segments), segments
        log.append(segments)
        return packed(self, query, key, value, p, causal, dropout)

    SDPAttention._packed = counted


IMPORTANCE = ("oar_g_answer_mean", "oar_p_answer_mean")


def _importance(ckpt: str, attention: str) -> dict:
    """OAR-G and OAR-P importance (tests/test_attribution.py's cases) of a model with this
    ``model.attention``."""
    from transformers import AutoTokenizer

    from megatron_oar.attribution import compute_importance
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model
    from tests.test_attribution import CASES, SEQ_ADV, make_batch

    model = build_gpt_model(read_hf_config(Path(ckpt) / "hf"), ModelOptions(attention=attention))
    meta = load_model(model, ckpt)
    tok = AutoTokenizer.from_pretrained(str(Path(ckpt) / "hf"))
    batch = make_batch(tok)
    model.train()
    return {name: compute_importance(model, batch, CASES[name], vocab_size=meta.vocab_size, seq_adv=SEQ_ADV,
                                     step=3, tokenizer=tok).importance for name in IMPORTANCE}


def _worker(ckpt: str, tp: int, pp: int, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.models.padding import force_multiple
    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=tp, pp=pp))
    log: list = []
    _count_thd_calls(log)
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = list(range(d, 5, dp))
    results = {"unfused": _passes(ckpt, rows, "token_budget", attention="unfused"),
               "importance": {a: _importance(ckpt, a) for a in ("unfused", "sdpa")}}
    for multiple in MULTIPLES:
        with force_multiple(multiple):
            for batching in ("token_budget", "packed"):
                log.clear()
                results[batching, multiple] = {**_passes(ckpt, rows, batching), "thd_calls": len(log)}
    save_gathered(results, out)


@pytest.fixture(scope="module", params=[(1, 1, 1), (2, 1, 2), (1, 2, 2)], ids=["tp1", "tp2", "pp2"])
def runs(request, scaled_checkpoint, tmp_path_factory):
    tp, pp, world = request.param
    out = tmp_path_factory.mktemp("packing") / f"tp{tp}pp{pp}w{world}.pt"
    return launch_and_load(_worker, world, out, str(scaled_checkpoint), tp, pp)


@pytest.mark.slow
@pytest.mark.parametrize("multiple", MULTIPLES)
def test_packed_equals_token_budget(runs, multiple):
    for rank, res in enumerate(runs):
        assert_same_passes(res["packed", multiple], res["token_budget", multiple], rank)


@pytest.mark.slow
def test_sdpa_equals_unfused_attention(runs):
    """SDPA (the local spec's default) against megatron's unfused attention: the passes with
    token budgets and packed, and OAR-G / OAR-P importance."""
    from tests.test_attribution import rel_error

    for rank, res in enumerate(runs):
        assert_same_passes(res["token_budget", 1], res["unfused"], rank)
        assert_same_passes(res["packed", 1], res["unfused"], rank)
        for name in IMPORTANCE:
            got, want = res["importance"]["sdpa"][name], res["importance"]["unfused"][name]
            assert want.abs().max() > 0, name
            assert rel_error(got, want) <= 2e-5, f"rank {rank}: {name}"


@pytest.mark.slow
@pytest.mark.parametrize("multiple", MULTIPLES)
def test_packed_runs_one_sequence_per_micro_batch(runs, multiple):
    """The packed passes ran the THD path, on sequences of the rows' lengths each rounded up to
    the multiple; the token-budget ones never did."""
    for rank, res in enumerate(runs):
        budget, packed = res["token_budget", multiple], res["packed", multiple]
        assert budget["thd_calls"] == 0 and packed["thd_calls"] > 0, f"rank {rank}"
        lengths = budget["valid"].sum(1).tolist()
        groups = micro_batches(lengths, batching="packed", rows_per_micro=1, max_tokens=BUDGET,
                               multiple=multiple)
        want = {sum(padded_length(lengths[i], multiple) for i in g) for g in groups}
        assert len(groups) > 1 and (multiple == 8 or max(len(g) for g in groups) > 1)  # rows packed
        for name in ("old_logprob", "reference", "update"):
            assert packed["widths"][name] == want, (rank, name, packed["widths"][name], want)
