"""megatron-core ``GPTModel`` for any supported family (:mod:`megatron_oar.models.families`),
built from a Hugging Face ``config.json``: the options, the ``TransformerConfig``, the layer
spec (local or Transformer Engine) and the layout checks.

The vocabulary is padded to a multiple of ``vocab_multiple`` (128) that does
not depend on TP, so a checkpoint's embedding shape is the same at every layout; padded
rows are zero and their logits must be masked by consumers (see :func:`mask_padded_vocab`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_oar.models.arch import ModelConfigError, QwenArch
from megatron_oar.models.families import family_of, parse_arch
from megatron_oar.runtime.kernels import kernel_report, log_model_kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ModelOptions:
    """How to instantiate the model; everything else comes from the HF config."""

    spec: str = "auto"  # auto | local | te   (auto: te when CUDA and TE are present)
    # core attention: auto | sdpa | unfused | te (auto: TE's fused attention under the TE spec,
    # PyTorch SDPA under the local spec; unfused: megatron's DotProductAttention, s x s scores)
    attention: str = "auto"
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (parameter dtype)
    fp8: str | None = None  # None | hybrid | e4m3 (TE spec only)
    fp8_recipe: str = "delayed"  # delayed | tensorwise | mxfp8 | blockwise (megatron's names)
    fp8_amax_history_len: int = 1024
    vocab_multiple: int = 128
    sequence_parallel: bool = False
    recompute: str | None = None  # None | selective | full
    # MoE models only (Qwen3-MoE): megatron's token dispatcher, auto | alltoall | allgather
    # (auto: alltoall on CUDA, allgather on CPU, where alltoall's CUDA streams do not exist)
    moe_dispatcher: str = "auto"
    freeze_router: bool = False  # MoE: the routers' weights get no gradient (not trained)
    # MoE: none | training | rollout (training/routing_replay.py); not none: megatron's routers
    # get their RouterReplay (moe_enable_routing_replay)
    routing_replay: str = "none"


MOE_DISPATCHERS = ("auto", "alltoall", "allgather")
ATTENTIONS = ("auto", "sdpa", "unfused", "te")  # model.attention
ROUTING_REPLAY_MODES = ("none", "training", "rollout")  # model.routing_replay


def check_layout(arch: QwenArch, tp: int, pp: int, vocab_multiple: int = 128,
                 flag: str = "--tp", *, ep: int = 1, etp: int | None = None) -> None:
    """Raises naming the flag when TP/PP (and for a MoE model EP, expert TP) cannot split this
    model. ``etp`` None: megatron's default, the attention's TP."""
    pp_flag = flag.replace("tp", "pp")
    ep_flag, etp_flag = flag.replace("tp", "ep"), flag.replace("tp", "etp")
    checks = [(flag, tp), (pp_flag, pp), ("vocab_multiple", vocab_multiple), (ep_flag, ep)]
    if etp is not None:
        checks.append((etp_flag, etp))
    for name, value in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelConfigError(f"{name}={value} must be a positive integer")
    if not arch.is_moe and ep > 1:
        raise ModelConfigError(f"{ep_flag}={ep}: expert parallelism needs a mixture-of-experts "
                               "model; this one is dense")
    if arch.is_moe:
        if arch.num_experts % ep:
            raise ModelConfigError(f"{ep_flag}={ep} does not divide num_experts={arch.num_experts}")
        expert_tp = tp if etp is None else etp
        if arch.moe_intermediate_size % expert_tp:
            which = f"{etp_flag}={etp}" if etp is not None else f"{flag}={tp} (the expert TP by default)"
            raise ModelConfigError(f"{which} does not divide moe_intermediate_size="
                                   f"{arch.moe_intermediate_size}")
    if arch.num_heads % tp:
        raise ModelConfigError(f"{flag}={tp} does not divide num_attention_heads={arch.num_heads}")
    if arch.num_kv_heads % tp:
        raise ModelConfigError(
            f"{flag}={tp} does not divide num_key_value_heads={arch.num_kv_heads} (KV groups)"
        )
    if arch.padded_vocab_size(vocab_multiple) % tp:
        raise ModelConfigError(f"{flag}={tp} does not divide the padded vocab "
                               f"{arch.padded_vocab_size(vocab_multiple)}")
    if arch.num_layers % pp:
        raise ModelConfigError(f"{pp_flag}={pp} does not divide num_hidden_layers={arch.num_layers}")


def resolve_moe_dispatcher(opts: ModelOptions) -> str:
    """Megatron's token dispatcher for a MoE model: ``auto`` is ``alltoall`` on CUDA, ``allgather``
    without it (megatron's alltoall dispatcher creates CUDA streams when it is built)."""
    if opts.moe_dispatcher not in MOE_DISPATCHERS:
        raise ModelConfigError(f"model.moe_dispatcher={opts.moe_dispatcher!r}; expected one of "
                               f"{', '.join(MOE_DISPATCHERS)}")
    cuda = torch.cuda.is_available()
    if opts.moe_dispatcher == "auto":
        return "alltoall" if cuda else "allgather"
    if opts.moe_dispatcher == "alltoall" and not cuda:
        raise ModelConfigError("model.moe_dispatcher='alltoall' needs CUDA (megatron's alltoall "
                               "token dispatcher creates CUDA streams); use allgather (or auto) "
                               "on CPU")
    return opts.moe_dispatcher


def resolve_attention(attention: str, spec: str) -> str:
    """The core attention a model of layer ``spec`` (``local`` / ``te``) runs for
    ``model.attention``: ``auto`` is TE's fused attention under the TE spec and PyTorch SDPA
    (``models/sdpa_attention.py``) under the local spec; ``unfused`` is megatron's
    ``DotProductAttention`` (``[b, heads, s, s]`` scores); ``te`` needs the TE spec."""
    if attention not in ATTENTIONS:
        raise ModelConfigError(f"model.attention={attention!r}; expected one of {', '.join(ATTENTIONS)}")
    if attention == "auto":
        return "te" if spec == "te" else "sdpa"
    if attention == "te" and spec != "te":
        raise ModelConfigError("model.attention='te' needs model.spec=te (Transformer Engine); the "
                               "local spec runs sdpa or unfused")
    return attention


def resolve_spec(opts: ModelOptions) -> str:
    """The layer spec this machine builds: ``auto`` is ``te`` where CUDA and Transformer Engine
    are present, else ``local``; ``te`` without them is an error."""
    from megatron_oar.runtime.kernels import kernel_report

    have_te = kernel_report().transformer_engine
    if opts.spec == "auto":
        return "te" if have_te else "local"
    if opts.spec not in ("local", "te"):
        raise ModelConfigError(f"model.spec={opts.spec!r}; expected auto, local or te")
    if opts.spec == "te" and not have_te:
        raise ModelConfigError("model.spec='te' needs CUDA and transformer-engine "
                               "(pip install 'megatron-oar[gpu]')")
    return opts.spec


def check_spec_features(opts: ModelOptions, spec: str) -> None:
    """Raises naming the keys when the resolved layer ``spec`` cannot serve the options.

    FP8 needs the Transformer Engine spec: FP8 autocast only covers TE modules. Sequence
    parallelism runs under either spec (the local spec's norm is
    :class:`~megatron_oar.models.local_norm.TorchRMSNorm`, which megatron's SP path accepts).
    """
    if spec == "te" or not opts.fp8:
        return
    got = f"model.spec={opts.spec!r}"
    if opts.spec == "auto":
        got += (f", which resolves to {spec!r} on this machine (no CUDA or no transformer-engine; "
                "model.spec=te asks for it explicitly)")
    raise ModelConfigError(f"model.fp8={opts.fp8!r} needs model.spec=te (Transformer Engine); "
                           f"got {got}")


# MXFP8 (block-scaled FP8 with E8M0 scales) runs on the tensor cores of Blackwell (sm_100) and
# later; Transformer Engine refuses it on Hopper (H100/H200, sm_90).
MXFP8_MIN_CAPABILITY = (10, 0)


def check_fp8_recipe_device(opts: ModelOptions) -> bool:
    """Raises when ``model.fp8_recipe=mxfp8`` is asked for on a pre-Blackwell GPU.

    Only checkable where a GPU is visible: returns False when FP8 with mxfp8 is on but no GPU is
    here to check (a login node, ``oar plan``), True when checked or not applicable. The model
    build runs it again on the GPU, before Transformer Engine is reached.
    """
    if not opts.fp8 or opts.fp8_recipe != "mxfp8":
        return True
    if not torch.cuda.is_available():
        return False
    cap = tuple(torch.cuda.get_device_capability())
    if cap < MXFP8_MIN_CAPABILITY:
        raise ModelConfigError(
            f"model.fp8_recipe='mxfp8' needs a Blackwell GPU (compute capability >= "
            f"{MXFP8_MIN_CAPABILITY[0]}.{MXFP8_MIN_CAPABILITY[1]}); this machine's "
            f"{torch.cuda.get_device_name()} is sm_{cap[0]}{cap[1]}. On Hopper (H100/H200) use "
            "model.fp8_recipe=delayed, tensorwise or blockwise")
    return True


def transformer_config(arch: QwenArch, opts: ModelOptions, tp: int, pp: int, *,
                       perform_initialization: bool = True,
                       use_cpu_initialization: bool | None = None,
                       ep: int = 1, etp: int | None = None, cp: int = 1):
    """The megatron ``TransformerConfig`` for this architecture and layout (``ep`` / ``etp``:
    expert parallel and expert tensor parallel sizes, MoE models only; ``cp``: context parallel
    size, under which megatron hands TE's attention the CP group, ``cp_comm_type`` p2p).

    ``use_cpu_initialization`` (default: only without CUDA) makes megatron create parameters
    without an explicit device, so a ``torch.device("meta")`` context applies to them; with it
    off, megatron passes ``torch.cuda.current_device()`` and the parameters land on the GPU.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if opts.dtype not in DTYPES:
        raise ModelConfigError(f"model.dtype={opts.dtype!r}; expected one of {list(DTYPES)}")
    if opts.fp8 not in (None, "hybrid", "e4m3"):
        raise ModelConfigError(f"model.fp8={opts.fp8!r}; expected null, hybrid or e4m3")
    spec = resolve_spec(opts)
    check_spec_features(opts, spec)
    check_fp8_recipe_device(opts)
    if opts.recompute not in (None, "selective", "full"):
        raise ModelConfigError(f"model.recompute={opts.recompute!r}; expected null, selective, full")
    check_layout(arch, tp, pp, opts.vocab_multiple, flag="parallel.tp", ep=ep, etp=etp)
    cuda = torch.cuda.is_available()
    cpu_init = (not cuda) if use_cpu_initialization is None else use_cpu_initialization
    dtype = DTYPES[opts.dtype]
    kwargs: dict[str, Any] = {}
    if opts.fp8:
        kwargs.update(fp8=opts.fp8, fp8_recipe=opts.fp8_recipe,
                      fp8_amax_history_len=opts.fp8_amax_history_len,
                      fp8_amax_compute_algo="max")
    if opts.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    elif opts.recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    if arch.is_moe:
        if tp > 1 and not opts.sequence_parallel:
            raise ModelConfigError(
                f"parallel.tp={tp} with a mixture-of-experts model needs "
                "parallel.sequence_parallel=true (megatron's MoE layer refuses tensor parallelism "
                "without sequence parallelism in training)")
        kwargs.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp,
                      moe_token_dispatcher_type=resolve_moe_dispatcher(opts),
                      # TE spec: TEGroupedMLP (grouped GEMM); local spec: SequentialMLP
                      moe_grouped_gemm=spec == "te",
                      # TE's fused token (un)permutation where it imports with CUDA; the
                      # fused router stays off (its top-k would bypass routing replay)
                      moe_permute_fusion=kernel_report().moe_permute, moe_router_fusion=False,
                      moe_enable_routing_replay=opts.routing_replay != "none")
    elif opts.moe_dispatcher not in MOE_DISPATCHERS:
        resolve_moe_dispatcher(opts)  # the same error for a dense model
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        **family_of(arch).megatron_config(arch),  # add_qkv_bias, qk_layernorm, ...
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=opts.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        use_cpu_initialization=cpu_init,
        perform_initialization=perform_initialization,
        # Fusions need CUDA kernels; megatron falls back to torch when they are off.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=kernel_report().masked_softmax,  # only where its kernel imports
        apply_rope_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=cuda,
        **kwargs,
    )


def layer_spec(spec: str, config=None, vp_stage: int | None = None, *,
               qk_layernorm: bool | None = None, attention: str = "auto"):
    """The layer spec, or with ``config`` the decoder block's spec for this pipeline stage.

    The block spec names the final norm explicitly. Given only a layer spec, megatron's
    ``TransformerBlock`` picks it by what imports (TENorm with Transformer Engine, apex's
    ``FusedLayerNorm`` with apex, else ``WrappedTorchNorm``), and ``FusedLayerNorm`` asserts
    LayerNorm: Qwen's RMSNorm crashed there on machines with apex but without TE. The local
    spec therefore uses torch's RMSNorm (``WrappedTorchNorm``) throughout, the TE spec TENorm.

    ``qk_layernorm`` (default: ``config.qk_layernorm``, else off) adds Qwen3's per-head q/k norm.
    Megatron builds it with ``hidden_size=head_dim`` and applies it to ``[s, b, heads, head_dim]``,
    i.e. over each head, as HF's ``q_norm`` / ``k_norm``; it is named here for the same reason as
    the final norm (megatron's choice for it depends on the TE version and on apex), so it is an
    RMSNorm (``config.normalization``) under either spec. Its weight is replicated over TP.

    ``attention`` (``model.attention``, :func:`resolve_attention`)
    picks the core attention: TE's, PyTorch SDPA's or megatron's unfused one.

    A MoE config (``config.num_moe_experts``) gets megatron's MoE layer where
    :func:`moe_layer_pattern` says so (this stage's slice of it), the dense layer elsewhere.
    """
    if qk_layernorm is None:
        qk_layernorm = bool(getattr(config, "qk_layernorm", False))
    core = resolve_attention(attention, spec)
    layer, norm = _layer_spec(spec, qk_layernorm, core=core)
    if config is None:
        return layer
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    if not getattr(config, "num_moe_experts", None):
        return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=norm)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    moe_layer, _ = _layer_spec(spec, qk_layernorm, config.num_moe_experts, config.moe_grouped_gemm,
                               core=core)
    pattern = moe_layer_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[moe_layer if pattern[offset + j] else layer for j in range(n)], layer_norm=norm)


def moe_layer_pattern(config) -> list[int]:
    """Per global decoder layer, 1 where megatron builds a MoE layer (``config.moe_layer_freq``:
    a list, or an int N for every N-th layer from the first, as megatron reads it)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(config.num_layers)]
    return list(freq)


def _layer_spec(spec: str, qk_layernorm: bool, num_experts: int | None = None,
                grouped_gemm: bool = False, core: str = "te"):
    """(a decoder layer's spec, the norm class of the spec); with ``num_experts``, a MoE layer.

    A MoE layer's MLP-input norm is a module of its own under either spec (nothing to fuse it
    into); it is named explicitly, as the final norm, and under the local spec its checkpoint
    key stays ``pre_mlp_layernorm.weight`` (megatron's local spec would rename it to the dense
    layer's ``mlp.linear_fc1.layer_norm_weight``, which the TE spec's MoE layer does not have).
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if spec == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        layer = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=qk_layernorm)
        norm = TENorm
    else:
        from megatron_oar.models.local_norm import TorchRMSNorm

        layer = specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=grouped_gemm,
                                               qk_layernorm=qk_layernorm, normalization="RMSNorm")
        norm = TorchRMSNorm  # megatron's WrappedTorchNorm, but usable with sequence parallelism
        layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
    attn = layer.submodules.self_attention.submodules
    if core == "sdpa":
        from megatron_oar.models.sdpa_attention import SDPAttention

        attn.core_attention = SDPAttention
    elif core == "unfused":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        attn.core_attention = DotProductAttention
    if qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = norm
    if num_experts:
        sub = layer.submodules
        sub.pre_mlp_layernorm = norm
        sub.sharded_state_dict_keys_map = {k: v for k, v in sub.sharded_state_dict_keys_map.items()
                                           if not k.startswith("pre_mlp_layernorm")}
    return layer, norm


def build_gpt_model(hf_config: dict[str, Any] | QwenArch, opts: ModelOptions | None = None, *,
                    perform_initialization: bool = True, vp_stage: int | None = None,
                    use_cpu_initialization: bool | None = None):
    """A ``GPTModel`` shard for this rank's TP/PP position (parallel_state must be initialised).

    A parameter-free template: ``with torch.device("meta"): build_gpt_model(...,
    perform_initialization=False, use_cpu_initialization=True)`` (see :func:`transformer_config`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    opts = opts or ModelOptions()
    arch = hf_config if isinstance(hf_config, QwenArch) else parse_arch(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    moe: dict[str, Any] = {}
    if arch.is_moe:
        from megatron_oar.runtime.cpu_backend import patch_megatron_moe_without_te

        patch_megatron_moe_without_te()
        moe = dict(ep=parallel_state.get_expert_model_parallel_world_size(),
                   etp=parallel_state.get_expert_tensor_parallel_world_size())
    config = transformer_config(arch, opts, tp, pp, perform_initialization=perform_initialization,
                                use_cpu_initialization=use_cpu_initialization,
                                cp=parallel_state.get_context_parallel_world_size(), **moe)
    spec = resolve_spec(opts)
    attention = resolve_attention(opts.attention, spec)
    log_model_kernels(config, spec, attention)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, config, vp_stage, attention=attention),
        vocab_size=arch.padded_vocab_size(opts.vocab_multiple),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(arch.rope_theta),
        vp_stage=vp_stage,
    )
    if config.params_dtype is not torch.float32:
        # megatron's torch-norm fallback ignores params_dtype; cast every parameter, as
        # Megatron-LM's Float16Module does, so checkpoints carry one dtype throughout.
        model.to(config.params_dtype)
    if not config.use_cpu_initialization and torch.cuda.is_available():
        # megatron builds its layers on the current CUDA device except a few parameters it leaves
        # to its caller's model.cuda() (Megatron-LM's get_model): megatron-core 0.16's MoE router
        # weight is created on the CPU (found on an H200: DDP's Float16Module refused it)
        model.cuda(torch.cuda.current_device())
    if arch.is_moe and opts.freeze_router:
        freeze_routers(model)
    return model


def freeze_routers(model) -> int:
    """Takes every MoE router's weights out of training (``requires_grad=False``: megatron's DDP
    and optimizer then skip them); returns how many tensors."""
    from megatron.core.transformer.moe.router import Router

    n = 0
    for module in model.modules():
        if isinstance(module, Router):
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)
                n += 1
    return n


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, vocab_start: int = 0) -> torch.Tensor:
    """Sets logits of padded vocabulary rows to -inf (logits may be a vocab-parallel shard)."""
    local = logits.shape[-1]
    ids = torch.arange(vocab_start, vocab_start + local, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))
