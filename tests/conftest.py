"""pytest configuration shared by every test module.

``TRITON_INTERPRET=1`` must be in the environment before any Triton kernel is *decorated*
(``@triton.jit`` checks it at decoration time), so it is set here, at conftest import, before any
test module imports a kernel module. It lets the Triton kernels run on CPU tensors (interpreter).
An explicit ``TRITON_INTERPRET`` in the environment wins.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
