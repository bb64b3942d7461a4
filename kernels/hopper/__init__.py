"""The sm_90-only (Hopper: H100, H200) paths of the kernels: Gluon kernels, TMA descriptors, programmatic dependent
launch (PDL) and inline PTX. Each portable wrapper one level up decides, in one check, whether its operation runs here:

- prefill attention: ``flash_attention.py`` (FlashAttention-3's structure) for ``minillm.kernels.flash_attention``;
- paged decode attention over an int8 cache: ``paged_decode.py`` for ``minillm.kernels.paged_attention``;
- the W4A16 GEMV (one bf16 row): ``w4_gemv.py`` for ``minillm.kernels.quant_matmul.w4a16_matmul``, with its two
  kernels (``w4_gemv_columns.py``, ``w4_gemv_split_k.py``), the forms with a norm, a residual or SiLU-and-multiply
  folded in (``w4_gemv_fused.py``, ``w4_gemv_norms.py``);
- shared: ``gluon.py`` (Gluon where this Triton has it), ``tma.py`` (what TMA descriptors need, for the
  Gluon kernels), ``pdl.py`` (PDL's device calls, which do nothing before Hopper).

Nothing here runs under Triton's interpreter (Gluon has none): the CPU tests compile these kernels for sm_90 and
check their instructions (tests/test_*sass*.py); the GPU tests run them on an H100/H200.
"""
