"""Converter peak memory against model and layer size (`oar bench convert`).

Builds a random Qwen2 of the requested shape, converts HF -> Megatron -> HF, and samples the
process's anonymous resident memory (RssAnon: heap and tensors; file pages of mmapped
safetensors are reclaimable page cache and reported separately) every 5 ms.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon", "RssFile", "VmRSS")):
            k, v = line.split(":")
            out[k] = int(v.split()[0]) * 1024
    return out


class PeakSampler:
    def __init__(self, every_s: float = 0.005):
        self.every_s, self.peak = every_s, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for k, v in _status().items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            time.sleep(self.every_s)

    def __enter__(self):
        self.peak = _status()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="oar bench convert", description=__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--workdir", default=None)
    p.add_argument("--max-shard-mib", type=int, default=64,
                   help="export shard size; export memory is bounded by this plus one layer")
    args = p.parse_args(argv)

    import torch  # noqa: F401  (baseline includes torch + megatron imports)

    from checkpoints_convert.convert import hf_to_megatron, megatron_to_hf
    from megatron_oar.models.tiny import make_tiny_qwen2

    root = Path(args.workdir or tempfile.mkdtemp(prefix="oar-convmem-"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    hf = make_tiny_qwen2(root / "hf", hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, vocab_size=args.vocab, tokenizer=False)
    h, f, kv = args.hidden, args.ffn, args.kv_heads * args.hidden // args.heads
    layer_bytes = 4 * (h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * f + 2 * h)
    embed_bytes = 4 * args.vocab * h
    model_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    base = _status()["RssAnon"]
    res = {}
    for name, fn in (("hf_to_megatron", lambda: hf_to_megatron(hf, root / "ckpt", progress=False)),
                     ("megatron_to_hf", lambda: megatron_to_hf(root / "ckpt", root / "back",
                                                               max_shard_bytes=args.max_shard_mib << 20,
                                                               progress=False))):
        with PeakSampler() as s:
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
        res[name] = {"seconds": round(dt, 2),
                     "peak_anon_over_baseline_MiB": round((s.peak["RssAnon"] - base) / 2**20, 1),
                     "peak_rss_MiB": round(s.peak["VmRSS"] / 2**20, 1)}
    report = {"model_MiB": round(model_bytes / 2**20, 1), "layer_MiB": round(layer_bytes / 2**20, 1),
              "embedding_MiB": round(embed_bytes / 2**20, 1), "max_shard_MiB": args.max_shard_mib,
              "baseline_anon_MiB": round(base / 2**20, 1), **res}
    print(json.dumps(report, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
