"""oar-convert on bad input: a clear error naming the file or flag, and nothing half-written.

Plus the converter's positive paths that the parity tests do not cover: sharded export that
transformers loads, bf16 conversion and round trip, tokenizer copy, and ``verify``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints_convert.cli import _size, main
from checkpoints_convert.convert import ConversionError, hf_to_megatron, megatron_to_hf
from checkpoints_convert.hf_io import INDEX, HFCheckpointError, HFReader
from megatron_oar.models import ModelConfigError, check_layout, hf_mapping, parse_arch
from megatron_oar.models.model_checkpoint import CheckpointError
from tests.tiny import make_tiny_qwen2, read_config

PROMPT = "12 + 30 = 42. <answer>42</answer>"


# ---------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny fp32 Qwen2 (4 heads, 2 KV heads, 4 layers, vocab 1000) and its checkpoint."""
    root = tmp_path_factory.mktemp("conv")
    hf = make_tiny_qwen2(root / "hf", seed=0)
    ckpt = root / "ckpt"
    hf_to_megatron(hf, ckpt, progress=False)
    return SimpleNamespace(root=root, hf=hf, ckpt=ckpt)


@pytest.fixture(scope="module")
def exported(tiny):
    """The checkpoint exported back to HF in ~20 KB shards."""
    out = tiny.root / "exported"
    assert main(["megatron-to-hf", "--ckpt", str(tiny.ckpt), "--out", str(out),
                 "--max-shard-size", "20KB", "--no-progress"]) == 0
    return out


@pytest.fixture
def hf_copy(tiny, tmp_path):
    """A private copy of the tiny HF model directory to break."""
    return Path(shutil.copytree(tiny.hf, tmp_path / "hf"))


@pytest.fixture
def ckpt_copy(tiny, tmp_path):
    return Path(shutil.copytree(tiny.ckpt, tmp_path / "ckpt"))


# ----------------------------------------------------------------------------- helpers

def assert_no_output(out: Path) -> None:
    out = Path(out)
    assert not out.exists(), f"{out} was left behind"
    leftovers = sorted(p.name for p in out.parent.glob(f".{out.name}.tmp-*"))
    assert leftovers == [], f"temporary directories left behind: {leftovers}"


def cli_error(capsys, argv: list[str], out: Path, *needles: str) -> str:
    """Runs the CLI expecting exit code 2 and an error naming every needle; no --out left."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("oar-convert: error: ")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert_no_output(out)
    return lines[0]


def h2m(hf: Path, out: Path, *extra: str) -> list[str]:
    return ["hf-to-megatron", "--hf", str(hf), "--out", str(out), "--no-progress", *extra]


def m2h(ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--no-progress", *extra]


def load_dir(d: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory (single file or shards)."""
    d = Path(d)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def logits(hf_dir: Path, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    with torch.no_grad():
        return model(tokens).logits


def tokens() -> torch.Tensor:
    return torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------- hf-to-megatron: config

def test_hf_dir_missing(tiny, capsys):
    missing, out = tiny.root / "no_such_model", tiny.root / "out_missing"
    cli_error(capsys, h2m(missing, out), out, "--hf", str(missing))
    with pytest.raises(ConversionError, match="--hf"):
        hf_to_megatron(missing, out, progress=False)
    assert_no_output(out)


def test_config_json_missing(hf_copy, tmp_path, capsys):
    (hf_copy / "config.json").unlink()
    out = tmp_path / "out"
    cli_error(capsys, h2m(hf_copy, out), out, str(hf_copy), "config.json")


def test_config_json_invalid(hf_copy, tmp_path, capsys):
    cfg = hf_copy / "config.json"
    cfg.write_text('{"architectures": ["Qwen2ForCausalLM"], "hidden_size": ')
    out = tmp_path / "out"
    cli_error(capsys, h2m(hf_copy, out), out, str(cfg), "not valid JSON")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        hf_to_megatron(hf_copy, out, progress=False)


def test_non_qwen2_architecture(hf_copy, tmp_path, capsys):
    cfg = hf_copy / "config.json"
    hf = json.loads(cfg.read_text())
    hf.update(architectures=["LlamaForCausalLM"], model_type="llama")
    cfg.write_text(json.dumps(hf))
    out = tmp_path / "out"
    cli_error(capsys, h2m(hf_copy, out), out, str(cfg), "LlamaForCausalLM", "unsupported")


# ------------------------------------------------------------------ hf-to-megatron: weights

def test_no_safetensors(hf_copy, tmp_path, capsys):
    (hf_copy / "model.safetensors").unlink()
    out = tmp_path / "out"
    cli_error(capsys, h2m(hf_copy, out), out, str(hf_copy), "model.safetensors", INDEX)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "truncated_header"])
def test_corrupt_safetensors(hf_copy, tmp_path, capsys, damage):
    path = hf_copy / "model.safetensors"
    size = path.stat().st_size
    if damage == "garbage":
        path.write_bytes(b"\x17not a safetensors file\x00" * 64)
    elif damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    else:
        with open(path, "r+b") as f:
            f.truncate(5)
    out = tmp_path / "out"
    cli_error(capsys, h2m(hf_copy, out), out, str(path), "corrupt")
    with pytest.raises(HFCheckpointError, match="corrupt"):
        HFReader(hf_copy)


def _shard(hf_dir: Path) -> tuple[Path, Path]:
    """Splits hf_dir/model.safetensors into two shards plus an index; returns the shards."""
    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    a, b = hf_dir / "model-00001-of-00002.safetensors", hf_dir / "model-00002-of-00002.safetensors"
    save_file({n: tensors[n] for n in first}, str(a), metadata={"format": "pt"})
    save_file({n: tensors[n] for n in second}, str(b), metadata={"format": "pt"})
    weight_map = {**{n: a.name for n in first}, **{n: b.name for n in second}}
    (hf_dir / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (hf_dir / "model.safetensors").unlink()
    return a, b


def test_sharded_checkpoint_reads_and_missing_shard_is_named(tiny, hf_copy, tmp_path, capsys):
    original = load_file(str(tiny.hf / "model.safetensors"))
    _, second = _shard(hf_copy)
    reader = HFReader(hf_copy)  # the intact sharded layout reads back every tensor
    assert reader.names() == set(original)
    assert all(torch.equal(reader.get(n), t) for n, t in original.items())

    second.unlink()
    out = tmp_path / "out"
    cli_error(capsys, h2m(hf_copy, out), out, str(second), "missing", INDEX)


def test_sharded_index_corrupt_or_inconsistent(hf_copy, tmp_path, capsys):
    first, _ = _shard(hf_copy)
    index = hf_copy / INDEX
    good = json.loads(index.read_text())
    out = tmp_path / "out"

    index.write_text("{ this is not json")
    cli_error(capsys, h2m(hf_copy, out), out, str(index), "not a valid safetensors index")

    index.write_text(json.dumps({"metadata": {}}))  # no weight_map
    cli_error(capsys, h2m(hf_copy, out), out, str(index))

    bad = dict(good["weight_map"])
    moved = next(n for n, f in bad.items() if f != first.name)
    bad[moved] = first.name  # the index claims a tensor the first shard does not hold
    index.write_text(json.dumps({"weight_map": bad}))
    cli_error(capsys, h2m(hf_copy, out), out, str(first), moved)


def test_missing_tensor_is_named(hf_copy, tmp_path, capsys):
    path = hf_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    out = tmp_path / "out"
    cli_error(capsys, h2m(hf_copy, out), out, "model.layers.1.mlp.up_proj.weight", str(hf_copy))


# ------------------------------------------------------------------- hf-to-megatron: layout

def test_tp_not_dividing_kv_heads(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    line = cli_error(capsys, h2m(tiny.hf, out, "--tp", "4"), out,
                     "--tp", "num_key_value_heads", "KV groups")
    assert "4" in line
    with pytest.raises(ConversionError, match="--tp=4"):
        hf_to_megatron(tiny.hf, out, tp=4, progress=False)
    # the same model does split at TP=2 (and PP=2/4): the check is not just "tp > 1 fails"
    arch = parse_arch(read_config(tiny.hf))
    for tp, pp in [(1, 1), (2, 1), (2, 2), (1, 4), (2, 4)]:
        check_layout(arch, tp, pp, flag="--tp")


def test_pp_not_dividing_layers(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    cli_error(capsys, h2m(tiny.hf, out, "--pp", "3"), out, "--pp", "num_hidden_layers")
    with pytest.raises(ConversionError, match="--pp=3"):
        hf_to_megatron(tiny.hf, out, pp=3, progress=False)


# ---------------------------------------------------------------------------------- --out

def test_out_exists_is_untouched(tiny, tmp_path, capsys):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "sentinel.txt").write_text("keep me")
    for argv in (h2m(tiny.hf, out), m2h(tiny.ckpt, out)):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2
        assert "oar-convert: error: --out" in err and str(out) in err and "already exists" in err
        assert sorted(p.name for p in out.iterdir()) == ["sentinel.txt"]
        assert (out / "sentinel.txt").read_text() == "keep me"
        assert list(tmp_path.glob(".existing.tmp-*")) == []


def test_out_parent_missing(tiny, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "parent" / "out"
    for argv in (h2m(tiny.hf, out), m2h(tiny.ckpt, out)):
        cli_error(capsys, argv, out, "--out", str(out.parent), "does not exist")
    assert not (tmp_path / "no").exists()


# -------------------------------------------------------------------------- megatron-to-hf

def test_ckpt_not_a_directory(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    missing = tmp_path / "nope"
    cli_error(capsys, m2h(missing, out), out, "--ckpt", str(missing), "not a directory")
    a_file = tmp_path / "file.bin"
    a_file.write_bytes(b"x")
    cli_error(capsys, m2h(a_file, out), out, "--ckpt", str(a_file))
    with pytest.raises(ConversionError, match="--ckpt"):
        megatron_to_hf(missing, out, progress=False)


def test_ckpt_without_meta(ckpt_copy, tmp_path, capsys):
    meta = ckpt_copy / "oar_checkpoint.json"
    meta.unlink()
    out = tmp_path / "out"
    cli_error(capsys, m2h(ckpt_copy, out), out, str(meta), "missing")
    # an HF model directory passed as --ckpt by mistake gets the same clear message
    with pytest.raises(CheckpointError, match="oar_checkpoint.json"):
        megatron_to_hf(ckpt_copy / "hf", out, progress=False)


@pytest.mark.parametrize("content", ["{ not json", '{"dtype": "fp32"}',
                                     '{"dtype": "fp32", "bogus_field": 1}', "[1, 2]"],
                         ids=["invalid_json", "missing_fields", "unknown_field", "not_an_object"])
def test_ckpt_meta_corrupt(ckpt_copy, tmp_path, capsys, content):
    meta = ckpt_copy / "oar_checkpoint.json"
    meta.write_text(content)
    out = tmp_path / "out"
    cli_error(capsys, m2h(ckpt_copy, out), out, str(meta), "unreadable checkpoint metadata")


def test_ckpt_meta_future_format(ckpt_copy, tmp_path, capsys):
    meta = ckpt_copy / "oar_checkpoint.json"
    raw = json.loads(meta.read_text())
    raw["format_version"] = 99
    meta.write_text(json.dumps(raw))
    out = tmp_path / "out"
    cli_error(capsys, m2h(ckpt_copy, out), out, str(meta), "format_version 99")


def test_ckpt_model_metadata_missing(ckpt_copy, tmp_path, capsys):
    (ckpt_copy / "model" / "metadata.json").unlink()
    out = tmp_path / "out"
    cli_error(capsys, m2h(ckpt_copy, out), out, str(ckpt_copy / "model"), "metadata.json")


def test_ckpt_hf_config_missing(ckpt_copy, tmp_path, capsys):
    (ckpt_copy / "hf" / "config.json").unlink()
    out = tmp_path / "out"
    cli_error(capsys, m2h(ckpt_copy, out), out, "--ckpt", str(ckpt_copy / "hf"), "config.json")


# ---------------------------------------------------------------------- --max-shard-size

@pytest.mark.parametrize("bad", ["garbage", "12XB", "-5MB", "MB", "", "2 GB of it"])
def test_max_shard_size_garbage(tiny, tmp_path, capsys, bad):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(m2h(tiny.ckpt, out, f"--max-shard-size={bad}"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--max-shard-size" in err and repr(bad) in err
    assert_no_output(out)


def test_size_parser():
    assert _size("20KB") == 20 << 10
    assert _size("500MB") == 500 << 20
    assert _size("2GB") == 2 << 30
    assert _size("1.5GiB") == 3 << 29
    assert _size("7") == 7
    assert _size(" 3 kb ") == 3 << 10


# ---------------------------------------------------------------------- failure mid-write

def test_failure_while_writing_hf_to_megatron_leaves_nothing(tiny, tmp_path, monkeypatch):
    from megatron.core import parallel_state

    out = tmp_path / "out"
    real = hf_mapping.hf_to_mcore_layer_tensor
    seen: list[list[str]] = []

    def failing(get, arch, i, name, spec):
        if i == 2:
            # output is genuinely being written when the failure hits
            seen.append(sorted(p.name for p in tmp_path.glob(".out.tmp-*")))
            raise RuntimeError("injected failure on layer 2")
        return real(get, arch, i, name, spec)

    monkeypatch.setattr(hf_mapping, "hf_to_mcore_layer_tensor", failing)
    # torch DCP re-raises producer errors as CheckpointException, a BaseException subclass
    with pytest.raises(BaseException) as exc:
        hf_to_megatron(tiny.hf, out, progress=False)
    assert "injected failure on layer 2" in str(exc.value)
    assert seen and len(seen[0]) == 1, "the failure was not injected mid-write"
    assert_no_output(out)
    assert not parallel_state.model_parallel_is_initialized()
    assert not torch.distributed.is_initialized()


def test_failure_while_writing_megatron_to_hf_leaves_nothing(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = hf_mapping.mcore_to_hf_layer_tensor
    seen: list[list[str]] = []

    def failing(arch, i, name, tensor, spec):
        if i == 2:
            tmp = list(tmp_path.glob(".out.tmp-*"))
            seen.append(sorted(p.name for p in tmp[0].iterdir()) if tmp else [])
            raise RuntimeError("injected failure on layer 2")
        return real(arch, i, name, tensor, spec)

    monkeypatch.setattr(hf_mapping, "mcore_to_hf_layer_tensor", failing)
    with pytest.raises(RuntimeError, match="injected failure on layer 2"):
        # tiny shards: layers 0 and 1 are already on disk when layer 2 fails
        megatron_to_hf(tiny.ckpt, out, max_shard_bytes=20 << 10, progress=False)
    assert seen and any(n.startswith(".shard-") for n in seen[0]), seen
    assert_no_output(out)


# ---------------------------------------------------------------------- positive paths

def test_sharded_export_loads_in_transformers(tiny, exported):
    files = sorted(p.name for p in exported.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    n = len(shards)
    assert n > 1
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert "model.safetensors" not in files
    assert not [f for f in files if f.startswith(".")], files  # no temporary shard files
    index = json.loads((exported / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    original = load_file(str(tiny.hf / "model.safetensors"))
    assert set(index["weight_map"]) == set(original)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in original.values())
    for name, shard in index["weight_map"].items():
        assert name in load_file(str(exported / shard)), (name, shard)
    got = load_dir(exported)
    assert all(torch.equal(got[k], original[k]) for k in original)

    x = tokens()
    assert torch.equal(logits(exported, x), logits(tiny.hf, x))


def test_tokenizer_files_copied(tiny, exported):
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tiny.hf / name).is_file()
        assert (exported / name).read_bytes() == (tiny.hf / name).read_bytes(), name
        assert (tiny.ckpt / "hf" / name).is_file()
    ref = AutoTokenizer.from_pretrained(str(tiny.hf))
    tok = AutoTokenizer.from_pretrained(str(exported))
    ids = tok(PROMPT)["input_ids"]
    assert ids == ref(PROMPT)["input_ids"] and len(ids) > 3
    assert tok.decode(ids) == PROMPT
    assert tok.eos_token == ref.eos_token == "<|endoftext|>"
    cfg, src = read_config(exported), read_config(tiny.hf)
    assert cfg.pop("torch_dtype") == src["dtype"] == "float32"
    assert cfg == src


def _assert_bf16_values(got: dict, expected: dict) -> None:
    """Every tensor present with exactly the bf16 values expected (compared in fp32 and bf16,
    so neither extra precision nor a lossy cast can pass)."""
    assert got.keys() == expected.keys()
    for k, t in expected.items():
        assert t.dtype == torch.bfloat16
        assert got[k].dtype == torch.bfloat16, k
        assert torch.equal(got[k].float(), t.float()), k
        assert torch.equal(got[k].to(torch.bfloat16), t), k


@pytest.fixture(scope="module")
def bf16_from_fp32(tiny):
    ckpt, back = tiny.root / "ckpt_bf16", tiny.root / "hf_bf16"
    assert main(h2m(tiny.hf, ckpt, "--dtype", "bf16")) == 0
    assert main(m2h(ckpt, back)) == 0
    return SimpleNamespace(src=tiny.hf, ckpt=ckpt, back=back)


@pytest.fixture(scope="module")
def bf16_model(tiny):
    root = tiny.root / "bf16_model"
    hf = make_tiny_qwen2(root / "hf", seed=2, dtype=torch.bfloat16, tokenizer=False)
    ckpt, back = root / "ckpt", root / "back"
    assert main(h2m(hf, ckpt)) == 0  # no --dtype: taken from config.json
    assert main(m2h(ckpt, back)) == 0
    return SimpleNamespace(src=hf, ckpt=ckpt, back=back)


def test_bf16_from_fp32_model(bf16_from_fp32):
    r = bf16_from_fp32
    assert json.loads((r.ckpt / "oar_checkpoint.json").read_text())["dtype"] == "bf16"
    assert read_config(r.ckpt / "hf")["torch_dtype"] == "bfloat16"
    assert read_config(r.back)["torch_dtype"] == read_config(r.back)["dtype"] == "bfloat16"
    original = load_file(str(r.src / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in original.values())
    got = load_dir(r.back)
    _assert_bf16_values(got, {k: t.to(torch.bfloat16) for k, t in original.items()})
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert read_config(r.src)["dtype"] == "float32"  # the source is untouched


def test_bf16_model_roundtrips_bit_exactly(bf16_model):
    r = bf16_model
    assert read_config(r.src)["dtype"] == "bfloat16"
    assert json.loads((r.ckpt / "oar_checkpoint.json").read_text())["dtype"] == "bf16"
    assert read_config(r.back)["torch_dtype"] == "bfloat16"
    original, got = load_file(str(r.src / "model.safetensors")), load_dir(r.back)
    _assert_bf16_values(got, original)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    x = tokens()
    assert torch.equal(logits(r.back, x, torch.bfloat16), logits(r.src, x, torch.bfloat16))


@pytest.mark.parametrize("which", ["bf16_from_fp32", "bf16_model"])
def test_bf16_export_keeps_every_tensor_bf16(request, which):
    r = request.getfixturevalue(which)
    got = load_dir(r.back)
    assert sorted(k for k, t in got.items() if t.dtype != torch.bfloat16) == []


def test_verify_accepts_correct_and_rejects_other_model(tiny, tmp_path, capsys):
    assert main(["verify", "--hf", str(tiny.hf), "--ckpt", str(tiny.ckpt)]) == 0
    out = capsys.readouterr().out
    assert "verify tp=1 pp=1" in out and " OK" in out

    other = make_tiny_qwen2(tmp_path / "other", seed=1)  # same config, other weights
    assert main(["verify", "--hf", str(other), "--ckpt", str(tiny.ckpt)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out


def test_verify_feeds_the_model_on_its_own_device(tiny, monkeypatch, capsys):
    """verify puts the prompt where the model's parameters are (a GPU shard got CPU tokens) and
    compares on CPU. With no second device here, the model is a stand-in on the meta device,
    its load and forward are faked, and the forward records where its input was."""
    import megatron_oar.models as models
    import megatron_oar.models.forward as forward
    import megatron_oar.models.model_checkpoint as checkpoint
    from checkpoints_convert import verify as verify_module

    seen = {}

    def fake_forward(model, tokens, micro_batch_size=None, vocab_size=None):
        seen["device"] = tokens.device
        ids = verify_module._tokens(tiny.hf, verify_module.DEFAULT_PROMPT, vocab_size)
        assert ids.shape == tokens.shape
        return logits(tiny.hf, ids)  # the reference's own logits: verify must say OK

    monkeypatch.setattr(models, "build_gpt_model", lambda hf, opts: torch.nn.Linear(2, 2, device="meta"))
    monkeypatch.setattr(checkpoint, "load_model", lambda model, ckpt: checkpoint.CheckpointMeta.read(ckpt))
    monkeypatch.setattr(forward, "forward_logits", fake_forward)
    assert main(["verify", "--hf", str(tiny.hf), "--ckpt", str(tiny.ckpt)]) == 0
    assert seen["device"] == torch.device("meta")
    assert " OK" in capsys.readouterr().out


# ---------------------------------------------------------------- bugs found in review, fixed

@pytest.mark.parametrize("flag", ["--tp", "--pp"])
def test_zero_tp_or_pp_is_a_flag_error(tiny, tmp_path, capsys, flag):
    out = tmp_path / "out"
    cli_error(capsys, h2m(tiny.hf, out, flag, "0"), out, flag)


def test_wrongly_shaped_tensor_is_named(hf_copy, tmp_path, capsys):
    path = hf_copy / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.input_layernorm.weight"] = torch.ones(80)
    save_file(tensors, str(path), metadata={"format": "pt"})
    out = tmp_path / "out"
    cli_error(capsys, h2m(hf_copy, out), out, "model.layers.1.input_layernorm.weight")


def test_layer_count_mismatch_is_an_error(ckpt_copy, tmp_path, capsys):
    cfg = ckpt_copy / "hf" / "config.json"
    hf = json.loads(cfg.read_text())
    hf["num_hidden_layers"] = 5
    cfg.write_text(json.dumps(hf))
    out = tmp_path / "out"
    cli_error(capsys, m2h(ckpt_copy, out), out, "num_hidden_layers")
