"""AdamW whose gradient clipping and update replay from one CUDA graph (train.py's optim.cuda_graph).

Eagerly, clipping and the fused AdamW update cost the training step milliseconds of host time a step
(Python over every parameter, a launch per tensor group), time the device spends idle where the step
is host-bound (benchmarks/results/profile_step_idle_gaps_h100.md). Captured once, they cost one graph
launch. A graph replays the kernels it captured on the memory it captured them on, so this optimizer
keeps everything the update reads where it was:

- the gradients: zero_grad zeroes them in place instead of freeing them, and backward accumulates
  into them; the first step copies gradients that backward handed over (possibly memory of the
  compiled model's own CUDA graphs) into memory of their own;
- the learning rate: each group's rate stays the float that LR schedulers, checkpoints and loggers
  see, and the update reads it from a float32 device tensor filled from that float before every step,
  eager or replayed (so both give the same numbers);
- the state (AdamW's moments and step counts) and the clipping setting: when anything the graph read
  has been replaced (load_state_dict, a gradient set anew, another clipping value), the step runs
  eagerly and captures again.
"""

import inspect
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch

Clipping = tuple[Literal["norm", "value"], float] | None


def capture_cuda_graph(update: Callable[[], None]) -> Callable[[], None]:
    """update's kernels captured into a CUDA graph; returns its replay. Captured on a side stream
    after a device synchronize (what torch.cuda.graph does); thread-local capture mode, so the data
    loader's pin-memory thread may keep allocating while this thread captures."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        update()
    return graph.replay


def on_graph_device(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph can read this tensor: it is on a CUDA device."""
    return tensor.is_cuda


class CUDAGraphAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (fused) whose clipping and update run eagerly on the first step, which creates
    the state, and replay from a CUDA graph from the second step on.

    Clipping is asked for step by step with clip_gradients (train.py's configure_gradient_clipping
    does, for trainer.gradient_clip_val), by norm or by value over every parameter, as Lightning's own
    clipping does, and runs inside the step.
    """

    def __init__(self, params, **adamw_options):
        super().__init__(params, fused=True, capturable=True, **adamw_options)
        self._clipping: Clipping = None  # asked for the coming step
        self._device_lrs: list[torch.Tensor] | None = None
        self._replay: Callable[[], None] | None = None
        self._captured: tuple | None = None  # what the graph read, compared before every replay
        self._owned_grads: list[torch.Tensor | None] | None = None  # the gradients as the last eager step left them

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads the state; the groups stay fused and capturable whatever optimizer saved them (a
        checkpoint of torch's AdamW, say)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.update(fused=True, capturable=True, foreach=None)

    def clip_gradients(self, algorithm: Literal["norm", "value"], value: float) -> None:
        """Clips the gradients (torch.nn.utils.clip_grad_norm_ or clip_grad_value_ over every
        parameter) inside the next step, before its update."""
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient clipping algorithm {algorithm!r}: expected 'norm' or 'value'")
        self._clipping = (algorithm, float(value))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes every gradient in place, whatever set_to_none says: the graph reads them where they are."""
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # under Lightning: forward, backward, and clip_gradients for this step
        clipping, self._clipping = self._clipping, None
        params = [p for group in self.param_groups for p in group["params"]]
        if self._device_lrs is None:
            device = next((p.device for p in params if p.grad is not None), params[0].device)
            self._device_lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in self.param_groups]
        for device_lr, group in zip(self._device_lrs, self.param_groups):
            device_lr.fill_(group["lr"])
        update = partial(self._update_from_device_lrs, clipping)
        read = self._graph_inputs(params, clipping)
        if self._replay is not None and self._same_inputs(read):
            self._replay()
        elif self._can_capture(params):
            self._replay, self._captured = capture_cuda_graph(update), read
            self._replay()  # capturing ran nothing: this step's update
        else:
            self._replay = self._captured = None
            update()
            for p in params:  # memory of their own, where the next backward accumulates
                if p.grad is not None:
                    p.grad = p.grad.clone()
            self._owned_grads = [p.grad for p in params]
        return loss

    def _update_from_device_lrs(self, clipping: Clipping) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        if clipping is not None:
            algorithm, value = clipping
            if algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(params, value)
            else:
                torch.nn.utils.clip_grad_value_(params, value)
        rates = [group["lr"] for group in self.param_groups]
        for group, device_lr in zip(self.param_groups, self._device_lrs):
            group["lr"] = device_lr
        try:
            # AdamW's own step without the step hooks torch wraps around optimizers' steps: they run
            # once, around this class's step.
            inspect.unwrap(torch.optim.AdamW.step)(self)
        finally:
            for group, rate in zip(self.param_groups, rates):
                group["lr"] = rate

    def _graph_inputs(self, params: list[torch.Tensor], clipping: Clipping) -> tuple:
        # Objects, compared by identity, and values baked into the kernels' arguments.
        settings = tuple(tuple((key, value) for key, value in group.items() if key not in ("params", "lr"))
                         for group in self.param_groups)
        return (self.state, [p.grad for p in params], clipping, settings)

    def _same_inputs(self, read: tuple) -> bool:
        state, grads, clipping, settings = read
        captured_state, captured_grads, captured_clipping, captured_settings = self._captured
        return (state is captured_state and clipping == captured_clipping and settings == captured_settings
                and len(grads) == len(captured_grads) and all(g is c for g, c in zip(grads, captured_grads)))

    def _can_capture(self, params: list[torch.Tensor]) -> bool:
        """Once an eager step has made the state (made during a capture, it would be zeroed at every
        replay) and given the gradients memory of their own, every gradient on a CUDA device."""
        grads = [p.grad for p in params]
        with_grad = [p for p in params if p.grad is not None]
        return (bool(with_grad) and all(on_graph_device(p.grad) and "step" in self.state.get(p, {}) for p in with_grad)
                and self._owned_grads is not None and len(grads) == len(self._owned_grads)
                and all(g is owned for g, owned in zip(grads, self._owned_grads)))
