"""How a pass splits its rows into micro-batches, and how much of what it processes is padding.

Three ways, chosen by ``train.batching``:

* ``token_budget`` (the default): rows sorted by length (longest first) fill micro-batches of at
  most ``max_tokens`` padded tokens (rows x the micro-batch's own longest row, rounded up to the
  sequence ``multiple``), so a micro-batch of short responses holds more rows and none is padded
  to the step's longest. A row longer than the budget gets a micro-batch of its own.
* ``padded``: ``rows_per_micro`` consecutive rows per micro-batch, every one padded to the
  longest row of the pass (what every Megatron-based trainer does without dynamic batching).
* ``packed``: grouped as ``token_budget`` (the same budget: the logits are unpacked to rows x
  longest row), but each micro-batch runs as ONE sequence of its rows back to back, each padded
  only to the ``multiple`` (``models.packing``, THD; TE's or SDPA's attention): under
  ``multiple`` padding tokens per row are left.

The grouping is a pure function of the lengths, so every tensor- and pipeline-parallel rank that
holds the same rows builds the same micro-batches (pipeline stages must agree on their shapes).
The losses are normalised by global token and sequence counts, so the grouping changes nothing
but floating-point rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_oar.models.padding import padded_length

BATCHINGS = ("token_budget", "padded", "packed")


def micro_batches(lengths: Sequence[int], *, batching: str, rows_per_micro: int,
                  max_tokens: int | None = None, multiple: int = 1) -> list[list[int]]:
    """Row indices per micro-batch. ``padded`` needs ``len(lengths)`` divisible by
    ``rows_per_micro``; ``token_budget`` and ``packed`` (grouped alike) need ``max_tokens``."""
    n = len(lengths)
    if batching == "padded":
        if n % rows_per_micro:
            raise ValueError(f"{n} rows are not divisible by micro_batch_size {rows_per_micro}")
        return [list(range(i, i + rows_per_micro)) for i in range(0, n, rows_per_micro)]
    if batching not in BATCHINGS:
        raise ValueError(f"batching must be one of {BATCHINGS}, got {batching!r}")
    if not max_tokens or max_tokens < 1:
        raise ValueError(f"{batching} batching needs max_tokens >= 1, got {max_tokens}")
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            width = padded_length(lengths[g[0]], multiple)  # the group's longest: its first row
            if (len(g) + 1) * width <= max_tokens:
                g.append(i)
                continue
        groups.append([i])
    return groups


def padded_width(lengths: Sequence[int], group: Sequence[int], multiple: int = 1) -> int:
    """The width a micro-batch of ``group`` is processed at."""
    return padded_length(max(lengths[i] for i in group), multiple)


def token_slots(lengths: Sequence[int], groups: Sequence[Sequence[int]], multiple: int = 1,
                width: int | None = None, *, packed: bool = False) -> tuple[int, int]:
    """``(processed, real)`` token slots of a pass over ``groups`` (``width``: one width for
    every micro-batch, as the padded path uses; else each group's own; ``packed``: each row's
    own length rounded up to ``multiple``, as ``batching=packed`` runs them)."""
    if packed:
        processed = sum(padded_length(lengths[i], multiple) for g in groups for i in g)
    else:
        processed = sum(len(g) * (width or padded_width(lengths, g, multiple)) for g in groups)
    return processed, sum(lengths[i] for g in groups for i in g)


def padding_fraction(lengths: Sequence[int], groups: Sequence[Sequence[int]], multiple: int = 1,
                     width: int | None = None, *, packed: bool = False) -> float:
    """Share of the processed token slots that are padding."""
    processed, real = token_slots(lengths, groups, multiple, width, packed=packed)
    return 1.0 - real / processed if processed else 0.0
