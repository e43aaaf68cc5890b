"""FP8 recipes, as TransformerEngine's `transformer_engine.common.recipe` names them.

Supported under `fusible.autocast`: `Float8CurrentScaling` (each tensor's scale from its own amax
when it is cast), `DelayedScaling` (scales from an amax history per tensor, updated after each cast,
kept in checkpoints) and `Float8BlockScaling` (a scale per 1x128 or 128x128 block).
"""

import enum
import math
from dataclasses import dataclass


class Format(enum.Enum):
    """FP8 formats per direction: E4M3 (max 448) both ways, E5M2 (max 57344) both ways, or
    HYBRID: E4M3 forward, E5M2 backward."""

    E4M3 = ("e4m3", "e4m3")
    E5M2 = ("e5m2", "e5m2")
    HYBRID = ("e4m3", "e5m2")

    @property
    def forward_format(self):
        """The forward tensors' format, "e4m3" or "e5m2"."""
        return self.value[0]

    @property
    def backward_format(self):
        """The gradients' format, "e4m3" or "e5m2"."""
        return self.value[1]


class Recipe:
    """Base of the recipes; te's predicates say which one a recipe is."""

    _kind = None

    def float8_current_scaling(self):
        return self._kind == "current"

    def delayed(self):
        return self._kind == "delayed"

    def float8_block_scaling(self):
        return self._kind == "block"

    def mxfp8(self):
        return False

    def nvfp4(self):
        return False

    def float8_per_tensor_scaling(self):
        return self._kind in ("current", "delayed")

    def _check_format(self):
        if not isinstance(self.fp8_format, Format):
            raise TypeError(
                f"{type(self).__name__}: expected fp8_format to be a recipe.Format, got "
                f"{type(self.fp8_format).__name__}"
            )
        n = self.fp8_min_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(
                f"{type(self).__name__}: expected fp8_min_tokens to be an int >= 0, got {n!r}"
            )


@dataclass
class Float8CurrentScaling(Recipe):
    """Per-tensor scale = fp8_max / amax of the tensor being cast (no state between steps).

    Args:
        fp8_format (Format): the FP8 formats, forward and backward (default HYBRID).
        fp8_min_tokens (int): fusible's, not te's (every recipe has it): a Linear or
            GroupedLinear whose call has fewer input rows (tokens) than this runs without FP8,
            forward and backward, its GEMMs in the compute dtype: for shapes too small to pay for
            the casts. 0 (the default): the recipe's numerics everywhere.
    """

    fp8_format: Format = Format.HYBRID
    fp8_min_tokens: int = 0
    _kind = "current"

    def __post_init__(self):
        self._check_format()


@dataclass
class DelayedScaling(Recipe):
    """Per-tensor scale from an amax history, updated after each step:
    scale = fp8_max / amax / 2^margin, amax = max of the history or its most recent entry.

    Args:
        margin (int): the scale is divided by 2^margin.
        fp8_format (Format): the FP8 formats, forward and backward (default HYBRID).
        amax_history_len (int): how many steps of amax each tensor keeps (>= 1).
        amax_compute_algo (str): "max" (of the history) or "most_recent"; te's callable form is
            refused by fusible.autocast (NotImplementedError).
        scaling_factor_compute_algo: te's keyword; fusible.autocast accepts None only.
        reduce_amax (bool): on a distributed run, reduce each tensor's amax history (max) over
            fusible.autocast's amax_reduction_group (default: the default group), so that every
            rank casts with the same scales; False: each rank keeps its own.
        fp8_dpa (bool): te's keyword, kept but not read (fusible has no FP8 attention).
        fp8_mha (bool): likewise.
        fp8_min_tokens (int): as Float8CurrentScaling's.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: object = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    fp8_min_tokens: int = 0  # as Float8CurrentScaling's
    _kind = "delayed"

    def __post_init__(self):
        self._check_format()
        if self.amax_compute_algo not in ("max", "most_recent") and not callable(
            self.amax_compute_algo
        ):
            raise ValueError(
                "DelayedScaling: expected amax_compute_algo 'max', 'most_recent' or a callable, "
                f"got {self.amax_compute_algo!r}"
            )
        if int(self.amax_history_len) < 1:
            raise ValueError(
                f"DelayedScaling: expected amax_history_len >= 1, got {self.amax_history_len}"
            )
        # (a NaN margin was refused only by the first cast, inside a forward)
        try:
            finite = math.isfinite(float(self.margin))
        except (TypeError, ValueError):
            finite = False
        if not finite:
            raise ValueError(
                f"DelayedScaling: expected a finite number as margin, got {self.margin!r}"
            )


@dataclass
class Float8BlockScaling(Recipe):
    """Block scales: by default 1x128 blocks for inputs and gradients (dim 1), 128x128 for
    weights (dim 2), each block's scale = fp8_max / its amax rounded down to a power of two.

    Args:
        fp8_format (Format): the FP8 formats (default E4M3 both ways).
        x_block_scaling_dim (int): 1 (1x128 blocks) or 2 (128x128) for the inputs.
        w_block_scaling_dim (int): likewise for the weights.
        grad_block_scaling_dim (int): likewise for the gradients.
        fp8_min_tokens (int): as Float8CurrentScaling's.
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_min_tokens: int = 0  # as Float8CurrentScaling's
    _kind = "block"

    def __post_init__(self):
        self._check_format()
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(
                    f"Float8BlockScaling: expected {name} 1 or 2, got {getattr(self, name)!r}"
                )
