"""The engine process. Everything that imports torch lives under this package."""

import warnings

# torch warns "Failed to initialize NumPy" at import when numpy is absent, as it is in a plain
# install: torch does not require it, and tether never converts a tensor to or from numpy.
# Installing numpy only to quiet it would cost every install 73 MB and every daemon start ~10 MB
# of memory and ~0.1 s (torch imports it when present), so the one warning is silenced here,
# before any module of this package imports torch.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
