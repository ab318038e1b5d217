"""Per-layer activation statistics of sparsely activated layers (SeqBoat, arXiv 2306.11197, Figs. 3 and 6): a CSV
history and a plot of the activation rate and attention span per layer, written at the end of each validation."""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path

from pytorch_lightning.callbacks import Callback

log = logging.getLogger(__name__)

_METRIC = re.compile(r"^(?P<stage>train|val|test)/stats/(?P<name>act_rate|attn_span)/layer_(?P<layer>\d+)$")


def collect_layer_stats(metrics: dict, stage: str) -> dict[int, dict[str, float]]:
    """{layer: {"act_rate": .., "attn_span": ..}} from logged metrics named `<stage>/stats/<name>/layer_<i>`."""
    per_layer: dict[int, dict[str, float]] = {}
    for key, value in metrics.items():
        match = _METRIC.match(key)
        if match and match["stage"] == stage:
            per_layer.setdefault(int(match["layer"]), {})[match["name"]] = float(value)
    return dict(sorted(per_layer.items()))


class ActivationStats(Callback):
    """Writes `<output_dir>/activation_stats.csv` (one row per layer per validation: step, stage, layer, act_rate,
    attn_span) and `<output_dir>/activation_stats.png` (the latest per-layer values) after each validation.

    Args:
        output_dir: the run directory; None uses the trainer's `default_root_dir`.
        stage: which logged stage to read ("val" or "test").
        plot: draw the PNG (needs matplotlib; without it the plot is skipped with one log line).
    """

    def __init__(self, output_dir: str | None = None, stage: str = "val", plot: bool = True):
        if stage not in ("val", "test"):
            raise ValueError(f"callbacks.activation_stats.stage={stage!r} must be 'val' or 'test'")
        self.output_dir, self.stage, self.plot = output_dir, stage, plot
        self._warned = False

    def _dir(self, trainer) -> Path:
        path = Path(self.output_dir or trainer.default_root_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        self.write(trainer, self.stage if self.stage == "val" else "val")

    def on_test_end(self, trainer, pl_module) -> None:
        if self.stage == "test" and trainer.is_global_zero:
            self.write(trainer, "test")

    def write(self, trainer, stage: str) -> dict[int, dict[str, float]]:
        """Append this evaluation's per-layer rows to the CSV and redraw the plot; returns the rows."""
        stats = collect_layer_stats(trainer.callback_metrics, stage)
        if not stats:
            return stats
        out = self._dir(trainer)
        csv_path = out / "activation_stats.csv"
        new = not csv_path.exists()
        with csv_path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", "stage", "layer", "act_rate", "attn_span"])
            for layer, values in stats.items():
                writer.writerow([trainer.global_step, stage, layer, values.get("act_rate", ""),
                                 values.get("attn_span", "")])
        if self.plot:
            self._plot(stats, out / "activation_stats.png", trainer.global_step, stage)
        return stats

    def _plot(self, stats: dict[int, dict[str, float]], path: Path, step: int, stage: str) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            if not self._warned:
                log.info("matplotlib is not installed: skipping %s (the CSV is still written)", path.name)
                self._warned = True
            return
        layers = list(stats)
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for ax, name, label in ((axes[0], "act_rate", "activation rate"), (axes[1], "attn_span", "attention span")):
            ax.bar(layers, [stats[i].get(name, 0.0) for i in layers])
            ax.set_xlabel("layer")
            ax.set_ylabel(label)
            ax.set_xticks(layers)
        fig.suptitle(f"{stage} step {step}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
