"""Training a sharded model under Lightning: TorchrecStrategy (strategy.py) and the pipelined
training step it drives (pipeline.py). The models, and how they are sharded, live in models/."""
