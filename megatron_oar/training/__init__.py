"""The trainer's components; ``megatron_oar.trainer`` reads them top to bottom.

- :mod:`.run_context`      the run directory, config snapshot and logging of one run
- :mod:`.policy`           the Megatron model, DDP wrapper, distributed optimizer and LR schedule
- :mod:`.collect`          one step's rollouts: generation, rewards, dynamic sampling
- :mod:`.dp_split`         which samples each data-parallel rank trains on (token-balanced)
- :mod:`.inputs`           the training prompts; a step's samples as this rank's batch
- :mod:`.policy_passes`    the old-logprob forward (log-probs, entropy, probe teacher) and the update
- :mod:`.evaluate`         held-out evaluation through the rollout engine
- :mod:`.step_checkpoint`  atomic dist checkpoints of everything a bit-exact resume needs
- :mod:`.phases`           the loop's phases and what is on the GPU in each
- :mod:`.logger`           console progress, JSONL, TensorBoard and wandb metrics
"""
