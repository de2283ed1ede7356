"""training/graphed_optimizer.py: CUDAGraphAdamW against torch's fused AdamW with Lightning's clipping.

A CUDA graph cannot be captured on the CPU, so these tests stand a re-run of the captured function in for
its replay (the function puts the graph's gradient copies and device learning rates in place before it
clips and updates, so it reads what the graph's kernels would): what they check is when the optimizer
captures, replays and captures again, and that every path gives the numbers of torch's AdamW. The last
test, marked gpu, replays real graphs on a GPU (scripts/gpu_session.sh graphed_optimizer).
"""

import pytest
import torch

import training.graphed_optimizer as graphed_optimizer
from training.graphed_optimizer import CUDAGraphAdamW


@pytest.fixture
def captures(monkeypatch) -> list:
    """Captures on the CPU: each capture is recorded, and its replay re-runs the captured function."""
    captured = []

    def capture(update):
        captured.append(update)
        return update

    monkeypatch.setattr(graphed_optimizer, "capture_cuda_graph", capture)
    monkeypatch.setattr(graphed_optimizer, "on_graph_device", lambda tensor: True)
    return captured


def make_model(seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).to(device)


def parameter_groups(model: torch.nn.Module) -> list[dict]:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]


def reference_step(model, optimizer, clipping) -> None:
    """What Lightning does with torch's AdamW: clip over every parameter (Precision.clip_grad_by_norm /
    clip_grad_by_value), then step; the learning rate as a float32 tensor, as CUDAGraphAdamW's update reads it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if clipping is not None:
        algorithm, value = clipping
        clip = torch.nn.utils.clip_grad_norm_ if algorithm == "norm" else torch.nn.utils.clip_grad_value_
        clip(params, value)
    optimizer.step()


def train(model, optimizer, steps: range, clipping, graphed: bool, reference_lrs=None, forward=None,
          without_grad: tuple = ()) -> None:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step), last_epoch=steps.start - 1)
    device = next(model.parameters()).device
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=generator).to(device), torch.randn(16, 1, generator=generator).to(device)
        optimizer.zero_grad()
        if forward is not None:  # compiled into CUDA graphs: tell them a new step starts
            torch.compiler.cudagraph_mark_step_begin()
        loss = torch.nn.functional.mse_loss((forward or model)(x), y) * 100  # gradients large enough to be clipped
        loss.backward()
        for p in without_grad:  # e.g. a parameter this step did not reach
            p.grad = None
        if graphed:
            if clipping is not None:
                optimizer.clip_gradients(*clipping)
            optimizer.step()
        else:
            for group, lr in zip(optimizer.param_groups, reference_lrs):
                lr.fill_(group["initial_lr"] / (1 + step))  # the float32 rate the graphed update reads
            reference_step(model, optimizer, clipping)
        scheduler.step()


def reference_optimizer(model) -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    groups = parameter_groups(model)
    device = next(model.parameters()).device
    lrs = [torch.tensor(0.01, dtype=torch.float32, device=device) for _ in groups]
    optimizer = torch.optim.AdamW([{**g, "lr": lr} for g, lr in zip(groups, lrs)], fused=True)
    for group in optimizer.param_groups:
        group["initial_lr"] = 0.01
    return optimizer, lrs


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("clipping", [None, ("norm", 0.5), ("value", 0.05)], ids=["no clipping", "norm", "value"])
def test_captures_once_then_replays_with_adamw_numbers(captures, clipping):
    model, reference = make_model(), make_model()
    optimizer = CUDAGraphAdamW(parameter_groups(model), lr=0.01)
    train(model, optimizer, range(1), clipping, graphed=True)
    assert not captures  # the first step makes the state: eager
    train(model, optimizer, range(1, 2), clipping, graphed=True)
    assert len(captures) == 1
    graph_grads = [p.grad for p in model.parameters()]
    train(model, optimizer, range(2, 6), clipping, graphed=True)
    assert len(captures) == 1  # captured on the second step, replayed on the rest
    assert all(p.grad is g for p, g in zip(model.parameters(), graph_grads))  # each step's gradients copied in

    reference_adamw, lrs = reference_optimizer(reference)
    train(reference, reference_adamw, range(6), clipping, graphed=False, reference_lrs=lrs)
    assert_same_parameters(model, reference)
    # The next step's rate, a float, as schedulers and loggers see it.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 / 7)
    assert isinstance(optimizer.param_groups[0]["lr"], float)


def test_captures_again_when_what_the_graph_was_captured_for_changes(captures):
    model, reference = make_model(), make_model()
    optimizer = CUDAGraphAdamW(parameter_groups(model), lr=0.01)
    reference_adamw, lrs = reference_optimizer(reference)
    train(model, optimizer, range(3), ("norm", 0.5), graphed=True)
    train(reference, reference_adamw, range(3), ("norm", 0.5), graphed=False, reference_lrs=lrs)
    assert len(captures) == 1

    optimizer.load_state_dict(optimizer.state_dict())  # new state tensors: captured again at once
    train(model, optimizer, range(3, 4), ("norm", 0.5), graphed=True)
    assert len(captures) == 2
    train(model, optimizer, range(4, 5), ("norm", 0.25), graphed=True)  # another clipping value
    assert len(captures) == 3
    last_bias = model[2].bias
    train(model, optimizer, range(5, 6), ("norm", 0.25), graphed=True, without_grad=(last_bias,))  # fewer gradients
    assert len(captures) == 4
    train(model, optimizer, range(6, 7), ("norm", 0.25), graphed=True)
    assert len(captures) == 5

    train(reference, reference_adamw, range(3, 4), ("norm", 0.5), graphed=False, reference_lrs=lrs)
    train(reference, reference_adamw, range(4, 5), ("norm", 0.25), graphed=False, reference_lrs=lrs)
    train(reference, reference_adamw, range(5, 6), ("norm", 0.25), graphed=False, reference_lrs=lrs,
          without_grad=(reference[2].bias,))
    train(reference, reference_adamw, range(6, 7), ("norm", 0.25), graphed=False, reference_lrs=lrs)
    assert_same_parameters(model, reference)


def test_runs_eagerly_off_cuda():
    model, reference = make_model(), make_model()
    optimizer = CUDAGraphAdamW(parameter_groups(model), lr=0.01)
    train(model, optimizer, range(4), ("norm", 0.5), graphed=True)
    assert optimizer._replay is None
    reference_adamw, lrs = reference_optimizer(reference)
    train(reference, reference_adamw, range(4), ("norm", 0.5), graphed=False, reference_lrs=lrs)
    assert_same_parameters(model, reference)


def test_lightning_trains_through_it_with_clipping_and_step_hooks_once_a_step(captures, monkeypatch, tmp_path):
    """train.py's task with model.optim.cuda_graph (its CUDA-device check lifted): Lightning's closure,
    zero_grad and trainer.gradient_clip_val reach the optimizer; the weights are those of the fused AdamW."""
    import lightning as L

    import train
    from data.datamodule import CTRDataModule
    from models import RankingModelConfig

    monkeypatch.setattr(train, "optimizer_config_error", lambda optim, trainer: None)
    clip, weights, stepped_norms = 1e-3, {}, []
    for cuda_graph in (True, False):
        data = CTRDataModule(data_dir=str(tmp_path), num_train=256, num_val=64, batch_size=32, vocab_size=50,
                             num_items=50, max_history_len=16)
        net = RankingModelConfig(d_model=16, num_heads=2, num_layers=1, mlp_ratio=2, embedding_dim=8,
                                 n_dense_tokens=1, attn_backend="reference")
        L.seed_everything(0)
        task = train.RankingTask(data.schema.to_dict(), net, train.OptimConfig(fused=True, cuda_graph=cuda_graph))

        class Record(L.Callback):
            def on_train_start(self, trainer, pl_module):
                assert isinstance(trainer.optimizers[0], CUDAGraphAdamW) is cuda_graph
                trainer.optimizers[0].register_step_post_hook(lambda opt, *_: stepped_norms.append(float(
                    torch.nn.utils.get_total_norm([p.grad for g in opt.param_groups for p in g["params"]]))))

        trainer = L.Trainer(accelerator="cpu", max_steps=4, gradient_clip_val=clip, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, callbacks=[Record()])
        trainer.fit(task, datamodule=data)
        weights[cuda_graph] = [p.detach().clone() for p in task.parameters()]
    assert len(captures) == 1
    assert len(stepped_norms) == 8 and max(stepped_norms) <= clip * 1.001  # each step's hooks ran once, clipped
    for graphed, fused in zip(weights[True], weights[False]):  # the rate as a float32 is the one difference
        torch.testing.assert_close(graphed, fused, rtol=1e-6, atol=1e-8)


def test_a_checkpoint_of_torchs_adamw_loads_and_stays_capturable():
    model = make_model()
    plain = torch.optim.AdamW(parameter_groups(model), lr=0.01, foreach=True)
    model(torch.randn(4, 6)).sum().backward()
    plain.step()
    optimizer = CUDAGraphAdamW(parameter_groups(model), lr=0.01)
    optimizer.load_state_dict(plain.state_dict())
    assert all(g["fused"] and g["capturable"] and not g["foreach"] for g in optimizer.param_groups)
    optimizer.step()  # fused and foreach together would refuse


def test_a_failed_capture_says_what_failed_and_how_to_train_without_it(captures, monkeypatch):
    def fail(update):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed_optimizer, "capture_cuda_graph", fail)
    model = make_model()
    optimizer = CUDAGraphAdamW(parameter_groups(model), lr=0.01)
    train(model, optimizer, range(1), None, graphed=True)
    with pytest.raises(RuntimeError, match=r"could not capture .*\(operation not permitted when stream is capturing\); "
                                           r"train.py's model.optim.cuda_graph=false steps eagerly"):
        train(model, optimizer, range(1, 2), None, graphed=True)


def test_rejects_an_unknown_clipping_algorithm():
    optimizer = CUDAGraphAdamW(make_model().parameters(), lr=0.01)
    with pytest.raises(ValueError, match="'l1': expected 'norm' or 'value'"):
        optimizer.clip_gradients("l1", 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager model", "model in CUDA graphs"])
def test_real_cuda_graph_replays_give_adamw_numbers(monkeypatch, compiled):
    """Captured and replayed on a GPU, beside a model whose own CUDA graphs (torch.compile's
    reduce-overhead) hand backward's gradients over in their memory pool."""
    captures = []
    real_capture = graphed_optimizer.capture_cuda_graph
    monkeypatch.setattr(graphed_optimizer, "capture_cuda_graph",
                        lambda update: captures.append(1) or real_capture(update))
    model, reference = make_model(device="cuda"), make_model(device="cuda")
    graphed_forward = (lambda m: torch.compile(m, mode="reduce-overhead")) if compiled else (lambda m: None)
    optimizer = CUDAGraphAdamW(parameter_groups(model), lr=0.01)
    train(model, optimizer, range(8), ("norm", 0.5), graphed=True, forward=graphed_forward(model))
    reference_adamw, lrs = reference_optimizer(reference)
    train(reference, reference_adamw, range(8), ("norm", 0.5), graphed=False, reference_lrs=lrs,
          forward=graphed_forward(reference))
    assert len(captures) == 1
    assert_same_parameters(model, reference)
