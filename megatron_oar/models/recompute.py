"""megatron-core's activation recompute (``model.recompute``) in a pass that runs in eval mode.

megatron-core decides whether to recompute from the module's ``training`` flag: full recompute
in ``TransformerBlock.forward`` (``recompute_granularity == 'full' and self.training`` runs
``_checkpointed_forward``), selective recompute of the core attention in ``Attention.forward``
(``checkpoint_core_attention and self.training``). An eval-mode pass with a backward (OAR-G's
input-gradient backward) therefore keeps every layer's activations, whatever the config asks.

:func:`eval_recompute` sets ``training`` on exactly those modules (not on their children, so
no ``.train()``): the decoder blocks under full recompute, the attention modules that checkpoint
their core attention under selective. Everything that reads its own ``training`` flag
elsewhere stays in eval mode: dropout (attention dropout inside the core attention, the
bias-dropout-add of each ``TransformerLayer``), the MoE router (no aux / z losses, no input
jitter), the MoE layer's TP-without-SP check, the embedding's dropout. What else a block or an
attention module does with the flag in megatron-core 0.16 concerns CUDA graphs and inference
contexts, which these passes use neither of (``tests/test_attribution.py`` checks the list of
modules this touches and that the scores equal the non-recomputed ones). The checkpointed
forward runs under megatron's RNG tracker fork, as in the update; with no dropout it draws nothing.

Selective recompute of other modules (``recompute_modules`` with ``layernorm``, ``mlp``,
``moe``) does not read ``training`` in megatron-core: it recomputes in eval mode already.
"""

from __future__ import annotations

import contextlib

from megatron.core.transformer.attention import Attention
from megatron.core.transformer.transformer_block import TransformerBlock

from megatron_oar.models.parallel import unwrap


def recompute_modules(model) -> list:
    """The modules whose ``training`` flag turns ``model``'s configured recompute on: the
    decoder's ``TransformerBlock`` (full), the ``Attention`` modules that checkpoint their core
    attention (selective with ``core_attn``); empty without recompute."""
    gpt = unwrap(model)
    granularity = getattr(gpt.config, "recompute_granularity", None)
    if granularity == "full":
        return [m for m in gpt.modules() if isinstance(m, TransformerBlock)]
    if granularity == "selective":
        return [m for m in gpt.modules()
                if isinstance(m, Attention) and getattr(m, "checkpoint_core_attention", False)]
    return []


def recomputing(model) -> bool:
    """Whether ``model``'s decoder recomputes its layers (routers included) in the backward
    of a call made now: full recompute with the block's ``training`` flag set (train mode, or
    inside :func:`eval_recompute`)."""
    gpt = unwrap(model)
    if getattr(gpt.config, "recompute_granularity", None) != "full":
        return False
    return any(m.training for m in recompute_modules(gpt))


@contextlib.contextmanager
def eval_recompute(model, on: bool = True):
    """Inside an eval-mode pass: megatron's configured activation recompute on (module
    docstring); every flag is restored afterwards. ``on=False``: nothing changes."""
    modules = recompute_modules(model) if on else []
    saved = [m.training for m in modules]
    try:
        for m in modules:
            m.training = True
        yield modules
    finally:
        for m, flag in zip(modules, saved):
            m.training = flag
