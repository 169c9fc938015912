"""HF <-> megatron-core converter for Qwen2/Qwen2.5 (`oar-convert`)."""
