"""Reading and writing files: the one package that does.

* :mod:`.safetensors`: the safetensors byte format, read and written with NumPy alone;
* :mod:`.checkpoint`: ``save_params``/``load_params`` (core names, config as metadata) and
  ``save_arrays``/``load_arrays`` for any named arrays;
* :mod:`.layouts`: transformers and state-spaces checkpoint layouts in core terms;
* :mod:`.pretrained`: ``load_pretrained`` for model directories and files.

Every failure reading a file is a :class:`CheckpointError` naming the file, and the tensor or key.
The package only reads and writes: the model it returns, :class:`portable_ssm.Mamba2LM`, lives
beside :mod:`portable_ssm.lm` and :mod:`portable_ssm.generation`.
"""

from .checkpoint import load_arrays, load_params, save_arrays, save_params  # noqa: I001 (errors first)
from .errors import CheckpointError
from .pretrained import load_pretrained

__all__ = ["CheckpointError", "load_arrays", "load_params", "load_pretrained", "save_arrays", "save_params"]
