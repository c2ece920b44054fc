"""Integer arithmetic of the host code, one home per formula."""


def cdiv(a, b):
    """``ceil(a / b)`` for integers ``a >= 0`` and ``b > 0``: Python ints, or integer tensors
    and arrays elementwise (``-(-a // b)``, exact where ``math.ceil(a / b)`` rounds through a
    float). E.g. the blocks that hold ``a`` tokens in blocks of ``b``."""
    return -(-a // b)
