"""HF <-> megatron-core parameter mapping for every supported family, and the HF side files a
checkpoint keeps next to its weights.

Everything here works on whole (TP=1) tensors of one layer at a time, which is what the
streaming converter and the vLLM weight sync need. megatron-core's own sharded state dict
takes care of TP/PP slicing of these global tensors.

The shared ``GPTModel`` names and layouts (fused qkv, ``[gate; up]``, norm names per spec,
padded vocabulary) are :mod:`megatron_oar.models.gpt_layout`, re-exported here; which tensors a
layer has and their HF names is the architecture's family
(:mod:`megatron_oar.models.families`), which the layer functions below dispatch to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_oar.models.arch import QwenArch
from megatron_oar.models.families import family_of
from megatron_oar.models.families.qwen3_moe import expert_name, parse_expert_name
from megatron_oar.models.gpt_layout import (  # noqa: F401  (re-exported names)
    CHECKPOINT_SPEC,
    FC1_W,
    FC2_W,
    HF_EMBED,
    HF_HEAD,
    HF_NORM,
    K_NORM,
    MC_EMBED,
    MC_HEAD,
    MC_LAYER_PREFIX,
    MC_NORM,
    PROJ_W,
    Q_NORM,
    QKV_B,
    QKV_W,
    Getter,
    merge_qkv,
    norm_names,
    pad_vocab,
    rename_spec,
    split_qkv,
)

# Files copied next to the weights so a checkpoint can be turned back into an HF model.
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


def layer_names(spec: str, arch: QwenArch | None = None, i: int | None = None) -> list[str]:
    """Megatron layer-relative parameter names for a spec ('local' or 'te') and architecture
    (None: Qwen2's, with the q/k/v bias and without q/k norms); with ``i``, those of decoder
    layer ``i`` (a MoE model's dense and MoE layers differ; without ``i``: its MoE layers')."""
    family = family_of(arch)
    return family.layer_names(spec, arch) if i is None else family.layer_names_at(spec, arch, i)


def hf_layer_names(arch: QwenArch, i: int) -> list[str]:
    """HF names of decoder layer ``i``'s tensors for this architecture."""
    return [f"model.layers.{i}.{n}" for n in family_of(arch).hf_layer_shapes_at(arch, i)]


def hf_names(arch: QwenArch) -> list[str]:
    return list(hf_shapes(arch))


def hf_shapes(arch: QwenArch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of this architecture with the shape config.json implies."""
    h = arch.hidden_size
    shapes = {HF_EMBED: (arch.vocab_size, h), HF_NORM: (h,)}
    family = family_of(arch)
    for i in range(arch.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in family.hf_layer_shapes_at(arch, i).items()})
    if not arch.tie_word_embeddings:
        shapes[HF_HEAD] = (arch.vocab_size, h)
    return shapes


# A MoE layer's experts in a torch_dist checkpoint, as megatron-core's own experts write them
# (``SequentialMLP.sharded_state_dict``, and ``TEGroupedMLP``'s, interchangeably): one tensor per
# projection with an axis of *global* expert ids after the layer axis. A model at EP > 1 maps its
# local experts onto it (``ep_rank * num_local_experts + local``), so one checkpoint loads at any EP.
CKPT_EXPERTS = "mlp.experts.experts.{fc}.weight"


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of the torch_dist checkpoint: its key and global shape, and where its data comes
    from. ``layers``: the decoder layers it holds (empty: embedding, final norm, output layer);
    ``stacked``: axis 0 is the layer number (megatron stacks homogeneous layers; with MoE and dense
    layers mixed each layer has keys of its own, ``decoder.layers.{i}.``); ``rel``: the layer-
    relative megatron name (TE spec); ``expert_fc``: an experts tensor (``rel`` is
    ``CKPT_EXPERTS``), whose next axis is the global expert id."""

    key: str
    shape: tuple[int, ...]
    layers: tuple[int, ...] = ()
    stacked: bool = False
    rel: str = ""
    expert_fc: str | None = None

    def layer_name(self, expert: int | None = None) -> str:
        """The layer-relative megatron name (TE spec) of this tensor, or of one of its experts."""
        if self.expert_fc is None:
            return self.rel
        return expert_name(CHECKPOINT_SPEC, expert, self.expert_fc)


def homogeneous_layers(arch: QwenArch) -> bool:
    """megatron's ``TransformerBlock.sharded_state_dict`` rule: layers stack on one axis unless
    ``moe_layer_freq`` is a list or an int > 1 (MoE and dense layers mixed)."""
    freq = family_of(arch).megatron_config(arch).get("moe_layer_freq", 1)
    return isinstance(freq, int) and freq <= 1


def checkpoint_layout(arch: QwenArch, padded_vocab: int) -> dict[str, CheckpointTensor]:
    """Every tensor of the torch_dist checkpoint (what the converter writes and megatron's
    ``model.sharded_state_dict()`` saves, at any TP/PP/EP), by key."""
    h, L = arch.hidden_size, arch.num_layers
    family = family_of(arch)
    stacked = homogeneous_layers(arch)
    out = {MC_EMBED: CheckpointTensor(MC_EMBED, (padded_vocab, h)),
           MC_NORM: CheckpointTensor(MC_NORM, (h,))}
    if not arch.tie_word_embeddings:
        out[MC_HEAD] = CheckpointTensor(MC_HEAD, (padded_vocab, h))
    for i in range(1 if stacked else L):
        per_layer: dict[str, tuple[tuple[int, ...], str | None]] = {}
        for name, shape in family.layer_shapes_at(arch, i).items():
            parsed = parse_expert_name(name)
            if parsed is None:
                per_layer[name] = (shape, None)
            elif parsed[1] == 0:
                per_layer[CKPT_EXPERTS.format(fc=parsed[2])] = ((arch.num_experts, *shape), parsed[2])
        for rel, (shape, fc) in per_layer.items():
            if stacked:
                key, layers, shape = MC_LAYER_PREFIX + rel, tuple(range(L)), (L, *shape)
            else:
                key, layers = f"{MC_LAYER_PREFIX}{i}.{rel}", (i,)
            out[key] = CheckpointTensor(key, shape, layers, stacked, rel, fc)
    return out


def checkpoint_shapes(arch: QwenArch, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Global shapes of the torch_dist checkpoint's tensors (:func:`checkpoint_layout`)."""
    return {k: t.shape for k, t in checkpoint_layout(arch, padded_vocab).items()}


def hf_to_mcore_layer_tensor(get: Getter, arch: QwenArch, i: int, name: str,
                             spec: str) -> torch.Tensor:
    """One megatron layer-relative tensor of decoder layer ``i``, reading only its HF sources."""
    norm_names(spec)
    return family_of(arch).hf_to_mcore(get, arch, i, name, spec)


def hf_to_mcore_layer(get: Getter, arch: QwenArch, i: int, spec: str) -> dict[str, torch.Tensor]:
    """One decoder layer: megatron layer-relative name -> tensor, from an HF tensor getter."""
    return {n: hf_to_mcore_layer_tensor(get, arch, i, n, spec) for n in layer_names(spec, arch, i)}


def mcore_to_hf_layer_tensor(arch: QwenArch, i: int, name: str, tensor: torch.Tensor,
                             spec: str) -> list[tuple[str, torch.Tensor]]:
    """One whole megatron layer-relative tensor of decoder layer ``i`` -> its HF tensor(s)."""
    norm_names(spec)
    return family_of(arch).mcore_to_hf(arch, i, name, tensor, spec)


def mcore_to_hf_layer(get: Getter, arch: QwenArch, i: int, spec: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_mcore_layer`; ``get`` takes layer-relative megatron names."""
    out: dict[str, torch.Tensor] = {}
    for name in layer_names(spec, arch, i):
        out.update(mcore_to_hf_layer_tensor(arch, i, name, get(name), spec))
    return out


def hf_to_mcore_global(get: Getter, arch: QwenArch, key: str, vocab_padded: int) -> torch.Tensor:
    """Non-layer tensors (embedding, final norm, untied output layer)."""
    if key == MC_EMBED:
        return pad_vocab(get(HF_EMBED), vocab_padded)
    if key == MC_NORM:
        return get(HF_NORM)
    if key == MC_HEAD:
        return pad_vocab(get(HF_HEAD), vocab_padded)
    raise KeyError(f"no HF source for megatron key {key!r}")


def mcore_to_hf_global_names(arch: QwenArch) -> list[str]:
    return [HF_EMBED, HF_NORM] + ([] if arch.tie_word_embeddings else [HF_HEAD])


def mcore_to_hf_global_tensor(get: Getter, arch: QwenArch, hf_name: str) -> torch.Tensor:
    """Embedding, final norm or (untied) lm_head, with padded vocab rows dropped."""
    if hf_name == HF_NORM:
        return get(MC_NORM)
    source = {HF_EMBED: MC_EMBED, HF_HEAD: MC_HEAD}[hf_name]
    return get(source)[: arch.vocab_size].contiguous()


def mcore_to_hf_global(get: Getter, arch: QwenArch) -> dict[str, torch.Tensor]:
    """All non-layer tensors in HF naming."""
    return {n: mcore_to_hf_global_tensor(get, arch, n) for n in mcore_to_hf_global_names(arch)}
