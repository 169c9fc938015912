"""What drawing OAR-G's noise cost on a GPU: the CPU draw of a micro-batch's ``[s, m, h]`` noise
and its copy (OAR-G before it drew on the embeddings' device) against the CUDA draw, at the
vs-hf bench's short batch (16 rows of about 1,100 tokens, hidden 1536). Run by
tests/gpu/lent_gpu_run.sh (OAR_GPU_BG=vshf); prints one line per way."""

import time

import torch

from megatron_oar.attribution.importance_passes import sample_noise

ROWS, LENGTH, HIDDEN = 16, 1100, 1536


def draw(device: str) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    noise = torch.zeros(LENGTH, ROWS, HIDDEN, device=device)
    for j in range(ROWS):
        noise[:, j] = sample_noise(1000 + j, LENGTH, HIDDEN, 1e-3, device=device)
    noise.to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    return time.perf_counter() - t


for device in ("cpu", "cuda"):
    draw(device)  # warm-up
    print(f"noise-cost {device}: {min(draw(device) for _ in range(3)):.4f} s for {ROWS} x {LENGTH} x {HIDDEN}")
