"""The comparison's rules: which steps are timed, and when two backends' training counts as the same.

Pure functions of loss curves and final metrics (pandas), so they are tested on simulated curves.
"""

import math

import numpy as np
import pandas as pd

# Step time: the first steps compile kernels, autotune and warm the allocator.
WARMUP_MIN_STEPS = 20
WARMUP_FRACTION = 0.10
STEP_TIME_RULE = (
    f"step time (train.py's StepMetrics: from one training step's start to the next's, read from CUDA events, so "
    f"data loading and Lightning's work count) excludes the "
    f"first max({WARMUP_MIN_STEPS}, {WARMUP_FRACTION:.0%} of the steps) steps, at most half of them, which compile "
    "and autotune kernels; median and p90 over the remaining logged steps of every seed together"
)

# Parity. The tolerance is the seed band (min to max over seeds) widened twice over: in time, to
# the widest band within +-10% of the logged steps (where seed curves cross, the band at one step
# nearly vanishes), and by a factor, because 2-3 seeds estimate the noise roughly and the gap is
# checked at every step. On simulated curves (random-walk seed drift) this fails identical
# backends in ~0% of comparisons with 3 seeds and ~9% with 2, and catches a shift of twice the
# typical band about 80% of the time with 3 seeds. Final metrics: 3 pooled seed stds are 3.7
# standard errors of a difference of 3-seed means, which a t test with 4 degrees of freedom exceeds
# by chance ~2% of the time. The floors keep zero-noise cases (one seed, a deterministic CPU run)
# from demanding bit-identical results.
BAND_WINDOW_FRACTION = 0.10
LOSS_BAND_FACTOR = 1.5
LOSS_FLOOR = 0.002
FINAL_METRICS = ("auc", "ne", "logloss")
FINAL_STD_FACTOR = 3.0
FINAL_FLOOR = 0.002
PARITY_RULE = (
    "Baseline: fa2 if compared, else the first backend. Each run's per-step train loss is smoothed with a "
    "centered moving average over 2*floor(n/100)+1 of its n logged steps; a backend's seed band at a step is "
    f"the widest min-max spread over its seeds within +-{BAND_WINDOW_FRACTION:.0%} of the logged steps. Pass if "
    "(1) every run finished; (2) for every other backend, at every logged step after warmup, "
    f"|mean loss - baseline mean loss| <= {LOSS_BAND_FACTOR:g} x (the wider of the two backends' seed bands) + "
    f"{LOSS_FLOOR:g}; and (3) at the last validation, |mean - baseline mean| < "
    f"max({FINAL_FLOOR:g}, {FINAL_STD_FACTOR:g} x pooled seed std) for AUC, NE and log loss. Means are over "
    "seeds; every backend uses the same seeds, data and data order. Use 3 or more seeds: with 2 the band "
    "is a poor noise estimate."
)

def warmup_steps(steps: int) -> int:
    """Steps left out of step-time statistics and of the loss-curve check (see STEP_TIME_RULE)."""
    return min(max(WARMUP_MIN_STEPS, math.ceil(WARMUP_FRACTION * steps)), steps // 2)


def smooth(losses: pd.DataFrame) -> pd.DataFrame:
    """Centered moving average of each column (one per seed) over 2*floor(n/100)+1 logged steps."""
    window = 2 * (len(losses) // 100) + 1
    return losses.rolling(window, center=True, min_periods=1).mean()


def seed_band(smoothed: pd.DataFrame) -> pd.Series:
    """At each step, the widest min-max spread over seeds within +-BAND_WINDOW_FRACTION of the steps."""
    half_width = max(1, round(BAND_WINDOW_FRACTION * len(smoothed)))
    spread = smoothed.max(axis=1) - smoothed.min(axis=1)
    return spread.rolling(2 * half_width + 1, center=True, min_periods=1).max()


def loss_gap(smoothed: pd.DataFrame, smoothed_baseline: pd.DataFrame) -> tuple[pd.Series, pd.Series, pd.Series]:
    """(mean - baseline mean, seed band, tolerance) at the steps both have; inputs come from smooth()."""
    steps = smoothed.index.intersection(smoothed_baseline.index)
    a, b = smoothed.loc[steps], smoothed_baseline.loc[steps]
    band = np.maximum(seed_band(a), seed_band(b))
    return a.mean(axis=1) - b.mean(axis=1), band, LOSS_BAND_FACTOR * band + LOSS_FLOOR


def _pooled_std(*samples: pd.Series) -> float:
    variances = [s.var(ddof=1) for s in samples if len(s) >= 2]
    return float(math.sqrt(sum(variances) / len(variances))) if variances else 0.0


def parity_verdict(
    losses: dict[str, pd.DataFrame], finals: dict[str, pd.DataFrame], baseline: str, warmup: int,
    problems: list[str] = (),
) -> dict:
    """Applies PARITY_RULE.

    losses[label]: per-step train loss, index = step, one column per seed (unsmoothed).
    finals[label]: last-validation metrics, index = seed, columns FINAL_METRICS.
    problems: runs that did not finish, as sentences; any makes the verdict fail.
    """
    problems = list(problems)
    if len(losses) < 2:
        problems.append("fewer than two backends to compare")
    smoothed = {}
    for label, frame in losses.items():
        frame = frame.dropna()
        if frame.empty:
            problems.append(f"{label}: no finished run to compare")
        else:
            smoothed[label] = smooth(frame)
    per_backend = {}
    for label in losses:
        if label == baseline or label not in smoothed or baseline not in smoothed:
            continue
        gap, band, tolerance = loss_gap(smoothed[label], smoothed[baseline])
        after_warmup = gap.index >= warmup
        gap, band, tolerance = gap[after_warmup], band[after_warmup], tolerance[after_warmup]
        if gap.empty:
            problems.append(f"{label}: no logged step after warmup (step >= {warmup})")
            continue
        largest, worst = gap.abs().idxmax(), (gap.abs() / tolerance).idxmax()
        outside = gap.index[gap.abs() > tolerance]
        entry = {
            "max_loss_gap": float(gap[largest]), "at_step": int(largest),
            "band_at_step": float(band[largest]),
            "tolerance_at_step": float(tolerance[largest]),
            "worst_gap_over_tolerance": float(abs(gap[worst]) / tolerance[worst]), "worst_step": int(worst),
            "steps_checked": int(len(gap)), "steps_outside": int(len(outside)),
            "first_step_outside": int(outside[0]) if len(outside) else None,
            "loss_pass": not len(outside), "final": {},
        }
        for metric in FINAL_METRICS:
            ours = finals.get(label, pd.DataFrame()).get(metric, pd.Series(dtype=float)).dropna()
            theirs = finals.get(baseline, pd.DataFrame()).get(metric, pd.Series(dtype=float)).dropna()
            if ours.empty or theirs.empty:
                entry["final"][metric] = {"pass": False, "missing": True}
                continue
            difference = float(ours.mean() - theirs.mean())
            std = _pooled_std(ours, theirs)
            tolerance_final = max(FINAL_FLOOR, FINAL_STD_FACTOR * std)
            entry["final"][metric] = {
                "mean": float(ours.mean()), "baseline_mean": float(theirs.mean()), "diff": difference,
                "pooled_seed_std": std, "tolerance": tolerance_final, "pass": abs(difference) < tolerance_final,
            }
        entry["pass"] = entry["loss_pass"] and all(m["pass"] for m in entry["final"].values())
        per_backend[label] = entry
    seed_counts = [frame.shape[1] for frame in smoothed.values()]
    verdict = {
        "pass": not problems and bool(per_backend) and all(e["pass"] for e in per_backend.values()),
        "rule": PARITY_RULE,
        "baseline": baseline,
        "warmup_steps": warmup,
        "problems": problems,
        "backends": per_backend,
    }
    if seed_counts and min(seed_counts) < 2:
        verdict["note"] = "with one seed per backend there is no seed band: only the absolute floors apply"
    return verdict
