"""Sizes as people write them ("64M") and as the kernel takes them (bytes).

A leaf module: standard library only, imports nothing of ours, so the
trainer (pool), the worker and the sandbox builder share one parser.
"""

__all__ = ["parse_size"]


def parse_size(value) -> int:
    """'64M' -> 67108864. Accepts ints and K/M/G/T suffixes (powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and value.strip():
        text = value.strip().upper().removesuffix("B").removesuffix("I")
        scale = 1
        if text and text[-1] in "KMGT":
            scale = 1024 ** ("KMGT".index(text[-1]) + 1)
            text = text[:-1]
        try:
            size = int(float(text) * scale)
        except ValueError:
            raise ValueError(f"cannot read {value!r} as a size; write e.g. 64M, 1G or a number of bytes") from None
    else:
        raise TypeError(f"a size must be an int or a string like '64M', not {type(value).__name__}")
    if size <= 0:
        raise ValueError(f"size {value!r} must be positive")
    return size
