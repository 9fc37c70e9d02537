"""Token estimation: :class:`TokenEstimation` says how to obtain tokens per sample (measure or pin),
:class:`Calibration` holds the numbers, frozen into the fingerprint and every checkpoint.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs


def _check_primer(instance: Any, attribute: Any, value: Any) -> None:
    if value == "measure":
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"TokenEstimation: a global tokens_per_byte must be a finite number > 0, got {value!r}")
        return
    if isinstance(value, Mapping):
        for name, v in value.items():
            if not isinstance(name, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"TokenEstimation: primer maps dataset names to tokens_per_byte > 0, got {name!r}: {v!r}")
        return
    raise ValueError(f"TokenEstimation: primer must be 'measure', {{name: tokens_per_byte}} or one tokens_per_byte, got {value!r}")


def _primer(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


def _positive(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TokenEstimation: {attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen
class TokenEstimation:
    """How the tokens per sample of each dataset are obtained.

    Args:
        primer: ``"measure"`` (tokenize a small sample of every dataset with the pipeline's
            tokenizer), ``{name: tokens_per_byte}`` (pins those, measures the rest), or one float
            for all (no tokenizer). Bytes per sample are always measured.
        calibration_samples: rows read per dataset, over up to ``calibration_shards_max`` shards.
        field: the text field whose UTF-8 bytes are counted when no tokenize step names one.

    Examples:
        >>> TokenEstimation().primer
        'measure'
        >>> TokenEstimation({"web": 0.27}, calibration_samples=512).calibration_samples
        512
    """

    primer: Any = attrs.field(default="measure", converter=_primer, validator=_check_primer)
    calibration_samples: int = attrs.field(default=2048, validator=_positive)
    calibration_shards_max: int = attrs.field(default=16, validator=_positive)
    field: str = "text"

    def pinned(self, name: str) -> float | None:
        """The pinned tokens per byte of dataset ``name``, or ``None`` when it is measured."""
        if isinstance(self.primer, Mapping):
            return self.primer.get(name)
        return None if self.primer == "measure" else float(self.primer)

    @property
    def needs_tokenizer(self) -> bool:
        return self.primer == "measure" or isinstance(self.primer, Mapping)

    def describe(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _sig(x: float) -> float:
    """``x`` to 6 significant digits, so that the fingerprint reads well and round-trips through JSON."""
    return float(f"{x:.6g}")


@attrs.frozen
class DatasetEstimate:
    """One dataset's calibration: tokens per byte and bytes per source sample (tokens per sample is their product)."""

    tokens_per_byte: float = attrs.field(converter=_sig)
    bytes_per_sample: float = attrs.field(converter=_sig)
    rows: int = 0  # rows read to measure it
    pinned: bool = False

    @property
    def tokens_per_sample(self) -> float:
        return self.tokens_per_byte * self.bytes_per_sample


@attrs.frozen
class Calibration:
    """The frozen result of token estimation by dataset name (``seconds`` is not fingerprinted)."""

    datasets: dict[str, DatasetEstimate]
    seconds: float = attrs.field(default=0.0, eq=False)

    def tokens_per_sample(self, names: tuple[str, ...]) -> tuple[float, ...]:
        return tuple(self.datasets[n].tokens_per_sample for n in names)

    def describe(self) -> dict[str, Any]:
        return {n: attrs.asdict(e) for n, e in self.datasets.items()}

    @classmethod
    def from_description(cls, data: Any) -> "Calibration":
        """Inverse of :meth:`describe` (a checkpoint's or a plan file's frozen numbers)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a calibration is a mapping of dataset name to its numbers, got {data!r}")
        out = {}
        for name, e in data.items():
            if not isinstance(e, Mapping) or not {"tokens_per_byte", "bytes_per_sample"} <= set(e):
                raise ValueError(f"calibration of {name!r} needs tokens_per_byte and bytes_per_sample, got {e!r}")
            out[name] = DatasetEstimate(e["tokens_per_byte"], e["bytes_per_sample"], int(e.get("rows", 0)), bool(e.get("pinned", False)))
        return cls(out)
