"""Loader throughput: samples/s from the prepared parquet files to collated Batch objects.

    python -m data.bench [--dataset synthetic] [--num-workers 0 2] [--batch-size 256] [--max-history-len 256]
"""

from __future__ import annotations

import argparse
import json
import time

from data.datamodule import CTRDataModule


def loader_throughput(module: CTRDataModule, epochs: int = 2) -> dict:
    """Time full shuffled training epochs after a warm-up batch (worker start-up is excluded)."""
    module.prepare_data()
    module.setup("fit")
    loader = module.train_dataloader()
    next(iter(loader))
    samples = tokens = 0
    start = time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            samples += batch.batch_size
            tokens += int(batch.sequence.values().numel())
    seconds = time.perf_counter() - start
    return {
        "num_workers": module.num_workers,
        "batch_size": module.batch_size,
        "samples_per_s": round(samples / seconds),
        "sequence_tokens_per_s": round(tokens / seconds),
        "mean_sequence_tokens_per_sample": round(tokens / samples, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--data-dir", default="data/cache")
    parser.add_argument("--num-workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-history-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    for num_workers in args.num_workers:
        module = CTRDataModule(
            dataset=args.dataset, data_dir=args.data_dir, batch_size=args.batch_size, num_workers=num_workers,
            max_history_len=args.max_history_len, vocab_size=args.vocab_size,
        )  # fmt: skip
        print(json.dumps({"dataset": args.dataset, **loader_throughput(module, args.epochs)}))


if __name__ == "__main__":
    main()
