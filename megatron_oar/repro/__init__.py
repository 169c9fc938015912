"""``oar repro``: the paper's evaluation in miniature on the chain testbed (CPU).

- :mod:`.runner`  the grid of runs, the SFT start, the oracle; resumable; ``main``
- :mod:`.report`  Table 1, Tables 3/4, Figures 3/5/6/7 from the runs' own logs
- :mod:`.stats`   means with 95% t-intervals over seeds, paired differences
- :mod:`.demo_model`  the testbed's tiny warmed-up policy (SFT start), shared with ``oar demo``
"""
