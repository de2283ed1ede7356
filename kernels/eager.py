"""When a call of a kernel custom op may skip the op's dispatch.

A torch.library.custom_op call costs more host time than a kernel launch (its Python dispatch,
autograd wrapper and argument checks), enough to make a sub-millisecond kernel wait on the host
when called eagerly. The ops exist for what traces them (torch.compile, export, fake tensors);
a plain eager call can run the same implementation directly and lose nothing.
"""

import torch


def eager_call(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on `tensors` may run an op's implementation directly: plain tensors, run
    eagerly. Tracing (torch.compile, export, make_fx), fake or other tensor subclasses and functorch
    transforms see the custom op. Two private torch calls, which tests/test_kernels.py's
    test_eager_calls_skip_the_custom_ops_only_when_nothing_traces holds to their meaning: the
    dispatch-mode stack (FakeTensorMode, make_fx's proxy mode) and the functorch interpreter stack
    (vmap, grad)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    for x in tensors:
        if x is not None and type(x) is not torch.Tensor:
            return False
    return True
