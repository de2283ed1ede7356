import dataclasses
import os

import pyarrow as pa
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import KeyedJaggedTensor, KeyedTensor

from data.batch import ArrowBatchCollator, Batch
from data.schema import LABEL, FeatureSchema
from models import RankingModel, RankingModelConfig
from models.ranking import fields_in_order

SCHEMA = FeatureSchema(
    dense=("d0", "d1", "d2"),
    categorical=(("user", 11), ("ad", 13)),
    sequence=(("clicks", 17, 100), ("views", 19, 8)),
)
CONFIG = RankingModelConfig(d_model=32, num_heads=2, num_layers=2, mlp_ratio=2, embedding_dim=8, n_dense_tokens=2)
FIXED_TOKENS = CONFIG.n_dense_tokens + len(SCHEMA.categorical)


def make_batch(clicks_lengths: list[int], views_lengths: list[int], seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    batch_size = len(clicks_lengths)
    sparse = KeyedJaggedTensor(
        keys=["user", "ad"],
        values=torch.cat([torch.randint(0, 11, (batch_size,), generator=generator),
                          torch.randint(0, 13, (batch_size,), generator=generator)]),
        lengths=torch.ones(2 * batch_size, dtype=torch.int32),
        stride=batch_size,
    )
    sequence = KeyedJaggedTensor(
        keys=["clicks", "views"],
        values=torch.cat([torch.randint(0, 17, (sum(clicks_lengths),), generator=generator),
                          torch.randint(0, 19, (sum(views_lengths),), generator=generator)]),
        lengths=torch.tensor(clicks_lengths + views_lengths, dtype=torch.int32),
        stride=batch_size,
    )
    return Batch(
        dense=torch.randn(batch_size, 3, generator=generator),
        sparse=sparse,
        sequence=sequence,
        labels=torch.randint(0, 2, (batch_size,), generator=generator).float(),
    )


@pytest.fixture
def model() -> RankingModel:
    torch.manual_seed(0)
    return RankingModel(SCHEMA, CONFIG)


def expected_tokens(model: RankingModel, batch: Batch) -> list[torch.Tensor]:
    """Each sample's token matrix built one sample at a time, straight from the layout's definition."""
    tower, config = model.tower, model.config
    slot = tower.slot_embedding.weight
    tables = model.categorical_embeddings.embedding_bags
    pooled = config.history_tokens == "mean"
    sequence_tables = model.sequence_embeddings.embedding_bags if pooled else model.sequence_embeddings.embeddings
    samples = []
    for b in range(batch.batch_size):
        fields = [tables[f"t_{name}"].weight[batch.sparse[name].values()[b]] for name in ("user", "ad")]
        item_ids = {}
        for name in ("clicks", "views"):
            jagged = batch.sequence[name]
            ids = jagged.values()[jagged.offsets()[b]: jagged.offsets()[b + 1]]
            weight = sequence_tables[f"t_{name}"].weight
            if pooled:  # one more field: the mean of its items, zeros for an empty history
                fields.append(weight[ids].mean(0) if len(ids) else weight.new_zeros(config.embedding_dim))
            else:
                item_ids[name] = ids.flip(0) if config.history_order == "reversed" else ids
        rows = list(tower.dense_mlp(batch.dense[b]).view(config.n_dense_tokens, config.d_model))
        for field, embedding in enumerate(fields):
            if config.field_projection == "per_field":  # field `field`'s own map
                rows.append(embedding @ tower.field_proj_weight[field] + tower.field_proj_bias[field])
            else:
                rows.append(tower.embedding_proj(embedding))
        rows = [row + slot[i] for i, row in enumerate(rows)]
        for slot_index, (name, ids) in enumerate(item_ids.items(), start=len(rows)):
            rows.extend(tower.embedding_proj(sequence_tables[f"t_{name}"].weight[i]) + slot[slot_index] for i in ids)
        samples.append(torch.stack(rows))
    return samples


@pytest.mark.parametrize("field_projection, history_order, history_tokens", [
    ("shared", "given", "items"), ("per_field", "given", "items"), ("shared", "reversed", "items"),
    ("shared", "given", "mean"), ("per_field", "given", "mean"),
])  # fmt: skip
def test_tokens_and_offsets_follow_the_layout(field_projection, history_order, history_tokens):
    torch.manual_seed(0)
    model = RankingModel(SCHEMA, dataclasses.replace(CONFIG, field_projection=field_projection,
                                                     history_order=history_order, history_tokens=history_tokens))
    # 0 and 70 history items: an empty history, and one that spills into a second 64-token block.
    clicks, views = [0, 70, 3], [2, 0, 5]
    batch = make_batch(clicks_lengths=clicks, views_lengths=views)
    tokens = model.build_tokens(batch)
    if history_tokens == "mean":  # each history is one more fixed token
        lengths = [FIXED_TOKENS + 2] * 3
    else:
        lengths = [FIXED_TOKENS + c + v for c, v in zip(clicks, views)]
    assert tokens.offsets.dtype == torch.int32
    # The samples, then the pad sequence, empty without pad_tokens_to.
    assert tokens.offsets.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths), sum(lengths)]
    assert tokens.values.shape == (sum(lengths), CONFIG.d_model)
    assert tokens.sample_ids.tolist() == [b for b, n in enumerate(lengths) for _ in range(n)]
    expected = torch.cat(expected_tokens(model, batch))
    torch.testing.assert_close(tokens.values, expected)


def test_a_pooled_history_is_one_token_per_feature_trains_its_table_and_has_no_order():
    torch.manual_seed(0)
    model = RankingModel(SCHEMA, dataclasses.replace(CONFIG, history_tokens="mean"))
    batch = make_batch(clicks_lengths=[0, 70, 3], views_lengths=[2, 0, 5])
    logits, num_tokens = model(batch)
    assert num_tokens == 3 * (FIXED_TOKENS + 2) and torch.isfinite(logits).all()
    model.loss(logits, batch.labels).backward()
    weight = model.sequence_embeddings.embedding_bags["t_clicks"].weight
    seen = torch.zeros(weight.shape[0], dtype=torch.bool)
    seen[batch.sequence["clicks"].values()] = True
    assert weight.grad[seen].abs().sum(1).gt(0).all() and weight.grad[~seen].eq(0).all()
    with pytest.raises(ValueError, match="history_tokens='mean' makes none"):
        dataclasses.replace(CONFIG, history_tokens="mean", history_order="reversed")


def test_features_out_of_schema_order_are_rejected(model):
    batch = make_batch(clicks_lengths=[4, 1], views_lengths=[0, 3])
    batch.sequence = KeyedJaggedTensor(
        keys=["views", "clicks"], values=batch.sequence.values(), lengths=batch.sequence.lengths(), stride=2
    )
    with pytest.raises(ValueError, match=r"batch.sequence has keys \['views', 'clicks'\]"):
        model(batch)


def test_forward_shapes_and_loss(model):
    batch = make_batch(clicks_lengths=[0, 70, 3, 100], views_lengths=[2, 0, 5, 8])
    logits, num_tokens = model(batch)
    assert logits.shape == (4,)
    assert torch.isfinite(logits).all()
    assert num_tokens == 4 * FIXED_TOKENS + 173 + 15
    loss = model.loss(logits, batch.labels)
    assert loss.shape == () and loss.item() > 0


def test_samples_do_not_see_each_other(model):
    # Changing sample 1's history must leave sample 0's logit untouched: attention and
    # pooling both stay inside each sample's slice of the jagged tensor.
    batch = make_batch(clicks_lengths=[5, 70], views_lengths=[1, 2])
    clicks, views = batch.sequence["clicks"].values(), batch.sequence["views"].values()
    changed = Batch(
        dense=batch.dense,
        sparse=batch.sparse,
        sequence=KeyedJaggedTensor(
            keys=["clicks", "views"],
            values=torch.cat([clicks[:5], torch.randint(0, 17, (30,)), views]),
            lengths=torch.tensor([5, 30, 1, 2], dtype=torch.int32),
            stride=2,
        ),
        labels=batch.labels,
    )
    logits, _ = model(batch)
    changed_logits, _ = model(changed)
    torch.testing.assert_close(changed_logits[0], logits[0])
    assert not torch.allclose(changed_logits[1], logits[1])


def test_gradients_reach_every_parameter(model):
    batch = make_batch(clicks_lengths=[0, 70, 3, 12], views_lengths=[2, 0, 5, 8])
    logits, _ = model(batch)
    model.loss(logits, batch.labels).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    # Only the looked-up rows of an embedding table get a gradient.
    user_grad = model.categorical_embeddings.embedding_bags["t_user"].weight.grad
    used = set(batch.sparse["user"].values().tolist())
    assert {i for i in range(11) if user_grad[i].abs().sum() > 0} == used


class RecordOps(TorchDispatchMode):
    """Records the name of every op dispatched under it, in order, as namespace.op ("aten.stack")."""

    def __init__(self):
        super().__init__()
        self.names = []

    @property
    def namespaces(self) -> set[str]:
        return {name.split(".")[0] for name in self.names}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_forward_and_backward_need_no_fbgemm_ops(model):
    # The GPU setup ships the CPU build of fbgemm (its ops have no CUDA kernels), so the
    # plain EBC/EC path must not call any to run on CUDA.
    batch = make_batch(clicks_lengths=[0, 70, 3], views_lengths=[2, 0, 5])
    with RecordOps() as recorded:
        logits, _ = model(batch)
        model.loss(logits, batch.labels).backward()
    assert "aten" in recorded.namespaces  # the recorder saw the ops
    assert "fbgemm" not in recorded.namespaces


def test_collated_batch_is_looked_up_without_conversions_or_copies(model):
    # Each conversion or copy is one more launch and allocation of the eager lookups in every step, on
    # the host's critical path when the tower replays from CUDA graphs.
    rows = pa.table({
        "d0": [0.5, 1.0, 2.0], "d1": [0.0, 1.0, 0.0], "d2": [3.0, 0.0, 1.0], "user": [1, 10, 4], "ad": [0, 12, 7],
        "clicks": [[], [3, 16, 2], [5]], "views": [[1, 18], [], [0, 0, 4]], LABEL: [1.0, 0.0, 1.0],
    })
    batch = ArrowBatchCollator(SCHEMA)(rows)
    with RecordOps() as recorded:
        model.embed(batch)
    assert {"aten.embedding_bag", "aten._embedding_bag"} & set(recorded.names)  # the recorder saw the lookups
    assert "aten._to_copy" not in recorded.names
    assert "aten.stack" not in recorded.names


def test_pooled_fields_come_in_schema_order_whatever_the_collections_order():
    values = torch.arange(24, dtype=torch.float32).view(2, 12)  # features a, b, c, 4 wide each
    fields = fields_in_order(KeyedTensor(keys=["a", "b", "c"], length_per_key=[4, 4, 4], values=values),
                             ["a", "b", "c"], 4)
    assert fields.shape == (2, 3, 4) and fields.data_ptr() == values.data_ptr()  # a view, no copy
    assert torch.equal(fields[:, 1], values[:, 4:8])
    # Grouped by shard, as a sharded collection returns them.
    by_shard = KeyedTensor(keys=["c", "a", "b"], length_per_key=[4, 4, 4], values=torch.cat([values[:, 8:], values[:, :8]], 1))
    assert torch.equal(fields_in_order(by_shard, ["a", "b", "c"], 4), fields)


def test_schema_without_sequences():
    # Criteo has no history: every sample is just its dense and categorical tokens.
    schema = FeatureSchema(dense=("d0",), categorical=(("user", 11),), sequence=())
    model = RankingModel(schema, CONFIG)
    batch = Batch(
        dense=torch.randn(3, 1),
        sparse=KeyedJaggedTensor(
            keys=["user"], values=torch.tensor([1, 2, 3]), lengths=torch.ones(3, dtype=torch.int32), stride=3
        ),
        sequence=KeyedJaggedTensor(
            keys=[], values=torch.empty(0, dtype=torch.int64), lengths=torch.empty(0, dtype=torch.int32), stride=3
        ),
        labels=torch.tensor([0.0, 1.0, 0.0]),
    )
    logits, num_tokens = model(batch)
    assert logits.shape == (3,) and num_tokens == 9
    assert model.build_tokens(batch).offsets.tolist() == [0, 3, 6, 9, 9]
    padded = RankingModel(schema, dataclasses.replace(CONFIG, pad_tokens_to=8))
    padded.load_state_dict(model.state_dict())
    assert padded.build_tokens(batch).offsets.tolist() == [0, 3, 6, 9, 16]
    torch.testing.assert_close(padded(batch)[0], logits)


def test_bf16_autocast_matches_fp32(model):
    # What precision: bf16-mixed does: Linear outputs, hence q, k, v, are bf16.
    batch = make_batch(clicks_lengths=[0, 70, 3], views_lengths=[2, 0, 5])
    expected, _ = model(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(batch)
        loss = model.loss(logits, batch.labels)
    loss.backward()
    torch.testing.assert_close(logits.float(), expected, atol=0.05, rtol=0.05)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 30, "num_heads": 4}, "divisible"),
        ({"d_model": 30, "num_heads": 2}, "even"),
        ({"num_layers": -1}, "num_layers=-1 must be >= 0"),
        ({"attn_backend": "cuda"}, "attn_backend"),
        ({"head_layers": 0}, "head_layers=0 must be >= 1"),
        ({"head_cross_layers": -1}, "head_cross_layers=-1 must be >= 0"),
    ],
)
def test_config_rejects_bad_sizes(overrides, message):
    with pytest.raises(ValueError, match=message):
        RankingModelConfig(**overrides)


def test_head_cross_layers_multiply_by_the_readout_then_add_their_input():
    """DCNv2's cross layer, x_{l+1} = x_0 * (W_l x_l + b_l) + x_l, as the head's MLP receives it."""
    torch.manual_seed(0)
    model = RankingModel(SCHEMA, RankingModelConfig(d_model=32, num_heads=2, embedding_dim=8, readout="fields_dot",
                                                    head_layers=2, head_cross_layers=2))
    seen = {}
    model.tower.head_cross[0].register_forward_pre_hook(lambda _, args: seen.setdefault("readout", args[0]))
    model.tower.head.register_forward_pre_hook(lambda _, args: seen.setdefault("head", args[0]))
    logits, _ = model(make_batch(clicks_lengths=[0, 70, 3], views_lengths=[2, 0, 5]))
    readout = seen["readout"]
    crossed = readout
    for layer in model.tower.head_cross:
        crossed = readout * (crossed @ layer.weight.T + layer.bias) + crossed
    torch.testing.assert_close(seen["head"], crossed)
    assert len(model.tower.head) == 5 and logits.shape == (3,)  # two hidden layers: Linear, GELU, Linear, GELU, Linear


@pytest.mark.parametrize("num_layers", [0, 1])
def test_without_attention_layers_no_token_reads_another(num_layers):
    """num_layers=0, the ablation: a sample's fixed tokens reach the readout without meeting its history items,
    so new history embeddings leave them as they were; one attention layer lets them read the items."""
    torch.manual_seed(0)
    model = RankingModel(SCHEMA, RankingModelConfig(**{**CONFIG.__dict__, "num_layers": num_layers, "readout": "fields"}))
    batch = make_batch(clicks_lengths=[0, 70, 3], views_lengths=[2, 0, 5])
    seen = []
    model.tower.head.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    with torch.no_grad():
        model(batch)
        for table in model.sequence_embeddings.embeddings.values():
            table.weight.add_(1.0)
        model(batch)
    fixed = model.tower.num_fixed_tokens * model.config.d_model  # the readout's first columns, then the mean
    assert len(model.tower.layers) == num_layers
    assert torch.equal(seen[0][:, :fixed], seen[1][:, :fixed]) == (num_layers == 0)
    assert not torch.equal(seen[0][:, fixed:], seen[1][:, fixed:])  # the mean over all tokens reads the items


def test_zero_residual_init_starts_as_the_ablation_without_attention_then_trains_its_layers():
    """residual_init="zero": every layer starts as the identity, so the model's logits are its num_layers=0
    ablation's on the same other parameters; one optimizer step moves the branches' last linears off zero,
    and the layers then change the logits."""
    config = dataclasses.replace(CONFIG, residual_init="zero", readout="fields_dot", head_cross_layers=1)
    torch.manual_seed(0)
    model = RankingModel(SCHEMA, config)
    ablation = RankingModel(SCHEMA, dataclasses.replace(config, num_layers=0))
    missing, unexpected = ablation.load_state_dict(model.state_dict(), strict=False)
    assert not missing and unexpected and all(key.startswith("tower.layers.") for key in unexpected)
    batch = make_batch(clicks_lengths=[0, 70, 3], views_lengths=[2, 0, 5])
    logits, _ = model(batch)
    torch.testing.assert_close(logits, ablation(batch)[0], rtol=0, atol=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.loss(logits, batch.labels).backward()
    optimizer.step()
    for layer in model.tower.layers:
        assert layer.out_proj.weight.abs().max() > 0 and layer.mlp[-1].weight.abs().max() > 0
    ablation.load_state_dict(model.state_dict(), strict=False)  # the step's other parameters too
    with torch.no_grad():
        assert not torch.equal(model(batch)[0], ablation(batch)[0])
    # The default initialization leaves them as nn.Linear makes them.
    assert RankingModel(SCHEMA, CONFIG).tower.layers[0].out_proj.weight.abs().max() > 0


def test_residual_stream_in_the_autocast_dtype_only_where_asked_and_only_between_the_layers():
    """residual_fp32=False: under autocast the layers take and give the token stream in bf16, the final norm's
    output and the head stay fp32 and the step trains; without autocast the switch changes no bit."""
    batch = make_batch(clicks_lengths=[0, 70, 3], views_lengths=[2, 0, 5])
    seen = {}
    for residual_fp32 in (True, False):
        torch.manual_seed(0)
        model = RankingModel(SCHEMA, dataclasses.replace(CONFIG, residual_fp32=residual_fp32, readout="fields"))
        model.tower.layers[1].register_forward_pre_hook(lambda _, args: seen.update(layer_in=args[0].dtype))
        model.tower.layers[1].register_forward_hook(lambda _, args, out: seen.update(layer_out=out.dtype))
        model.tower.head.register_forward_pre_hook(lambda _, args: seen.update(head_in=args[0].dtype))
        seen[residual_fp32, "plain"] = model(batch)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, _ = model(batch)
            loss = model.loss(logits, batch.labels)
        loss.backward()
        stream = torch.float32 if residual_fp32 else torch.bfloat16
        assert (seen["layer_in"], seen["layer_out"], seen["head_in"]) == (stream, stream, torch.float32)
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        seen[residual_fp32] = logits.float()
    torch.testing.assert_close(seen[False], seen[True], atol=0.05, rtol=0)  # bf16 rounding of the stream only
    assert torch.equal(seen[True, "plain"], seen[False, "plain"])


def test_padding_the_token_count_changes_no_logit(model):
    """pad_tokens_to appends one sequence of pad tokens that no real token attends to and pooling drops."""
    batch = make_batch(clicks_lengths=[0, 70, 3, 100], views_lengths=[2, 0, 5, 8])
    padded = RankingModel(SCHEMA, dataclasses.replace(CONFIG, pad_tokens_to=128))
    padded.load_state_dict(model.state_dict())
    logits, num_tokens = model(batch)
    padded_logits, padded_num_tokens = padded(batch)
    assert padded_num_tokens == num_tokens  # the real tokens, as FLOP counts want them
    torch.testing.assert_close(padded_logits, logits)
    tokens, padded_tokens = model.build_tokens(batch), padded.build_tokens(batch)
    assert padded_tokens.num_tokens % 128 == 0 and padded_tokens.num_tokens - num_tokens < 128
    # The real tokens are where they were; the pad tokens form the last sequence.
    torch.testing.assert_close(padded_tokens.values[:num_tokens], tokens.values)
    assert padded_tokens.offsets[:-1].tolist() == tokens.offsets[:-1].tolist()
    assert padded_tokens.offsets[-1] == padded_tokens.num_tokens


# "target": the fields_dot readout (the one with the most ops) plus target attention's scatter ops, under
# dynamic shapes; a compile of fields_dot alone would add nothing to it (each compile costs ~a minute of CPU).
@pytest.mark.parametrize("readout", ["mean", "target"])
def test_compiled_model_matches_eager_on_cpu(readout):
    """torch.compile of the token-interaction stack (inductor on CPU, reference attention), padded to
    a few token counts as the GPU config pads them: the same logits and gradients as eager."""
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, readout="fields_dot", target_attention_feature="ad") if readout == "target" \
        else dataclasses.replace(CONFIG, readout=readout)
    model = RankingModel(SCHEMA, config)
    compiled = RankingModel(SCHEMA, dataclasses.replace(config, compile=True, pad_tokens_to=64))
    compiled.load_state_dict(model.state_dict())
    for seed, lengths in enumerate(([0, 70, 3, 100], [5, 1, 64, 0])):
        batch = make_batch(clicks_lengths=lengths, views_lengths=[2, 0, 5, 8], seed=seed)
        eager_loss = model.loss(model(batch)[0], batch.labels)
        compiled_loss = compiled.loss(compiled(batch)[0], batch.labels)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
        eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
        compiled_grads = torch.autograd.grad(compiled_loss, list(compiled.parameters()))
        for (name, _), a, b in zip(model.named_parameters(), compiled_grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


# Each fused-sublayer switch, and the layer attribute naming its backend.
FUSED_SWITCHES = {"fused_attention": "attention_sublayer_backend", "fused_mlp": "mlp_backend"}


@pytest.mark.parametrize("backend", ("reference", "triton", "triton_blocks"))
@pytest.mark.parametrize("switch", FUSED_SWITCHES)
def test_fused_sublayer_switch_keeps_the_model(switch, backend):
    """model.net.fused_attention / fused_mlp run each layer's sublayer as one op on the same
    parameters (and state dict): the reference op is bitwise the unfused path; the Triton kernels
    (interpreter, fp32) match it, loss and every gradient, eager and (the kernels' custom ops inside
    inductor's graph) compiled; "triton_blocks" is the attention sublayer's per-block plan
    (model.net.attention_sublayer_plan). d_model 64 in 2 heads: head_dim 32, the Triton attention's smallest."""
    if backend == "triton_blocks" and switch != "fused_attention":
        pytest.skip("the per-block plan is the attention sublayer's")
    if backend.startswith("triton"):
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    config = dataclasses.replace(CONFIG, d_model=64, attn_backend="reference")
    torch.manual_seed(0)
    model = RankingModel(SCHEMA, config)
    batch = make_batch(clicks_lengths=[0, 70, 3, 100], views_lengths=[2, 0, 5, 8])
    expected_loss = model.loss(model(batch)[0], batch.labels)
    expected_grads = torch.autograd.grad(expected_loss, list(model.parameters()))
    attribute = FUSED_SWITCHES[switch]
    for compile in (False,) if backend == "reference" else (False, True):
        fused = RankingModel(SCHEMA, dataclasses.replace(config, compile=compile, pad_tokens_to=64 if compile else 0,
                                                         **{switch: True}))
        assert getattr(fused.config, attribute) == "reference"
        # The attention backend names the sublayer's kernels; set it after the attention check above.
        for layer in fused.tower.layers:
            setattr(layer, attribute, backend.removesuffix("_blocks"))
            if backend == "triton_blocks":  # what attention_sublayer_plan="blocks" (with attn_backend="triton") sets
                layer.attention_sublayer_launch = {"fwd": {"plan": "blocks"}, "bwd": {"plan": "blocks"}}
        fused.load_state_dict(model.state_dict())
        loss = fused.loss(fused(batch)[0], batch.labels)
        grads = torch.autograd.grad(loss, list(fused.parameters()))
        if backend == "reference":
            assert torch.equal(loss, expected_loss)
            assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        for (name, _), a, b in zip(model.named_parameters(), grads, expected_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ("reference", "triton"))
def test_mlp_gelu_tanh_reaches_both_paths(backend):
    """model.net.mlp_gelu="tanh": the unfused layers' nn.GELU and the fused MLP op (reference bitwise, the
    Triton kernels under the interpreter in fp32) compute the same tanh-form model, loss and every gradient,
    and it is not the exact-GELU model."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    config = dataclasses.replace(CONFIG, d_model=64, attn_backend="reference", mlp_gelu="tanh")
    torch.manual_seed(0)
    model = RankingModel(SCHEMA, config)
    assert {layer.mlp[1].approximate for layer in model.tower.layers} == {"tanh"}
    batch = make_batch(clicks_lengths=[0, 70, 3, 100], views_lengths=[2, 0, 5, 8])
    expected_loss = model.loss(model(batch)[0], batch.labels)
    expected_grads = torch.autograd.grad(expected_loss, list(model.parameters()))
    exact = RankingModel(SCHEMA, dataclasses.replace(config, mlp_gelu="none"))
    exact.load_state_dict(model.state_dict())
    assert not torch.equal(exact.loss(exact(batch)[0], batch.labels), expected_loss)
    fused = RankingModel(SCHEMA, dataclasses.replace(config, fused_mlp=True))
    for layer in fused.tower.layers:
        layer.mlp_backend = backend
    fused.load_state_dict(model.state_dict())
    loss = fused.loss(fused(batch)[0], batch.labels)
    grads = torch.autograd.grad(loss, list(fused.parameters()))
    if backend == "reference":
        assert torch.equal(loss, expected_loss) and all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_per_block_attention_plan_needs_the_triton_or_tlx_backend():
    layer = RankingModel(SCHEMA, dataclasses.replace(CONFIG, attn_backend="triton", fused_attention=True,
                                                     attention_sublayer_plan="blocks")).tower.layers[0]
    assert layer.attention_sublayer_launch == {"fwd": {"plan": "blocks"}, "bwd": {"plan": "blocks"}}
    assert RankingModel(SCHEMA, CONFIG).tower.layers[0].attention_sublayer_launch is None
    RankingModelConfig(attn_backend="tlx", fused_attention=True, attention_sublayer_plan="blocks")
    with pytest.raises(ValueError, match="attention_sublayer_plan='blocks' runs the triton or tlx backend's per-block "
                                         "kernels: set attn_backend to 'triton' or 'tlx' \\(got 'fa2'\\)"):
        RankingModelConfig(attn_backend="fa2", fused_attention=True, attention_sublayer_plan="blocks")


@pytest.mark.parametrize("attribute", FUSED_SWITCHES.values())
def test_fused_sublayers_follow_the_attention_backend(attribute):
    assert getattr(RankingModelConfig(attn_backend="tlx"), attribute) == "tlx"
    assert getattr(RankingModelConfig(attn_backend="triton"), attribute) == "triton"
    # fa2 has no sublayer kernels: the fastest that runs.
    assert getattr(RankingModelConfig(attn_backend="fa2"), attribute) == "auto"


def test_same_batch_gives_bitwise_equal_gradients(model):
    """Same-seed runs on one CPU must be bitwise equal: no backward may sum in a thread-dependent order
    (an indexed read's backward accumulates with atomic adds across threads; this batch is large
    enough for its rows to be split between two)."""
    generator = torch.Generator().manual_seed(1)
    batch = make_batch(torch.randint(20, 100, (256,), generator=generator).tolist(),
                       torch.randint(0, 8, (256,), generator=generator).tolist())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gradients = []
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            logits, _ = model(batch)
            model.loss(logits, batch.labels).backward()
            gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    finally:
        torch.set_num_threads(threads)
    for repeat in gradients[1:]:
        assert [name for name in repeat if not torch.equal(repeat[name], gradients[0][name])] == []


def test_memory_estimate_counts_adamw_state_and_refuses_what_does_not_fit():
    """24 bytes a trainable parameter plus activations; check_fits refuses past the limit (the held
    weights counted once) and passes at it."""
    from models import memory

    net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2, bias=False))
    net[1].weight.requires_grad_(False)
    estimate = memory.estimate_training_memory(net, tokens_per_batch=3, d_model=4, num_layers=2, mlp_ratio=4)
    assert estimate.parameters == 110
    assert estimate.training_state_bytes == 110 * 24
    assert estimate.activation_bytes == 3 * (9 + 8) * 4 * 2 * 4
    held = 4 * 110
    memory.check_fits(estimate, estimate.total_bytes - held, held, "the test")
    with pytest.raises(ValueError, match=r"needs about .*\(110 parameters x 24 bytes.*the test has.*Make the tables smaller"):
        memory.check_fits(estimate, estimate.total_bytes - held - 1, held, "the test")
    # Where activations are most of it, the advice is the batch, not the tables.
    batch = memory.estimate_training_memory(net, tokens_per_batch=1000, d_model=4, num_layers=2, mlp_ratio=4)
    with pytest.raises(ValueError, match=r"Most of it is activations: make data.batch_size smaller"):
        memory.check_fits(batch, batch.total_bytes - held - 1, held, "the test")


def test_available_memory_reads_meminfo(tmp_path):
    from models import memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   12345 kB\n")
    assert memory.available_bytes(torch.device("cpu"), meminfo) == 12345 * 1024
    assert memory.available_bytes(torch.device("cpu"), tmp_path / "none") is None


@pytest.mark.parametrize("readout, target", [("fields", None), ("fields_dot", None), ("mean", "ad"),
                                             ("fields", "ad"), ("fields_dot", "user")])
def test_readout_reads_each_samples_fixed_tokens_target_attention_and_mean(readout, target):
    """readout="fields": the head reads sample b's fixed tokens after the final norm, side by side, then
    the mean of all its tokens, with the token count padded (a pad sequence after the samples);
    "fields_dot" then also every pair's dot product / sqrt(d_model), pairs in row-major order.
    target_attention_feature: one more field after the fixed ones (the only one under "mean"), the softmax-
    weighted sum of the sample's history item tokens, each weighted by its dot with the named feature's token
    through the query map, / sqrt(d_model); zeros for the sample without history items."""
    torch.manual_seed(0)
    model = RankingModel(SCHEMA, dataclasses.replace(CONFIG, readout=readout, pad_tokens_to=64,
                                                     target_attention_feature=target))
    seen = {}
    model.tower.final_norm.register_forward_hook(lambda module, args, out: seen.update(x=out.detach()))
    model.tower.head.register_forward_pre_hook(lambda module, args: seen.update(head_input=args[0].detach()))
    clicks, views = [0, 70, 3, 12, 0], [2, 0, 5, 8, 0]
    logits, _ = model(make_batch(clicks_lengths=clicks, views_lengths=views))
    lengths = [FIXED_TOKENS + c + v for c, v in zip(clicks, views)]
    starts = torch.tensor([0, *lengths]).cumsum(0)
    d = CONFIG.d_model

    def expected_row(start, length):
        tokens = seen["x"][start:start + length]
        fields = list(tokens[:FIXED_TOKENS]) if readout != "mean" else []
        if target is not None:
            query = model.tower.target_query(tokens[CONFIG.n_dense_tokens + SCHEMA.categorical_names.index(target)])
            items = tokens[FIXED_TOKENS:]
            weights = torch.softmax(items @ query / d ** 0.5, 0)
            fields.append(weights @ items if len(items) else torch.zeros(d))
        row = [*fields, tokens.mean(0)]
        if readout == "fields_dot":
            row.append(torch.stack([fields[i] @ fields[j] / d ** 0.5
                                    for i in range(len(fields)) for j in range(i + 1, len(fields))]))
        return torch.cat(row).detach()

    expected = torch.stack([expected_row(start, length) for start, length in zip(starts.tolist(), lengths)])
    num_fields = (FIXED_TOKENS if readout != "mean" else 0) + (target is not None)
    pairs = num_fields * (num_fields - 1) // 2 if readout == "fields_dot" else 0
    assert seen["head_input"].shape == (5, (num_fields + 1) * d + pairs)
    torch.testing.assert_close(seen["head_input"], expected)
    if target is not None:  # the empty history's field
        empty = seen["head_input"][4, (num_fields - 1) * d:num_fields * d]
        assert torch.equal(empty, torch.zeros(d))
    assert logits.shape == (5,) and torch.isfinite(logits).all()


def test_target_attention_trains_its_query_and_reads_every_block_of_the_history():
    """The candidate's pooled field reads history items beyond its own 64-token block (which block attention
    alone never lets it see): changing only an item in a sample's third block changes it, with no attention
    layers at all; the query map gets a gradient."""
    torch.manual_seed(0)
    model = RankingModel(SCHEMA, dataclasses.replace(CONFIG, num_layers=0, readout="fields",
                                                     target_attention_feature="ad"))
    seen = []
    model.tower.head.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    batch = make_batch(clicks_lengths=[100, 3], views_lengths=[8, 0])
    logits, _ = model(batch)
    model.loss(logits, batch.labels).backward()
    assert model.tower.target_query.weight.grad.abs().sum() > 0
    with torch.no_grad():
        values = batch.sequence.values().clone()
        values[90] = (values[90] + 1) % 17  # sample 0's click 90: token 94, block 1, not the candidate's block 0
        changed = dataclasses.replace(batch, sequence=KeyedJaggedTensor(
            keys=batch.sequence.keys(), values=values, lengths=batch.sequence.lengths(), stride=2))
        model(changed)
    target_field = slice(FIXED_TOKENS * CONFIG.d_model, (FIXED_TOKENS + 1) * CONFIG.d_model)
    assert not torch.equal(seen[0][0, target_field], seen[1][0, target_field])
    assert torch.equal(seen[0][1], seen[1][1])  # the other sample's row: its items did not change


@pytest.mark.parametrize("config, schema, message", [
    ({"target_attention_feature": "item"}, SCHEMA, r"'item' is not a categorical feature of this data; it has \['user', 'ad'\]"),
    ({"target_attention_feature": "ad"}, dataclasses.replace(SCHEMA, sequence=()), "no sequence feature"),
])
def test_target_attention_names_a_categorical_feature_of_data_with_history(config, schema, message):
    with pytest.raises(ValueError, match=message):
        RankingModel(schema, dataclasses.replace(CONFIG, **config))


def test_target_attention_needs_history_item_tokens():
    with pytest.raises(ValueError, match="history_tokens='mean' makes none"):
        RankingModelConfig(target_attention_feature="ad", history_tokens="mean")


@pytest.mark.parametrize("token_init", ["unit_slots", "small_slots"])
def test_small_slots_let_a_token_start_as_its_features_value(token_init):
    """At initialization, what share of a categorical token's (squared) size varies with the feature's value?
    With tables as large as MovieLens-1M's, torchrec starts the rows within +-1/sqrt(rows) (~0.013): next to
    N(0, 1) slot vectors and nn.Linear's bias the value is ~0.002% of the token; with small_slots ~9% here."""
    torch.manual_seed(0)
    schema = dataclasses.replace(SCHEMA, categorical=(("user", 6040), ("ad", 3706)))
    model = RankingModel(schema, dataclasses.replace(CONFIG, token_init=token_init))
    lengths = [3] * 64
    tokens = model.build_tokens(make_batch(clicks_lengths=lengths, views_lengths=lengths))
    user = tokens.values[tokens.offsets[:-2].long() + CONFIG.n_dense_tokens]  # each sample's user token
    share = (user - user.mean(0)).pow(2).sum(1).mean() / user.pow(2).sum(1).mean()
    if token_init == "unit_slots":
        assert share < 1e-4
    else:
        assert share > 0.03
        assert model.tower.embedding_proj.bias.abs().max() == 0
