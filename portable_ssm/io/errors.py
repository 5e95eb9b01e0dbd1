"""The one error type of the I/O package."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file or model directory that is corrupt, truncated, hostile or does not match
    its config. The message names the file, and the tensor or key."""
