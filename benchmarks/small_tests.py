"""What the overhead benchmarks run: a small torch test, and a pass-through dispatch mode.

Both are source text, written into the temporary test folders the benchmarks create.
"""

# Four tensor operations on a 64-element tensor: well under a millisecond.
TEST_FUNCTION = """
def test_small(n):
    x = torch.ones(64) * n
    assert x.sum().item() == 64 * n
"""

# A session's worth of them: the file the whole-session benchmarks write, ``count`` tests.
TEST_FILE = (
    """
import pytest
import torch

@pytest.mark.parametrize("n", range({count}))"""
    + TEST_FUNCTION
)

# Hands every op on unchanged: what PyTorch charges for handing each op to Python, the floor
# under the cpu backend's dispatch counter, which counts storages from such a mode.
PASS_THROUGH_MODE = """
from torch.utils._python_dispatch import TorchDispatchMode


class PassThrough(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls):
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func._op(*args, **kwargs) if kwargs else func._op(*args)
"""
