"""The simulator: chunkwise's scheduler, unchanged, driven by a calibrated or derived step-cost model on a
virtual clock, across one or many replicas behind a router (`chunkwise replay`)."""
