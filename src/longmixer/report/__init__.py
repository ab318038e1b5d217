"""The report: finished runs collected into the papers' result tables (`python -m longmixer.report`)."""

from longmixer.report.build import build_report, main

__all__ = ["build_report", "main"]
