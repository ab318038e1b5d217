"""longmixer: a Hydra + Lightning framework for long-sequence models (CHELA, LongVQ, LaS, SeqBoat, MEGA)."""

__version__ = "0.1.0"
