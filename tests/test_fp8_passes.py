"""Which forward-only passes run under FP8 autocast (issue 28, item 6c).

Under delayed scaling, Transformer Engine updates an FP8 model's scales only when the outermost
``fp8_autocast`` exits with grad enabled (``FP8GlobalStateManager.autocast_exit``); the
forward-only passes run under ``torch.no_grad()``, so they never update them. A frozen reference
model would run forever with TE's initial scales (1.0), and the policy's first old-logprob pass
before any update with them too. On CPU there is no TE: the model is a local-spec one with
``config.fp8`` set after it is built, and megatron's ``get_fp8_context`` (which
``TransformerBlock`` calls only when ``config.fp8`` is set) is a recording fake.

Cost: one 1-rank job on the warm rank pool, about 1 s (a cold pool adds its start).
"""

from __future__ import annotations

import pytest

from tests.distributed import launch


def _passes_worker() -> None:
    from contextlib import nullcontext
    from unittest import mock

    import torch
    from megatron.core.transformer import transformer_block

    from megatron_oar.models import ModelOptions, build_gpt_model
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy_passes import no_grad_fp8, old_logprob_pass, reference_logprobs
    from tests.tiny import SMALL

    init_runtime(ParallelConfig())
    hf = {**SMALL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    model = build_gpt_model(hf, ModelOptions())
    config = model.config
    tokens = torch.randint(0, hf["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(tokens, torch.tensor([4, 3, 2, 2]), torch.tensor([12, 9, 7, 5]),
                       loss_mask=torch.ones(4, 12, dtype=torch.bool), rollout_logprobs=torch.zeros(4, 12),
                       seq_adv=torch.ones(4))  # two micro-batches of two rows
    entered: list[tuple[str, bool]] = []  # (recipe, grad enabled) per FP8 autocast entered

    def fp8_context(config, layer_no=-1, is_init=False):
        entered.append((config.fp8_recipe, torch.is_grad_enabled()))
        return nullcontext()

    def fp8_passes(fn) -> list:
        entered.clear()
        fn()
        assert config.fp8 == "hybrid"  # restored after the pass
        return list(entered)

    with mock.patch.object(transformer_block, "get_fp8_context", fp8_context):
        config.fp8, config.fp8_recipe = "hybrid", "delayed"
        assert fp8_passes(lambda: model(tokens, None, attention_mask=None))  # the fake sees FP8 passes
        # delayed scaling: the frozen reference never enters FP8; the old-logprob pass only once
        # the policy has been updated in this process
        assert not no_grad_fp8(model, trained=False) and no_grad_fp8(model, trained=True)
        assert fp8_passes(lambda: reference_logprobs(model, batch, hf["vocab_size"], 2)) == []
        assert fp8_passes(lambda: old_logprob_pass(model, batch, hf["vocab_size"], 2, fp8=False)) == []
        assert fp8_passes(lambda: old_logprob_pass(model, batch, hf["vocab_size"], 2)) == [("delayed", False)] * 2
        # current scaling scales each tensor as it is cast: the reference stays in FP8 (per layer)
        config.fp8_recipe = "tensorwise"
        assert no_grad_fp8(model, trained=False)
        assert fp8_passes(lambda: reference_logprobs(model, batch, hf["vocab_size"], 2)) == \
            [("tensorwise", False)] * 2 * hf["num_hidden_layers"]
        config.fp8 = None
        assert not no_grad_fp8(model, trained=True)


@pytest.mark.slow
def test_forward_only_passes_under_delayed_fp8_scaling():
    launch(_passes_worker, 1)
