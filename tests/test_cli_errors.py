"""Bad input to the command lines (train.py, python -m data.prepare): each exits 2 with one line naming
the problem, no traceback, and leaves no empty run folder behind."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.compare.run import run_train_mains
from test_data_real import criteo_line, random_criteo_lines

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A good Criteo file prepared with table size 1000, a malformed one, a CSV with a header, a file that
    is no checkpoint, and a run folder with no checkpoint."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "good.tsv").write_text("\n".join(random_criteo_lines(40, seed=0)) + "\n")
    (root / "malformed.tsv").write_text("\n".join([*random_criteo_lines(5, seed=1), criteo_line(label="2")]) + "\n")
    header = "label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    (root / "header.csv").write_text(header + "\n" + criteo_line().replace("\t", ",") + "\n")
    (root / "garbage.ckpt").write_bytes(b"not a checkpoint")
    (root / "exists").mkdir()
    (root / "misspelled.yaml").write_text("model:\n  net:\n    d_modle: 32\n")
    (root / "python_tag.yaml").write_text(f"run_name: !!python/object/apply:os.system ['touch {root / 'executed'}']\n")
    prepared = subprocess.run(
        [sys.executable, "-m", "data.prepare", "criteo", "--input", str(root / "good.tsv"),
         "--out", str(root / "criteo"), "--table-size", "1000"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    return root


TRAIN = [sys.executable, "train.py", "--config", "configs/tiny.yaml"]
PREPARE = [sys.executable, "-m", "data.prepare", "criteo"]
CASES = {
    "missing checkpoint": (TRAIN + ["--ckpt_path={root}/missing.ckpt"], "{root}/missing.ckpt: no such checkpoint"),
    "no checkpoint to resume": (TRAIN + ["--ckpt_path=last"], "last: no version_*/checkpoints/last.ckpt under"),
    "unreadable checkpoint": (TRAIN + ["--ckpt_path={root}/garbage.ckpt"], "garbage.ckpt: not a readable checkpoint"),
    "vocab_size mismatch": (
        TRAIN + ["--data.dataset=criteo", "--data.data_dir={root}/criteo", "--data.vocab_size=100"],
        "(prepared vs arguments): categorical 'C1' num_embeddings 1000 vs 100, categorical 'C2' num_embeddings "
        "1000 vs 100, categorical 'C3' num_embeddings 1000 vs 100, ... (26 in all)",
    ),
    "criteo not prepared": (
        TRAIN + ["--data.dataset=criteo", "--data.data_dir={root}/nothing"], "holds no prepared Criteo data"
    ),
    "model too large for the memory limit": (
        TRAIN + ["--memory_limit_gib=0.001"],
        "this model needs about 4.5 MiB to train (25,441 parameters x 24 bytes",
    ),
    "no heads": (TRAIN + ["--model.net.num_heads=0"], "num_heads=0 must be >= 1"),
    "no token width": (TRAIN + ["--model.net.d_model=0"], "d_model=0 must be >= 1"),
    "negative learning rate": (TRAIN + ["--model.optim.lr=-1"], "got lr=-1"),
    "negative warmup": (TRAIN + ["--model.optim.warmup_steps=-5"], "got warmup_steps=-5"),
    "negative checkpoint interval": (
        TRAIN + ["--checkpoint.every_n_steps=-3"], "checkpoint.every_n_steps and checkpoint.every_minutes must be >= 0"
    ),
    "no steps to train": (TRAIN + ["--trainer.max_steps=0"], "trainer.max_steps=0 trains nothing"),
    "data_dir that is a file": (TRAIN + ["--data.data_dir={root}/garbage.ckpt"], "data.data_dir={root}/garbage.ckpt: "),
    "runs_dir that is a file": (TRAIN + ["--runs_dir={root}/garbage.ckpt"], "garbage.ckpt is a file, not a folder"),
    "misspelled key": (TRAIN + ["--model.net.num_layerz=1"], "num_layerz=1 (python train.py --help lists every key)"),
    "misspelled key in a config file": (
        TRAIN + ["--config={root}/misspelled.yaml"], "Group 'model' does not accept option 'net.d_modle'"
    ),
    "a config with a python object tag": (  # rejected, not executed (test_a_python_object_tag_is_not_executed)
        TRAIN + ["--config={root}/python_tag.yaml"], "could not determine a constructor for the tag"
    ),
    "precision the model cannot train under": (
        TRAIN + ["--trainer.precision=16-true"], "trainer.precision=16-true is not one this model trains under"
    ),
    "gradient accumulation": (
        TRAIN + ["--trainer.accumulate_grad_batches=4"],
        "trainer.accumulate_grad_batches=4 is not supported: the logged loss would be divided by it",
    ),
    "zero logging and validation intervals": (
        TRAIN + ["--trainer.log_every_n_steps=0", "--trainer.val_check_interval=0"],
        "trainer.log_every_n_steps=0 must be >= 1; trainer.val_check_interval=0 must be > 0",
    ),
    "heads that do not divide d_model": (TRAIN + ["--model.net.num_heads=3"], "d_model=32 is not divisible by num_heads=3"),
    "features set by hand": (TRAIN + ["--model.schema.dense=[]"], "unrecognized arguments: --model.schema.dense=[]"),
    "unknown attention backend": (
        TRAIN + ["--attn=cuda"], "'auto', 'reference', 'fa2', 'flex', 'triton', 'tlx']. Got value: cuda"
    ),
    "attention backend that cannot take the model's heads": (
        TRAIN + ["--attn=triton"],  # tiny.yaml's 2 heads of 16 (the test suite sets TRITON_INTERPRET=1)
        "block_attention backend 'triton' does not support head_dim 16 (the Triton kernels take 32, 64, 128), as "
        "this model (model.net.d_model=32, num_heads=2) under trainer.precision=32-true would call it",
    ),
    "optimizer CUDA graph without a GPU": (
        TRAIN + ["--model.optim.cuda_graph=true"],
        "model.optim.cuda_graph=true cannot train here: the device is not a CUDA GPU",
    ),
    "unknown sharding type": (
        TRAIN + ["--sharding.sharding_type=diagonal"],
        "'table_wise', 'row_wise', 'column_wise', 'data_parallel']. Got value: diagonal",
    ),
    **({} if torch.cuda.is_available() else {"the GPU config on a machine without one": (
        TRAIN + ["--config", "configs/gpu.yaml"],
        "trainer.accelerator is 'gpu' (configs/gpu.yaml sets it) but this machine has no CUDA GPU",
    )}),
    "malformed line, --strict": (
        PREPARE + ["--input={root}/malformed.tsv", "--out={root}/out", "--strict"],
        "malformed line 6: column label value '2' is not 0 or 1",
    ),
    "output folder exists": (PREPARE + ["--input={root}/good.tsv", "--out={root}/exists"], "exists already exists"),
    "missing input": (PREPARE + ["--input={root}/missing.tsv", "--out={root}/out"], "missing.tsv: no such file"),
    "comma-separated with a header": (
        PREPARE + ["--input={root}/header.csv", "--out={root}/out"],
        "line 1 is comma-separated, 40 fields (a header): 'label,I1,I2,",
    ),
}


@pytest.fixture(scope="module")
def train_cases(inputs, tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """{case: (exit code, stderr, its runs_dir)} of every train.py case, all run in one process (the
    comparison's runner: each case through train.main with stdout and stderr of its own)."""
    root = tmp_path_factory.mktemp("train_cases")
    argvs, runs = {}, {}
    for index, (name, (command, _)) in enumerate(CASES.items()):
        if command[1] != "train.py":
            continue
        argvs[name] = [part.format(root=inputs) for part in command[2:]]
        runs[name] = root / f"case{index}" / "runs"
        if not any(part.startswith("--runs_dir") for part in argvs[name]):
            argvs[name].append(f"--runs_dir={runs[name]}")
    results = run_train_mains(list(argvs.values()), timeout=900)
    return {name: (code, stderr, runs[name]) for name, (code, _, stderr) in zip(argvs, results)}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_exits_2_with_one_line_naming_the_problem(inputs, train_cases, tmp_path, name):
    command, message = CASES[name]
    if command[1] == "train.py":
        returncode, stderr, runs = train_cases[name]
    else:
        command = [part.format(root=inputs) for part in command]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
        returncode, stderr, runs = result.returncode, result.stderr, tmp_path / "runs"
    assert returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message.format(root=inputs) in last, last
    assert not runs.exists()  # no empty run folder
    assert not (inputs / "out").exists()


def test_a_python_object_tag_is_not_executed(inputs, train_cases):
    assert train_cases["a config with a python object tag"][0] == 2
    assert not (inputs / "executed").exists()
