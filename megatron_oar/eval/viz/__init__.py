"""``oar viz RECORDS.jsonl``: token-importance maps like the paper's Figures 4 and 8 (HTML, PNG).

One row ("panel") per method, in the order given: ``oar_p`` (OAR-P), ``oar_g`` (OAR-G),
``entropy``, ``random`` or any other score in the record, and ``oracle`` (the counterfactual
causal mask). By default: the OAR-P, OAR-G and entropy scores the record has, then the oracle
when it was run. Each token is drawn on a background whose colour encodes its score normalised
per sequence and method the way OAR normalises importance (Eq. 14: ``log1p``, then min-max over
the scored tokens; negatives are clamped to 0), so the panels share one scale: white = the
sequence's least important token, dark red = its most important. Oracle pivots are blue; in the
method rows they are underlined in blue too, so alignment can be read off one row. Tokens the
probe does not rank (``scored`` false, e.g. the answer span) and non-finite scores are grey.
Both renderers draw the same cells (:func:`.cells.panel_cells`), so the HTML and the PNG agree
colour for colour; the caption of both gives, per method, the recall of oracle pivots among the
top 20% of scored tokens (the paper's Figure 5 at K=20%).

One file per part:

* :mod:`.colors`: the importance colour ramp, the pivot and unscored colours, text contrast.
* :mod:`.cells`: scores to cells: OAR's normalisation, ranks, each token's colours and tooltip
  in a panel, the caption's recall of pivots.
* :mod:`.inputs`: which records and which panels to draw (``--id``, ``--index``,
  ``--max-records``, ``--methods``), and a record id as a file name.
* :mod:`.html_page`: the self-contained HTML page.
* :mod:`.png_figure`: the PNG (matplotlib, Agg).
* :mod:`.cli`: the ``oar viz`` command line and :func:`~.cli.visualize`, what it writes.
"""
