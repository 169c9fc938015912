"""Prompt sampler for training: seeded shuffles, fixed-size batches, epochs, exact resume.

    sampler = PromptSampler(examples, batch_size=64, seed=1)
    batch = next(sampler)                  # list[Example]; sampler.epoch, sampler.step
    state = sampler.state_dict()           # into the checkpoint
    sampler.load_state_dict(state)         # a resumed run yields exactly the same batches next

Epoch ``e`` visits the examples in the order ``permutation(seed, e)`` (a fresh shuffle per epoch,
identical on every rank and every run). With ``drop_last`` (default) an epoch yields
``len(examples) // batch_size`` full batches; otherwise the last batch of an epoch may be short.
``max_epochs`` ends iteration (``StopIteration``); ``None`` iterates forever.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from megatron_oar.data.readers import Example
from megatron_oar.seeds import SAMPLER, derive_seed


class PromptSampler:
    """Yields batches of ``batch_size`` examples; ``state_dict()`` / ``load_state_dict()`` resume it."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int = 0, *,
                 shuffle: bool = True, drop_last: bool = True, max_epochs: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not isinstance(examples, Sequence):
            examples = list(examples)
        if not len(examples):
            raise ValueError("PromptSampler got no examples")
        if drop_last and len(examples) < batch_size:
            raise ValueError(f"batch_size {batch_size} is larger than the dataset ({len(examples)} "
                             "examples) and drop_last=True would yield nothing")
        # a list is copied; another sequence (e.g. a lazy ChainStream of a million problems) is
        # indexed in place, never materialised
        self.examples = list(examples) if isinstance(examples, (list, tuple)) else examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.max_epochs = max_epochs
        self.epoch = 0      # current epoch
        self.position = 0   # index into this epoch's order of the next example to yield
        self.step = 0       # batches yielded so far, over all epochs
        self._order: Sequence[int] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = len(self.examples), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def order(self, epoch: int) -> Sequence[int]:
        """The example order of ``epoch``."""
        if not self.shuffle:
            return range(len(self.examples))  # lazy: a stream of any length costs nothing here
        order = list(range(len(self.examples)))
        random.Random(derive_seed(SAMPLER, self.seed, epoch)).shuffle(order)
        return order

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[Example]:
        n = len(self.examples)
        left = n - self.position
        if left == 0 or (self.drop_last and left < self.batch_size):
            self.epoch += 1
            self.position = 0
            self._order = None
        if self.max_epochs is not None and self.epoch >= self.max_epochs:
            raise StopIteration
        if self._order is None:
            self._order = self.order(self.epoch)
        idx = self._order[self.position:self.position + self.batch_size]
        self.position += len(idx)
        self.step += 1
        return [self.examples[i] for i in idx]

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: seed, epoch, position, step (plus checks)."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "step": self.step,
                "batch_size": self.batch_size, "num_examples": len(self.examples),
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Restores a ``state_dict()``; refuses one made for a different dataset size or batching."""
        for key, mine in (("num_examples", len(self.examples)), ("batch_size", self.batch_size),
                          ("shuffle", self.shuffle), ("drop_last", self.drop_last)):
            if key in state and state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {mine!r}; "
                                 "resuming would not continue the same sequence of prompts")
        if not 0 <= int(state["position"]) <= len(self.examples):
            raise ValueError(f"sampler state position {state['position']} is out of range")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.step = int(state.get("step", 0))
        self._order = None
