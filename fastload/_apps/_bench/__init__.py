"""``fastload bench DATA``: a training-like loop over each configuration, its table, advice and
plot, and the page-cache tools behind ``--cold``."""
