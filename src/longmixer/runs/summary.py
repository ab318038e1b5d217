"""A short model summary for the run log: Lightning's table without the FLOPs column and total when nothing
measured FLOPs (they are counted only for a module with `example_input_array`, so they read 0 otherwise)."""

from __future__ import annotations

import logging

from pytorch_lightning.callbacks import ModelSummary
from pytorch_lightning.utilities.model_summary.model_summary import (
    _format_summary_table,
)

log = logging.getLogger("longmixer")


class CompactModelSummary(ModelSummary):
    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **summarize_kwargs) -> None:
        if not total_flops:
            summary_data = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *summary_data)
        if not total_flops:
            table = "\n".join(line for line in table.splitlines() if "Total Flops" not in line)
        log.info("model summary\n%s", table)
