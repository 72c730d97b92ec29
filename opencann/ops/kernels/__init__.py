"""Kernels per device: ``cpu`` (oneDNN / MKL fused-op kernels) and ``vnpu`` (NPU-format
kernels), plus ``vnpu_cost`` (time models of nodes on the vnpu). An `OpDef` names its
kernels in its ``kernel_factories`` / ``device_cost`` columns; nothing here registers."""
