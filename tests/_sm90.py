"""Compile the Triton kernels that Inductor generated on this CPU (`h100_codegen` in test_compile.py) for sm_90,
as a Hopper GPU's first call would, without a GPU: `python -m tests._sm90 DIR` reads DIR/*.py (each one kernel's
source as Inductor wrote it) and prints a JSON object {file: the compiler's first error line} of those that fail.

A process of its own: Triton cannot compile in a process whose `triton.language` was loaded under
TRITON_INTERPRET=1, which the test suite sets."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_error(path: Path) -> str | None:
    """None when the kernel compiles for sm_90 at its smallest blocks (a persistent reduction's block is fixed)."""
    src = path.read_text()
    meta = eval(re.search(r"triton_meta=(\{.*\}),\n", src).group(1), {"DeviceProperties": dict})  # noqa: S307
    r0 = re.search(r"R0_BLOCK: tl.constexpr = (\d+)", src)
    runnable = path.with_name(f"run_{path.name}")
    start = src.index("@triton_heuristics")  # the autotuning decorator goes; helpers above the kernel stay
    runnable.write_text(src[:start].replace("triton_helpers.set_driver_to_cpu()", "")
                        + src[src.index("@triton.jit", start):].replace("Placeholder.KERNEL_NAME", "kernel"))
    spec = importlib.util.spec_from_file_location(runnable.stem, runnable)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signature = meta["signature"]

    def block(name: str) -> int:
        if name == "R0_BLOCK" and r0:
            return int(r0.group(1))
        return 16 if name.startswith("R") else 1

    constants = {(i,): block(name) for i, (name, kind) in enumerate(signature.items()) if kind == "constexpr"}
    try:
        triton.compile(ASTSource(module.kernel, signature, constants, attrs=meta["configs"][0]),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
    except Exception as e:  # noqa: BLE001 - the compiler's own error is the finding
        return (str(e).splitlines() or [type(e).__name__])[0]
    return None


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    errors = {p.name: e for p in sorted(folder.glob("kernel_*.py")) if (e := compile_error(p))}
    print(json.dumps(errors))
