"""Triton kernels, installed as ``minillm.kernels``.

One kernel family per file, each with a plain-torch ``<name>_ref`` that defines what it computes.
Hopper-only (sm_90) code lives in ``hopper/``, chosen by one check in each portable wrapper. The
package imports nothing from the rest of ``minillm``. Triton ships wheels for Linux only; everything
outside this package runs on torch alone.
"""

if __name__ == "kernels":
    # This folder imported under the top-level name ``kernels``: the repository root is on sys.path
    # (`python -m pytest`, `python -c`, a notebook started there). That name is Hugging Face's
    # `kernels` package, which transformers imports; hand the name over to it (or to nothing, if it
    # is not installed) so this folder never shadows it. minillm itself imports it as minillm.kernels.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _elsewhere = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    del sys.modules["kernels"]
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)

