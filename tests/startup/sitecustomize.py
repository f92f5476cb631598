"""Start-up hook for every Python process the test suite starts (``PYTHONPATH``, set in conftest).

Installs ``lightning_parallel._torchvision_compat``'s import hook, loaded from its file so that
nothing else is imported at start-up: example scripts import Lightning before lightning_parallel,
which beside this environment's torchvision (a CUDA wheel next to a CPU torch) would fail.
"""

import importlib.util
import pathlib

_path = pathlib.Path(__file__).resolve().parents[2] / "lightning_parallel" / "_torchvision_compat.py"
_spec = importlib.util.spec_from_file_location("_lightning_parallel_torchvision_compat", _path)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install_import_hook()
