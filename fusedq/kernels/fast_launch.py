"""The eager launch path: a kernel launch resolved once per signature, then handed straight
to Triton's launcher.

``JITFunction.__getitem__(grid)(...)`` pays, on every call, for binding ~30 arguments,
specialising each one, hashing the specialisation into its cache key, and building launch
metadata for hooks nobody set; ``triton_launch.launch`` adds the launch config, the kernel
key and the registry lock. With a fixed signature (shapes, strides, dtypes, device, config)
all of that is constant except which of the four pointer-alignment variants the addresses
select. ``BoundLaunch`` computes the rest once; its first launch of each variant goes the
normal way (compiling if needed, with the CUDA-graph capture guard) and keeps Triton's
compiled kernel; later launches call that kernel's launcher (``CompiledKernel.run``, the
``CudaLauncher``) with the grid, the current stream, raw addresses (so the launcher does not
ask the driver about every pointer) and the constant tail of integers and constexprs.

The launcher's calling convention is the one ``JITFunction.run`` itself uses in Triton 3.6
and 3.9 (``grid, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
*every kernel parameter``, constexprs included). Under ``TRITON_INTERPRET=1``, off CUDA, off
the current device, or while a Triton launch hook is set (a profiler), every launch takes
the normal path.
"""

from __future__ import annotations

import torch
import triton

from fusedq.kernels import common, triton_launch

# The pointer parameters every kernel variant opens with, in order; the launch tail follows.
POINTER_PARAMS = ("q_ptr", "qpe_ptr", "w_ptr", "ws_ptr", "out_ptr", "qs_ptr")
# Low address bits that must be zero for the alignment hints (triton_launch.pointer_aligned,
# inlined: this runs on every call).
_MISALIGNED = common.ALIGN_BYTES - 1

_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)
# Triton's own choice of stream getter (torch's raw-stream accessor, a C function).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def supported() -> bool:
    """Whether this Triton exposes what the direct launch needs (knobs with hook chains, and
    torch's raw-stream accessor)."""
    return _RUNTIME_KNOBS is not None and _raw_stream is not None


def _hooks_active() -> bool:
    # Launch hooks (Proton and other profilers) expect launch metadata: leave those launches
    # to Triton. Older Triton versions hold a function or None instead of a HookChain.
    for hook in (_RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def variant_index(io_aligned: bool, w_aligned: bool) -> int:
    """Slot of a pointer-alignment variant in ``BoundLaunch``."""
    return 2 * io_aligned + w_aligned


class BoundLaunch:
    """One signature's launch of the fused kernel, resolved once.

    Built from example operands whose shapes, strides, dtypes and device every later call
    shares (the caller's cache key guarantees it); calling it launches on new operands of that
    signature. Holds the launch config, the grid, and per alignment variant the compiled
    kernel's launcher and the constant argument tail.
    """

    __slots__ = ("_variants", "config", "device_index", "direct", "grid", "io_strides", "w_strides")

    def __init__(
        self,
        q_nope: torch.Tensor,
        values: torch.Tensor,
        scales: torch.Tensor | None,
        q_pe: torch.Tensor,
        out: torch.Tensor,
        config: triton_launch.LaunchConfig,
    ) -> None:
        self.config = config
        _, self.w_strides = triton_launch.weight_stride_traits(values)
        self.io_strides = triton_launch.io_strides_aligned(q_nope, q_pe, out)
        self.grid = triton_launch.grid_for(config, q_nope.shape[1], q_nope.shape[0])
        self.device_index = out.device.index if out.is_cuda else -1
        # The compiled kernel's function handle belongs to the device that was current when it
        # was loaded; launches for another device stay on Triton's path.
        self.direct = (
            supported()
            and out.is_cuda
            and not common.interpreting()
            and self.device_index == torch.cuda.current_device()
        )
        self._variants: list[tuple | None] = [None, None, None, None]

    def variant(self, p_q: int, p_pe: int, p_w: int, p_out: int) -> int:
        """The alignment variant these addresses select (the strides were checked once)."""
        return variant_index(
            self.io_strides and not (p_q | p_pe | p_out) & _MISALIGNED,
            self.w_strides and not p_w & _MISALIGNED,
        )

    def __call__(
        self,
        q_nope: torch.Tensor,
        values: torch.Tensor,
        scales: torch.Tensor | None,
        q_pe: torch.Tensor,
        out: torch.Tensor,
        q_scale: torch.Tensor | None,
    ) -> None:
        p_q, p_pe, p_w, p_out = (
            q_nope.data_ptr(),
            q_pe.data_ptr(),
            values.data_ptr(),
            out.data_ptr(),
        )
        bound = self._variants[self.variant(p_q, p_pe, p_w, p_out)]
        if bound is None or _hooks_active():
            self._launch_normally(q_nope, values, scales, q_pe, out, q_scale)
            return
        run, function, metadata, tail = bound
        run(
            *self.grid,
            _raw_stream(self.device_index),
            function,
            metadata,
            None,
            None,
            None,
            p_q,
            p_pe,
            p_w,
            p_w if scales is None else scales.data_ptr(),
            p_out,
            p_w if q_scale is None else q_scale.data_ptr(),
            *tail,
        )

    def _launch_normally(self, q_nope, values, scales, q_pe, out, q_scale) -> None:
        key, compiled = triton_launch.launch_compiled(
            q_nope, values, scales, q_pe, out, q_scale, config=self.config
        )
        if not self.direct or compiled is None:
            return
        ints, constexprs = triton_launch.launch_arguments(q_nope, values, scales, q_pe, out, key)
        self._variants[variant_index(key.io_aligned, key.w_aligned)] = (
            compiled.run,
            compiled.function,
            compiled.packed_metadata,
            launch_tail(triton_launch.kernel_for(self.config), ints, constexprs),
        )


def launch_tail(fn, ints: tuple[int, ...], constexprs: dict[str, object]) -> tuple:
    """The kernel parameters after the pointers, positionally: ``ints`` then the constexprs in
    the kernel's own parameter order (the launcher skips constexprs but takes every
    parameter). Raises ``RuntimeError`` when the kernel's parameters are not that layout."""
    names = tuple(fn.arg_names)
    rest = names[len(POINTER_PARAMS) + len(ints) :]
    if names[: len(POINTER_PARAMS)] != POINTER_PARAMS or set(rest) != set(constexprs):
        raise RuntimeError(
            f"fusedq: kernel {fn.__name__} parameters {names} are not {POINTER_PARAMS}, "
            f"{len(ints)} integers, then the constexprs {sorted(constexprs)}"
        )
    return ints + tuple(constexprs[name] for name in rest)
