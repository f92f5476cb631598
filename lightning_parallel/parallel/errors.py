"""Re-export of :func:`lightning_parallel.errors.config_error` for the torch layer.

The helper lives at the package root so that the models, data, nn and app packages import
nothing from ``parallel/``; the torch layer imports it from here or from the root alike.
"""

from lightning_parallel.errors import config_error

__all__ = ["config_error"]
