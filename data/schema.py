"""Feature schema shared by every dataset and by the models.

A prepared split is a table with one column per schema feature plus ``label``:
dense features are float32 (already normalized), categoricals are integer ids,
sequence features are lists of integer ids, ``label`` is float32 0/1.
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import numpy as np

LABEL = "label"


@dataclass(frozen=True)
class FeatureSchema:
    dense: tuple[str, ...]
    categorical: tuple[tuple[str, int], ...]
    sequence: tuple[tuple[str, int, int], ...]

    def __post_init__(self) -> None:
        names = self.column_names
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"FeatureSchema: duplicate feature names {duplicates}")
        if LABEL in names:
            raise ValueError(f"FeatureSchema: {LABEL!r} is reserved for the label column")
        for name, num_embeddings in self.categorical:
            if num_embeddings < 1:
                raise ValueError(f"FeatureSchema: categorical {name!r} has num_embeddings={num_embeddings}, need >= 1")
        for name, num_embeddings, max_len in self.sequence:
            if num_embeddings < 1 or max_len < 1:
                raise ValueError(
                    f"FeatureSchema: sequence {name!r} has num_embeddings={num_embeddings}, max_len={max_len}; "
                    "both must be >= 1"
                )

    @property
    def categorical_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.categorical)

    @property
    def sequence_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.sequence)

    @property
    def column_names(self) -> tuple[str, ...]:
        return self.dense + self.categorical_names + self.sequence_names

    def differences(self, other: FeatureSchema) -> list[str]:
        """What differs from `other`, one item per feature, e.g. "categorical 'C1' num_embeddings 1000 vs 100"."""
        def sizes(schema: FeatureSchema) -> dict[str, tuple]:
            return {**{name: ("dense",) for name in schema.dense},
                    **{name: ("categorical", n) for name, n in schema.categorical},
                    **{name: ("sequence", n, max_len) for name, n, max_len in schema.sequence}}

        mine, theirs = sizes(self), sizes(other)
        fields = {"categorical": ("num_embeddings",), "sequence": ("num_embeddings", "max_len"), "dense": ()}
        found = [f"{name!r} only in the first" for name in mine if name not in theirs]
        found += [f"{name!r} only in the second" for name in theirs if name not in mine]
        for name in (n for n in mine if n in theirs and mine[n] != theirs[n]):
            if mine[name][0] != theirs[name][0]:
                found.append(f"{name!r} is {mine[name][0]} vs {theirs[name][0]}")
                continue
            found += [f"{mine[name][0]} {name!r} {field} {a} vs {b}"
                      for field, a, b in zip(fields[mine[name][0]], mine[name][1:], theirs[name][1:]) if a != b]
        if not found and self.column_names != other.column_names:
            found.append("the same features in another order")
        return found

    def features(self) -> datasets.Features:
        """The on-disk column types; every writer uses this so all datasets agree."""
        columns: dict[str, datasets.features.FeatureType] = {}
        for name in self.dense:
            columns[name] = datasets.Value("float32")
        for name, _ in self.categorical:
            columns[name] = datasets.Value("int64")
        for name, _, _ in self.sequence:
            columns[name] = datasets.List(datasets.Value("int64"))
        columns[LABEL] = datasets.Value("float32")
        return datasets.Features(columns)

    def to_dict(self) -> dict:
        return {
            "dense": list(self.dense),
            "categorical": [list(item) for item in self.categorical],
            "sequence": [list(item) for item in self.sequence],
        }

    @classmethod
    def from_dict(cls, spec: dict) -> "FeatureSchema":
        return cls(
            dense=tuple(spec["dense"]),
            categorical=tuple((str(name), int(size)) for name, size in spec["categorical"]),
            sequence=tuple((str(name), int(size), int(max_len)) for name, size, max_len in spec["sequence"]),
        )


def signed_log1p(raw: np.ndarray) -> np.ndarray:
    """Normalize raw counts: sign(x) * log1p(|x|), missing (NaN) -> 0, as float32.

    Equals log1p(x) for the usual non-negative counts; the sign keeps Criteo's
    small negative values (-1, -2, -3) distinct from 0 instead of clamping them.
    """
    raw = np.asarray(raw, dtype=np.float64)
    normalized = np.sign(raw) * np.log1p(np.abs(raw))
    return np.nan_to_num(normalized, nan=0.0).astype(np.float32)
