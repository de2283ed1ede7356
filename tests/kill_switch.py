"""A callback the kill-and-resume tests add to a training run (--trainer.callbacks+=...): the process
sends itself a signal at a chosen point, as a crash, the OOM killer or a scheduler would."""

import os
import signal

from lightning.pytorch.callbacks import Callback


class KillSwitch(Callback):
    """Sends `signal_name` to this process after training step `step` (global_step == step), or, with
    `during_validation`, in the middle of the validation that follows that step."""

    def __init__(self, step: int, during_validation: bool = False, signal_name: str = "SIGKILL"):
        self.step, self.during_validation, self.signal = step, during_validation, getattr(signal, signal_name)
        if self.signal == signal.SIGINT:
            # A process started under pytest-xdist inherits SIGINT ignored; a terminal's Ctrl-C meets Python's handler.
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.during_validation and trainer.global_step == self.step:
            os.kill(os.getpid(), self.signal)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx=0) -> None:
        if self.during_validation and trainer.global_step == self.step and batch_idx == 2:
            os.kill(os.getpid(), self.signal)
