"""Build-time check, as the official pytorch Dockerfile does: refuse a CPU-only torch and one
of another version or CUDA release than the build arguments name."""

import sys

import torch

want_torch, want_cuda = sys.argv[1], sys.argv[2]
if not torch.version.cuda:
    sys.exit(f"torch {torch.__version__} is not a CUDA build (torch.version.cuda is empty)")
if torch.__version__.split("+")[0] != want_torch:
    sys.exit(f"torch {torch.__version__} is installed, TORCH_VERSION={want_torch}: run make lock")
if not torch.version.cuda.startswith(want_cuda):
    sys.exit(f"torch is built for CUDA {torch.version.cuda}, TORCH_CUDA={want_cuda}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
