"""Fused-op implementations.

``registry`` (the leaf: what a fused op and an implementation are, how one is chosen, the custom-op
factory), ``implementations`` (the one ordered table), one folder per fused-op family
(``residual_norm``, ``collective_linear``, ``linear_activation``, ``grouped_linear``: fused ops,
reference, implementations, kernels), and ``runtime`` (extension builds, symmetric pool, devices).
"""
