"""Training: the RL loop (:mod:`.trainer`, ``Trainer.train_step`` reads one step top to bottom)
and its components.

- :mod:`.trainer`          the loop: build, one step's phases in order, evaluate, save, export
- :mod:`.run_context`      the run directory, config snapshot and logging of one run
- :mod:`.policy`           the Megatron model, DDP wrapper, distributed optimizer and LR schedule
- :mod:`.collect`          one step's rollouts: generation, rewards, dynamic sampling
- :mod:`.dp_split`         which samples each data-parallel rank trains on (token-balanced)
- :mod:`.inputs`           the training prompts; a step's samples as this rank's batch
- :mod:`.policy_passes`    the old-logprob forward (log-probs, entropy, probe teacher) and the update
- :mod:`.evaluate`         held-out evaluation through the rollout engine
- :mod:`.step_metrics`     a step's reported metrics: DP-reduced credit / loss / token counts,
                           model FLOPs, throughput and MFU, padding fractions
- :mod:`.step_checkpoint`  atomic dist checkpoints of everything a bit-exact resume needs
- :mod:`.phases`           the loop's phases and what vLLM holds on the GPU in each
- :mod:`.logger`           console progress, JSONL, TensorBoard and wandb metrics
"""
