"""Synthetic ads-CTR data with a planted rule that only feature interactions can learn.

Each sample has Criteo-like heavy-tailed counts (some missing), Zipf-popular
hashed categoricals, a candidate ``item`` and a jagged ``history`` of item ids.
The click logit is

    bias + W_PAIR * <u[user_group], v[ad_campaign]>          (two-categorical interaction)
         + W_MATCH * (share of history items in the candidate item's cluster)  (item x history)
         + W_DENSE * zscore(dense_0)                          (a plain main effect)

with hidden per-id vectors u, v and a hidden item -> cluster map. Histories are
drawn mostly from a per-row interest cluster, which is the candidate's cluster for
half the rows, so the match share is informative. Neither interaction term has a
main effect, so a model without interactions (e.g. logistic regression) mostly
sees the dense term.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data.registry import DataArgs, DatasetSpec
from data.schema import LABEL, FeatureSchema, signed_log1p
from data.storage import META_FILE, keyed_folder, write_prepared

# Bump when the generated data changes, so cached files from older code are not reused.
GENERATOR_VERSION = 2

_NUM_CLUSTERS = 10
_LATENT_DIM = 4
_ZIPF_EXPONENT = 1.1
# The interacting pair uses this many distinct ids of its table, so their hidden vectors are learnable from ~30k rows.
_PAIR_CARDINALITY = 100
_MISSING_RATE = 0.1
_EMPTY_HISTORY_RATE = 0.1
_HISTORY_FROM_INTEREST = 0.7
_INTEREST_MATCHES_CANDIDATE = 0.5
_BASE_CTR = 0.25
_W_PAIR = 0.6
_W_MATCH = 4.0
_W_DENSE = 0.5

PLANTED_CATEGORICALS = ("user_group", "ad_campaign", "item")
HISTORY = "history"


@dataclass(frozen=True)
class SyntheticConfig:
    num_train: int = 32768
    num_val: int = 4096
    num_dense: int = 8
    num_categorical: int = 6  # the first three are user_group, ad_campaign, item
    vocab_size: int = 1000  # table size of every categorical except item
    num_items: int = 200  # table size of item and history
    max_history_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "num_train": self.num_train >= 1,
            "num_val": self.num_val >= 1,
            "num_dense": self.num_dense >= 1,
            "num_categorical": self.num_categorical >= len(PLANTED_CATEGORICALS),
            "vocab_size": self.vocab_size >= 2,
            "num_items": self.num_items >= _NUM_CLUSTERS,
            "max_history_len": self.max_history_len >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"SyntheticConfig: invalid {', '.join(f'{name}={getattr(self, name)}' for name in bad)} "
                f"(need num_train, num_val, num_dense, max_history_len >= 1, num_categorical >= 3, "
                f"vocab_size >= 2, num_items >= {_NUM_CLUSTERS})"
            )

    def cache_key(self) -> dict:
        return {"generator_version": GENERATOR_VERSION, **asdict(self)}


def synthetic_schema(config: SyntheticConfig) -> FeatureSchema:
    extra = tuple((f"cat_{i}", config.vocab_size) for i in range(len(PLANTED_CATEGORICALS), config.num_categorical))
    return FeatureSchema(
        dense=tuple(f"dense_{i}" for i in range(config.num_dense)),
        categorical=(
            ("user_group", config.vocab_size),
            ("ad_campaign", config.vocab_size),
            ("item", config.num_items),
        )
        + extra,
        sequence=((HISTORY, config.num_items, config.max_history_len),),
    )


def _zipf_sampler(rng: np.random.Generator, table_size: int, num_used: int | None = None):
    """Zipf-like popularity over num_used random ids of the table (popular ids are not just 0, 1, 2...)."""
    num_used = table_size if num_used is None else min(num_used, table_size)
    weights = 1.0 / np.arange(1, num_used + 1) ** _ZIPF_EXPONENT
    cumulative = np.cumsum(weights / weights.sum())
    ids_by_rank = rng.permutation(table_size)[:num_used]

    def sample(size: int) -> np.ndarray:
        ranks = np.minimum(np.searchsorted(cumulative, rng.random(size)), num_used - 1)
        return ids_by_rank[ranks]

    return sample


def _items_in_clusters(rng: np.random.Generator, clusters: np.ndarray, items_by_cluster, cluster_starts, cluster_sizes):
    # Squaring a uniform skews picks toward each cluster's first items: popular items, seen often enough to learn.
    picks = (rng.random(clusters.size) ** 2 * cluster_sizes[clusters]).astype(np.int64)
    return items_by_cluster[cluster_starts[clusters] + picks]


def _calibrated_bias(logits: np.ndarray, target_rate: float) -> float:
    low, high = -20.0, 20.0
    for _ in range(60):
        mid = (low + high) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < target_rate:
            low = mid
        else:
            high = mid
    return (low + high) / 2


@dataclass
class SyntheticData:
    train: pa.Table
    validation: pa.Table
    # Planted terms per row (train rows then validation rows), for tests and analysis only.
    pair_term: np.ndarray
    match_term: np.ndarray
    click_probability: np.ndarray


def generate(config: SyntheticConfig) -> SyntheticData:
    rng = np.random.default_rng(config.seed)
    n = config.num_train + config.num_val
    schema = synthetic_schema(config)

    # Heavy-tailed counts: lognormal with a per-feature scale, floored to integers.
    scales = rng.uniform(0.5, 2.5, size=config.num_dense)
    raw_counts = np.floor(np.exp(rng.normal(0.0, 1.0, size=(n, config.num_dense)) * scales + scales))
    raw_counts[rng.random(raw_counts.shape) < _MISSING_RATE] = np.nan
    dense = signed_log1p(raw_counts)

    categorical = {}
    for name, num_embeddings in schema.categorical:
        if name != "item":
            num_used = _PAIR_CARDINALITY if name in PLANTED_CATEGORICALS[:2] else None
            categorical[name] = _zipf_sampler(rng, num_embeddings, num_used)(n)

    item_cluster = rng.permutation(np.arange(config.num_items) % _NUM_CLUSTERS)  # balanced, none empty
    items_by_cluster = rng.permutation(config.num_items)
    items_by_cluster = items_by_cluster[np.argsort(item_cluster[items_by_cluster], kind="stable")]
    cluster_sizes = np.bincount(item_cluster, minlength=_NUM_CLUSTERS)
    cluster_starts = np.concatenate([[0], np.cumsum(cluster_sizes)[:-1]])
    popular_item = _zipf_sampler(rng, config.num_items)
    # The candidate is drawn the same way for every row, and the interest behind the history matches its
    # cluster at a fixed rate, so no single item (candidate or in a history) predicts the label on its own.
    candidate = popular_item(n)
    categorical["item"] = candidate
    interest = np.where(
        rng.random(n) < _INTEREST_MATCHES_CANDIDATE, item_cluster[candidate], rng.integers(_NUM_CLUSTERS, size=n)
    )

    median_length = max(1.0, config.max_history_len / 5)
    lengths = np.clip(np.round(np.exp(rng.normal(np.log(median_length), 0.9, size=n))), 1, config.max_history_len)
    lengths[rng.random(n) < _EMPTY_HISTORY_RATE] = 0
    lengths = lengths.astype(np.int64)
    token_rows = np.repeat(np.arange(n), lengths)
    history = popular_item(token_rows.size)
    token_from_interest = rng.random(token_rows.size) < _HISTORY_FROM_INTEREST
    history[token_from_interest] = _items_in_clusters(
        rng, interest[token_rows[token_from_interest]], items_by_cluster, cluster_starts, cluster_sizes
    )

    # Centered over the rows so that no user_group or ad_campaign id has a main effect, only the pair.
    user_vectors = rng.normal(size=(config.vocab_size, _LATENT_DIM))
    user_vectors -= user_vectors[categorical["user_group"]].mean(axis=0)
    ad_vectors = rng.normal(size=(config.vocab_size, _LATENT_DIM))
    ad_vectors -= ad_vectors[categorical["ad_campaign"]].mean(axis=0)
    pair = np.einsum("nd,nd->n", user_vectors[categorical["user_group"]], ad_vectors[categorical["ad_campaign"]])
    same_cluster = item_cluster[history] == item_cluster[candidate[token_rows]]
    match = np.bincount(token_rows, weights=same_cluster, minlength=n) / np.maximum(lengths, 1)
    dense_signal = dense[:, 0]
    dense_z = (dense_signal - dense_signal.mean()) / max(dense_signal.std(), 1e-6)
    logits = _W_PAIR * pair + _W_MATCH * match + _W_DENSE * dense_z
    logits = logits + _calibrated_bias(logits, _BASE_CTR)
    probability = 1.0 / (1.0 + np.exp(-logits))
    labels = (rng.random(n) < probability).astype(np.float32)

    offsets = np.concatenate([[0], np.cumsum(lengths)])
    columns: dict[str, pa.Array] = {}
    for i, name in enumerate(schema.dense):
        columns[name] = pa.array(dense[:, i])
    for name in schema.categorical_names:
        columns[name] = pa.array(categorical[name].astype(np.int64))
    columns[HISTORY] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(history.astype(np.int64)))
    columns[LABEL] = pa.array(labels)
    table = pa.table(columns, schema=schema.features().arrow_schema)

    return SyntheticData(
        train=table.slice(0, config.num_train),
        validation=table.slice(config.num_train),
        pair_term=pair,
        match_term=match,
        click_probability=probability,
    )


def synthetic_folder(config: SyntheticConfig, root: str | Path) -> Path:
    """Where ensure_synthetic() puts the prepared folder for this config."""
    return keyed_folder(root, "synthetic", config.cache_key())


def ensure_synthetic(config: SyntheticConfig, root: str | Path) -> Path:
    """Generate the prepared folder for this config under root unless it already exists."""
    folder = synthetic_folder(config, root)
    if (folder / META_FILE).exists():
        return folder
    data = generate(config)
    write_prepared(
        folder, {"train": data.train, "validation": data.validation}, synthetic_schema(config),
        source="synthetic", config=config.cache_key(),
    )  # fmt: skip
    return folder


def synthetic_config(args: DataArgs) -> SyntheticConfig:
    return SyntheticConfig(
        num_train=args.num_train, num_val=args.num_val, num_dense=args.num_dense, num_categorical=args.num_categorical,
        vocab_size=args.vocab_size, num_items=args.num_items, max_history_len=args.max_history_len, seed=args.seed,
    )


DATASET = DatasetSpec(
    schema=lambda args: synthetic_schema(synthetic_config(args)),
    folder=lambda args: synthetic_folder(synthetic_config(args), args.data_dir),
    prepare=lambda args: ensure_synthetic(synthetic_config(args), args.data_dir),
    generated=True,
)
