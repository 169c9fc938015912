"""The trainer's components; ``megatron_oar.trainer`` reads them top to bottom.

- :mod:`.policy`      the Megatron model, DDP wrapper, distributed optimizer and LR schedule
- :mod:`.rollouts`    one step's rollouts: generation, rewards, dynamic sampling, overlong filter
- :mod:`.passes`      the old-logprob forward (log-probs, entropy, probe teacher) and the update
- :mod:`.checkpoint`  atomic dist checkpoints of everything a bit-exact resume needs
- :mod:`.logger`      console progress, JSONL, TensorBoard and wandb metrics
"""
