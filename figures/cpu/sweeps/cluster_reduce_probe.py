"""Can a Gluon kernel sum split-K partials across a thread-block cluster through distributed shared memory? The
question behind the W4A16 GEMV's fix-up (kernels/w4_gemv_hopper.py: ~1.5 us of a 10 us kernel go to a fenced atomic
and a round trip to L2 by the last split; the programs of one column tile, as a cluster, could add their partials
on chip instead). This compiles, for sm_90 on the CPU, the smallest such kernel: a two-CTA cluster (num_ctas=2), each
CTA holding one row of a [2, 256] tensor (a CGA layout splitting rows over the CTAs), converted to a layout every CTA
holds whole and summed. It records whether the Triton at hand compiles it and which cluster instructions the PTX has
(mapa, ld.shared::cluster, barrier.cluster). Nothing runs.
Run: ``python figures/cpu/sweeps/cluster_reduce_probe.py`` with each Triton to compare; it adds its result to
figures/cpu/cluster_reduce_probe.json under the Triton version."""
import json
import os
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

# Layouts with a CGA part are built outside the kernel: inside, Triton 3.6 turns the nested lists into tuples of
# constexprs that its layout comparison cannot handle.
ROW_PER_CTA = gl.constexpr(gl.BlockedLayout([1, 2], [1, 32], [1, 4], [1, 0], cga_layout=[[1, 0]]))
WHOLE_IN_EACH = gl.constexpr(gl.BlockedLayout([2, 2], [1, 32], [1, 4], [1, 0], cga_layout=[[0, 0]]))


@gluon.jit
def cluster_sum(P, Y, N: gl.constexpr):
    rows = gl.arange(0, 2, layout=gl.SliceLayout(1, ROW_PER_CTA))[:, None]
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, ROW_PER_CTA))[None, :]
    rank = gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank; // $1", "=r,r", [rows], dtype=gl.int32,
                                     is_pure=True, pack=1)
    part = gl.load(P + rank * N + cols)  # CTA r's row: its own partial
    total = gl.sum(gl.convert_layout(part, WHOLE_IN_EACH), axis=0)  # the rows of both CTAs, through DSMEM
    gl.store(Y + gl.arange(0, N, layout=gl.SliceLayout(0, WHOLE_IN_EACH)), total)


def main():
    source = GluonASTSource(fn=cluster_sum, signature={"P": "*fp32", "Y": "*fp32", "N": "constexpr"},
                            constexprs={"N": 256})
    with tempfile.TemporaryFile(mode="w+") as diagnostics:  # MLIR writes its errors to file descriptor 2
        saved = os.dup(2)
        os.dup2(diagnostics.fileno(), 2)
        try:
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 128), options={"num_warps": 4, "num_ctas": 2})
            ptx = kernel.asm["ptx"]
            row = {"compiled": True, "ptx_counts": {key: ptx.count(key) for key in
                                                    ("mapa", "ld.shared::cluster", "barrier.cluster")}}
        except Exception as error:  # the compiler's own failure is the finding
            diagnostics.seek(0)
            lines = [line for line in diagnostics.read().splitlines() if "error:" in line] or [repr(error)]
            row = {"compiled": False, "error": lines[0].rsplit("/", 1)[-1][-300:]}  # (no machine's paths)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    path = os.path.join(os.path.dirname(__file__), "..", "cluster_reduce_probe.json")
    result = json.load(open(path)) if os.path.exists(path) else {
        "benchmark": "cluster_reduce_probe", "device": "sm_90 code compiled on a CPU: nothing ran",
        "command": "python figures/cpu/sweeps/cluster_reduce_probe.py", "runs": {}}
    result["runs"][f"triton {triton.__version__}"] = row
    json.dump(result, open(path, "w"), indent=1)
    print(triton.__version__, row)


if __name__ == "__main__":
    main()
