"""What every Megatron entry point sets up before its first pass: the trainer
(``Trainer.__init__``) and the oracle (``oar analyze oracle``) share it.

    ctx = start_run(cfg)   # collective: parallel state, the HF config and arch, tokenizer, gloo group
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_oar.models import QwenArch, parse_arch, read_hf_config
from megatron_oar.runtime import RuntimeInfo, gloo_group, init_runtime


@dataclass
class RunContext:
    rt: RuntimeInfo       # ranks, world size, device (megatron's parallel state is initialised)
    hf_config: dict       # the model's config.json
    arch: QwenArch
    tokenizer: object     # transformers tokenizer of ``model.tokenizer_dir()``
    pad_id: int           # the tokenizer's pad token, or EOS when it has none
    control: object       # a gloo process group for small object messages (parallel.timeout_minutes)


def start_run(cfg, hf_config: dict | None = None) -> RunContext:
    """Collective: initialises torch.distributed and megatron's parallel state for
    ``cfg.parallel`` and loads what describes the model (``cfg``: a validated
    :class:`~megatron_oar.config.Config`; ``hf_config``: its config.json when already read)."""
    from transformers import AutoTokenizer

    hf_config = hf_config or read_hf_config(cfg.model.hf_dir() / "config.json")
    rt = init_runtime(cfg.parallel)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model.tokenizer_dir()))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return RunContext(rt=rt, hf_config=hf_config, arch=parse_arch(hf_config), tokenizer=tokenizer,
                      pad_id=pad_id, control=gloo_group())
