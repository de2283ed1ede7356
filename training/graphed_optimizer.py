"""AdamW whose gradient clipping and update replay from one CUDA graph (train.py's optim.cuda_graph).

Eagerly, clipping and the fused AdamW update cost the training step milliseconds of host time a step
(Python over every parameter, a launch per tensor group), time the device spends idle where the step
is host-bound (benchmarks/results/profile_step_idle_gaps_h100.md). Captured once, they cost one graph
launch. A graph replays the kernels it captured on the memory it captured them on, so what the update
reads is kept where the graph found it:

- the gradients: the graph reads its own copy of them, refreshed by one copy launch before each replay,
  so backward keeps handing gradients over as it does for torch's AdamW (zero_grad frees them, no
  launch adds into them). After a step each parameter's .grad is that copy, clipped, as torch's
  optimizers leave it;
- the learning rate: each group's rate stays the float that LR schedulers, checkpoints and loggers
  see, and the update reads it from a float32 device tensor filled from that float before every step,
  eager or replayed (so both give the same numbers);
- the state (AdamW's moments and step counts), the clipping setting and which parameters have a
  gradient: when any of them changes (load_state_dict, another clipping value, a parameter left
  without a gradient), the step captures again.
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
    the state (made during a capture, it would be zeroed at every replay), and replay from a CUDA graph
    from the second step on.

    Clipping is asked for step by step with clip_gradients (train.py's configure_gradient_clipping
    does, for trainer.gradient_clip_val), by norm or by value over every parameter, as Lightning's own
    clipping does, and runs inside the step.
    """

    def __init__(self, params, **adamw_options):
        super().__init__(params, fused=True, capturable=True, **adamw_options)
        self._clipping: Clipping = None  # asked for the coming step
        self._device_lrs: list[torch.Tensor] | None = None
        self._graph_grads: list[torch.Tensor] = []  # the graph's copies of the gradients
        self._replay: Callable[[], None] | None = None
        self._captured: tuple | None = None  # what the graph was captured for, compared before every replay

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

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # under Lightning: forward, backward, and clip_gradients for this step
        clipping, self._clipping = self._clipping, None
        with_grad = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self._device_lrs is None:
            device = (with_grad or self.param_groups[0]["params"])[0].device
            self._device_lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in self.param_groups]
        for device_lr, group in zip(self._device_lrs, self.param_groups):
            device_lr.fill_(group["lr"])
        settings = self._graph_settings(with_grad, clipping)
        if self._replay is not None and self._same_settings(settings):
            torch._foreach_copy_(self._graph_grads, [p.grad for p in with_grad])
            self._replay()
        elif with_grad and all(on_graph_device(p.grad) and "step" in self.state.get(p, {}) for p in with_grad):
            self._graph_grads = [p.grad.clone() for p in with_grad]
            try:
                self._replay = capture_cuda_graph(partial(self._update, with_grad, self._graph_grads, clipping))
            except RuntimeError as error:
                raise RuntimeError(f"CUDAGraphAdamW could not capture the clipping and AdamW update into a CUDA "
                                   f"graph ({error}); train.py's model.optim.cuda_graph=false steps eagerly") from error
            self._captured = settings
            self._replay()  # capturing ran nothing: this step's update
        else:
            self._replay = self._captured = None
            self._update(with_grad, [p.grad for p in with_grad], clipping)
        if self._replay is not None:
            for p, grad in zip(with_grad, self._graph_grads):
                p.grad = grad
        return loss

    def _update(self, with_grad: list[torch.Tensor], grads: list[torch.Tensor], clipping: Clipping) -> None:
        """Clipping and AdamW's update of the parameters with_grad, from grads and the device rates."""
        for p, grad in zip(with_grad, grads):
            p.grad = grad
        if clipping is not None:
            algorithm, value = clipping
            params = [p for group in self.param_groups for p in group["params"]]
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

    def _graph_settings(self, with_grad: list[torch.Tensor], clipping: Clipping) -> tuple:
        # Values baked into the kernels' arguments, and objects compared by identity.
        groups = tuple(tuple((key, value) for key, value in group.items() if key not in ("params", "lr"))
                       for group in self.param_groups)
        return self.state, with_grad, clipping, groups

    def _same_settings(self, settings: tuple) -> bool:
        state, with_grad, clipping, groups = settings
        captured_state, captured_with_grad, captured_clipping, captured_groups = self._captured
        return (state is captured_state and clipping == captured_clipping and groups == captured_groups
                and len(with_grad) == len(captured_with_grad)
                and all(p is q for p, q in zip(with_grad, captured_with_grad)))
