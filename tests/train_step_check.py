"""One training step's Megatron half, checked against transformers: shared by the CPU test
(tests/test_train_step.py, a spawned gloo rank) and the CUDA test (tests/gpu/).

A tiny Qwen2 is converted, wrapped by ``build_policy`` (megatron DDP, distributed optimizer, LR
schedule); a batch of prompt + response rows goes through the old-logprob pass (checked against
transformers' log-probs of the same tokens), OAR-G attribution with the pass's teacher, OAR
credit, and one ``update_step``. The update must move the log-probs the way the advantages say:
up for the rows with A > 0, down for A < 0.
"""

from __future__ import annotations

from pathlib import Path

import torch

SEQ_ADV = torch.tensor([1.0, 1.0, -1.0, -1.0])
PROMPT, RESPONSE = 5, (7, 9, 6, 8)


def make_rows(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [4, L], prompt_lens, lengths)``: random ids, right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([PROMPT + r for r in RESPONSE])
    tokens = torch.zeros(len(RESPONSE), int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :n] = torch.randint(3, vocab, (n,), generator=g)
    return tokens, torch.full((len(RESPONSE),), PROMPT), lengths


def hf_logprobs(hf_dir: Path, tokens: torch.Tensor, device: str) -> torch.Tensor:
    """``[B, L]`` transformers log-probs of ``tokens`` (column t from the logits at t - 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = model(tokens.to(device)).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None].to(device))[..., 0]
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1).cpu()


def fp8_state(gpt) -> dict[str, float]:
    """Transformer Engine's delayed-scaling state over ``gpt``'s modules: the largest amax
    recorded (0: no GEMM ran under FP8 autocast yet) and how far any forward scale is from TE's
    initial 1.0 (0: the scales were never updated). Empty without delayed-scaling metadata."""
    amax, moved = [], []
    for module in gpt.modules():
        meta = getattr(module, "fp8_meta", None)
        fwd = meta.get("scaling_fwd") if isinstance(meta, dict) else None
        if fwd is None or not hasattr(fwd, "amax_history"):  # current scaling keeps no history
            continue
        amax.append(float(fwd.amax_history.abs().max()))
        moved.append(float((fwd.scale - 1).abs().max()))
    return {"amax_max": max(amax), "scale_moved": max(moved), "modules": len(amax)} if amax else {}


def run(root: Path, *, dtype: str = "fp32", lr: float = 1e-3, adv_scale: float = 1.0, spec: str = "local",
        fp8: str | None = None, fp8_recipe: str = "delayed", allow_fp8: bool = False) -> dict:
    """Builds, scores and updates on this process's device; returns tensors on the CPU.
    ``spec``/``fp8``/``fp8_recipe``: the model options (FP8 needs the TE spec); the forward-only
    passes enter FP8 as the trainer's do (``no_grad_fp8``); ``allow_fp8``: OAR-G's backward too."""
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.algorithms import PolicyLossConfig, ShapingConfig, assign_credit
    from megatron_oar.attribution import (
        AttributionConfig,
        ProbeConfig,
        compute_importance,
        locate_probes,
    )
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.models.tiny import make_tiny_qwen2
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy import build_policy
    from megatron_oar.training.policy_passes import no_grad_fp8, old_logprob_pass, update_step

    hf = make_tiny_qwen2(root / "hf", seed=7, vocab_size=256)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    rt = init_runtime(ParallelConfig())
    try:
        dev = rt.device
        hf_config = read_hf_config(root / "ckpt" / "hf" / "config.json")
        vocab = hf_config["vocab_size"]
        policy = build_policy(hf_config, ModelConfig(path=str(root / "ckpt"), dtype=dtype, spec=spec, fp8=fp8,
                                                     fp8_recipe=fp8_recipe),
                              OptimConfig(lr=lr, use_distributed_optimizer=True),
                              checkpoint=root / "ckpt", total_optimizer_steps=4)
        tokens, prompt_lens, lengths = make_rows(vocab)
        pos = torch.arange(tokens.shape[1])
        mask = (pos >= prompt_lens[:, None]) & (pos < lengths[:, None])
        batch = TrainBatch(tokens.to(dev), prompt_lens.to(dev), lengths.to(dev),
                           torch.arange(4, device=dev), loss_mask=mask.to(dev),
                           rollout_logprobs=torch.zeros(tokens.shape, device=dev), seq_adv=SEQ_ADV.to(dev))
        attr_cfg = AttributionConfig(method="oar_g", sigma=1e-2, probe=ProbeConfig(kind="last_token"),
                                     allow_fp8=allow_fp8)
        sites = locate_probes(batch, attr_cfg.probe, 0, None)
        first_fp8 = no_grad_fp8(policy.model, trained=False)
        batch.old_logprobs, batch.entropy, teacher = old_logprob_pass(policy.model, batch, vocab, 2,
                                                                      sites=sites, fp8=first_fp8)
        fp8_after_first_pass = fp8_state(policy.gpt)
        attr = compute_importance(policy.model, batch, attr_cfg, vocab_size=vocab, seq_adv=batch.seq_adv,
                                  step=0, sites=sites, teacher=teacher, external_teacher=True,
                                  teacher_fp8=first_fp8)
        credit = assign_credit(ShapingConfig(scheme="oar"), batch.seq_adv, batch.loss_mask,
                               importance=attr.importance, score_mask=attr.score_mask)
        batch.advantages = credit.advantages * adv_scale  # huge: an fp16 loss-scale overflow
        before = {k: v.detach().float().clone() for k, v in policy.gpt.state_dict().items()
                  if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        result = update_step(policy, batch, PolicyLossConfig(), vocab, 2)
        fp8_after_update = fp8_state(policy.gpt)
        after_lp, _, _ = old_logprob_pass(policy.model, batch, vocab, 2,
                                          fp8=no_grad_fp8(policy.model, trained=True))
        changed = max(float((v.detach().float() - before[k]).abs().max())
                      for k, v in policy.gpt.state_dict().items() if k in before)
        return {"overflow": result.overflow, "old_logprobs": batch.old_logprobs.cpu(), "new_logprobs": after_lp.cpu(),
                "mask": mask, "weights": credit.weights.cpu(), "importance": attr.importance.cpu(),
                "applied": result.applied, "grad_norm": result.grad_norm, "changed": changed,
                "hf_logprobs": hf_logprobs(hf, tokens, str(dev)), "stats": result.stats, "first_pass_fp8": first_fp8,
                "fp8_after_first_pass": fp8_after_first_pass, "fp8_after_update": fp8_after_update}
    finally:
        destroy_runtime()


def check(res: dict, *, logprob_tol: float) -> None:
    mask = res["mask"]
    diff = (res["old_logprobs"] - res["hf_logprobs"]).abs()[mask].max()
    assert diff <= logprob_tol, f"Megatron vs transformers log-probs differ by {float(diff):.2e}"
    assert res["applied"] and torch.isfinite(torch.tensor(res["grad_norm"])) and res["grad_norm"] > 0
    assert res["changed"] > 0
    w = res["weights"]
    torch.testing.assert_close(w.sum(-1), mask.sum(-1).to(w.dtype), rtol=1e-5, atol=1e-4)
    assert w[mask].std() > 0, "OAR weights are uniform: the importance carried no ranking"
    delta = ((res["new_logprobs"] - res["old_logprobs"]) * mask).sum(-1) / mask.sum(-1)
    assert delta[SEQ_ADV > 0].mean() > 0 > delta[SEQ_ADV < 0].mean(), delta
