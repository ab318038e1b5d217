"""Backbone, blocks, embeddings and heads."""

from longmixer.models.backbone import SequenceModel

__all__ = ["SequenceModel"]
