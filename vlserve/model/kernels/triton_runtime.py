"""Triton, where it is installed, set up once for every kernel of vlserve: where CUDA is absent (CI, the
developers' CPUs) kernels are defined in Triton's interpreter, which runs the same programs on the CPU with
numpy (slow; for tests of the kernels' logic), with the mends below."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

try:
    if not torch.cuda.is_available():  # must be set before @triton.jit runs (it is read at decoration time)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without Triton: the CPU paths never need it
    triton = tl = None


def _interpreter_compat() -> None:
    """Four mends to Triton 3.6's interpreter, for the CPU tests of the kernels:
    - triton.language may have been imported before TRITON_INTERPRET was set (torch._dynamo imports it): its
      library functions (tl.max, tl.sum, tl.zeros, ...) are then compiled-mode functions that refuse to run in
      the interpreter; they are wrapped as interpreted ones;
    - the interpreter holds scalars as 1-element arrays and turns them into loop bounds with `int()`, which
      numpy >= 2.4 refuses for arrays that are not 0-d: the one element is taken instead;
    - it holds bf16 as raw uint16 bits and multiplies those bits in `tl.dot`: bf16 operands are widened to fp32
      (exactly) first, which is what the tensor cores' bf16 products accumulated in fp32 compute;
    - it truncates fp32 to bf16 where a GPU (and torch) rounds to nearest even: rounded as torch does."""
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    for module in {tl, tl.core, tl.standard, tl.math}:
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, name, interpreter.InterpretedFunction(value.fn))
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if getattr(original, "__name__", "") != "patch":
        interpreter._patch_lang_tensor = patch

    builder = interpreter.InterpreterBuilder
    dot = builder.create_dot

    def widen(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype("uint32") << 16).view("float32"), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    if getattr(dot, "__name__", "") != "create_dot_widened":
        create_dot.__name__ = "create_dot_widened"
        builder.create_dot = create_dot

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:  # torch's (and a GPU's) rounding
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interpreter.TensorHandle(values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                            tl.bfloat16)
        return cast(self, src, dst_type)

    if getattr(cast, "__name__", "") != "cast_impl_rounded":
        cast_impl.__name__ = "cast_impl_rounded"
        builder.cast_impl = cast_impl


if triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _interpreter_compat()
    except (AttributeError, ImportError) as e:  # another Triton's interpreter internals: run it as it is
        logging.getLogger("vlserve.kernels").warning("Triton %s interpreter not adapted (%s)", triton.__version__, e)


def available() -> bool:
    return triton is not None
