"""Where a run resumed from a checkpoint continues, and whether this config may resume it.

A checkpoint inside a run folder (<runs_dir>/<run_name>/version_N/checkpoints/) continues in that
folder, whatever --runs_dir and --run_name say, unless the folder's last.ckpt is further on: then
resuming the earlier checkpoint is a rewind, and it trains into a new version of the run, so the
folder's later checkpoints and metrics rows stay as they were. Before anything is written, the config
is compared with the checkpoint's: a different network, data stream or optimizer setting would fail
to load, train another model, or be silently replaced by the checkpoint's optimizer state."""

from dataclasses import dataclass
from pathlib import Path

import models.sharding as sharding
from data.schema import FeatureSchema
from models import RankingModelConfig
from models.baselines import BLOCK_ATTENTION

LAST = "last.ckpt"
# The optimizer's state in a checkpoint holds these per parameter group (and the schedule its base
# learning rate): a resumed run would train with the checkpoint's values whatever the config says.
OPTIMIZER_STATE_FIELDS = ("lr", "weight_decay")


@dataclass(frozen=True)
class ResumePlan:
    ckpt_path: str  # the checkpoint itself, "last" resolved
    metadata: dict  # its non-tensor entries (global_step, hyper_parameters, the data module's state), read once
    run_folder: Path | None  # the version_N folder holding the checkpoint, if it sits in one
    rewind_of: int | None = None  # the step of that folder's last.ckpt, when the checkpoint is an earlier one

    @property
    def step(self) -> int:
        return int(self.metadata["global_step"])

    @property
    def in_place(self) -> bool:
        return self.run_folder is not None and self.rewind_of is None


def run_folder_of(ckpt_path: str | Path) -> Path | None:
    """The version_N run folder whose checkpoints/ holds this checkpoint (a file, or the torchrec
    strategy's folder), or None."""
    path = Path(ckpt_path).resolve()
    folder = path.parent.parent
    return folder if path.parent.name == "checkpoints" and folder.name.startswith("version_") else None


def read_checkpoint_metadata(ckpt_path: str) -> dict:
    """A checkpoint's metadata, checked readable and Lightning's; ValueError naming the problem otherwise."""
    if not Path(ckpt_path).exists():
        raise ValueError(f"--ckpt_path {ckpt_path}: no such checkpoint")
    try:
        metadata = sharding.checkpoint_metadata(ckpt_path)
    except Exception as error:  # torch.load's errors for a truncated or foreign file vary by cause
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--ckpt_path {ckpt_path}: not a readable checkpoint ({reason})") from None
    if not isinstance(metadata, dict) or "global_step" not in metadata:
        raise ValueError(f"--ckpt_path {ckpt_path}: not a Lightning checkpoint (it has no global_step)")
    return metadata


def plan_resume(ckpt_path: str, run_root: Path) -> ResumePlan:
    """The checkpoint --ckpt_path names ("last": the newest last.ckpt under run_root) and where its run goes on."""
    if ckpt_path == "last":
        candidates = sorted(run_root.glob(f"version_*/checkpoints/{LAST}"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise ValueError(f"--ckpt_path last: no version_*/checkpoints/{LAST} under {run_root} "
                             f"(set --run_name and --runs_dir to the run's, or give the checkpoint's path)")
        ckpt_path = str(candidates[-1])
    metadata = read_checkpoint_metadata(ckpt_path)
    folder = run_folder_of(ckpt_path)
    last = folder / "checkpoints" / LAST if folder is not None else None
    if last is not None and last.exists() and last.resolve() != Path(ckpt_path).resolve():
        last_step = int(sharding.checkpoint_metadata(last)["global_step"])
        if last_step > int(metadata["global_step"]):
            return ResumePlan(ckpt_path, metadata, folder, rewind_of=last_step)
    return ResumePlan(ckpt_path, metadata, folder)


def _differences(prefix: str, saved: dict, current: dict, keys) -> list[str]:
    return [f"{prefix}.{key}: {saved[key]!r} in the checkpoint, {current.get(key)!r} now"
            for key in keys if key in saved and saved[key] != current.get(key)]


def config_differences(metadata: dict, hparams: dict, data_stream: dict) -> list[str]:
    """hparams: the task's (LightningModule.hparams: plain dicts, as the checkpoint holds them). What in this config differs from the checkpoint's where a resumed run must keep the checkpoint's:
    the network (all of model.net but RankingModelConfig.EXECUTION_FIELDS), its architecture and
    features, the optimizer settings its state holds, and the training data's stream (a checkpoint
    from before the data module saved it has none to compare)."""
    saved = metadata.get("hyper_parameters") or {}
    differences = _differences("model", saved, hparams, ["arch"])
    if "schema" in saved and saved["schema"] != hparams.get("schema"):  # the data's features, as the tables are sized
        differences += [f"data features: {difference} (checkpoint vs now)" for difference in
                        FeatureSchema.from_dict(saved["schema"]).differences(FeatureSchema.from_dict(hparams["schema"]))]
    # The network's own settings: model.net's for the block-attention model, model.baseline's for a baseline.
    network = "net" if saved.get("arch", BLOCK_ATTENTION) == BLOCK_ATTENTION else "baseline"
    if network in saved:
        skip = RankingModelConfig.EXECUTION_FIELDS if network == "net" else ()
        differences += _differences(f"model.{network}", saved[network], hparams[network],
                                    [key for key in saved[network] if key not in skip])
    if "optim" in saved:
        differences += _differences("model.optim", saved["optim"], hparams["optim"], OPTIMIZER_STATE_FIELDS)
    saved_stream = (metadata.get("CTRDataModule") or {}).get("data_stream")
    if saved_stream:
        differences += _differences("data", saved_stream, data_stream, list(saved_stream))
    return differences
