"""HF <-> megatron-core conversion for Qwen2/Qwen2.5, Qwen3 and Qwen3-MoE, streaming one tensor /
layer at a time.

HF -> Megatron saves through megatron's ``dist_checkpointing.save`` with a *template*: the
sharded state dict of a real ``GPTModel`` built on the meta device at TP=1/PP=1/EP=1 (no memory).
Its keys, global shapes and chunking are exactly what a training run's
``model.sharded_state_dict()`` produces, so the checkpoint reloads with megatron's own
``dist_checkpointing.load`` at any TP/PP/EP: a MoE layer's experts are stored by megatron's
experts ``sharded_state_dict`` with an axis of global expert ids, which a model at EP > 1 maps
its local experts onto. Megatron -> HF reads one layer's region of each tensor (a MoE layer's
experts in groups) with PyTorch DCP, whatever TP/PP/EP the checkpoint was written at.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from checkpoints_convert.hf_io import HFReader, ShardedSafetensorsWriter
from megatron_oar.models import (
    DTYPES,
    ModelOptions,
    QwenArch,
    build_gpt_model,
    check_layout,
    hf_mapping,
    parse_arch,
    read_hf_config,
)
from megatron_oar.models.model_checkpoint import (
    HF_DIR,
    MODEL_DIR,
    CheckpointMeta,
    copy_hf_side_files,
    model_dir,
)

log = logging.getLogger(__name__)
_HF_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class ConversionError(ValueError):
    """Bad converter input; the message names the file or flag."""


def _hf_arch(hf_dir: Path, flag: str) -> tuple[dict, QwenArch]:
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{flag} {hf_dir}: no config.json")
    hf = read_hf_config(cfg_path)
    arch = parse_arch(hf, source=str(cfg_path))
    return hf, arch


@contextmanager
def _single_process_runtime():
    """A TP=1/PP=1 megatron runtime for building templates (reuses an existing one)."""
    from megatron.core import parallel_state

    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime

    owned = not parallel_state.model_parallel_is_initialized()
    if owned:
        if int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise ConversionError("the converter runs as one process; do not launch it with torchrun")
        init_runtime(ParallelConfig())
    elif (parallel_state.get_tensor_model_parallel_world_size() != 1
          or parallel_state.get_pipeline_model_parallel_world_size() != 1):
        raise ConversionError("the converter needs a TP=1/PP=1 runtime")
    try:
        yield
    finally:
        if owned:
            destroy_runtime()


def template(arch: QwenArch, dtype: str, vocab_multiple: int = 128) -> dict:
    """Flat sharded state dict of a meta-device GPTModel (module-path key -> ShardedBase).

    Checkpoint keys do not depend on the layer spec: megatron's local spec maps its
    ``input_layernorm`` / ``pre_mlp_layernorm`` to the Transformer Engine names
    (``sharded_state_dict_keys_map``), so one checkpoint serves both specs.

    The template never touches an accelerator: with CUDA visible megatron would create every
    parameter with ``device=torch.cuda.current_device()``, which a ``torch.device("meta")``
    context does not override (about 145 GB for a 72B model in bf16); CPU initialisation makes
    it create them without a device, so the meta context holds them all.
    """
    opts = ModelOptions(spec="local", dtype=dtype, vocab_multiple=vocab_multiple)
    with torch.device("meta"):
        model = build_gpt_model(arch, opts, perform_initialization=False,
                                use_cpu_initialization=True)
    return dict(model.sharded_state_dict())


def _resolve_dtype(dtype: str | None, hf: dict) -> str:
    if dtype is None:
        dtype = _HF_DTYPE_NAMES.get(hf.get("torch_dtype") or hf.get("dtype"), "fp32")
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


def _prepare_out(out: Path) -> Path:
    if out.exists():
        raise ConversionError(f"--out {out}: already exists; choose a new directory")
    if not out.parent.is_dir():
        raise ConversionError(f"--out {out}: parent directory {out.parent} does not exist")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def check_convert_layout(arch: QwenArch, tp: int, pp: int, vocab_multiple: int, ep: int,
                         etp: int | None) -> None:
    """The layout flags against the model (``check_layout``'s rules), as ConversionError."""
    try:
        check_layout(arch, tp, pp, vocab_multiple, flag="--tp", ep=ep, etp=etp)
    except ValueError as e:
        raise ConversionError(str(e)) from e


def hf_to_megatron(hf_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                   etp: int | None = None, dtype: str | None = None, vocab_multiple: int = 128,
                   progress: bool = True) -> CheckpointMeta:
    """Writes a torch_dist checkpoint of an HF Qwen2 / Qwen3 / Qwen3-MoE model; ``tp``/``pp``/``ep``/
    ``etp`` are validated and recorded as the intended layout (the checkpoint itself loads at any
    TP/PP/EP)."""
    from megatron.core import dist_checkpointing

    hf_dir, out = Path(hf_dir), Path(out)
    hf, arch = _hf_arch(hf_dir, "--hf")
    check_convert_layout(arch, tp, pp, vocab_multiple, ep, etp)
    dtype = _resolve_dtype(dtype, hf)
    torch_dtype = DTYPES[dtype]
    reader = HFReader(hf_dir)
    reader.require(hf_mapping.hf_shapes(arch))
    padded = arch.padded_vocab_size(vocab_multiple)
    tmp = _prepare_out(out)
    try:
        with _single_process_runtime():
            sd = template(arch, dtype, vocab_multiple)
            total = sum(v.data.numel() * v.data.element_size() for v in sd.values()
                        if hasattr(v, "data") and isinstance(v.data, torch.Tensor))
            layout = hf_mapping.checkpoint_layout(arch, padded)
            cache: dict = {}

            def produce(key: str, offset: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
                shape, t = sizes, layout[key]
                if t.layers:
                    layer = t.layers[0]
                    if t.stacked:  # axis 0 is the layer number
                        layer, offset, sizes = offset[0], offset[1:], sizes[1:]
                    expert = None
                    if t.expert_fc is not None:  # then the global expert id, one per chunk
                        if sizes[0] != 1:
                            raise RuntimeError(f"{key}: a chunk of {sizes[0]} experts")
                        expert, offset, sizes = offset[0], offset[1:], sizes[1:]
                    name = t.layer_name(expert)
                    if cache.get("id") != (layer, name):  # fc1's gate/up chunks share one tensor
                        cache.clear()
                        cache["id"] = (layer, name)
                        cache["t"] = hf_mapping.hf_to_mcore_layer_tensor(
                            reader.get, arch, layer, name, hf_mapping.CHECKPOINT_SPEC)
                    full = cache["t"]
                else:
                    full = hf_mapping.hf_to_mcore_global(reader.get, arch, key, padded)
                idx = tuple(slice(o, o + s) for o, s in zip(offset, sizes))
                return full[idx].to(torch_dtype).reshape(shape).contiguous()

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="hf->megatron",
                       disable=not progress)
            from checkpoints_convert.streaming import StreamingTorchDistSaveStrategy

            (tmp / MODEL_DIR).mkdir()
            strategy = StreamingTorchDistSaveStrategy(produce, on_item=bar.update)
            dist_checkpointing.save(sd, str(tmp / MODEL_DIR), sharded_strategy=strategy)
            bar.close()
        copy_hf_side_files(hf_dir, tmp / HF_DIR)
        _set_hf_dtype(tmp / HF_DIR / "config.json", dtype)
        meta = CheckpointMeta(dtype=dtype, vocab_size=arch.vocab_size,
                              padded_vocab_size=padded,
                              vocab_multiple=vocab_multiple,
                              tie_word_embeddings=arch.tie_word_embeddings,
                              written_tp=tp, written_pp=pp, written_ep=ep, written_etp=etp)
        meta.write(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _set_hf_dtype(config_path: Path, dtype: str) -> None:
    import json

    cfg = json.loads(config_path.read_text())
    name = {v: k for k, v in _HF_DTYPE_NAMES.items()}[dtype]
    cfg["torch_dtype"] = name
    if "dtype" in cfg:
        cfg["dtype"] = name
    config_path.write_text(json.dumps(cfg, indent=2) + "\n")


def _check_checkpoint_shapes(reader, layout: dict, arch: QwenArch, ckpt: Path) -> None:
    for key, t in layout.items():
        try:
            got = reader.shape(key)
        except KeyError as e:
            raise ConversionError(f"--ckpt {ckpt}: {e.args[0]} (does {ckpt / HF_DIR}/config.json "
                                  f"match the checkpoint?)") from None
        if got != t.shape:
            moe = (f", num_experts={arch.num_experts}, moe_intermediate_size="
                   f"{arch.moe_intermediate_size}" if arch.is_moe else "")
            raise ConversionError(
                f"--ckpt {ckpt}: tensor {key!r} has shape {list(got)}, but {ckpt / HF_DIR}/"
                f"config.json implies {list(t.shape)} (num_hidden_layers={arch.num_layers}, "
                f"hidden_size={arch.hidden_size}, intermediate_size={arch.intermediate_size}{moe})")


def _region(t, layer: int, first: int = 0, count: int | None = None):
    """(offsets, sizes) of decoder layer ``layer`` of tensor ``t``; of an experts tensor, experts
    ``first .. first + count``."""
    offsets, sizes = [0] * len(t.shape), list(t.shape)
    axis = 0
    if t.stacked:
        offsets[0], sizes[0], axis = layer, 1, 1
    if t.expert_fc is not None:
        offsets[axis], sizes[axis] = first, count
    return tuple(offsets), tuple(sizes)


def _layer_tensors(reader, layout: dict, arch: QwenArch, layer: int,
                   expert_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Decoder layer ``layer``'s whole megatron tensors (TE-spec layer-relative names): the
    non-expert ones in one read, a MoE layer's experts in groups of about ``expert_bytes``."""
    mine = [t for t in layout.values() if layer in t.layers]
    plain = [t for t in mine if t.expert_fc is None]
    got = reader.read({t.key: _region(t, layer) for t in plain})
    for t in plain:
        yield t.rel, got.pop(t.key).squeeze(0) if t.stacked else got.pop(t.key)
    experts = [t for t in mine if t.expert_fc is not None]
    if not experts:
        return
    itemsize = {t.key: reader.dtype(t.key).itemsize for t in experts}
    per_expert = sum(math.prod(t.shape[2 if t.stacked else 1:]) * itemsize[t.key] for t in experts)
    group = max(1, expert_bytes // max(per_expert, 1))
    for first in range(0, arch.num_experts, group):
        count = min(group, arch.num_experts - first)
        got = reader.read({t.key: _region(t, layer, first, count) for t in experts})
        for t in experts:
            block = got.pop(t.key)
            block = block.squeeze(0) if t.stacked else block
            for j in range(count):
                yield t.layer_name(first + j), block[j]
        del got


def megatron_to_hf(ckpt: str | Path, out: str | Path, *, max_shard_bytes: int = 2 << 30,
                   progress: bool = True) -> Path:
    """Writes HF safetensors shards + index, config and tokenizer, one layer in memory (a MoE
    layer's experts a shard's worth at a time).

    Reads with plain DCP (no megatron runtime needed), so it also exports checkpoints that a
    training run wrote at any TP/PP/EP.
    """
    from checkpoints_convert.streaming import CheckpointRegionReader

    ckpt, out = Path(ckpt), Path(out)
    if not ckpt.is_dir():
        raise ConversionError(f"--ckpt {ckpt}: not a directory")
    meta = CheckpointMeta.read(ckpt)
    mdir = model_dir(ckpt)
    hf, arch = _hf_arch(ckpt / HF_DIR, "--ckpt")
    reader = CheckpointRegionReader(mdir)
    layout = hf_mapping.checkpoint_layout(arch, meta.padded_vocab_size)
    _check_checkpoint_shapes(reader, layout, arch, ckpt)  # fail before writing anything
    tmp = _prepare_out(out)
    try:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        for i in tqdm(range(arch.num_layers), desc="megatron->hf", disable=not progress):
            for name, t in _layer_tensors(reader, layout, arch, i, max_shard_bytes):
                for hf_name, hf_t in hf_mapping.mcore_to_hf_layer_tensor(
                        arch, i, name, t, hf_mapping.CHECKPOINT_SPEC):
                    writer.add(hf_name, hf_t)
        for name in hf_mapping.mcore_to_hf_global_names(arch):  # one tensor at a time
            writer.add(name, hf_mapping.mcore_to_hf_global_tensor(
                lambda k: reader.read_whole([k])[k], arch, name))
        writer.finish()
        copy_hf_side_files(ckpt / HF_DIR, tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
