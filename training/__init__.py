"""Training a sharded model under Lightning: TorchrecStrategy (strategy.py) and the pipelined
training step it drives (pipeline.py), the callbacks, and what a precision setting means for the
compute dtype (precision.py). The models, and how they are sharded, live in models/."""
