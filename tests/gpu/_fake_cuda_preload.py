"""A zygote preload that leaves ``torch.cuda.is_initialized()`` true (tests/gpu/test_gpu_node.py).

No GPU on the test machines: it sets the flag PyTorch's ``is_initialized`` reads, which is
what a real ``torch.cuda.init()`` in a preload module leaves behind.
"""

import torch

torch.cuda._initialized = True
