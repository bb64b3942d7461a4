"""What ``import minillm`` loads: only what ``LLM()`` needs (DESIGN.md, "Layers").

Tensor and pipeline parallelism, quantization, benchmarks, the server (FastAPI and uvicorn with it), offloading,
the swap space, multi-step and async decoding, and the Triton kernels (triton itself) load when a config asks
for them. Checked in a fresh interpreter, since this test process has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys

NOT_AT_IMPORT = ("minillm.parallel", "minillm.quant", "minillm.bench", "minillm.eval", "minillm.offload",
                 "minillm.kv.swap", "minillm.kv.radix", "minillm.multi_step", "minillm.cuda_graphs",
                 "minillm.model.fused", "minillm.serve", "fastapi", "uvicorn", "starlette")


def loaded_after(code: str) -> list[str]:
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/")
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_minillm_loads_only_what_llm_needs():
    modules = loaded_after("import minillm")
    assert "minillm.llm" in modules and "minillm.engine" in modules
    unexpected = [m for m in modules if m.startswith((*NOT_AT_IMPORT, "triton"))]
    assert not unexpected, unexpected


def test_a_default_llm_loads_no_more():
    """``LLM()`` on the embedded model (static batching on a CPU) loads none of minillm's optional parts either
    (triton may come with transformers)."""
    modules = loaded_after("import torch; torch.set_num_threads(1)\n"
                           "from minillm import LLM; LLM(device='cpu')")
    unexpected = [m for m in modules if m.startswith(NOT_AT_IMPORT)]
    assert not unexpected, unexpected
