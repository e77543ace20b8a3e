"""fp8 quantization of activations: each row (token) of a matrix to e4m3 with its own scale
(``quantize_fp8_per_token``), the dynamic half of an fp8 matmul whose weights were quantized
per output channel ahead of time. ``ops`` is the entry; see ``pagedattn_kernels.ops`` for the
files every op folder has.
"""
