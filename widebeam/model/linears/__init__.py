"""Linear-layer kernels for CPU: int8 weights, oneDNN-packed and split float32."""
