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


def op_or_eager(forward_op, forward_launcher, setup_context, eager_gradients):
    """`call(tensors, *constants)` -> the first output of a kernel custom op `forward_op`, run as the
    op where something traces (eager_call is False); otherwise its launcher `forward_launcher`
    directly, under an autograd.Function with the op's formula (setup_context, and
    eager_gradients(ctx, grads) -> the inputs' gradients) when a tensor needs a gradient. The
    launcher's outputs after the first are saved for the backward and get no gradient."""

    class EagerCall(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            outputs = list(forward_launcher(*inputs))
            setup_context(ctx, inputs, outputs)
            ctx.mark_non_differentiable(*outputs[1:])
            return tuple(outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            return eager_gradients(ctx, grads)

    def call(tensors, *constants):
        if not eager_call(*tensors):
            return forward_op(*tensors, *constants)[0]
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return EagerCall.apply(*tensors, *constants)[0]
        return forward_launcher(*tensors, *constants)[0]

    return call
