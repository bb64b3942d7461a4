"""Triton kernels, installed as ``minillm.kernels``.

One kernel family per file, each with a plain-torch ``<name>_ref`` that defines what it computes.
Hopper-only (sm_90) code lives in ``hopper/``, chosen by one check in each portable wrapper. The
package imports nothing from the rest of ``minillm``. Triton ships wheels for Linux only; everything
outside this package runs on torch alone.
"""
