"""megatron-oar: Outcome-grounded Advantage Reshaping for RL post-training on megatron-core."""

__version__ = "0.1.0"
