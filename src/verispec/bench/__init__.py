"""The benchmark tooling behind ``verispec bench``: the task suite and its runs (``suite``), the peers run on
the same weights (``peers``), and the report drawn from the results alone (``report``)."""
