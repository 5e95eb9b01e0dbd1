"""``Mamba2Config``: the model's hyper-parameters, with mamba_ssm's field names, checked on creation."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba-2 hyper-parameters (mamba_ssm's ``Mamba2`` / ``MambaConfig`` names).

    Derived sizes: ``d_inner = expand·d_model``, ``ssm_dim = d_ssm or d_inner`` (channels the SSM
    runs on), ``d_mlp = d_inner - ssm_dim`` (the rest: a gated MLP), ``nheads = ssm_dim / headdim``,
    ``conv_dim = ssm_dim + 2·ngroups·d_state``, ``d_in_proj = 2·d_inner + 2·ngroups·d_state + nheads``.
    Invalid combinations raise ``ValueError`` naming the field.
    """

    d_model: int
    n_layer: int = 1
    d_state: int = 128  # n: SSM state size per head
    d_conv: int = 4  # k: causal depthwise conv width
    expand: int = 2  # d_inner = expand * d_model
    headdim: int = 64  # p
    ngroups: int = 1  # g: B/C groups shared by nheads/ngroups heads each
    chunk_size: int = 256  # mamba_ssm's chunk; the scan result does not depend on it
    dt_min: float = 0.001  # init range of Δ
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple[float, float] = (0.0, math.inf)  # clamp on Δ after softplus
    A_init_range: tuple[float, float] = (1.0, 16.0)  # A ~ U(range), A_log = log A
    D_has_hdim: bool = False  # D is [nheads, headdim] instead of [nheads]
    d_ssm: int | None = None  # SSM on this many of the d_inner channels, a gated MLP on the rest; None: all
    rmsnorm: bool = True  # False: no norm, out_proj(y · silu(z))
    norm_before_gate: bool = False  # True: rmsnorm(y) · silu(z) instead of rmsnorm(y · silu(z))
    conv_bias: bool = True
    bias: bool = False  # biases on in_proj / out_proj
    norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    vocab_size: int | None = None  # None: a backbone on embeddings only
    tie_embeddings: bool = True
    pad_vocab_size_multiple: int = 16
    initializer_range: float = 0.02  # std of the embedding init
    rescale_prenorm_residual: bool = True  # out_proj init / sqrt(n_layer)

    def __post_init__(self) -> None:
        for name, limit in _LIMITS.items():
            value = getattr(self, name)
            if name == "vocab_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
                raise ValueError(f"Mamba2Config.{name}: expected a positive int"
                                 f"{' or None' if name == 'vocab_size' else ''}, got {value!r} (at most {limit:_})")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Mamba2Config.{name}: expected True or False, got {getattr(self, name)!r}")
        for name in _FINITE:
            _finite(name, getattr(self, name))
        self._check_d_ssm()
        if self.ssm_dim % self.headdim:
            what = "d_ssm" if self.d_mlp else "d_inner = expand*d_model"
            raise ValueError(f"Mamba2Config.headdim: {what} = {self.ssm_dim} must be a "
                             f"multiple of headdim = {self.headdim}")
        if self.nheads % self.ngroups:
            raise ValueError(f"Mamba2Config.ngroups: nheads = ssm_dim/headdim = {self.nheads} must be a "
                             f"multiple of ngroups = {self.ngroups}")
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"Mamba2Config.dt_min/dt_max: expected 0 < dt_min <= dt_max, "
                             f"got {self.dt_min}, {self.dt_max}")
        if self.dt_init_floor < 0:
            raise ValueError(f"Mamba2Config.dt_init_floor: expected >= 0, got {self.dt_init_floor}")
        if self.initializer_range < 0:
            raise ValueError(f"Mamba2Config.initializer_range: expected >= 0, got {self.initializer_range}")
        low, high = _pair("dt_limit", self.dt_limit)
        if not 0 <= low < high:
            raise ValueError(f"Mamba2Config.dt_limit: expected 0 <= low < high, got {self.dt_limit}")
        lo, hi = _pair("A_init_range", self.A_init_range)
        if not (0 < lo <= hi and math.isfinite(hi)):
            raise ValueError(f"Mamba2Config.A_init_range: expected finite 0 < low <= high, got {self.A_init_range}")
        if not self.norm_eps > 0:
            raise ValueError(f"Mamba2Config.norm_eps: expected > 0, got {self.norm_eps}")
        object.__setattr__(self, "dt_limit", (low, high))
        object.__setattr__(self, "A_init_range", (lo, hi))

    def _check_d_ssm(self) -> None:
        """``d_ssm``: None or a positive int up to d_inner; d_ssm = d_inner is stored as None (one model,
        one config)."""
        d_ssm = self.d_ssm
        if d_ssm is None:
            return
        if isinstance(d_ssm, bool) or not isinstance(d_ssm, int) or not 0 < d_ssm <= self.d_inner:
            raise ValueError(f"Mamba2Config.d_ssm: expected None or an int in [1, d_inner = {self.d_inner}], "
                             f"got {d_ssm!r}")
        if d_ssm == self.d_inner:
            object.__setattr__(self, "d_ssm", None)

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def ssm_dim(self) -> int:
        """Channels the SSM runs on (mamba_ssm's resolved ``self.d_ssm``): d_ssm, or d_inner when None."""
        return self.d_inner if self.d_ssm is None else self.d_ssm

    @property
    def d_mlp(self) -> int:
        """Channels of the gated MLP beside the SSM: ``silu(z0) · x0`` goes to out_proj before y."""
        return self.d_inner - self.ssm_dim

    @property
    def nheads(self) -> int:
        return self.ssm_dim // self.headdim

    @property
    def conv_dim(self) -> int:
        return self.ssm_dim + 2 * self.ngroups * self.d_state

    @property
    def d_in_proj(self) -> int:
        return 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads

    @property
    def padded_vocab_size(self) -> int | None:
        """``vocab_size`` rounded up to ``pad_vocab_size_multiple`` (mamba_ssm), or None."""
        if self.vocab_size is None:
            return None
        m = self.pad_vocab_size_multiple
        return ((self.vocab_size + m - 1) // m) * m

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict that :meth:`from_dict` reads back (inf written as a string)."""
        out = asdict(self)
        out["dt_limit"] = [str(v) if math.isinf(v) else v for v in self.dt_limit]
        out["A_init_range"] = list(self.A_init_range)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Mamba2Config:
        """Builds a config from :meth:`to_dict`'s output; unknown keys raise ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"Mamba2Config: expected a dict of fields, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Mamba2Config: unknown fields {unknown}")
        data = dict(data)
        if "dt_limit" in data:
            data["dt_limit"] = tuple(float(v) for v in data["dt_limit"])
        if "A_init_range" in data:
            data["A_init_range"] = tuple(float(v) for v in data["A_init_range"])
        return cls(**data)


#: Every size field with its largest accepted value: far above any released model, low enough that a
#: hostile config cannot make the shapes' bookkeeping (or an allocation) run away before a check.
_LIMITS = {"d_model": 2**17, "n_layer": 4096, "d_state": 2**14, "d_conv": 256, "expand": 64,
           "headdim": 2**14, "ngroups": 2**14, "chunk_size": 2**20, "vocab_size": 2**25,
           "pad_vocab_size_multiple": 2**16}
_FLAGS = ("D_has_hdim", "rmsnorm", "norm_before_gate", "conv_bias", "bias", "residual_in_fp32", "tie_embeddings",
          "rescale_prenorm_residual")
_FINITE = ("dt_min", "dt_max", "dt_init_floor", "norm_eps", "initializer_range")


def default_config(d_model: int) -> Mamba2Config:
    """The small default model used when ``forward`` gets no params and no config: two layers,
    d_state 64, and the largest headdim <= 64 that divides ``2·d_model``."""
    d_inner = 2 * d_model
    headdim = max(d for d in range(1, min(64, d_inner) + 1) if d_inner % d == 0)
    return Mamba2Config(d_model=d_model, n_layer=2, d_state=64, headdim=headdim)


def check_config(config: Any, name: str = "config") -> None:
    """TypeError unless ``config`` is a :class:`Mamba2Config`."""
    if not isinstance(config, Mamba2Config):
        raise TypeError(f"{name}: expected a Mamba2Config, got {type(config).__name__}")


def _finite(name: str, value: Any) -> None:
    """TypeError unless ``value`` is a real number (not a bool), ValueError unless it is finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Mamba2Config.{name}: expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"Mamba2Config.{name}: expected a finite number, got {value}")


def _pair(name: str, value: Any) -> tuple[float, float]:
    """``(low, high)`` as floats, no NaN; TypeError/ValueError naming the field otherwise."""
    if isinstance(value, str) or not hasattr(value, "__len__") or len(value) != 2:
        raise TypeError(f"Mamba2Config.{name}: expected a pair (low, high), got {value!r}")
    low, high = value
    for v in (low, high):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"Mamba2Config.{name}: expected a pair of numbers, got {value!r}")
        if math.isnan(v):
            raise ValueError(f"Mamba2Config.{name}: expected numbers, got NaN in {value!r}")
    return float(low), float(high)
