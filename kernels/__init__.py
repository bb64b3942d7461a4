"""Triton kernels, installed as ``minillm.kernels``.

One kernel family per file, each with a plain-torch ``<name>_ref`` that defines what it computes.
Triton ships wheels for Linux only; everything outside this package runs on torch alone.
"""
