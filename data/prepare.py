"""Prepare real datasets into the parquet layout the datamodule reads.

    python -m data.prepare criteo --input train.txt --out data/cache/criteo [--strict] [--table-size N] [--shard-rows N]
    python -m data.prepare movielens100k [--data-dir data/cache] [--max-history-len 256]
    python -m data.prepare movielens1m --protocol recbole_context [--seed 0]

MovieLens raw files are fetched into <data-dir>/raw/ml-100k/ (ml-1m/) unless already there.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from data.criteo import DEFAULT_TABLE_SIZE, prepare_criteo
from data.movielens import ML_100K, PROTOCOLS, MovieLensConfig, ensure_movielens
from data.movielens1m import ML_1M
from data.storage import read_meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="dataset", required=True)

    criteo = commands.add_parser("criteo", help="Criteo TSV (label, 13 integer, 26 hex columns) -> parquet shards")
    criteo.add_argument("--input", required=True, help="labeled Criteo TSV file, optionally .gz")
    criteo.add_argument("--out", required=True, help="output folder (must not exist); pass it as data.data_dir")
    criteo.add_argument("--strict", action="store_true", help="stop at the first malformed line instead of skipping")
    criteo.add_argument("--table-size", type=int, default=DEFAULT_TABLE_SIZE, help="rows per categorical table")
    criteo.add_argument("--shard-rows", type=int, default=1_000_000, help="rows per parquet shard")
    criteo.add_argument("--val-fraction", type=float, default=0.1, help="last fraction of lines used for validation")

    for release in (ML_100K, ML_1M):
        movielens = commands.add_parser(
            release.name, help=f"fetch {release.folder_name} (the {release.wheel} wheel) and build samples"
        )
        movielens.add_argument("--data-dir", default="data/cache", help="cache root (same as data.data_dir)")
        movielens.add_argument("--protocol", choices=PROTOCOLS, default=MovieLensConfig.protocol)
        movielens.add_argument("--max-history-len", type=int, default=MovieLensConfig.max_history_len,
                               help=f"{PROTOCOLS[0]} only; 0: no history feature")
        movielens.add_argument("--val-fraction", type=float, default=MovieLensConfig.val_fraction,
                               help=f"{PROTOCOLS[0]} only: validation's share of the ratings, by time")
        movielens.add_argument("--test-fraction", type=float, default=MovieLensConfig.test_fraction,
                               help=f"{PROTOCOLS[0]} only: the latest ratings' share, the test part")
        movielens.add_argument("--seed", type=int, default=MovieLensConfig.seed,
                               help=f"{PROTOCOLS[1]} only: the random split's seed (same as data.seed)")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        prepare(args)
    except (ValueError, OSError) as error:  # bad input, a missing file, an existing output folder
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def prepare(args: argparse.Namespace) -> None:
    if args.dataset == "criteo":
        summary = prepare_criteo(
            args.input, args.out, table_size=args.table_size, shard_rows=args.shard_rows,
            val_fraction=args.val_fraction, strict=args.strict,
        )  # fmt: skip
        print(json.dumps(summary.to_dict(), indent=2))
        print(f"prepared {args.out}; train with: data.dataset=criteo data.data_dir={args.out} "
              f"data.vocab_size={args.table_size}")  # fmt: skip
    else:
        config = MovieLensConfig(protocol=args.protocol, max_history_len=args.max_history_len,
                                 val_fraction=args.val_fraction, test_fraction=args.test_fraction, seed=args.seed)
        release = ML_1M if args.dataset == ML_1M.name else ML_100K
        folder = ensure_movielens(release, config, args.data_dir)
        print(json.dumps(read_meta(folder).get("rows"), indent=2))
        print(f"prepared {folder}")


if __name__ == "__main__":
    sys.exit(main())
