"""The model package's load errors, apart so that every reader of checkpoints can raise them."""


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into; names the file and the mismatch."""
