"""The converter's template (HF -> Megatron) never allocates parameter storage on any device.

On a GPU machine megatron creates parameters with ``device=torch.cuda.current_device()`` unless
``use_cpu_initialization`` is set, and an explicit device wins over a ``torch.device("meta")``
context: the "meta" template of a 72B model took about 145 GB of GPU memory. The test makes
CUDA look available (so the template goes down the GPU code path) and records every torch call
that names a CUDA device; the CPU backend, which the runtime enables here, turns such requests
into CPU tensors, so without the fix the template's tensors are real (CPU) storage instead of
meta tensors and the recorded requests name the CUDA device.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from checkpoints_convert.convert import template
from megatron_oar.models import parse_arch
from megatron_oar.runtime.cpu_backend import _is_cuda

ARCH = parse_arch({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1000,
                   "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2,
                   "max_position_embeddings": 512, "tie_word_embeddings": False})


class CudaRequests(TorchFunctionMode):
    """Records torch calls that ask for a CUDA device (a ``device=`` argument or ``.to(cuda)``)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func is torch.Tensor.to and len(args) > 1:
            device = args[1]
        if device is not None and _is_cuda(device):
            self.calls.append(f"{getattr(func, '__name__', func)}(device={device!r})")
        return func(*args, **kwargs)


@pytest.fixture
def cuda_visible(monkeypatch):
    """A TP=1/PP=1 runtime (CPU backend on), then CUDA reported as available."""
    from megatron_oar.runtime import destroy_runtime, init_runtime

    if torch.cuda.is_available():
        pytest.skip("fakes CUDA on a CPU machine")
    init_runtime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield
    monkeypatch.undo()
    destroy_runtime()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_template_touches_no_device_where_cuda_is_visible(cuda_visible, dtype):
    requests = CudaRequests()
    with requests:
        sd = template(ARCH, dtype)
    assert requests.calls == [], requests.calls[:5]
    tensors = {k: v.data for k, v in sd.items() if isinstance(getattr(v, "data", None), torch.Tensor)}
    assert len(tensors) >= 2 + 2 * 4  # embedding, final norm, head, and the layers' stacked tensors
    stored = sorted(k for k, t in tensors.items() if not t.is_meta)
    assert stored == [], f"template tensors with real storage: {stored[:5]}"
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16 if dtype == "bf16" else torch.float32}


def test_template_keys_and_shapes_match_the_cpu_path(cuda_visible):
    """The template is the same whether CUDA is visible or not (keys, global shapes)."""
    sd = template(ARCH, "bf16")
    torch.cuda.is_available = lambda: False  # undone by the fixture's monkeypatch.undo()
    ref = template(ARCH, "bf16")
    assert sd.keys() == ref.keys()
    for k in sd:
        assert getattr(sd[k], "global_shape", None) == getattr(ref[k], "global_shape", None), k
