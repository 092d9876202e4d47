"""Build the native kernels for this CPU now (``make setup`` does), and say which int8, int4
and bfloat16 paths the models will take: ``python -m cactus_spec.backends.native``."""

from cactus_spec.backends.packed import bf16_kernel
from cactus_spec.backends.quant import int4_kernel, quant_kernel

if __name__ == "__main__":
    print(f"int8 layers: {quant_kernel()}")
    print(f"int4 layers: {int4_kernel()}")
    print(f"bf16 layers (CPU): {bf16_kernel()}")
