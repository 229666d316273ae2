"""Compile the Triton modules a Pallas lowering embeds, offline, and report their resources.

`triton_modules` lowers a jitted function for CUDA under an abstract mesh whose device
kind is a `DeviceSpec`'s GPU (no GPU needed; the Pallas kernels pick their configs by that
kind) and returns each embedded pallas_call as Triton IR. `compile_module` compiles one of
them with the official Triton compiler for the spec's compute capability, after Triton's
TTIR passes as XLA's Triton pipeline runs them, and reports shared memory (against the
device's per-block limit), registers and spills (`ptxas -v`) and static SASS instructions
(the cubin's code bytes) as a `KernelReport`; `format_table` prints the reports.

Which kernels, shapes and configs are checked is `pallas_kernels.aot`'s business (its
command line runs the check).
"""

from __future__ import annotations

import dataclasses
import re
import struct
import subprocess
import tempfile
from pathlib import Path

import jax
from jax._src.lib.mlir import ir
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax._src.pallas.triton.lowering import _new_ir_context

from pallas_kernels.tuning import DeviceSpec

MAX_REGISTERS = 255  # per thread, every NVIDIA target since sm_50


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One pallas_call as lowered: its name, Triton IR text and launch parameters."""

    name: str
    ir_text: str
    num_warps: int
    num_stages: int


def _abstract_mesh(spec: DeviceSpec) -> AbstractMesh:
    device = AbstractDevice(device_kind=spec.name, num_cores=spec.num_sms, platform="gpu")
    return AbstractMesh((1,), ("x",), abstract_device=device)


def _custom_calls(op) -> list:
    found = []
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "stablehlo.custom_call":
                    found.append(inner)
                found.extend(_custom_calls(inner))
    return found


def triton_modules(fn, args, spec: DeviceSpec) -> list[TritonModule]:
    """The Triton modules embedded in `fn(*args)` lowered for CUDA under `spec`'s mesh."""
    with jax.sharding.use_abstract_mesh(_abstract_mesh(spec)):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    modules = []
    for call in _custom_calls(lowered.compiler_ir("stablehlo").operation):
        backend = ir.DictAttr(call.attributes["mhlo.backend_config"])
        with _new_ir_context(), ir.Location.unknown():
            module = ir.Module.parse(ir.StringAttr(backend["ir"]).value_bytes)
            text = module.operation.get_asm(enable_debug_info=False)
        modules.append(TritonModule(
            name=ir.StringAttr(backend["name"]).value, ir_text=text,
            num_warps=ir.IntegerAttr(backend["num_warps"]).value,
            num_stages=ir.IntegerAttr(backend["num_stages"]).value))
    return modules


@dataclasses.dataclass(frozen=True)
class KernelReport:
    kernel: str
    device: str
    heads: int  # of the checked shape; 0 where none apply (grouped GEMM, top-k)
    compiled: bool
    shared_bytes: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    sass_instructions: int | None = None
    shared_limit: int = 0
    error: str = ""
    shape: str = ""  # grouped GEMM: preset, tokens and tiling

    @property
    def ok(self) -> bool:
        """Compiled within the device's limits (spills are reported, not failures)."""
        return (self.compiled and self.shared_bytes <= self.shared_limit
                and self.registers <= MAX_REGISTERS)


def ptxas_resources(stderr: str) -> tuple[int, int]:
    """(registers per thread, spill bytes) from the output of `ptxas -v`."""
    registers = int(re.search(r"Used (\d+) registers", stderr).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", stderr))
    return registers, spills


def _ptxas_report(ptx: str, capability: int) -> tuple[int, int]:
    """(registers per thread, spill bytes) from `ptxas -v` for this target."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "kernel.ptx")
        source.write_text(ptx)
        result = subprocess.run(
            [get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}",
             str(source), "-o", str(Path(tmp, "kernel.cubin"))],
            capture_output=True, text=True, check=True)
    return ptxas_resources(result.stderr)


# Every SASS instruction is 16 bytes on the targets we compile for (sm_70 and later).
SASS_INSTRUCTION_BYTES = 16


def sass_instructions(cubin: bytes) -> int:
    """Static instruction count of a cubin: the bytes of its code sections (`.text.<kernel>`
    in the ELF section table) over the instruction size, the count `cuobjdump -sass` lists
    (tests/test_aot.py checks it) without its ~0.6 s a call."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    (section_offset,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size)
                for i in range(count)]
    names = sections[names_index][4]

    def name(section) -> bytes:
        start = names + section[0]
        return cubin[start:cubin.index(b"\0", start)]

    code = sum(section[5] for section in sections if name(section).startswith(b".text."))
    return code // SASS_INSTRUCTION_BYTES


def _run_ttir_passes(path: Path, target, options: dict) -> str:
    """The module after Triton's TTIR passes. `triton.compile` skips the passes of the stage
    its IR file is in, but the runtime (XLA's Triton pipeline) runs them on Pallas' TTIR,
    and they shape the kernel: e.g. `combine` folds `acc + dot(a, b)` into the dot's
    accumulator, without which a matmul loop holds two accumulators and spills."""
    from triton._C.libtriton import ir as triton_ir
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    context = triton_ir.context()
    triton_ir.load_dialects(context)
    backend.load_dialects(context)
    module = triton_ir.parse_mlir_module(str(path), context)
    module.context = context
    backend.make_ttir(module, {}, backend.parse_options(options), target.arch)
    return str(module)


def compile_triton(module: TritonModule, spec: DeviceSpec):
    """The Triton `CompiledKernel` of `module` for `spec`'s compute capability (its PTX,
    cubin and metadata), after Triton's TTIR passes as XLA's pipeline runs them."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", capability(spec), 32)
    options = dict(num_warps=module.num_warps, num_stages=module.num_stages)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, f"{module.name}.ttir")
        path.write_text(module.ir_text)
        path.write_text(_run_ttir_passes(path, target, options))
        return triton.compile(str(path), target=target, options=options)


def capability(spec: DeviceSpec) -> int:
    """The spec's compute capability as Triton numbers it (sm_121: 121)."""
    return spec.compute_capability[0] * 10 + spec.compute_capability[1]


def compile_module(module: TritonModule, spec: DeviceSpec, heads: int, *, kernel: str = "",
                   shape: str = "") -> KernelReport:
    """Compile one Triton module for `spec` with the official Triton compiler (reported as
    `kernel`, by default the module's name)."""
    base = dict(kernel=kernel or module.name, device=spec.name, heads=heads,
                shared_limit=spec.smem_per_block, shape=shape)
    try:
        compiled = compile_triton(module, spec)
        registers, spills = _ptxas_report(compiled.asm["ptx"], capability(spec))
        sass = sass_instructions(compiled.asm["cubin"])
    except Exception as error:  # reported in the table; the exit status says it failed
        return KernelReport(compiled=False, error=f"{type(error).__name__}: {error}"[:300],
                            **base)
    return KernelReport(compiled=True, shared_bytes=int(compiled.metadata.shared),
                        registers=registers, spill_bytes=spills, sass_instructions=sass, **base)


def format_table(reports: list[KernelReport]) -> str:
    lines = [f"{'kernel':16} {'device':12} {'H':>3} {'compiled':8} {'smem B':>8} "
             f"{'limit B':>8} {'margin B':>9} {'regs':>5} {'spill B':>7} {'SASS':>6}  status"]
    for r in reports:
        if r.compiled:
            lines.append(
                f"{r.kernel:16} {r.device:12} {r.heads:3} {'yes':8} {r.shared_bytes:8} "
                f"{r.shared_limit:8} {r.shared_limit - r.shared_bytes:9} {r.registers:5} "
                f"{r.spill_bytes:7} {r.sass_instructions:6}  {'ok' if r.ok else 'OVER LIMIT'}"
                f"{'  ' + r.shape if r.shape else ''}")
        else:
            lines.append(f"{r.kernel:16} {r.device:12} {r.heads:3} {'no':8} {'':>8} "
                         f"{r.shared_limit:8} {'':>9} {'':>5} {'':>7} {'':>6}  {r.error}"
                         f"{'  ' + r.shape if r.shape else ''}")
    return "\n".join(lines)
