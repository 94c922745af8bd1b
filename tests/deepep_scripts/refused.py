"""A script that asks the CPU for CUDA memory statistics: refused, naming the call."""
import torch

torch.cuda.memory_allocated()
