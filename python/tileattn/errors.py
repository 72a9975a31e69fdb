"""The exceptions tileattn raises for a call it refuses, each naming the argument and the rule.

flash-attn's checks and PyTorch's SDPA raise RuntimeError, Python's convention is ValueError for a
bad value and TypeError for a bad type: each class here is both, so code written against any of
the three catches it. What a backend or build cannot run raises NotImplementedError, which is a
RuntimeError already; a device failure raises RuntimeError.
"""

__all__ = ["InvalidArgumentError", "InvalidTypeError"]


class InvalidArgumentError(ValueError, RuntimeError):
    """A shape, stride, option or value breaks a rule of the API (the library's invalid_argument)."""


class InvalidTypeError(TypeError, RuntimeError):
    """A dtype, dtype mix or argument type the API does not take (the library's invalid_type)."""


# The phrase of the library's refusal of a head dim whose bucket a build (TILEATTN_HEADDIMS) left out.
_NOT_BUILT = "head-dim bucket of this build"


def _not_built(error: BaseException) -> bool:
    """Whether error is that refusal: the call is valid, this build just has no kernel for it."""
    return isinstance(error, NotImplementedError) and _NOT_BUILT in str(error)
